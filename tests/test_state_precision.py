"""Optimizer state in a chosen precision: the dtypes asked for (one dtype, a per-field mapping,
scalars untouched), rounding to nearest against its definition, stochastic rounding's carried
key (reproducible, advancing, exact against the key stream, jit), composition with loss scaling
(both orders), MultiSteps and master weights, sharding, checkpoint-resume and bad input."""

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
    quadratic_loss,
    run_sharded_steps,
    run_steps,
    small_grads_at,
    standard_promotion,
)

from mpjax import (
    DynamicLossScale,
    StatePrecisionState,
    loss_scaling,
    master_weights,
    state_precision,
    stochastic_round,
)
from mpjax.optim.rounding import next_rounding_keys, rounding_key

F32, BF16, F16 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
I32, U32 = np.dtype(jnp.int32), np.dtype(jnp.uint32)


def dtypes(tree):
    return jax.tree.map(lambda x: np.dtype(x.dtype), tree)


def make_params(dtype=F32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (16, 4)).astype(dtype),
        "b": (0.1 * jax.random.normal(k2, (4,))).astype(dtype),
    }


grads_at = small_grads_at


run = functools.partial(run_steps, grads_at=grads_at)


def adam_of(state):
    """optax.adam's ScaleByAdamState inside a StatePrecisionState."""
    return state.inner_state[0]


# ---------------------------------------------------------------------------------------------
# Dtypes


def test_one_dtype_stores_every_moment_and_updates_keep_the_gradients_dtype():
    tx = state_precision(optax.adam(1e-3), "bfloat16")
    params = make_params()
    with standard_promotion():
        state = tx.init(params)
        assert isinstance(state, StatePrecisionState)
        assert isinstance(state.key, optax.EmptyState)  # nearest needs no key
        for s in (state, tx.update(grads_at(0, params), state, params)[1]):
            adam = adam_of(s)
            assert dtypes(adam.mu) == dtypes(adam.nu) == {"w": BF16, "b": BF16}
            assert adam.count.dtype == I32
        updates, _ = tx.update(grads_at(0, params), state, params)
        assert dtypes(updates) == {"w": F32, "b": F32}
        # bfloat16 gradients (and params) give bfloat16 updates.
        low = make_params(BF16)
        updates, _ = tx.update(grads_at(0, low), tx.init(low), low)
        assert dtypes(updates) == {"w": BF16, "b": BF16}


def test_mapping_gives_the_nu_dtype_optax_lacks():
    # bfloat16 params: optax's Adam would keep nu in bfloat16; the mapping stores it in float32.
    params = make_params(BF16)
    tx = state_precision(optax.adam(1e-3), {"mu": "bfloat16", "nu": "float32"})
    with standard_promotion():
        state = tx.init(params)
        updates, new_state = tx.update(grads_at(0, params), state, params)
    for s in (state, new_state):
        assert dtypes(adam_of(s).mu) == {"w": BF16, "b": BF16}
        assert dtypes(adam_of(s).nu) == {"w": F32, "b": F32}
        assert adam_of(s).count.dtype == I32
    assert dtypes(updates) == {"w": BF16, "b": BF16}


@pytest.mark.parametrize("param_dtype", [F32, BF16], ids=["f32_params", "bf16_params"])
def test_leaves_not_named_keep_their_dtype(param_dtype):
    params = make_params(param_dtype)
    tx = state_precision(optax.adam(1e-3), {"mu": "float16"})
    with standard_promotion():
        state = tx.init(params)
        _, new_state = tx.update(grads_at(0, params), state, params)
    for s in (state, new_state):
        assert dtypes(adam_of(s).mu) == {"w": F16, "b": F16}
        assert dtypes(adam_of(s).nu) == {"w": param_dtype, "b": param_dtype}  # as optax has it


