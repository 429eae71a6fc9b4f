"""Train a small MLP in mixed float16, as torch.autocast + GradScaler would: autocast casts at
the operations (matmuls in float16, softmax and the loss in float32), a dynamic loss scale keeps
the gradients in float16's range and skips any step that overflows.

This is the README's first example, verbatim. Run: python examples/quickstart.py
"""
import jax, jax.numpy as jnp, optax
import mpjax

def loss_fn(params, x, y):  # unmodified float32 code
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

fast_loss = mpjax.autocast(loss_fn, "mixed_float16")  # torch.autocast: matmuls in float16
tx = mpjax.loss_scaling(optax.adam(1e-2), "dynamic")  # GradScaler: scale, unscale, skip inf

@jax.jit
def step(params, opt_state, x, y):
    loss, grads = mpjax.scaled_value_and_grad(fast_loss)(opt_state, params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)  # f32 grads, like the params
    return optax.apply_updates(params, updates), opt_state, loss

k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
params = {"w1": jax.random.normal(k1, (2, 64)), "b1": jnp.zeros(64), "w2": jax.random.normal(k2, (64, 2)) / 8}
x = jax.random.normal(k3, (1024, 2)); y = (x[:, 0] * x[:, 1] > 0).astype(jnp.int32)  # XOR quadrants
opt_state = tx.init(params)
for i in range(301):
    params, opt_state, loss = step(params, opt_state, x, y)
    if i % 100 == 0: print(f"step {i:3d}  loss {loss:.4f}  scale {mpjax.loss_scaling_info(opt_state).loss_scale}")
print(mpjax.inspect_matmuls(jax.grad(fast_loss))(params, x, y))  # every matmul, forward and backward
