"""Training an Equinox model the Equinox way under mpjax: optax over
``eqx.filter(model, eqx.is_inexact_array)``, loss scaling through
``mpjax.equinox.filter_value_and_grad``, master weights and optimizer-state precision; a skipped
step and a serialise/restore round trip are bit for bit."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mixed_precision_checks import key, normal
from tolerances import assert_close_in_norm

import mpjax

eqx = pytest.importorskip("equinox")
mpe = pytest.importorskip("mpjax.equinox")

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
D = 8


class Net(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.norm = eqx.nn.LayerNorm(D)
        self.mlp = eqx.nn.MLP(D, 1, 16, depth=2, activation=jax.nn.gelu, key=key)

    def __call__(self, x):
        return self.mlp(self.norm(x))[0]


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def data(seed=0, n=32):
    x = normal(n, D, seed=seed)
    return x, jnp.sin(jnp.sum(x, axis=-1))


def params_of(model):
    return eqx.filter(model, eqx.is_inexact_array)


def make_step(tx):
    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = mpe.filter_value_and_grad(loss_fn)(opt_state, model, x, y)
        # optax's bias correction raises Python float ** int32 under strict promotion (an
        # optax matter, not mpjax's): the optimizer alone runs under standard promotion.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params_of(model))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def leaves_equal(a, b) -> bool:
    a, b = (
        jax.tree.leaves(eqx.filter(a, eqx.is_array)),
        jax.tree.leaves(eqx.filter(b, eqx.is_array)),
    )
    return len(a) == len(b) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)
    )


def float16_run(seed: int = 0):
    """A mixed_float16 model, Adam under dynamic loss scaling, its state, step and data."""
    model = mpe.apply_policy(Net(key(seed)), "mixed_float16")
    tx = mpjax.loss_scaling(optax.adam(1e-2), "dynamic")
    return model, tx.init(params_of(model)), make_step(tx), *data()


@pytest.mark.slow  # compiles and runs train steps
def test_mixed_float16_with_dynamic_loss_scaling_trains():
    model, opt_state, step, x, y = float16_run()
    first = None
    for _ in range(30):
        model, opt_state, loss = step(model, opt_state, x, y)
        first = loss if first is None else first
    assert float(loss) < 0.5 * float(first)
    info = mpjax.loss_scaling_info(opt_state)
    assert bool(info.applied) and int(info.consecutive_skipped) == 0
    assert {p.dtype for p in jax.tree.leaves(params_of(model))} == {F32}
    report = mpjax.inspect_matmuls(eqx.filter_grad(loss_fn))(model, x, y)
    assert report and {m.operand_dtypes for m in report} == {(F16, F16)}


@pytest.mark.slow
def test_a_skipped_step_leaves_the_model_and_the_optimizer_bit_identical():
    model, opt_state, step, x, y = float16_run()
    model, opt_state, _ = step(model, opt_state, x, y)  # Adam has moments and a count
    bad = x.at[0, 0].set(jnp.inf)
    new_model, new_state, _ = step(model, opt_state, bad, y)
    assert not bool(mpjax.loss_scaling_info(new_state).applied)
    assert leaves_equal(new_model, model)
    assert leaves_equal(new_state.inner_state, opt_state.inner_state)
    assert float(mpjax.loss_scaling_info(new_state).loss_scale) == 0.5 * float(
        mpjax.loss_scaling_info(opt_state).loss_scale
    )


@pytest.mark.slow  # compiles and runs train steps
def test_master_weights_and_state_precision_over_bf16_stored_params():
    model = mpe.apply_policy(Net(key()), "p=bf16,c=bf16,o=f32")
    stored = params_of(model)
    assert {p.dtype for p in jax.tree.leaves(stored.model.mlp)} == {BF16}
    assert {p.dtype for p in jax.tree.leaves(stored.model.norm)} == {F32}  # the norm rule
    tx = mpjax.master_weights(mpjax.loss_scaling(mpjax.state_precision(optax.adam(1e-3), BF16)))
    opt_state = tx.init(stored)
    step = make_step(tx)
    x, y = data()
    for _ in range(3):
        model, opt_state, _ = step(model, opt_state, x, y)
    master = opt_state.master.model.mlp.layers[0].weight
    assert master.dtype == F32
    weight = model.model.mlp.layers[0].weight
    assert weight.dtype == BF16
    # The stored params are the master rounded to bf16, up to an ulp of the step's size
    # where a param moved by more than its own magnitude (mpjax.master_weights): in norm.
    rounded = np.asarray(master.astype(BF16), np.float32)
    assert_close_in_norm(np.asarray(weight, np.float32), rounded, float(jnp.finfo(BF16).eps))
    assert not np.array_equal(np.asarray(weight), np.asarray(stored.model.mlp.layers[0].weight))
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    assert adam and {m.dtype for m in jax.tree.leaves(adam[0].mu)} == {BF16}


@pytest.mark.slow  # compiles and runs train steps
def test_serialise_and_restore_continues_bit_identically():
    model, opt_state, step, x, y = float16_run()
    for _ in range(3):
        model, opt_state, _ = step(model, opt_state, x, y)
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, (model, opt_state))
    like_model, like_state = float16_run(seed=7)[:2]  # other values, the same structure
    restored = eqx.tree_deserialise_leaves(io.BytesIO(buffer.getvalue()), (like_model, like_state))
    assert leaves_equal(restored, (model, opt_state))
    a, b = (model, opt_state), restored
    for _ in range(3):
        a = step(*a, x, y)[:2]
        b = step(*b, x, y)[:2]
    assert leaves_equal(a, b)
    assert not leaves_equal(a[0], model)


def test_filter_value_and_grad_returns_the_loss_unscaled_and_the_gradients_scaled():
    model = mpe.apply_policy(Net(key()), "mixed_float16")
    tx = mpjax.loss_scaling(optax.sgd(0.1), "static:1024")
    opt_state = tx.init(params_of(model))
    x, y = data()
    loss, grads = eqx.filter_jit(mpe.filter_value_and_grad(loss_fn))(opt_state, model, x, y)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    np.testing.assert_array_equal(loss, ref_loss)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == F32
        # f16 matmuls on gradients 1024 times larger: the same up to f16 rounding.
        np.testing.assert_allclose(g / 1024, r, rtol=2e-2, atol=1e-3)
    with_aux = mpe.filter_value_and_grad(lambda m, x, y: (loss_fn(m, x, y), x[0]), has_aux=True)
    (_, aux), _ = eqx.filter_eval_shape(with_aux, opt_state, model, x, y)
    assert aux.shape == (D,)
    # Without loss scaling in the state it is eqx.filter_value_and_grad.
    plain = optax.sgd(0.1).init(params_of(model))
    loss, grads = eqx.filter_jit(mpe.filter_value_and_grad(loss_fn))(plain, model, x, y)
    assert leaves_equal(grads, eqx.filter_jit(eqx.filter_grad(loss_fn))(model, x, y))


@pytest.mark.slow
def test_filter_value_and_grad_refuses_misplaced_arguments():
    model = mpe.apply_policy(Net(key()), "mixed_float16")
    tx = mpjax.loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(params_of(model))
    x, y = data()
    with pytest.raises(TypeError, match="fun must be the loss function"):
        mpe.filter_value_and_grad(loss_fn(model, x, y))
    with pytest.raises(TypeError, match="the optimizer state goes first"):
        mpe.filter_value_and_grad(lambda m, s, x, y: loss_fn(m, x, y))(model, opt_state, x, y)
    with pytest.raises(TypeError, match="has_aux must be a bool"):
        mpe.filter_value_and_grad(loss_fn, has_aux="yes")
