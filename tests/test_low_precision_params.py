"""bfloat16/float16 params without a master copy: the -1e-4 demo for each rounding (stochastic
against the binomial bound, Kahan against float32, nearest stuck), updates and state dtypes,
params landing exactly on the rounded target, reproducibility, jit, checkpoint-resume, loss
scaling in both orders (skips, and float16 gradients below the normal range), MultiSteps,
composition with state_precision (6 bytes per param), sharding and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optimizer_checks import (
    assert_trees_bitwise_equal,
    assert_trees_equal_up_to_fma,
    counting_step,
    make_poisoned_step,
    run_sharded_steps,
    run_steps,
    standard_promotion,
)

from mpjax import (
    DynamicLossScale,
    LowPrecisionParamsState,
    loss_scaling,
    low_precision_params,
    memory_report,
    state_precision,
    stochastic_round,
)
from mpjax.optim.rounding import next_rounding_keys, rounding_key, widen

F32, BF16, F16 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def is_masked(x):
    return isinstance(x, optax.MaskedNode)


def dtypes(tree):
    """Each leaf's dtype, MaskedNode kept as it is."""
    return jax.tree.map(lambda x: x if is_masked(x) else np.dtype(x.dtype), tree, is_leaf=is_masked)


def as_f64(x):
    return np.asarray(jnp.asarray(x).astype(F32), np.float64)


def make_params(dtype=BF16):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": (1.0 + 0.3 * jax.random.normal(k1, (16, 8))).astype(dtype),
        "b": jnp.linspace(-2.0, 2.0, 8).astype(dtype),
    }


def grads_at(i, params):
    """Step ``i``'s gradients, in each param's dtype."""
    key = jax.random.fold_in(jax.random.key(1), i)
    return {
        name: jax.random.normal(jax.random.fold_in(key, j), p.shape).astype(p.dtype)
        for j, (name, p) in enumerate(sorted(params.items()))
    }


run = functools.partial(run_steps, grads_at=grads_at)


# ---------------------------------------------------------------------------------------------
# 100 updates of -1e-4 to params at 1.0


def minus_1e4_run(rounding, dtype, n=4096, steps=100):
    """``steps`` SGD updates of -1e-4 to ``n`` params at 1.0; the params and the state."""
    tx = low_precision_params(optax.sgd(1e-4), rounding)
    traces = []

    @jax.jit
    def step(params, state):
        traces.append(1)
        updates, state = tx.update({"w": jnp.ones(n, dtype)}, state, params)
        assert updates["w"].dtype == dtype
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.ones(n, dtype)}
    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    assert len(traces) == 1
    assert params["w"].dtype == dtype
    return params["w"], state