def test_params_named_like_state_fields_do_not_choose_the_dtype():
    # The state field (ScaleByAdamState.nu) decides, not the key of the param under it.
    params = {"mu": jnp.ones(4, BF16), "nu": jnp.ones(4, BF16), "master": jnp.ones(4, BF16)}
    tx = state_precision(optax.adam(1e-3), {"mu": "bfloat16", "nu": "float32"})
    with standard_promotion():
        state = tx.init(params)
        _, new_state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    for s in (state, new_state):
        assert dtypes(adam_of(s).mu) == {"mu": BF16, "nu": BF16, "master": BF16}
        assert dtypes(adam_of(s).nu) == {"mu": F32, "nu": F32, "master": F32}
    # Only "mu" named: the nu of a param called "mu" keeps Adam's own f32.
    f32_params = jax.tree.map(lambda p: p.astype(F32), params)
    state = state_precision(optax.adam(1e-3), {"mu": "bfloat16"}).init(f32_params)
    assert dtypes(adam_of(state).nu) == {"mu": F32, "nu": F32, "master": F32}
    # A param named "master" is not a master-weights copy.
    state = state_precision(optax.adam(1e-3), "bf16").init(params)
    assert dtypes(adam_of(state).nu) == {"mu": BF16, "nu": BF16, "master": BF16}


def test_one_dtype_leaves_scalar_hyperparameters_alone():
    tx = state_precision(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "bf16")
    params = make_params()
    with standard_promotion():
        state = tx.init(params)
        _, new_state = tx.update(grads_at(0, params), state, params)
    for s in (state, new_state):
        injected = s.inner_state
        assert set(dtypes(injected.hyperparams).values()) == {F32}
        assert float(injected.hyperparams["learning_rate"]) == float(np.float32(1e-3))
        adam = injected.inner_state[0]
        assert dtypes(adam.mu) == dtypes(adam.nu) == {"w": BF16, "b": BF16}


# ---------------------------------------------------------------------------------------------
# Rounding


@pytest.mark.parametrize("param_dtype", [F32, BF16], ids=["f32_params", "bf16_params"])
def test_nearest_is_float32_adam_with_mu_rounded_after_each_step(param_dtype):
    # The definition, by hand: float32 Adam on the widened params and gradients, and after each
    # step mu (and, for bfloat16 params, nu as optax keeps it in their dtype) rounded to its
    # storage dtype to nearest. Eager, op by op, like the reference.
    params = make_params(param_dtype)
    tx = state_precision(optax.adam(1e-2), {"mu": "bfloat16"})
    adam = optax.adam(1e-2)

    def rounded(tree, dtype):
        return jax.tree.map(lambda x: x.astype(dtype).astype(F32), tree)

    def wide(tree):
        return jax.tree.map(lambda x: x.astype(F32), tree)

    with standard_promotion():
        state, ref, unrounded = tx.init(params), adam.init(wide(params)), adam.init(wide(params))
        for i in range(20):
            grads = grads_at(i, params)
            updates, state = tx.update(grads, state, params)
            expected, ref = adam.update(wide(grads), ref, wide(params))
            ref = (
                ref[0]._replace(mu=rounded(ref[0].mu, BF16), nu=rounded(ref[0].nu, param_dtype)),
                ref[1],
            )
            as_param = jax.tree.map(lambda u: u.astype(param_dtype), expected)
            assert_trees_bitwise_equal(updates, as_param)
            for field, dtype in (("mu", BF16), ("nu", param_dtype)):
                stored = jax.tree.map(lambda x: x.astype(dtype), getattr(ref[0], field))  # noqa: B023
                assert_trees_bitwise_equal(getattr(adam_of(state), field), stored)
            without, unrounded = adam.update(wide(grads), unrounded, wide(params))
            params = optax.apply_updates(params, updates)
    # Not vacuous: by the last step the rounding has changed the updates.
    assert not np.array_equal(np.asarray(expected["w"]), np.asarray(without["w"]))


