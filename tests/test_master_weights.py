"""f32 master weights: the rounding invariant, the -1e-4 demo, dtypes, composition with loss
scaling, jit, sharding and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optimizer_checks import standard_promotion

from mpjax import (
    DynamicLossScale,
    MasterWeightsState,
    loss_scaling,
    master_weights,
    scale_loss,
)

F32, BF16, F16 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def assert_bitwise_equal(x, y):
    assert jnp.result_type(x) == jnp.result_type(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_small_updates_are_kept_by_the_master_and_lost_without_it():
    # 100 updates of -1e-4 to a bf16 param at 1.0: 1.0 - 1e-4 rounds back to 1.0 in bf16.
    grads = {"w": jnp.ones(1, BF16)}
    plain, mw = optax.sgd(1e-4), master_weights(optax.sgd(1e-4))
    p_plain = p_mw = {"w": jnp.ones(1, BF16)}
    p_f32 = {"w": jnp.ones(1, F32)}
    s_plain, s_mw, s_f32 = plain.init(p_plain), mw.init(p_mw), plain.init(p_f32)
    for _ in range(100):
        u, s_plain = plain.update(grads, s_plain, p_plain)
        p_plain = optax.apply_updates(p_plain, u)
        u, s_mw = mw.update(grads, s_mw, p_mw)
        p_mw = optax.apply_updates(p_mw, u)
        u, s_f32 = plain.update({"w": jnp.ones(1, F32)}, s_f32, p_f32)
        p_f32 = optax.apply_updates(p_f32, u)
    assert float(p_plain["w"][0]) == 1.0  # every update rounded away
    assert_bitwise_equal(p_f32["w"], jnp.array([0.98999834], F32))
    assert_bitwise_equal(s_mw.master["w"], p_f32["w"])  # the master tracks the f32 run
    assert_bitwise_equal(p_mw["w"], p_f32["w"].astype(BF16))
    assert p_mw["w"].dtype == BF16


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_apply_updates_gives_the_master_rounded_bit_for_bit(dtype):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w": (1.0 + 0.3 * jax.random.normal(k1, (64, 8))).astype(dtype),
        "b": jnp.full(8, -2.0, dtype),
    }
    tx = master_weights(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)))
    with standard_promotion():
        state = tx.init(params)
        step = jax.jit(tx.update)
        for i in range(30):
            grads = jax.tree.map(
                lambda p: jax.random.normal(jax.random.fold_in(k2, i), p.shape).astype(dtype),  # noqa: B023
                params,
            )
            updates, state = step(grads, state, params)
            assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
            params = optax.apply_updates(params, updates)
            for name in params:
                assert_bitwise_equal(params[name], state.master[name].astype(dtype))
    assert float(jnp.max(jnp.abs(state.master["w"] - 1.0))) > 0.1  # the params really moved


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_rounding_invariant_holds_for_any_step_within_a_factor_of_two(dtype):
    # Sterbenz: if the new value is within a factor of 2 of the old one (same sign), the
    # difference is exact in the param dtype, so params + updates lands on it exactly.
    rng = np.random.default_rng(0)
    old = (rng.choice([-1, 1], 4096) * 2.0 ** rng.uniform(-10, 10, 4096)).astype(np.float32)
    new = old * rng.uniform(0.5, 2.0, 4096).astype(np.float32)
    params = {"w": jnp.asarray(old).astype(dtype)}
    tx = master_weights(optax.identity())
    state = MasterWeightsState({"w": jnp.asarray(new)}, tx.init(params).inner_state)
    updates, _ = tx.update({"w": jnp.zeros(4096, dtype)}, state, params)
    assert_bitwise_equal(optax.apply_updates(params, updates)["w"], jnp.asarray(new).astype(dtype))


def test_a_zero_crossing_step_lands_close_and_the_next_step_resyncs():
    # A step larger than the param itself cannot always be expressed as one low-precision
    # difference; the master stays exact and the next ordinary step lands on it again.
    params = {"w": jnp.array([2.5558472e-04], BF16)}
    target = jnp.array([-1.4591217e-04], F32)
    tx = master_weights(optax.identity())
    state = MasterWeightsState({"w": target}, tx.init(params).inner_state)
    updates, state = tx.update({"w": jnp.zeros(1, BF16)}, state, params)
    params = optax.apply_updates(params, updates)
    step = float(jnp.abs(updates["w"][0]))
    assert abs(float(params["w"][0]) - float(target[0].astype(BF16))) <= step * 2.0**-8
    state = state._replace(master={"w": target * 1.01})
    updates, state = tx.update({"w": jnp.zeros(1, BF16)}, state, params)
    params = optax.apply_updates(params, updates)
    assert_bitwise_equal(params["w"], state.master["w"].astype(BF16))


def test_state_dtypes_and_float32_params_pass_through():
    params = {
        "low": jnp.ones(3, BF16),
        "half": jnp.ones(2, F16),
        "full": jnp.ones(4, F32),
        "step": jnp.zeros((), jnp.int32),
    }
    tx = master_weights(optax.adam(1e-2))
    state = tx.init(params)
    assert isinstance(state, MasterWeightsState)
    assert state.master["low"].dtype == F32 and state.master["half"].dtype == F32
    assert isinstance(state.master["full"], optax.MaskedNode)  # no copy of an f32 param
    assert isinstance(state.master["step"], optax.MaskedNode)
    adam = state.inner_state[0]
    for moments in (adam.mu, adam.nu):
        assert {k: v.dtype for k, v in moments.items()} == {
            "low": F32,
            "half": F32,
            "full": F32,
            "step": np.dtype(jnp.int32),
        }
    grads = {
        "low": jnp.ones(3, BF16),
        "half": jnp.ones(2, F16),
        "full": jnp.ones(4, F32),
        "step": jnp.zeros((), jnp.int32),
    }
    f32_only = {"full": params["full"]}
    plain = optax.adam(1e-2)
    with standard_promotion():
        with pytest.raises(TypeError, match=r"got int32 at grads\['step'\]"):
            tx.update(grads, state, params)
        mw_only = master_weights(plain)
        updates, new_state = mw_only.update(
            {"full": grads["full"]}, mw_only.init(f32_only), f32_only
        )
        expected, expected_state = plain.update(
            {"full": grads["full"]}, plain.init(f32_only), f32_only
        )
    assert_bitwise_equal(updates["full"], expected["full"])  # f32 params: exactly the inner's
    for a, b in zip(jax.tree.leaves(new_state.inner_state), jax.tree.leaves(expected_state)):
        assert_bitwise_equal(a, b)


def test_update_dtypes_follow_the_params():
    params = {"low": jnp.ones(3, BF16), "half": jnp.ones(2, F16), "full": jnp.ones(4, F32)}
    tx = master_weights(optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert {k: v.dtype for k, v in updates.items()} == {"low": BF16, "half": F16, "full": F32}
    assert jax.tree.map(jax.typeof, new_state) == jax.tree.map(jax.typeof, state)


@pytest.mark.parametrize("order", ["master_outside", "loss_scaling_outside"])
def test_composition_with_loss_scaling_skips_and_applies(order):
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    ls = DynamicLossScale(2.0**10, growth_interval=2)
    tx = (
        master_weights(loss_scaling(inner, ls))
        if order == "master_outside"
        else loss_scaling(master_weights(inner), ls)
    )
    params = {"w": jnp.linspace(0.5, 1.5, 8).astype(F16)}
    loss = lambda p: jnp.sum(p["w"].astype(F32) ** 2)  # noqa: E731
    traces = []

    @jax.jit
    def step(params, state, poison):
        traces.append(1)
        grads = jax.grad(lambda p: scale_loss(loss(p), state))(params)
        grads = {"w": grads["w"] + poison.astype(F16)}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with standard_promotion():
        state = tx.init(params)
        params, state = step(params, state, jnp.float32(0.0))
        before = (params, state)
        params, state = step(params, state, jnp.float32(jnp.inf))
        for a, b in zip(jax.tree.leaves(before[1]), jax.tree.leaves(state)):
            if a.shape:  # params-shaped leaves: master and Adam moments
                assert_bitwise_equal(a, b)
        assert_bitwise_equal(params["w"], before[0]["w"])
        for _ in range(3):
            params, state = step(params, state, jnp.float32(0.0))
    assert len(traces) == 1
    master = state.master["w"] if order == "master_outside" else state.inner_state.master["w"]
    assert master.dtype == F32
    assert_bitwise_equal(params["w"], master.astype(F16))
    assert float(jnp.max(params["w"].astype(F32))) < 1.5  # it trained


def test_master_outside_keeps_gradients_below_float16_range():
    # A true gradient of 2**-26 is below float16's smallest subnormal (2**-24): scaled by 2**10
    # it is representable, and only the master-outside order unscales it in float32.
    tiny = 2.0**-26
    params = {"w": jnp.zeros(1, F16)}
    scaled_grads = {"w": jnp.full(1, tiny * 2.0**10, F16)}
    outside = master_weights(loss_scaling(optax.sgd(1.0), "static:1024"))
    inside = loss_scaling(master_weights(optax.sgd(1.0)), "static:1024")
    _, s_out = outside.update(scaled_grads, outside.init(params), params)
    _, s_in = inside.update(scaled_grads, inside.init(params), params)
    assert float(s_out.master["w"][0]) == -tiny
    assert float(s_in.inner_state.master["w"][0]) == 0.0  # the gradient rounded to 0 in float16


def test_sharded_master_and_moments_follow_the_params():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
    params = {"w": jax.device_put(jnp.ones((4, 16), BF16), sharding)}
    tx = master_weights(optax.sgd(0.1, momentum=0.9))
    state0 = tx.init(params)
    updates, state1 = jax.jit(tx.update)(
        {"w": jax.device_put(jnp.ones((4, 16), BF16), sharding)}, state0, params
    )
    for s in (state0, state1):
        assert s.master["w"].sharding.is_equivalent_to(sharding, 2)
        assert s.inner_state[0].trace["w"].sharding.is_equivalent_to(sharding, 2)
    assert updates["w"].sharding.is_equivalent_to(sharding, 2)


def test_bad_input():
    params = {"w": jnp.ones(2, BF16), "b": jnp.ones(1, BF16)}
    tx = master_weights(optax.sgd(1.0))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(
        ValueError,
        match=r"master_weights needs the params: call update\(grads, opt_state, params\)",
    ):
        tx.update(grads, state)
    with pytest.raises(
        ValueError, match="master_weights: the grads tree does not match the params tree"
    ):
        tx.update({"w": grads["w"]}, state, params)
    with pytest.raises(
        TypeError,
        match=r"master_weights: gradients must be floating-point, got int32 at grads\['b'\]",
    ):
        tx.update({"w": grads["w"], "b": jnp.ones(1, jnp.int32)}, state, params)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"w": jnp.ones(2, jnp.float8_e4m3fn)}, r"params\['w'\] is float8_e4m3fn, which cannot"),
        ({"w": jnp.ones(2, jnp.float8_e5m2)}, r"params\['w'\] is float8_e5m2, which cannot"),
        ({"w": jnp.ones(2, BF16), "act": "gelu"}, r"params must be arrays, got 'gelu' of type"),
        (None, r"init got params=None"),
    ],
)
def test_init_refuses_params_it_cannot_keep_a_master_of(params, message):
    with pytest.raises(TypeError, match=f"master_weights: {message}"):
        master_weights(optax.sgd(1.0)).init(params)