def float32_run(steps=100):
    x = np.float32(1.0)
    for _ in range(steps):
        x = np.float32(x - np.float32(1e-4))
    assert x == np.float32(0.98999834)
    return x


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_stochastic_rounding_moves_the_mean_as_float32_does(dtype):
    n, steps = 4096, 100
    w, _ = minus_1e4_run("stochastic", dtype, n, steps)
    # Each step lands on 1 - k * spacing (spacing of dtype below 1.0) or the one below it, the
    # lower one with probability p = 1e-4 / spacing: the mean is unbiased, its spread binomial.
    spacing = 2.0**-8 if dtype == BF16 else 2.0**-11
    p = 1e-4 / spacing
    bound = 5 * spacing * np.sqrt(steps * p * (1 - p) / n)
    values = as_f64(w)
    assert abs(values.mean() - float32_run(steps)) < bound
    assert bound < 0.001  # tight enough to tell 0.99 from 1.0 (nearest) by ten times over
    assert len(np.unique(values)) > 3  # the elements went their own ways


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_rounding_to_nearest_never_moves(dtype):
    w, state = minus_1e4_run("nearest", dtype)
    np.testing.assert_array_equal(as_f64(w), 1.0)
    assert isinstance(state.key, optax.EmptyState)
    assert is_masked(state.compensation["w"])


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_kahan_tracks_float32(dtype):
    # After each step param + compensation is the float32 sum param + update + compensation,
    # up to the rounding of the compensation into dtype: over the run it tracks float32 within
    # those roundings, and the param is the dtype value nearest the float32 run.
    n = 64
    tx = low_precision_params(optax.sgd(1e-4), "kahan")
    params = {"w": jnp.ones(n, dtype)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    grads = {"w": jnp.ones(n, dtype)}
    slack = 0.0
    for _ in range(100):
        before = as_f64(params["w"]) + as_f64(state.compensation["w"])
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        after = as_f64(params["w"]) + as_f64(state.compensation["w"])
        c = np.abs(as_f64(state.compensation["w"])).max()
        half_ulp = 2.0 ** (np.floor(np.log2(c)) - (8 if dtype == BF16 else 11)) if c else 0.0
        assert np.all(np.abs(after - (before - 1e-4)) <= half_ulp + 2.0**-23)
        slack += half_ulp + 2.0**-23
    assert state.compensation["w"].dtype == dtype
    target = float32_run()
    total = as_f64(params["w"]) + as_f64(state.compensation["w"])
    assert np.all(np.abs(total - target) <= slack)
    assert slack < 1e-3  # far closer than the 0.01 that rounding to nearest loses
    np.testing.assert_array_equal(np.asarray(params["w"]), np.full(n, target, dtype))


def test_kahan_on_float16_lands_on_float32_exactly():
    # float16's compensation holds 11 bits: here it loses nothing at all.
    w, state = minus_1e4_run("kahan", F16, n=8)
    total = w.astype(F32) + state.compensation["w"].astype(F32)
    np.testing.assert_array_equal(np.asarray(total), np.full(8, float32_run(), np.float32))


# ---------------------------------------------------------------------------------------------
# Dtypes and exactness


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_dtypes_of_updates_and_state(rounding):
    params = {"low": jnp.ones(3, BF16), "half": jnp.ones(2, F16), "full": jnp.ones(4, F32)}
    tx = low_precision_params(optax.adam(1e-2), rounding)
    with standard_promotion():
        state = tx.init(params)
        updates, new_state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
    new_params = optax.apply_updates(params, updates)  # under strict promotion: dtypes match
    assert isinstance(state, LowPrecisionParamsState)
    assert dtypes(updates) == dtypes(params) == dtypes(new_params)
    for s in (state, new_state):
        adam = s.inner_state[0]
        assert dtypes(adam.mu) == dtypes(adam.nu) == {"low": F32, "half": F32, "full": F32}
        if rounding == "kahan":
            assert dtypes(s.compensation) == {"low": BF16, "half": F16, "full": optax.MaskedNode()}
        else:
            assert all(is_masked(c) for c in s.compensation.values())
        if rounding == "stochastic":
            assert s.key.dtype == np.uint32 and s.key.shape == (2,)
        else:
            assert isinstance(s.key, optax.EmptyState)
    assert all(bool(jnp.all(new_params[k] != params[k])) for k in params)  # every param moved


def test_float32_params_take_the_inner_updates_unchanged():
    # The reference runs the inner optimizer on the same tree (widened): optax jits parts of
    # Adam over the whole tree, and XLA may compile a different tree's arithmetic differently.
    params = {"low": jnp.linspace(0.5, 1.5, 8).astype(BF16), "full": jnp.linspace(-1.0, 1.0, 8)}
    grads = {"low": jnp.linspace(-1.0, 2.0, 8).astype(BF16), "full": jnp.linspace(3.0, -1.0, 8)}
    adam = optax.adam(1e-2)
    alone = {"full": params["full"]}
    for tree in (params, alone):
        tx = low_precision_params(adam, "stochastic")
        p = tree
        g = {k: grads[k] for k in tree}
        with standard_promotion():
            state, ref = tx.init(p), adam.init(widen(p))
            for _ in range(3):
                updates, state = tx.update(g, state, p)
                expected, ref = adam.update(widen(g), ref, widen(p))
                assert_trees_bitwise_equal(updates["full"], expected["full"])
                p = optax.apply_updates(p, updates)
        assert_trees_bitwise_equal(state.inner_state, ref)
        assert updates["full"].dtype == F32


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_stochastic_params_land_exactly_on_the_rounded_target(dtype):
    # Reproduces each step by hand: float32 Adam on the widened params, then param + update
    # rounded with the leaf keys the carried key gives (leaves in tree order: "b", "w").
    params = make_params(dtype)
    tx = low_precision_params(optax.adam(1e-2), "stochastic", seed=5)
    adam = optax.adam(1e-2)
    with standard_promotion():
        state, ref = tx.init(params), adam.init(widen(params))
        assert_trees_bitwise_equal(state.key, rounding_key(5))
        for i in range(3):  # eager, op by op, like the reference
            grads = grads_at(i, params)
            inner_updates, ref = adam.update(widen(grads), ref, widen(params))
            next_key, (key_b, key_w) = next_rounding_keys(state.key, 2)
            updates, state = tx.update(grads, state, params)
            new = optax.apply_updates(params, updates)
            for name, key in (("b", key_b), ("w", key_w)):
                target = params[name].astype(F32) + inner_updates[name]
                assert_trees_bitwise_equal(new[name], stochastic_round(target, dtype, key))
            assert_trees_bitwise_equal(state.key, next_key)
            assert_trees_bitwise_equal(state.inner_state, ref)
            params = new
    # Not a cast: some params went to the farther neighbour.
    assert not np.array_equal(np.asarray(new["w"]), np.asarray(target.astype(dtype)))


@pytest.mark.parametrize("rounding", ["kahan", "nearest"])
def test_deterministic_params_land_exactly_on_the_rounded_target(rounding):
    params = make_params()
    tx = low_precision_params(optax.adam(1e-2), rounding)
    adam = optax.adam(1e-2)
    comp = jax.tree.map(jnp.zeros_like, params)
    with standard_promotion():
        state, ref = tx.init(params), adam.init(widen(params))
        for i in range(3):
            grads = grads_at(i, params)
            inner_updates, ref = adam.update(widen(grads), ref, widen(params))
            updates, state = tx.update(grads, state, params)
            new = optax.apply_updates(params, updates)
            for name in params:
                target = params[name].astype(F32) + inner_updates[name]
                if rounding == "kahan":
                    target = target + comp[name].astype(F32)
                    comp[name] = (target - target.astype(BF16).astype(F32)).astype(BF16)
                    assert_trees_bitwise_equal(state.compensation[name], comp[name])
                assert_trees_bitwise_equal(new[name], target.astype(BF16))
            params = new


def test_reproducible_from_the_seed_and_no_retrace():
    params = make_params()

    def tx(seed):
        return low_precision_params(optax.adamw(1e-2), "stochastic", seed=seed)

    t = tx(0)
    a, b = run(t, params, 3), run(tx(0), params, 3)
    assert_trees_bitwise_equal(a, b)
    # Another seed only changes the key the state starts from, and the rounding.
    assert_trees_bitwise_equal(tx(1).init(params).key, rounding_key(1))
    with standard_promotion():
        other = t.init(params)._replace(key=rounding_key(1))
    c = run(t, params, 3, state=other)
    assert not np.array_equal(np.asarray(a[0]["w"]), np.asarray(c[0]["w"]))

    step, traces = counting_step(t)

    with standard_promotion():
        state = t.init(params)
        keys = [state.key]
        for i in range(3):
            params, state = step(params, state, grads_at(i, params))
            keys.append(state.key)
    assert len(traces) == 1
    assert len({np.asarray(k).tobytes() for k in keys}) == 4  # the key advances every step
    assert_trees_bitwise_equal((params, state), a)


@pytest.mark.slow
def test_orbax_checkpoint_resume_is_bit_identical(tmp_path):
    # Two carried keys: the params' and the state's.
    tx = low_precision_params(
        state_precision(optax.adamw(1e-2), "bf16", rounding="stochastic", seed=1),
        "stochastic",
        seed=2,
    )
    params = make_params()
    expected = run(tx, params, 6)

    params, state = run(tx, params, 3)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
        checkpointer.wait_until_finished()
        with standard_promotion():
            fresh = {"params": make_params(), "opt_state": tx.init(make_params())}
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt_state"], LowPrecisionParamsState)
    assert_trees_bitwise_equal(restored["opt_state"], state)
    resumed = run(tx, restored["params"], 3, start=3, state=restored["opt_state"])
    assert_trees_bitwise_equal(resumed, expected)


# ---------------------------------------------------------------------------------------------
# Loss scaling, MultiSteps, state_precision


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("order", ["params_outside", "loss_scaling_outside"])
def test_a_skipped_step_changes_nothing(order, rounding):
    adam = optax.adam(1e-2)
    scale = DynamicLossScale(2.0**10, growth_interval=100)
    if order == "params_outside":
        tx = low_precision_params(loss_scaling(adam, scale), rounding)
    else:
        tx = loss_scaling(low_precision_params(adam, rounding), scale)
    step = make_poisoned_step(tx)
    params = make_params()

    def parts(state):
        """The params' compensation, Adam's state and the key, wherever the order puts them."""
        lpp = state if order == "params_outside" else state.inner_state
        adam_state = lpp.inner_state.inner_state if order == "params_outside" else lpp.inner_state
        return lpp.compensation, adam_state, lpp.key

    with standard_promotion():
        state = tx.init(params)
        params, state = step(params, state, jnp.float32(0.0))
        before = (params, state)
        params, state = step(params, state, jnp.float32(jnp.inf))
        assert_trees_bitwise_equal(params, before[0])
        assert_trees_bitwise_equal(parts(state), parts(before[1]))
        params, state = step(params, state, jnp.float32(0.0))
    assert not np.array_equal(np.asarray(params["w"]), np.asarray(before[0]["w"]))
    if rounding == "stochastic":
        assert not np.array_equal(np.asarray(parts(state)[2]), np.asarray(parts(before[1])[2]))
    else:
        assert parts(state)[0]["w"].dtype == BF16
    assert int(parts(state)[1][0].count) == 2


def test_params_outside_loss_scaling_unscale_float16_gradients_in_float32():
    # True gradients below float16's normal range: 1e-6 (a subnormal there, so it loses bits)
    # and 2**-26 (below the smallest subnormal, so it becomes 0). Scaled by 2**15 both are
    # ordinary float16 numbers; only the order with low_precision_params outside unscales them
    # in float32. Momentum's trace holds the gradient the optimizer saw.
    true = np.array([1e-6, 2.0**-26], np.float32)
    scaled = jnp.asarray(true * 2.0**15).astype(F16)
    params = {"w": jnp.zeros(2, F16)}
    sgd = optax.sgd(1.0, momentum=0.9)
    outside = low_precision_params(loss_scaling(sgd, "static:32768"), "stochastic")
    inside = loss_scaling(low_precision_params(sgd, "stochastic"), "static:32768")
    _, s_out = outside.update({"w": scaled}, outside.init(params), params)
    _, s_in = inside.update({"w": scaled}, inside.init(params), params)
    seen_out = np.asarray(s_out.inner_state.inner_state[0].trace["w"])
    seen_in = np.asarray(s_in.inner_state.inner_state[0].trace["w"])
    np.testing.assert_array_equal(seen_out, np.asarray(scaled.astype(F32)) / np.float32(2.0**15))
    np.testing.assert_allclose(seen_out, true, rtol=1e-3)
    assert seen_in[1] == 0.0  # lost
    assert abs(seen_in[0] - true[0]) > 1e-2 * true[0]  # distorted by float16's subnormal spacing
    assert seen_in[0] == float(jnp.float32(true[0]).astype(F16))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_multisteps_micro_steps_leave_params_unchanged(rounding):
    tx = low_precision_params(optax.MultiSteps(optax.adam(1e-2), 2), rounding)
    params = make_params()
    step = jax.jit(tx.update)
    with standard_promotion():
        state = tx.init(params)
        for i in range(6):
            updates, new_state = step(grads_at(i, params), state, params)
            new_params = optax.apply_updates(params, updates)
            if i % 2 == 0:
                assert_trees_bitwise_equal(new_params, params)
                assert_trees_bitwise_equal(new_state.compensation, state.compensation)
            else:
                assert not np.array_equal(np.asarray(new_params["w"]), np.asarray(params["w"]))
            params, state = new_params, new_state
    assert int(state.inner_state.gradient_step) == 3
    assert dtypes(params) == {"w": BF16, "b": BF16}


def test_with_state_precision_six_bytes_per_param():
    params = make_params()
    n = sum(p.size for p in jax.tree.leaves(params))
    tx = low_precision_params(
        state_precision(optax.adamw(1e-2), "bf16", rounding="stochastic"), "stochastic"
    )
    params, state = run(tx, params, 2)
    report = memory_report(params, state)
    assert report.param_count == n
    assert report.part_bytes("params") == 2 * n
    assert report.part_bytes("mu") == 2 * n
    assert report.part_bytes("nu") == 2 * n
    assert report.part_bytes("key") == 2 * 8  # two carried keys: the params' and the state's
    assert report.part_bytes("count") == 4
    assert report.total_bytes == 6 * n + 16 + 4
    assert report.part_bytes("compensation") == report.part_bytes("master") == 0
    adam = state.inner_state.inner_state[0]
    assert dtypes(adam.mu) == dtypes(adam.nu) == {"w": BF16, "b": BF16}


# ---------------------------------------------------------------------------------------------
# Sharding


@pytest.fixture
def mesh():
    devices = jax.devices()[:8]
    assert len(devices) == 8, "conftest.py must give 8 CPU devices"
    return Mesh(np.array(devices), ("x",))


@pytest.mark.slow
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_sharded_run_matches_the_unsharded_one_bit_for_bit(mesh, rounding):
    # The same keys, the numbers up to how XLA compiles each size (see
    # optimizer_checks.assert_trees_equal_up_to_fma).
    sharding = NamedSharding(mesh, P("x"))
    params = {"w": (1.0 + 0.3 * jax.random.normal(jax.random.key(0), (64, 8))).astype(BF16)}
    tx = low_precision_params(optax.adam(1e-2), rounding)
    expected = run(tx, params, 3)
    p, state0, state = run_sharded_steps(tx, params, 3, sharding, grads_at=grads_at)
    adam0, adam = state0.inner_state[0], state.inner_state[0]
    for a0, a in ((adam0.mu["w"], adam.mu["w"]), (adam0.nu["w"], adam.nu["w"])):
        assert a0.sharding.is_equivalent_to(sharding, 2)
        assert a.sharding.is_equivalent_to(a0.sharding, 2)
    if rounding == "kahan":
        assert state.compensation["w"].sharding.is_equivalent_to(sharding, 2)
    assert p["w"].sharding.is_equivalent_to(sharding, 2)
    if rounding == "kahan":
        # The compensation holds what the bfloat16 params cannot: a param landing on the other
        # neighbour moves it by a whole param ulp, so compare what the two hold together.
        def held(params, state):
            return params["w"].astype(F32) + state.compensation["w"].astype(F32)

        assert_trees_equal_up_to_fma(held(p, state), held(*expected), steps=3)
        assert_trees_equal_up_to_fma(state.inner_state, expected[1].inner_state, steps=3)
    else:
        assert_trees_equal_up_to_fma((p, state), expected, steps=3)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input():
    params = make_params()
    tx = low_precision_params(optax.sgd(1.0))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(
        ValueError,
        match=r"low_precision_params needs the params: call update\(grads, opt_state, params\)",
    ):
        tx.update(grads, state)
    for rounding in ("up", "Kahan"):
        with pytest.raises(
            ValueError,
            match=r"rounding must be one of \('stochastic', 'kahan', 'nearest'\), got '" + rounding,
        ):
            low_precision_params(optax.sgd(1.0), rounding)
    with pytest.raises(TypeError, match="low_precision_params: rounding must be one of .* int"):
        low_precision_params(optax.sgd(1.0), 1)
    with pytest.raises(
        ValueError, match=r"low_precision_params: grads\['w'\] has shape \(8,\) but params"
    ):
        tx.update({"w": jnp.ones(8, BF16), "b": grads["b"]}, state, params)
    with pytest.raises(ValueError, match="the grads tree does not match the params tree"):
        tx.update({"w": grads["w"]}, state, params)
    with pytest.raises(TypeError, match=r"gradients must be floating-point, got int32 at grads"):
        tx.update({"w": grads["w"], "b": jnp.ones(8, jnp.int32)}, state, params)
    for inner in (optax.sgd, None, "adam"):
        with pytest.raises(
            TypeError,
            match="low_precision_params: inner must be an optax GradientTransformation",
        ):
            low_precision_params(inner)
    with pytest.raises(TypeError, match="low_precision_params: update got a state of type"):
        tx.update(grads, optax.sgd(1.0).init(params), params)
    with pytest.raises(TypeError, match="seed must be an integer or a PRNG key"):
        low_precision_params(optax.sgd(1.0), seed="0")
    for rounding in ("kahan", "nearest"):  # wrong even where the rounding ignores it
        with pytest.raises(TypeError, match="seed must be an integer or a PRNG key.* float"):
            low_precision_params(optax.sgd(1.0), rounding, seed=1.5)