def test_stochastic_state_is_the_float32_step_rounded_with_the_carried_key_stream():
    params = make_params()
    tx = state_precision(optax.adam(1e-2), "bfloat16", rounding="stochastic", seed=3)
    adam = optax.adam(1e-2)
    with standard_promotion():
        state = tx.init(params)
        assert_trees_bitwise_equal(state.key, rounding_key(3))
        for i in range(3):
            grads = grads_at(i, params)
            wide_state = jax.tree.map(
                lambda x: x.astype(F32) if x.dtype == BF16 else x, state.inner_state
            )
            _, expected = adam.update(grads, wide_state, params)
            updates, new_state = tx.update(grads, state, params)
            # The chosen leaves in tree order: mu["b"], mu["w"], nu["b"], nu["w"].
            next_key, keys = next_rounding_keys(state.key, 4)
            assert_trees_bitwise_equal(new_state.key, next_key)
            chosen = [
                expected[0].mu["b"],
                expected[0].mu["w"],
                expected[0].nu["b"],
                expected[0].nu["w"],
            ]
            stored = [
                adam_of(new_state).mu["b"],
                adam_of(new_state).mu["w"],
                adam_of(new_state).nu["b"],
                adam_of(new_state).nu["w"],
            ]
            for x, k, s in zip(chosen, keys, stored):
                assert_trees_bitwise_equal(s, stochastic_round(x, BF16, k))
            assert int(adam_of(new_state).count) == i + 1
            state = new_state
            params = optax.apply_updates(params, updates)
    # Not a cast: some moments went to the farther neighbour.
    assert not np.array_equal(np.asarray(stored[1]), np.asarray(chosen[1].astype(BF16)))


def test_stochastic_is_reproducible_from_its_seed_and_its_key_advances():
    params = make_params()

    def tx(seed):
        return state_precision(optax.adam(1e-2), "bfloat16", rounding="stochastic", seed=seed)

    t = tx(0)
    state = t.init(params)
    assert state.key.dtype == U32 and state.key.shape == (2,)
    # Two transformations built from the same seed run bit for bit alike.
    a, b = run(t, params, 4), run(tx(0), params, 4)
    assert_trees_bitwise_equal(a, b)
    # The seed (an integer or a key) is the key the state starts from; another one rounds
    # differently.
    assert_trees_bitwise_equal(tx(1).init(params).key, rounding_key(1))
    assert_trees_bitwise_equal(tx(jax.random.key(1)).init(params).key, rounding_key(1))
    c = run(t, params, 4, state=state._replace(key=rounding_key(1)))
    assert not np.array_equal(np.asarray(adam_of(a[1]).mu["w"]), np.asarray(adam_of(c[1]).mu["w"]))

    keys = [state.key]
    step = jax.jit(t.update)
    with standard_promotion():
        for i in range(4):
            _, state = step(grads_at(i, params), state, params)
            keys.append(state.key)
    assert len({np.asarray(k).tobytes() for k in keys}) == len(keys)
    assert_trees_bitwise_equal(state, a[1])


def test_jit_does_not_retrace_on_the_next_step():
    params = make_params()
    tx = state_precision(optax.adamw(1e-2), {"mu": "bf16", "nu": "bf16"}, rounding="stochastic")
    step, traces = counting_step(tx)

    with standard_promotion():
        state = tx.init(params)
        for i in range(3):
            params, state = step(params, state, grads_at(i, params))
    assert len(traces) == 1
    assert dtypes(adam_of(state).mu) == {"w": BF16, "b": BF16}


# ---------------------------------------------------------------------------------------------
# Composition


def test_loss_scaling_outside_skips_with_the_whole_state_bit_identical():
    inner = state_precision(optax.adam(1e-2), "bf16", rounding="stochastic")
    tx = loss_scaling(inner, DynamicLossScale(2.0**10, growth_interval=100))
    step = make_poisoned_step(tx)
    params = make_params()
    with standard_promotion():
        state = tx.init(params)
        params, state = step(params, state, jnp.float32(0.0))
        before = (params, state)
        params, state = step(params, state, jnp.float32(jnp.inf))
        assert not bool(state.applied)
        assert_trees_bitwise_equal(state.inner_state, before[1].inner_state)  # key included
        assert_trees_bitwise_equal(params, before[0])
        assert float(state.scale) == 2.0**9
        params, state = step(params, state, jnp.float32(0.0))
    assert bool(state.applied)
    assert not np.array_equal(
        np.asarray(state.inner_state.key), np.asarray(before[1].inner_state.key)
    )
    assert int(state.inner_state.inner_state[0].count) == 2


