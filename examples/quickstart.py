"""Train a small MLP under the mixed_bfloat16 policy: f32 params, bf16 matmuls, f32 logits.

This is the README's first example, verbatim. Run: python examples/quickstart.py
"""
import jax, jax.numpy as jnp, optax
import mpjax

policy = mpjax.get_policy("mixed_bfloat16")  # params f32, compute bf16, output f32

def model(params, x):
    params, x = policy.cast_to_compute((params, x))  # the matmuls below run in bf16
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return policy.cast_to_output(h @ params["w2"])  # logits back in f32

k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
params = {"w1": jax.random.normal(k1, (2, 64)), "b1": jnp.zeros(64), "w2": jax.random.normal(k2, (64, 2)) / 8}
x = jax.random.normal(k3, (1024, 2)); y = (x[:, 0] * x[:, 1] > 0).astype(jnp.int32)  # XOR quadrants
loss_fn = lambda p: optax.softmax_cross_entropy_with_integer_labels(model(p, x), y).mean()
opt = optax.adam(1e-2); opt_state = opt.init(params)

@jax.jit
def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)  # grads come back f32, like the params
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

for i in range(301):
    params, opt_state, loss = step(params, opt_state)
    if i % 100 == 0: print(f"step {i:3d}  loss {loss:.4f}")
print(mpjax.inspect_matmuls(jax.grad(loss_fn))(params))  # every matmul, forward and backward: bf16
