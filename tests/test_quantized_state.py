"""Quantized optimizer state: which leaves are quantized and why (size, last axis, mask, format
fields), which map (signed, unsigned), the optimizers it wraps, the update against its
definition, stochastic rounding's carried key, composition (loss scaling skipping bit for bit
in both orders, master weights, low-precision params, MultiSteps, jit), FSDP on 8 devices,
checkpoints (flax.serialization, orbax, resume), training accuracy, and bad input."""

import functools

import flax.serialization
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
    counting_step,
    make_poisoned_step,
    quadratic_loss,
    run_sharded_steps,
    run_steps,
    small_grads_at,
    standard_promotion,
)

from mpjax import (
    QUANT_FORMATS,
    DynamicLossScale,
    QuantizedArray,
    QuantizedState,
    loss_scaling,
    low_precision_params,
    master_weights,
    quantization_choices,
    quantize_blockwise,
    quantized_state,
)
from mpjax.optim.rounding import next_rounding_keys, rounding_key

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)


def make_params(dtype=F32):
    """A matrix the default rules quantize (16384 elements, last axis 256) and a bias they
    keep wide; :func:`optimizer_checks.quadratic_loss` takes them."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (64, 256)).astype(dtype),
        "b": (0.1 * jax.random.normal(k2, (256,))).astype(dtype),
    }


grads_at = small_grads_at


run = functools.partial(run_steps, grads_at=grads_at)


def adam_of(state):
    return state.inner_state[0]


def quantized_leaves(tree):
    return [
        x
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedArray))
        if isinstance(x, QuantizedArray)
    ]


# ---------------------------------------------------------------------------------------------
# Which leaves, which map


def test_default_quantizes_large_moments_with_the_map_of_their_field():
    params = make_params()
    state = quantized_state(optax.adam(1e-3)).init(params)
    assert isinstance(state, QuantizedState) and isinstance(state.key, optax.EmptyState)
    adam = adam_of(state)
    mu, nu = adam.mu["w"], adam.nu["w"]
    assert isinstance(mu, QuantizedArray) and isinstance(nu, QuantizedArray)
    assert (mu.format.name, mu.signed, nu.signed) == ("dynamic8", True, False)
    assert mu.codes.shape == (64, 256) and mu.absmax.shape == (64, 1) and mu.block_size == 256
    # The bias (256 elements, under min_size) and the counter stay as optax keeps them.
    assert adam.mu["b"].dtype == F32 and adam.nu["b"].dtype == F32
    assert adam.count.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(mu.dequantize()), np.zeros((64, 256)))

    four = adam_of(quantized_state(optax.adam(1e-3), "dynamic4").init(params)).mu["w"]
    assert four.codes.shape == (64, 128) and four.absmax.shape == (64, 2)
    small = adam_of(quantized_state(optax.adam(1e-3), min_size=0).init(params))
    assert isinstance(small.nu["b"], QuantizedArray) and small.nu["b"].absmax.shape == (1,)


def test_choices_say_why_a_leaf_stays_wide():
    params = {**make_params(), "odd": jnp.zeros((64, 100)), "emb": jnp.zeros((512, 64))}
    choices = quantization_choices(optax.adam(1e-3), params, block_size=128)
    why = {r.path: (r.stored, r.reason) for r in choices.rows}
    assert why["[0].mu['w']"] == ("dynamic8 signed", "quantized")
    assert why["[0].nu['w']"] == ("dynamic8 unsigned", "quantized")
    assert why["[0].mu['b']"] == ("f32", "256 elements, fewer than min_size 4096")
    assert why["[0].mu['odd']"] == (
        "f32",
        "its last axis, 100, is not a multiple of block_size 128",
    )
    assert why["[0].mu['emb']"] == ("f32", "its last axis, 64, is not a multiple of block_size 128")
    assert {r.path for r in choices.quantized} == {"[0].mu['w']", "[0].nu['w']"}
    assert str(choices).splitlines()[0].split() == ["leaf", "shape", "stored", "why"]
    # A mask keeps a param's state wide (False) or asks for it whatever its size (True).
    mask = {"w": False, "b": True, "odd": False, "emb": False}
    choices = quantization_choices(optax.adam(1e-3), params, mask=mask)
    assert {r.path for r in choices.quantized} == {"[0].mu['b']", "[0].nu['b']"}
    assert (
        dict((r.path, r.reason) for r in choices.rows)["[0].mu['w']"]
        == "mask is False for params['w']"
    )
    with pytest.raises(
        ValueError,
        match=r"the mask asks to quantize \[0\]\.mu\['odd'\] of shape \(64, 100\) in dynamic8, but "
        r"its last axis, 100, is not a multiple of block_size 256\. Set the mask False",
    ):
        quantized_state(
            optax.adam(1e-3), mask=lambda p: {**jax.tree.map(lambda _: True, p), "emb": False}
        ).init(params)
    # A format mapping quantizes the fields it names, each in its format.
    choices = quantization_choices(optax.adam(1e-3), make_params(), {"mu": "dynamic4"})
    assert [(r.path, r.stored) for r in choices.quantized] == [("[0].mu['w']", "dynamic4 signed")]
    with pytest.raises(ValueError, match=r"\['moo'\] name no floating leaf.*'mu', 'nu'"):
        quantized_state(optax.adam(1e-3), {"mu": "dynamic8", "moo": "e4m3"}).init(make_params())


@pytest.mark.parametrize(
    "inner, fields",
    [
        (optax.adam(1e-2), {"mu": True, "nu": False}),
        (optax.adamw(1e-2), {"mu": True, "nu": False}),
        (optax.lion(1e-3), {"mu": True}),
        (optax.sgd(1e-2, momentum=0.9), {"trace": True}),
        (optax.rmsprop(1e-3), {"nu": False}),
        (optax.adafactor(1e-2), {"v_row": False, "v_col": False}),
    ],
    ids=["adam", "adamw", "lion", "sgd_momentum", "rmsprop", "adafactor"],
)
@pytest.mark.slow
def test_moment_like_leaves_of_common_optimizers(inner, fields):
    # Adafactor's factored second moments of a (128, 4096) matrix: v_row has 128 elements
    # (stays wide), v_col 4096 (quantized, unsigned).
    params = {"w": jax.random.normal(jax.random.key(0), (128, 4096))}
    tx = quantized_state(inner)
    params, state = run(tx, params, 3)
    found = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        state.inner_state, is_leaf=lambda x: isinstance(x, QuantizedArray)
    ):
        if isinstance(leaf, QuantizedArray):
            found[[e.name for e in path if isinstance(e, jax.tree_util.GetAttrKey)][-1]] = (
                leaf.signed
            )
    expected = {"v_col": False} if "v_row" in fields else fields
    assert found == expected
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------------------------
# The update


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic8", "e4m3", "dynamic4"])
def test_nearest_is_float32_adam_on_the_dequantized_state_then_quantized(name):
    # The definition, by hand: float32 Adam from the dequantized moments, the new moments
    # quantized with the same format and map; the updates those of that float32 step.
    params = make_params()
    tx = quantized_state(optax.adam(1e-2), name)
    adam = optax.adam(1e-2)
    with standard_promotion():
        state = tx.init(params)
        for i in range(4):
            grads = grads_at(i, params)
            stored = adam_of(state)
            wide = stored._replace(
                mu={"w": stored.mu["w"].dequantize(), "b": stored.mu["b"]},
                nu={"w": stored.nu["w"].dequantize(), "b": stored.nu["b"]},
            )
            expected_updates, (expected, _) = adam.update(grads, (wide, optax.EmptyState()), params)
            updates, state = tx.update(grads, state, params)
            assert_trees_bitwise_equal(updates, expected_updates)
            for field, signed in (("mu", True), ("nu", False)):
                q = getattr(adam_of(state), field)["w"]
                ref = quantize_blockwise(getattr(expected, field)["w"], name, signed=signed)
                assert_trees_bitwise_equal((q.codes, q.absmax), (ref.codes, ref.absmax))
                assert_trees_bitwise_equal(
                    getattr(adam_of(state), field)["b"], getattr(expected, field)["b"]
                )
            params = optax.apply_updates(params, updates)
    assert int(adam_of(state).count) == 4


@pytest.mark.slow
def test_stochastic_rounds_with_the_carried_key_stream():
    params = make_params()
    tx = quantized_state(optax.adam(1e-2), rounding="stochastic", seed=3)
    with standard_promotion():
        state = tx.init(params)
        assert_trees_bitwise_equal(state.key, rounding_key(3))
        for i in range(3):
            grads = grads_at(i, params)
            # The float32 step is the nearest one's; only the requantization differs.
            wide = jax.tree.map(
                lambda x: x.dequantize() if isinstance(x, QuantizedArray) else x,
                state.inner_state,
                is_leaf=lambda x: isinstance(x, QuantizedArray),
            )
            _, (expected, _) = optax.adam(1e-2).update(grads, wide, params)
            updates, new_state = tx.update(grads, state, params)
            next_key, keys = next_rounding_keys(state.key, 2)  # mu['w'], nu['w'] in tree order
            assert_trees_bitwise_equal(new_state.key, next_key)
            for field, signed, key in (("mu", True, keys[0]), ("nu", False, keys[1])):
                q = getattr(adam_of(new_state), field)["w"]
                ref = quantize_blockwise(
                    getattr(expected, field)["w"], signed=signed, rounding="stochastic", key=key
                )
                assert_trees_bitwise_equal((q.codes, q.absmax), (ref.codes, ref.absmax))
            state = new_state
            params = optax.apply_updates(params, updates)
    # Not a nearest rounding: some codes went to the farther neighbour.
    nearest = quantize_blockwise(expected.mu["w"])
    assert not np.array_equal(np.asarray(nearest.codes), np.asarray(adam_of(state).mu["w"].codes))
    # Reproducible from the seed, under jit.
    a, b = (
        run(tx, make_params(), 3),
        run(quantized_state(optax.adam(1e-2), rounding="stochastic", seed=3), make_params(), 3),
    )
    assert_trees_bitwise_equal(a, b)


def test_jit_does_not_retrace_on_the_next_step():
    params = make_params()
    tx = quantized_state(optax.adamw(1e-2), "dynamic4", rounding="stochastic")
    step, traces = counting_step(tx)
    with standard_promotion():
        state = tx.init(params)
        for i in range(3):
            params, state = step(params, state, grads_at(i, params))
    assert len(traces) == 1
    assert adam_of(state).mu["w"].format.name == "dynamic4"


# ---------------------------------------------------------------------------------------------
# Composition


def test_loss_scaling_inside_skipped_step_keeps_codes_absmaxes_and_key_bit_for_bit():
    inner = loss_scaling(optax.adam(1e-2), DynamicLossScale(2.0**10, growth_interval=100))
    tx = quantized_state(inner, "dynamic8", rounding="stochastic")
    step = make_poisoned_step(tx)
    params = make_params()
    with standard_promotion():
        state = tx.init(params)
        params, state = step(params, state, jnp.float32(0.0))
        # Requantizing the dequantized state would move it (a negative block extreme comes
        # back 0.7% smaller): the skip keeps what is stored.
        assert any(
            not np.array_equal(
                np.asarray(q.codes),
                np.asarray(quantize_blockwise(q.dequantize(), signed=q.signed).codes),
            )
            or not np.array_equal(
                np.asarray(q.absmax),
                np.asarray(quantize_blockwise(q.dequantize(), signed=q.signed).absmax),
            )
            for q in quantized_leaves(state)
        )
        before = (params, state)
        params, state = step(params, state, jnp.float32(jnp.inf))
        assert not bool(state.inner_state.applied)
        assert_trees_bitwise_equal(state.key, before[1].key)
        assert_trees_bitwise_equal(state.inner_state.inner_state, before[1].inner_state.inner_state)
        assert_trees_bitwise_equal(params, before[0])
        params, state = step(params, state, jnp.float32(0.0))
    assert bool(state.inner_state.applied)
    assert not np.array_equal(np.asarray(state.key), np.asarray(before[1].key))
    assert int(state.inner_state.inner_state[0].count) == 2


def test_loss_scaling_outside_skips_with_the_whole_state_bit_identical():
    tx = loss_scaling(
        quantized_state(optax.adam(1e-2), "e4m3", rounding="stochastic"),
        DynamicLossScale(2.0**10, growth_interval=100),
    )
    step = make_poisoned_step(tx)
    params = make_params()
    with standard_promotion():
        state = tx.init(params)
        params, state = step(params, state, jnp.float32(0.0))
        before = (params, state)
        params, state = step(params, state, jnp.float32(jnp.inf))
    assert not bool(state.applied)
    assert_trees_bitwise_equal(state.inner_state, before[1].inner_state)
    assert_trees_bitwise_equal(params, before[0])


def test_master_weights_outside_works_and_inside_is_refused():
    params = make_params(BF16)
    tx = master_weights(quantized_state(optax.adam(1e-2), "dynamic8"))
    params, state = run(tx, params, 5)
    assert state.master["w"].dtype == F32
    assert isinstance(state.inner_state.inner_state[0].mu["w"], QuantizedArray)
    assert float(jnp.max(jnp.abs(state.master["w"] - make_params()["w"]))) > 0.04  # it trained
    with pytest.raises(ValueError, match=r"master-weights copy .*master_weights\(quantized_state"):
        quantized_state(master_weights(optax.adam(1e-2)), min_size=0).init(params)


def test_low_precision_params_with_stochastic_rounding_trains_bf16_params():
    params = make_params(BF16)
    tx = low_precision_params(
        loss_scaling(quantized_state(optax.adamw(1e-2), rounding="stochastic", seed=1)),
        "stochastic",
        seed=2,
    )
    step = make_poisoned_step(tx)
    loss0 = float(quadratic_loss(params))
    with standard_promotion():
        state = tx.init(params)
        for _ in range(20):
            params, state = step(params, state, jnp.float32(0.0))
    assert jax.tree.map(lambda p: p.dtype, params) == {"w": BF16, "b": BF16}
    assert float(quadratic_loss(params)) < loss0 * 0.9


def test_multisteps_outside_accumulates_and_inside_keeps_the_accumulator_wide():
    tx = optax.MultiSteps(quantized_state(optax.adam(1e-2), rounding="stochastic"), 2)
    step, _ = counting_step(tx)
    params = make_params()
    with standard_promotion():
        state = tx.init(params)
        for i in range(6):
            previous = (params, state.inner_opt_state)
            params, state = step(params, state, grads_at(i, params))
            if i % 2 == 0:  # a micro-step: the quantized state and its key stay as they are
                assert_trees_bitwise_equal(state.inner_opt_state, previous[1])
                assert_trees_bitwise_equal(params, previous[0])
    assert int(adam_of(state.inner_opt_state).count) == 3
    inside = quantized_state(optax.MultiSteps(optax.adam(1e-2), 2))
    with standard_promotion():
        acc = inside.init(make_params()).inner_state.acc_grads
    assert acc["w"].dtype == F32


# ---------------------------------------------------------------------------------------------
# Sharding and checkpoints


@pytest.mark.slow
def test_fsdp_on_8_devices_matches_the_single_device_step_bit_for_bit():
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    sharding = NamedSharding(mesh, P("fsdp"))
    params = {"w": jax.random.normal(jax.random.key(0), (64, 512))}
    for name in ("dynamic8", "e4m3", "dynamic4"):
        tx = quantized_state(optax.adam(1e-2), name, rounding="stochastic")
        expected = run(tx, params, 3)
        p, state0, state = run_sharded_steps(tx, params, 3, sharding, grads_at=grads_at)
        for q in quantized_leaves(state0) + quantized_leaves(state):
            # Whole blocks on each device: the codes and absmaxes sharded like the param.
            assert q.codes.sharding.is_equivalent_to(sharding, 2)
            assert q.absmax.sharding.is_equivalent_to(sharding, 2)
        assert_trees_bitwise_equal((p, state), expected)


def test_flax_serialization_round_trips_bit_for_bit():
    params = make_params()
    for name in ("dynamic8", "e4m3", "dynamic4"):
        tx = quantized_state(optax.adam(1e-2), name, rounding="stochastic")
        _, state = run(tx, params, 2)
        restored = flax.serialization.from_bytes(
            tx.init(params), flax.serialization.to_bytes(state)
        )
        assert_trees_bitwise_equal(restored, state)
        assert isinstance(adam_of(restored).mu["w"], QuantizedArray)
        as_dict = flax.serialization.to_state_dict(state)
        assert set(as_dict["inner_state"]["0"]["mu"]["w"]) == {"codes", "absmax"}


@pytest.mark.slow
def test_orbax_checkpoint_resume_is_bit_identical(tmp_path):
    tx = quantized_state(optax.adamw(1e-2), "dynamic4", rounding="stochastic", seed=7)
    params = make_params()
    expected = run(tx, params, 6)
    params, state = run(tx, params, 3)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
        checkpointer.wait_until_finished()
        fresh = {"params": make_params(), "opt_state": tx.init(make_params())}
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt_state"], QuantizedState)
    assert isinstance(adam_of(restored["opt_state"]).mu["w"], QuantizedArray)
    assert_trees_bitwise_equal(restored["opt_state"], state)
    resumed = run(tx, restored["params"], 3, start=3, state=restored["opt_state"])
    assert_trees_bitwise_equal(resumed, expected)


# ---------------------------------------------------------------------------------------------
# Training


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic8", "e4m3", "dynamic4"])
def test_adam_with_quantized_states_trains_a_regression_like_float32_adam(name):
    # A least-squares fit, 300 steps of Adam from zero. The tolerance comes from the map: a
    # block's largest moment is stored within r of itself, r half the widest gap of the signed
    # map relative to the block's absmax (dynamic8 0.7%, e4m3 6.25%, dynamic4 11.25%), so each
    # step's move, and the progress the run makes from the initial loss, are within about that
    # fraction of float32 Adam's.
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (512, 64))
    y = x @ jax.random.normal(kw, (64, 256))

    def loss(p):
        return jnp.mean((x @ p["w"] - y) ** 2)

    def train(tx, steps=300):
        params = {"w": jnp.zeros((64, 256))}
        state = tx.init(params)

        @jax.jit
        def step(params, state):
            grads = jax.grad(loss)(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        with standard_promotion():
            for _ in range(steps):
                params, state = step(params, state)
        return float(loss(params))

    initial = float(loss({"w": jnp.zeros((64, 256))}))
    reference = train(optax.adam(1e-2))
    quantized = train(quantized_state(optax.adam(1e-2), name))
    fmt = QUANT_FORMATS[name]
    grid = fmt.map(True).astype(np.float64)
    r = max(np.max(np.diff(grid)) / 2, 1 + grid[0]) if not fmt.float8 else 2.0**-4
    assert reference < initial / 50  # the reference trains
    assert abs(quantized - reference) <= r * (initial - reference)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input():
    adam = optax.adam(1e-3)
    with pytest.raises(
        ValueError,
        match=r"quantized_state format must be one of \('dynamic8', 'e4m3', 'dynamic4'\) or a QuantFormat, got 'int8'",
    ):
        quantized_state(adam, "int8")
    with pytest.raises(ValueError, match=r"format for 'nu' must be one of .* got 'fp4'"):
        quantized_state(adam, {"mu": "dynamic8", "nu": "fp4"})
    with pytest.raises(ValueError, match="format is an empty mapping"):
        quantized_state(adam, {})
    with pytest.raises(
        ValueError,
        match=r"quantized_state: block_size must be a positive power of two \(64, 128, 256\.\.\.\), got 100",
    ):
        quantized_state(adam, block_size=100)
    with pytest.raises(
        TypeError,
        match="quantized_state: block_size must be a positive power of two .* of type str",
    ):
        quantized_state(adam, block_size="256")
    with pytest.raises(
        ValueError, match="block_size must be at least 2 for the 4-bit format 'dynamic4'"
    ):
        quantized_state(adam, "dynamic4", block_size=1)
    with pytest.raises(ValueError, match="min_size must be a non-negative integer .* got -1"):
        quantized_state(adam, min_size=-1)
    with pytest.raises(
        ValueError, match=r"rounding must be one of \('nearest', 'stochastic'\), got 'up'"
    ):
        quantized_state(adam, rounding="up")
    with pytest.raises(TypeError, match="seed must be an integer or a PRNG key"):
        quantized_state(adam, seed=0.5)
    with pytest.raises(TypeError, match=r"got the function adam: call it"):
        quantized_state(optax.adam)
    with pytest.raises(
        TypeError, match="unsigned_fields must be a sequence of state field names, got 'nu'"
    ):
        quantized_state(adam, unsigned_fields="nu")
    params = make_params()
    with pytest.raises(ValueError, match="the mask tree does not match the params tree"):
        quantized_state(adam, mask={"w": True}).init(params)
    with pytest.raises(TypeError, match=r"mask\['b'\] must be True .* or False .*, got 1"):
        quantized_state(adam, mask={"w": True, "b": 1}).init(params)
    tx = quantized_state(adam)
    with pytest.raises(TypeError, match="update got a state of type tuple, not the QuantizedState"):
        tx.update(grads_at(0, params), adam.init(params), params)
    with pytest.raises(ValueError, match=r"quantized_state: grads\['w'\] has shape \(4,\)"):
        tx.update({"w": jnp.ones(4), "b": jnp.ones(256)}, tx.init(params))