def test_loss_scaling_inside_skipped_step_does_not_advance_the_key():
    inner = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10, growth_interval=100))
    tx = state_precision(inner, "bf16", rounding="stochastic")
    step = make_poisoned_step(tx)
    params = make_params()
    with standard_promotion():
        state = tx.init(params)
        params, state = step(params, state, jnp.float32(0.0))
        before = (params, state)
        params, state = step(params, state, jnp.float32(jnp.inf))
        ls = state.inner_state
        assert not bool(ls.applied)
        assert_trees_bitwise_equal(state.key, before[1].key)
        assert_trees_bitwise_equal(ls.inner_state, before[1].inner_state.inner_state)
        assert_trees_bitwise_equal(params, before[0])
        assert float(ls.scale) == 2.0**9 and ls.loss_scale.loss_scale.dtype == F32
        params, state = step(params, state, jnp.float32(0.0))
    assert bool(state.inner_state.applied)
    assert not np.array_equal(np.asarray(state.key), np.asarray(before[1].key))
    adam = state.inner_state.inner_state[0]
    assert int(adam.count) == 2
    assert dtypes(adam.mu) == dtypes(adam.nu) == {"w": BF16, "b": BF16}


def test_inside_multisteps_trains_and_keeps_dtypes():
    inner = state_precision(optax.adam(1e-2), "bf16", rounding="stochastic")
    tx = loss_scaling(optax.MultiSteps(inner, 2), DynamicLossScale(2.0**10, growth_interval=100))
    step = make_poisoned_step(tx)
    params = make_params()
    losses = [float(quadratic_loss(params))]
    with standard_promotion():
        state = tx.init(params)
        key0 = state.inner_state.inner_opt_state.key
        for i in range(8):
            previous = params
            params, state = step(params, state, jnp.float32(0.0))
            sp = state.inner_state.inner_opt_state
            if i % 2 == 0:  # a micro-step: nothing moves, the key included
                assert_trees_bitwise_equal(params, previous)
                assert_trees_bitwise_equal(sp.key, key0)
            else:
                assert not np.array_equal(np.asarray(sp.key), np.asarray(key0))
                key0 = sp.key
            losses.append(float(quadratic_loss(params)))
    assert isinstance(sp, StatePrecisionState)
    assert dtypes(sp.inner_state[0].mu) == dtypes(sp.inner_state[0].nu) == {"w": BF16, "b": BF16}
    assert dtypes(state.inner_state.acc_grads) == {"w": F32, "b": F32}
    assert int(sp.inner_state[0].count) == 4
    assert losses[-1] < losses[0]


def test_master_weights_outside_works_and_inside_is_refused():
    params = make_params(BF16)
    tx = master_weights(state_precision(optax.adam(1e-2), "bf16", rounding="stochastic"))
    params, state = run(tx, params, 5)
    assert dtypes(state.master) == {"w": F32, "b": F32}
    adam = state.inner_state.inner_state[0]
    assert dtypes(adam.mu) == dtypes(adam.nu) == {"w": BF16, "b": BF16}
    assert_trees_bitwise_equal(params, jax.tree.map(lambda m: m.astype(BF16), state.master))
    assert float(jnp.max(jnp.abs(state.master["w"] - make_params()["w"]))) > 0.01  # it trained

    with pytest.raises(ValueError, match=r"master-weights copy .*master_weights\(state_precision"):
        state_precision(master_weights(optax.adam(1e-2)), "bf16").init(params)


# ---------------------------------------------------------------------------------------------
# Sharding and checkpoints


@pytest.fixture
def mesh():
    devices = jax.devices()[:8]
    assert len(devices) == 8, "conftest.py must give 8 CPU devices"
    return Mesh(np.array(devices), ("x",))


@pytest.mark.slow
def test_sharded_run_matches_the_unsharded_one_bit_for_bit(mesh):
    # threefry is partitionable, so the rounding draws do not depend on the sharding: the key
    # and a draw are the same bit for bit, the numbers up to how XLA compiles each size
    # (optimizer_checks.assert_trees_equal_up_to_fma).
    sharding = NamedSharding(mesh, P("x"))
    params = {"w": jax.random.normal(jax.random.key(0), (64, 8))}
    tx = state_precision(optax.adam(1e-2), "bf16", rounding="stochastic")
    expected = run(tx, params, 3)
    p, state0, state = run_sharded_steps(tx, params, 3, sharding, grads_at=grads_at)
    for moment in (adam_of(state0).mu["w"], adam_of(state0).nu["w"]):
        assert moment.sharding.is_equivalent_to(sharding, 2)
    assert adam_of(state).mu["w"].sharding.is_equivalent_to(adam_of(state0).mu["w"].sharding, 2)
    assert adam_of(state).nu["w"].sharding.is_equivalent_to(adam_of(state0).nu["w"].sharding, 2)
    assert_trees_equal_up_to_fma((p, state), expected, steps=3)
    assert_trees_bitwise_equal(state.key, expected[1].key)
    x = jax.random.normal(jax.random.key(2), (64, 8))
    draw = jax.jit(lambda x, key: stochastic_round(x, BF16, key))
    assert_trees_bitwise_equal(draw(jax.device_put(x, sharding), state.key), draw(x, state.key))


@pytest.mark.slow
def test_orbax_checkpoint_resume_is_bit_identical(tmp_path):
    tx = state_precision(
        optax.adamw(1e-2), {"mu": "bf16", "nu": "bf16"}, rounding="stochastic", seed=7
    )
    params = make_params()
    expected = run(tx, params, 6)

    params, state = run(tx, params, 3)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
        checkpointer.wait_until_finished()
        fresh = {"params": make_params(), "opt_state": tx.init(make_params())}
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt_state"], StatePrecisionState)
    assert_trees_bitwise_equal(restored["opt_state"], state)
    resumed = run(tx, restored["params"], 3, start=3, state=restored["opt_state"])
    assert_trees_bitwise_equal(resumed, expected)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input():
    params = make_params()
    adam = optax.adam(1e-3)
    with pytest.raises(
        ValueError,
        match=r"\['moo'\] name no floating leaf.* Field names with floating leaves: .*'mu', 'nu'",
    ):
        state_precision(adam, {"mu": "bf16", "moo": "bf16"}).init(params)
    with pytest.raises(ValueError, match="dtype is an empty mapping"):
        state_precision(adam, {})
    with pytest.raises(TypeError, match="keys of a dtype mapping are state field names .* got 1"):
        state_precision(adam, {1: "bf16"})
    with pytest.raises(
        ValueError, match=r"rounding must be one of \('nearest', 'stochastic'\), got 'up'"
    ):
        state_precision(adam, "bf16", rounding="up")
    with pytest.raises(TypeError, match="state_precision: rounding must be one of .* of type int"):
        state_precision(adam, "bf16", rounding=1)
    with pytest.raises(
        TypeError, match=r"got the function adam: call it .* e\.g\. optax\.adam\(1e-3\)"
    ):
        state_precision(optax.adam, "bf16")
    with pytest.raises(TypeError, match="inner must be an optax GradientTransformation"):
        state_precision(None, "bf16")
    with pytest.raises(ValueError, match="state_precision dtype float8_e4m3fn is too narrow"):
        state_precision(adam, "float8_e4m3fn")
    with pytest.raises(
        ValueError, match="state_precision dtype for 'nu' float8_e5m2 is too narrow"
    ):
        state_precision(adam, {"mu": "bf16", "nu": "float8_e5m2"})
    with pytest.raises(
        ValueError, match="state_precision dtype must be a floating-point dtype, got int8"
    ):
        state_precision(adam, jnp.int8)
    with pytest.raises(TypeError, match="state_precision dtype must be a floating dtype"):
        state_precision(adam, None)
    with pytest.raises(TypeError, match="seed must be an integer or a PRNG key"):
        state_precision(adam, "bf16", rounding="stochastic", seed=0.5)
    with pytest.raises(TypeError, match="seed must be an integer or a PRNG key.*'a' of type str"):
        state_precision(adam, "bf16", seed="a")  # wrong even where rounding to nearest ignores it
    tx = state_precision(adam, "bf16")
    with pytest.raises(
        TypeError,
        match="state_precision: update got a state of type tuple, not the StatePrecisionState",
    ):
        tx.update(grads_at(0, params), adam.init(params), params)
    with pytest.raises(ValueError, match=r"state_precision: grads\['w'\] has shape \(4,\)"):
        tx.update({"w": jnp.ones(4), "b": jnp.ones(4)}, tx.init(params), params)
