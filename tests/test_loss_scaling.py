"""Loss scaling: the scale values, the loss_scaling optax transform and the readers of its
state: trajectories, skips, pytree behaviour, jit, sharding, checkpoints, MultiSteps, bad input
and the names that are gone."""

import functools
import gc
import importlib
import re
import warnings

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from optimizer_checks import assert_trees_bitwise_equal, standard_promotion

import mpjax
from mpjax import (
    DynamicLossScale,
    LossScalingInfo,
    LossScalingState,
    NoOpLossScale,
    PersistentOverflowError,
    StaticLossScale,
    check_overflow,
    jax_compat,
    loss_scaling,
    loss_scaling_info,
    scale_loss,
)

F32, BF16, F16 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def torch_rule(scale, tracker, finite, growth=2.0, backoff=0.5, interval=2000, lo=None, hi=None):
    """PyTorch's GradScaler update rule in plain Python (float32), plus mpjax's clamps."""
    if not finite:
        scale = np.float32(scale * backoff)
        return (scale if lo is None else max(scale, np.float32(lo))), 0
    tracker += 1
    if tracker == interval:
        grown = np.float32(scale * growth)
        if hi is not None:
            grown = min(grown, np.float32(hi))
        return (grown if np.isfinite(grown) else scale), 0
    return scale, tracker


def run_adjust(loss_scale, finite_sequence):
    """Scales used at each step and scales after each step, adjusting under jit."""
    adjust = jax.jit(lambda ls, finite: ls.adjust(finite))
    used, after = [], []
    for finite in finite_sequence:
        used.append(float(loss_scale.loss_scale))
        loss_scale = adjust(loss_scale, jnp.array(finite))
        after.append(float(loss_scale.loss_scale))
    return used, after


# ---------------------------------------------------------------------------------------------
# Loss-scale trajectories


def test_reference_trajectory_pytorch_example():
    # PyTorch's rule worked by hand: init 16, interval 3, overflow at (0-indexed) steps 6, 9
    # and 10. Growth after each third finite step in a row, halving on every overflow.
    finite = [i not in (6, 9, 10) for i in range(11)]
    used, after = run_adjust(DynamicLossScale(16, growth_interval=3, min_scale=None), finite)
    assert after == [16, 16, 32, 32, 32, 64, 32, 32, 32, 16, 8]
    # The scale that scaled the loss at step k is the one after step k - 1.
    assert used == [16, 16, 16, 32, 32, 32, 64, 32, 32, 32, 16]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
        dict(growth_factor=1.5, backoff_factor=0.75, growth_interval=1),
        dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=5),
        dict(growth_interval=2, min_scale=4.0, max_scale=64.0),
    ],
)
def test_trajectory_matches_pytorch_rule_with_custom_factors(kwargs):
    rng = np.random.default_rng(0)
    finite = list(rng.random(40) > 0.3)
    # No floor unless the case sets one: PyTorch's GradScaler has none.
    loss_scale = DynamicLossScale(16.0, **{"min_scale": None, **kwargs})
    _, after = run_adjust(loss_scale, finite)
    expected, scale, tracker = [], np.float32(16.0), 0
    for f in finite:
        scale, tracker = torch_rule(
            scale,
            tracker,
            f,
            kwargs.get("growth_factor", 2.0),
            kwargs.get("backoff_factor", 0.5),
            kwargs["growth_interval"],
            kwargs.get("min_scale"),
            kwargs.get("max_scale"),
        )
        expected.append(float(scale))
    assert after == expected


def test_min_and_max_scale_clamp():
    _, after = run_adjust(DynamicLossScale(8.0, min_scale=2.0), [False] * 4)
    assert after == [4.0, 2.0, 2.0, 2.0]
    _, after = run_adjust(DynamicLossScale(8.0, growth_interval=1, max_scale=24.0), [True] * 3)
    assert after == [16.0, 24.0, 24.0]


def test_growth_that_would_overflow_float32_is_refused_and_counter_resets():
    big = DynamicLossScale(2.0**126, counter=1, growth_interval=1)
    big = big.adjust(jnp.array(True))
    assert float(big.loss_scale) == 2.0**127
    grown = big.adjust(jnp.array(True))
    assert float(grown.loss_scale) == 2.0**127 and int(grown.counter) == 0


def test_counter_counts_and_resets():
    ls = DynamicLossScale(4.0, growth_interval=3)
    ls = ls.adjust(True).adjust(True)
    assert int(ls.counter) == 2
    assert int(ls.adjust(False).counter) == 0
    assert int(ls.adjust(True).counter) == 0 and float(ls.adjust(True).loss_scale) == 8.0


def test_static_and_noop_never_change():
    for ls in (StaticLossScale(64), NoOpLossScale()):
        for finite in (True, False):
            new = ls.adjust(jnp.array(finite))
            assert float(new.loss_scale) == float(ls.loss_scale)
            assert new.counter.dtype == jnp.int32


# ---------------------------------------------------------------------------------------------
# Dtypes and pytree structure


@pytest.mark.parametrize(
    "initial",
    [
        2**15,
        32768.0,
        np.float16(4),
        np.float64(4),
        jnp.float16(4),
        jnp.asarray(4.0),
        jnp.bfloat16(8),
    ],
    ids=["int", "float", "np_f16", "np_f64", "jnp_f16", "weak", "jnp_bf16"],
)
@pytest.mark.parametrize("cls", [DynamicLossScale, StaticLossScale])
def test_scale_is_strongly_typed_float32_whatever_is_passed(cls, initial):
    ls = cls(initial)
    assert ls.loss_scale.dtype == F32 and not jax.typeof(ls.loss_scale).weak_type
    assert ls.counter.dtype == jnp.int32
    after = jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)
    assert jax.tree.map(jax.typeof, after) == jax.tree.map(jax.typeof, ls)


@pytest.mark.parametrize("ls", [DynamicLossScale(1024.0), StaticLossScale(1024.0), NoOpLossScale()])
def test_scale_keeps_dtypes_and_unscale_returns_float32(ls):
    tree = {
        "f32": jnp.full(3, 0.5, F32),
        "bf16": jnp.full(3, 0.5, BF16),
        "f16": jnp.full(3, 0.5, F16),
        "int": jnp.arange(3),
        "np": np.full(2, 0.5, np.float32),
    }
    scaled = ls.scale(tree)
    assert {k: v.dtype for k, v in scaled.items()} == {
        "f32": F32,
        "bf16": BF16,
        "f16": F16,
        "int": np.dtype(jnp.int32),
        "np": F32,
    }
    np.testing.assert_array_equal(scaled["int"], tree["int"])
    factor = float(ls.loss_scale)
    np.testing.assert_array_equal(np.asarray(scaled["bf16"], np.float32), 0.5 * factor)
    unscaled = ls.unscale(scaled)
    assert {k: unscaled[k].dtype for k in ("f32", "bf16", "f16", "np")} == {
        "f32": F32,
        "bf16": F32,
        "f16": F32,
        "np": F32,
    }
    for k in ("f32", "bf16", "f16"):
        np.testing.assert_array_equal(unscaled[k], np.full(3, 0.5, np.float32))


def test_scale_of_a_float16_loss_is_computed_in_float32():
    # 2**15 * 1.5 overflows float16, so the loss is inf and the step will be skipped; but a
    # scale of 2**15 itself must not be rounded to float16 before multiplying.
    out = DynamicLossScale(2.0**15).scale(jnp.array(1.0, F16))
    assert out.dtype == F16 and float(out) == 2.0**15


def test_hyperparameters_survive_jit_tree_map_and_flatten():
    ls = DynamicLossScale(
        8.0,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=7,
        min_scale=0.5,
        max_scale=1024.0,
    )
    roundtrips = [
        jax.jit(lambda x: x)(ls),
        jax.tree.map(lambda x: x, ls),
        jax.tree.unflatten(*reversed(jax.tree.flatten(ls))),
    ]
    for other in roundtrips:
        assert (other.growth_factor, other.backoff_factor, other.growth_interval) == (3.0, 0.25, 7)
        assert (other.min_scale, other.max_scale) == (0.5, 1024.0)
    assert [x.dtype for x in jax.tree.leaves(ls)] == [F32, np.dtype(jnp.int32)]
    assert jax.tree.leaves(NoOpLossScale()) == []


def test_tree_operations_with_placeholders_do_not_validate():
    ls = DynamicLossScale()
    shapes = jax.eval_shape(lambda s: s.adjust(True), ls)
    assert shapes.loss_scale.dtype == F32
    assert jax.tree.map(lambda _: None, ls).loss_scale is None


@pytest.mark.parametrize(
    "ls", [DynamicLossScale(8.0, growth_interval=5, max_scale=64.0), StaticLossScale(8.0)]
)
def test_unflatten_rebuilds_without_validation_but_the_constructor_validates(ls):
    leaves, treedef = jax.tree.flatten(ls)
    placeholders = [object() for _ in leaves]
    rebuilt = jax.tree.unflatten(treedef, placeholders)  # would raise if it validated
    assert type(rebuilt) is type(ls)
    assert jax.tree.leaves(rebuilt) == placeholders
    if isinstance(ls, DynamicLossScale):
        assert (rebuilt.growth_interval, rebuilt.max_scale) == (5, 64.0)
    # Values the constructor would reject and cast come back as they are.
    negative = jax.tree.unflatten(treedef, [-1.0 for _ in leaves])
    assert jax.tree.leaves(negative) == [-1.0 for _ in leaves]
    with pytest.raises(TypeError, match="loss_scale must be a positive number, got <object"):
        type(ls)(object())
    with pytest.raises(ValueError, match="loss_scale must be positive"):
        type(ls)(-1.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (jnp.array(jnp.nan), "loss_scale must be positive and finite in float32, got Array(nan"),
        (jnp.array(-4.0), "loss_scale must be positive"),
        (jnp.array(0.0, BF16), "loss_scale must be positive"),
        (jnp.ones(2), "loss_scale must be a positive number, got Array"),
    ],
    ids=["nan", "negative", "zero_bf16", "not_scalar"],
)
@pytest.mark.parametrize("cls", [DynamicLossScale, StaticLossScale])
def test_constructor_rejects_bad_concrete_jax_arrays(cls, bad, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        cls(bad)


def test_constructor_checks_a_concrete_jax_counter_and_bounds():
    with pytest.raises(ValueError, match="counter must be a non-negative integer"):
        DynamicLossScale(counter=jnp.array(-1))
    with pytest.raises(ValueError, match="counter must be a non-negative integer"):
        DynamicLossScale(counter=jnp.array(1.0))
    with pytest.raises(ValueError, match=r"outside \[min_scale, max_scale\]"):
        DynamicLossScale(jnp.array(2.0), min_scale=4.0)


def test_constructor_casts_tracers_without_checking_them():
    # Inside jit the value is unknown: a NaN scale built there is cast, not rejected.
    def build(scale, counter):
        ls = DynamicLossScale(scale, counter, min_scale=1.0)
        return ls, StaticLossScale(scale)

    dynamic, static = jax.jit(build)(jnp.array(jnp.nan, BF16), jnp.array(3, jnp.int16))
    assert dynamic.loss_scale.dtype == F32 and static.loss_scale.dtype == F32
    assert dynamic.counter.dtype == jnp.int32 and int(dynamic.counter) == 3
    assert bool(jnp.isnan(dynamic.loss_scale)) and dynamic.min_scale == 1.0


def test_concrete_float32_jax_scale_keeps_its_sharding(mesh):
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    scale = jax.device_put(jnp.float32(16.0), replicated)
    assert DynamicLossScale(scale).loss_scale.sharding == replicated


def test_replace_builds_a_validated_copy():
    ls = DynamicLossScale(8.0, growth_interval=3)
    other = ls.replace(loss_scale=32)
    assert float(other.loss_scale) == 32.0 and other.loss_scale.dtype == F32
    assert other.growth_interval == 3
    with pytest.raises(ValueError, match="growth_interval must be an integer from 1 to 2"):
        ls.replace(growth_interval=0)


# ---------------------------------------------------------------------------------------------
# Choosing a loss scale


def initial_loss_scale(spec):
    """The loss scale a loss_scaling transform built from ``spec`` starts with."""
    return loss_scaling(optax.sgd(1.0), spec).init(jnp.ones(1)).loss_scale


def test_loss_scale_specs():
    assert isinstance(initial_loss_scale("dynamic"), DynamicLossScale)
    assert float(initial_loss_scale("dynamic").loss_scale) == 2.0**15
    assert isinstance(initial_loss_scale("none"), NoOpLossScale)
    static = initial_loss_scale("static:512")
    assert isinstance(static, StaticLossScale) and float(static.loss_scale) == 512.0
    assert float(initial_loss_scale(8).loss_scale) == 8.0
    custom = DynamicLossScale(4.0)
    assert initial_loss_scale(custom) is custom
    for spec in ("dynamic", "none", "static:3", 3, 2.5, custom):
        ls = initial_loss_scale(spec)
        assert ls.loss_scale.dtype == F32 and ls.counter.dtype == jnp.int32


def test_default_loss_scale_is_dynamic_at_2_to_15():
    state = loss_scaling(optax.sgd(1.0)).init(jnp.ones(2))
    assert isinstance(state.loss_scale, DynamicLossScale)
    assert float(state.scale) == 2.0**15 and state.loss_scale.growth_interval == 2000


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("mixed_float16", DynamicLossScale),
        ("float16", DynamicLossScale),
        ("p=f16,c=f32,o=f32", DynamicLossScale),
        ("mixed_bfloat16", NoOpLossScale),
        ("bf16", NoOpLossScale),
        ("float32", NoOpLossScale),
        (jnp.float16, DynamicLossScale),
    ],
)
def test_policy_needs_loss_scaling_picks_the_loss_scale(policy, expected):
    policy = mpjax.get_policy(policy)
    assert policy.needs_loss_scaling is (expected is DynamicLossScale)
    ls = initial_loss_scale("dynamic" if policy.needs_loss_scaling else "none")
    assert type(ls) is expected and ls.loss_scale.dtype == F32


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DynamicLossScale(0.0), "loss_scale must be positive"),
        (lambda: DynamicLossScale(-2.0), "loss_scale must be positive"),
        (lambda: DynamicLossScale(float("inf")), "loss_scale must be positive and finite"),
        (lambda: DynamicLossScale(1e39), "finite in float32"),
        (lambda: StaticLossScale(0), "loss_scale must be positive"),
        (
            lambda: DynamicLossScale(growth_factor=1.0),
            r"growth_factor must be greater than 1 and finite in float32 .*got 1.0",
        ),
        (lambda: DynamicLossScale(growth_factor=0.5), "growth_factor"),
        (
            lambda: DynamicLossScale(backoff_factor=1.0),
            r"backoff_factor must be in the open interval \(0, 1\), got 1.0",
        ),
        (lambda: DynamicLossScale(backoff_factor=0.0), "backoff_factor"),
        (lambda: DynamicLossScale(backoff_factor=-0.5), "backoff_factor"),
        (
            lambda: DynamicLossScale(growth_interval=0),
            r"growth_interval must be an integer from 1 to 2\*\*31 - 1 .*got 0",
        ),
        (lambda: DynamicLossScale(min_scale=0.0), "min_scale must be positive"),
        (lambda: DynamicLossScale(max_scale=-1.0), "max_scale must be positive"),
        (
            lambda: DynamicLossScale(8.0, min_scale=16.0, max_scale=4.0),
            "min_scale must not exceed max_scale",
        ),
        (lambda: DynamicLossScale(8.0, min_scale=16.0), r"outside \[min_scale, max_scale\]"),
        (lambda: DynamicLossScale(counter=-1), "counter must be a non-negative integer"),
        (
            lambda: loss_scaling(optax.sgd(1.0), "dynamc"),
            "Unknown loss_scale 'dynamc'. Valid choices: 'dynamic', 'none', 'static:N'",
        ),
        (
            lambda: loss_scaling(optax.sgd(1.0), "static:abc"),
            "Malformed static loss scale 'static:abc'",
        ),
        (lambda: loss_scaling(optax.sgd(1.0), "static:0"), "loss_scale must be positive"),
        (lambda: loss_scaling(optax.sgd(1.0), "bogus"), "Valid choices"),
    ],
)
def test_bad_loss_scale_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DynamicLossScale(growth_interval=2.5), "growth_interval must be an integer"),
        (lambda: DynamicLossScale(growth_factor="2"), "growth_factor must be a number"),
        (lambda: DynamicLossScale("1024"), "loss_scale must be a positive number, got '1024'"),
        (lambda: StaticLossScale(True), "loss_scale must be a positive number, got True"),
        (lambda: DynamicLossScale(counter=None), "counter must be a non-negative integer"),
        (lambda: loss_scaling(optax.sgd(1.0), None), "loss_scale must be one of"),
        (lambda: loss_scaling(optax.sgd(1.0), True), "loss_scale must be one of"),
    ],
)
def test_bad_loss_scale_types_raise_type_error(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_integer_gradients_raise_type_error():
    tx = loss_scaling(optax.sgd(1.0))
    params = {"w": jnp.ones(2), "n": jnp.ones(2)}
    state = tx.init(params)
    with pytest.raises(
        TypeError, match=r"gradients must be floating-point, got int32 at grads\['n'\]"
    ):
        tx.update({"w": jnp.ones(2), "n": jnp.ones(2, jnp.int32)}, state, params)


def test_gradient_tree_mismatch_raises_value_error():
    tx = loss_scaling(optax.sgd(1.0))
    params = {"w": jnp.ones(2), "b": jnp.ones(2)}
    state = tx.init(params)
    with pytest.raises(ValueError, match="the grads tree does not match the params tree"):
        tx.update({"w": jnp.ones(2)}, state, params)


# ---------------------------------------------------------------------------------------------
# The transformation


def quadratic_grads(params, state, target):
    """Gradients of the scaled loss sum((w - target)**2) / 2, i.e. scale * (w - target)."""
    loss = lambda p: jnp.sum((p["w"] - target) ** 2) / 2  # noqa: E731
    return jax.grad(lambda p: scale_loss(loss(p), state))(params)


def test_unscale_uses_the_scale_that_scaled_the_loss_on_growth_steps():
    # growth_interval=1: every finite step is a growth step (MPX halves grads on these).
    tx = loss_scaling(optax.sgd(1.0), DynamicLossScale(8.0, growth_interval=1))
    params = {"w": jnp.array([1.0, -3.0])}
    state = tx.init(params)
    step = jax.jit(tx.update)
    for expected_scale in (8.0, 16.0, 32.0, 64.0):
        assert float(state.scale) == expected_scale
        grads = quadratic_grads(params, state, jnp.zeros(2))
        np.testing.assert_array_equal(grads["w"], params["w"] * expected_scale)
        updates, state = step(grads, state, params)
        np.testing.assert_array_equal(updates["w"], -params["w"])
    assert float(state.scale) == 128.0


def test_scripted_sequence_through_the_transform():
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(16.0, growth_interval=3))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    used, applied = [], []
    for i in range(11):
        grads = {"w": jnp.full(3, jnp.inf if i in (6, 9, 10) else 1.0) * state.scale}
        used.append(float(state.scale))
        _, state = step(grads, state, params)
        applied.append(bool(state.applied))
    assert used == [16, 16, 16, 32, 32, 32, 64, 32, 32, 32, 16]
    assert float(state.scale) == 8.0
    assert applied == [i not in (6, 9, 10) for i in range(11)]
    assert int(state.skipped_steps) == 3 and int(state.consecutive_skipped) == 2


def test_non_finite_step_returns_zero_updates_and_keeps_inner_state():
    tx = loss_scaling(optax.sgd(0.1, momentum=0.9), "static:4")
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    _, state = step({"w": jnp.ones(3), "b": jnp.ones(2)}, state, params)
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        grads = {"w": jnp.array([1.0, bad, 1.0]), "b": jnp.ones(2)}
        updates, new_state = step(grads, state, params)
        for u in jax.tree.leaves(updates):
            np.testing.assert_array_equal(u, np.zeros_like(u))  # zeros, not NaN
        assert_trees_bitwise_equal(optax.apply_updates(params, updates), params)
        assert_trees_bitwise_equal(new_state.inner_state, state.inner_state)
        assert not bool(new_state.applied)
        assert int(new_state.skipped_steps) == 1 and int(new_state.consecutive_skipped) == 1
    _, state = step({"w": jnp.ones(3), "b": jnp.ones(2)}, new_state, params)
    assert bool(state.applied) and int(state.consecutive_skipped) == 0
    assert int(state.skipped_steps) == 1


def test_state_dtypes():
    params = {"w": jnp.ones(2, BF16)}
    tx = loss_scaling(optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)
    _, new_state = jax.jit(tx.update)({"w": jnp.ones(2, BF16)}, state, params)
    for s in (state, new_state):
        assert isinstance(s, LossScalingState)
        assert s.scale.dtype == F32 and s.counter.dtype == jnp.int32
        assert s.applied.dtype == jnp.bool_ and s.window_finite.dtype == jnp.bool_
        assert s.skipped_steps.dtype == jnp.int32 and s.consecutive_skipped.dtype == jnp.int32
    # The inner state keeps the params' dtype: the inner sees gradients in their own dtype.
    assert jax.tree.map(jax.typeof, new_state.inner_state) == jax.tree.map(
        jax.typeof, state.inner_state
    )


def test_updates_have_the_gradient_dtype():
    for dtype in (F32, BF16, F16):
        params = {"w": jnp.ones(2, dtype)}
        tx = loss_scaling(optax.sgd(0.5), "static:8")
        state = tx.init(params)
        updates, _ = tx.update({"w": jnp.full(2, 8.0, dtype)}, state, params)
        assert updates["w"].dtype == dtype
        np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), -0.5)


def test_unscaled_value_that_overflows_float16_is_not_finite():
    # A scale below 1 makes unscaled gradients larger than the scaled ones.
    tx = loss_scaling(optax.sgd(1.0), "static:0.5")
    params = {"w": jnp.ones(1, F16)}
    updates, state = tx.update({"w": jnp.full(1, 60000.0, F16)}, tx.init(params), params)
    assert not bool(state.applied) and float(updates["w"][0]) == 0.0


def test_noop_scale_passes_gradients_through_exactly():
    params = {"w": jnp.linspace(-1, 1, 5)}
    grads = {"w": jnp.linspace(0.3, -2, 5)}
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    expected, _ = inner.update(grads, inner.init(params), params)
    tx = loss_scaling(inner, "none")
    updates, _ = tx.update(grads, tx.init(params), params)
    assert_trees_bitwise_equal(updates, expected)


def test_clipping_sees_unscaled_gradients():
    tx = loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), "static:1024")
    params = {"w": jnp.zeros(2)}
    updates, _ = tx.update({"w": jnp.array([0.3, 0.4]) * 1024}, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)  # norm 0.5: not clipped


def test_persistent_overflow_never_applies_and_check_overflow_raises():
    tx = loss_scaling(optax.adam(1e-3), DynamicLossScale(2.0**15, min_scale=None))
    initial_params = params = {"w": jnp.linspace(-1.0, 1.0, 4)}
    with standard_promotion():
        state = tx.init(params)
        step = jax.jit(lambda s, p: tx.update({"w": jnp.full(4, jnp.nan)}, s, p))
        initial_inner = state.inner_state
        check_overflow(state, max_consecutive=1)
        with pytest.warns(mpjax.LossScalingWarning, match="the last 25 optimizer steps"):
            for _ in range(300):
                updates, state = step(state, params)
                params = optax.apply_updates(params, updates)
            jax.effects_barrier()
    assert_trees_bitwise_equal(params, initial_params)
    assert_trees_bitwise_equal(state.inner_state, initial_inner)
    assert int(state.consecutive_skipped) == 300 and int(state.skipped_steps) == 300
    assert float(state.scale) == 0.0  # no min_scale: backoff went below float32's range
    check_overflow(state, max_consecutive=301)
    with pytest.raises(
        PersistentOverflowError,
        match=r"The last 300 optimizer steps were all skipped.*limit: 100.*loss scale is now 0",
    ):
        check_overflow(state, max_consecutive=100)
    assert issubclass(PersistentOverflowError, RuntimeError)


def _overflow_warnings(caught):
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, mpjax.LossScalingWarning) and "skipped" in str(w.message)
    ]


def _unscaled_warnings(caught):
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, mpjax.LossScalingWarning) and "not scaled" in str(w.message)
    ]


UNSCALED = (
    "mpjax.loss_scaling: update() got gradients of a loss that was not scaled with this state's "
    "loss scale: gradients from a plain jax.value_and_grad are divided by a scale they were never "
    "multiplied by, and the step all but vanishes. Compute them with "
    "mpjax.scaled_value_and_grad(loss_fn)(opt_state, params) or differentiate "
    "mpjax.scale_loss(loss, opt_state). If the loss was scaled in another jitted function than "
    "this update, this warning is a false alarm (see the loss-scaling guide)."
)


def _steps(tx):
    """A plain, a scaled_value_and_grad and a scale_loss training step for ``tx``."""

    def loss_fn(p):
        return jnp.sum(p["w"] ** 2)

    def plain(state, params):
        return tx.update(jax.grad(loss_fn)(params), state, params)

    def scaled(state, params):
        _, grads = mpjax.scaled_value_and_grad(loss_fn)(state, params)
        return tx.update(grads, state, params)

    def by_hand(state, params):
        grads = jax.grad(lambda p: scale_loss(loss_fn(p), state))(params)
        return tx.update(grads, state, params)

    return plain, scaled, by_hand


@pytest.mark.parametrize(
    "make",
    [
        lambda: loss_scaling(optax.sgd(0.1)),
        lambda: loss_scaling(optax.sgd(0.1), "static:1024"),
        lambda: loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2)),
        lambda: mpjax.master_weights(loss_scaling(optax.sgd(0.1))),
    ],
    ids=["dynamic", "static", "multisteps", "master_weights"],
)
def test_a_forgotten_scale_loss_warns_and_the_documented_paths_do_not(make):
    tx = make()
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    plain, scaled, by_hand = _steps(tx)
    for wrap in (lambda f: f, jax.jit):
        with warnings.catch_warnings(record=True) as caught, standard_promotion():
            warnings.simplefilter("always")
            wrap(plain)(state, params)
        assert _unscaled_warnings(caught) == [UNSCALED]
        with warnings.catch_warnings(record=True) as caught, standard_promotion():
            warnings.simplefilter("always")
            for step in (scaled, by_hand):
                _, new_state = wrap(step)(state, params)
                wrap(step)(new_state, params)  # the next step, with the next state's scale
        assert _unscaled_warnings(caught) == []


def test_no_warning_where_the_scale_is_trivial():
    for tx in (loss_scaling(optax.sgd(0.1), "none"), loss_scaling(optax.sgd(0.1), "static:1")):
        params = {"w": jnp.ones(3)}
        plain, _, _ = _steps(tx)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.jit(plain)(tx.init(params), params)
        assert _unscaled_warnings(caught) == []


def test_persistent_overflow_warns_once_from_the_step_and_changes_nothing(monkeypatch):
    tx = loss_scaling(optax.sgd(0.1))  # dynamic: 2**15 down to the floor of 1 in 15 steps
    params = {"w": jnp.ones(4)}
    nan = {"w": jnp.full(4, jnp.nan)}

    def run():
        step = jax.jit(lambda s, g: tx.update(g, s, params))
        state = tx.init(params)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(60):
                _, state = step(state, nan)
            jax.effects_barrier()
        return state, _overflow_warnings(caught)

    with standard_promotion():
        state, messages = run()
        module = importlib.import_module(
            "mpjax.optim.loss_scaling"
        )  # the attribute is the function
        monkeypatch.setattr(module, "_warn_if_persistent", lambda *a: None)
        silent_state, silent = run()
    assert messages == [
        "mpjax.loss_scaling: the last 25 optimizer steps were all skipped because the gradients "
        "had inf or NaN; the loss scale is now 1 and nothing has been applied since. No loss "
        "scale fixes this: check the loss and the forward pass for inf/NaN, keep "
        "overflow-prone ops in float32 via the policy, lower the learning rate, or use "
        "bfloat16. mpjax.check_overflow(opt_state) raises PersistentOverflowError instead."
    ]
    assert silent == [] and int(state.consecutive_skipped) == 60
    assert_trees_bitwise_equal(state, silent_state)


def test_a_healthy_step_warns_nothing_and_its_callback_sits_in_the_skip_branch():
    tx = loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(4)}
    with standard_promotion():
        step = jax.jit(lambda s: tx.update({"w": jnp.ones(4)}, s, params))
        state = tx.init(params)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(30):
                _, state = step(state)
            jax.effects_barrier()
        jaxpr = jax.make_jaxpr(lambda s: tx.update({"w": jnp.ones(4)}, s, params))(state)
    assert _overflow_warnings(caught) == [] and int(state.consecutive_skipped) == 0

    def callbacks(jaxpr):
        return sum(
            (e.primitive.name == "debug_callback")
            + sum(callbacks(getattr(j, "jaxpr", j)) for j in jax_compat.sub_jaxprs(e))
            for e in jaxpr.eqns
        )

    top = jaxpr.jaxpr.eqns
    assert callbacks(jaxpr.jaxpr) == 1
    assert not [e for e in top if e.primitive.name == "debug_callback"]
    (cond,) = [e for e in top if e.primitive.name == "cond" and callbacks(_Eqns([e]))]
    assert sorted(callbacks(b.jaxpr) for b in jax_compat.cond_branches(cond)) == [0, 1]


class _Eqns:
    def __init__(self, eqns):
        self.eqns = eqns


def test_check_overflow_reports_the_scale_and_rejects_bad_use():
    tx = loss_scaling(optax.sgd(1.0), DynamicLossScale(1024.0, min_scale=1.0))
    params = {"w": jnp.ones(1)}
    state = tx.init(params)
    for _ in range(12):
        _, state = tx.update({"w": jnp.full(1, jnp.inf)}, state, params)
    with pytest.raises(PersistentOverflowError, match=r"The last 12 .*loss scale is now 1\."):
        check_overflow({"train": {"nested": state}}, 10)
    with pytest.raises(ValueError, match="max_consecutive must be an integer >= 1, got 0"):
        check_overflow(state, 0)
    with pytest.raises(TypeError, match="max_consecutive must be an integer"):
        check_overflow(state, 2.5)
    with pytest.raises(TypeError, match="max_consecutive must be an integer"):
        check_overflow(state, np.bool_(True))
    # NumPy integers count as integers.
    check_overflow(state, np.int64(13))
    with pytest.raises(PersistentOverflowError, match=r"The last 12 .*limit: 10\)"):
        check_overflow(state, np.int64(10))
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda s: check_overflow(s, 5))(state)


# ---------------------------------------------------------------------------------------------
# Readers of any optimizer state: scale_loss, loss_scaling_info, check_overflow


def test_readers_find_the_state_anywhere_and_scale_loss_keeps_the_loss_dtype():
    params = {"w": jnp.ones(2)}
    ls = loss_scaling(optax.sgd(1.0), "static:8")
    states = [
        ls.init(params),
        optax.chain(ls).init(params),
        loss_scaling(optax.MultiSteps(optax.sgd(1.0), 2), "static:8").init(params),
        mpjax.master_weights(ls).init({"w": jnp.ones(2, BF16)}),
        mpjax.low_precision_params(ls, "kahan").init({"w": jnp.ones(2, BF16)}),
        {"opt": (ls.init(params), jnp.zeros(3))},  # a train state holding it
        # Nested several levels: master weights of loss scaling of a chain with MultiSteps.
        mpjax.master_weights(
            loss_scaling(
                optax.chain(optax.clip(1.0), optax.MultiSteps(optax.sgd(1.0), 2)), "static:8"
            )
        ).init({"w": jnp.ones(2, F16)}),
        # After a stateless transformation: its updates are zeros on a skipped step.
        optax.chain(ls, optax.scale(-1.0)).init(params),
    ]
    for state in states:
        info = loss_scaling_info(state)
        assert isinstance(info, LossScalingInfo)
        assert float(info.loss_scale) == 8.0 and info.loss_scale.dtype == F32
        assert bool(info.applied) and info.applied.dtype == jnp.bool_
        assert int(info.skipped_steps) == 0 and info.skipped_steps.dtype == jnp.int32
        assert int(info.consecutive_skipped) == 0 and info.consecutive_skipped.dtype == jnp.int32
        check_overflow(state, 1)
        for dtype in (F32, BF16, F16):
            scaled = scale_loss(jnp.array(0.75, dtype), state)
            assert scaled.dtype == dtype and float(scaled) == 6.0


def test_loss_scaling_info_follows_skips_through_master_weights_under_jit():
    tx = mpjax.master_weights(loss_scaling(optax.sgd(1.0), DynamicLossScale(64.0)))
    params = {"w": jnp.ones(2, F16)}
    state = tx.init(params)

    @jax.jit
    def step(state, poison):
        grads = {"w": (jnp.ones(2) * 64.0 + poison).astype(F16)}
        _, state = tx.update(grads, state, params)
        return state, loss_scaling_info(state)

    state, info = step(state, jnp.float32(jnp.inf))
    assert (float(info.loss_scale), bool(info.applied)) == (32.0, False)
    assert (int(info.skipped_steps), int(info.consecutive_skipped)) == (1, 1)
    state, info = step(state, jnp.float32(0.0))
    assert (float(info.loss_scale), bool(info.applied)) == (32.0, True)
    assert (int(info.skipped_steps), int(info.consecutive_skipped)) == (1, 0)
    assert info == loss_scaling_info(state)


@pytest.mark.parametrize(
    "make_state",
    [
        lambda p: optax.adam(1.0).init(p),
        lambda p: optax.chain(optax.clip(1.0), optax.MultiSteps(optax.sgd(1.0), 2)).init(p),
        lambda p: mpjax.master_weights(optax.sgd(1.0)).init(p),
        lambda p: (),
    ],
    ids=["adam", "chain_multisteps", "master_weights", "empty"],
)
def test_readers_pass_through_without_loss_scaling(make_state):
    state = make_state({"w": jnp.ones(2, BF16)})
    for dtype in (F32, BF16, F16):
        loss = jnp.array(0.75, dtype)
        assert scale_loss(loss, state) is loss
    info = loss_scaling_info(state)
    assert jax.tree.map(jax.typeof, info) == jax.tree.map(
        jax.typeof, LossScalingInfo(jnp.float32(1), jnp.bool_(True), jnp.int32(0), jnp.int32(0))
    )
    assert (float(info.loss_scale), bool(info.applied)) == (1.0, True)
    assert (int(info.skipped_steps), int(info.consecutive_skipped)) == (0, 0)
    check_overflow(state, 1)  # nothing is ever skipped without loss scaling
    # The same jitted step serves states with and without loss scaling.
    grads = jax.jit(jax.grad(lambda w, s: scale_loss(jnp.sum(w**2), s)))(jnp.ones(2), state)
    np.testing.assert_array_equal(grads, np.full(2, 2.0, np.float32))


def test_readers_reject_more_than_one_loss_scaling_state():
    params = jnp.ones(1)
    two = optax.chain(loss_scaling(optax.sgd(1.0)), loss_scaling(optax.sgd(1.0))).init(params)
    for read in (
        lambda s: scale_loss(jnp.array(1.0), s),
        loss_scaling_info,
        lambda s: check_overflow(s, 1),
    ):
        with pytest.raises(
            ValueError, match="opt_state must hold at most one LossScalingState, found 2"
        ):
            read(two)


# ---------------------------------------------------------------------------------------------
# Fault injection: a run with inf/NaN steps equals a run that omits them, bit for bit


def mlp_loss(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def mlp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (4, 8)) / 2,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(k2, (8, 2)) / 3,
    }


def make_train_step(tx):
    @jax.jit
    def train_step(params, opt_state, x, poison):
        grads = jax.grad(lambda p: scale_loss(mlp_loss(p, x), opt_state))(params)
        grads["w1"] = grads["w1"].at[1, 2].add(poison)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return train_step


@pytest.mark.parametrize("loss_scale", ["static:1024", "dynamic_interval_2"])
def test_fault_injection_is_bit_identical_to_omitting_the_steps(loss_scale):
    if loss_scale == "dynamic_interval_2":
        # Scales stay powers of two, so unscaling is exact whatever the scale: the inner state
        # must match even though the two runs have different scale histories.
        loss_scale = DynamicLossScale(2.0**10, growth_interval=2)
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2))
    tx = loss_scaling(inner, loss_scale)
    train_step = make_train_step(tx)
    xs = jax.random.normal(jax.random.key(1), (12, 16, 4))
    faults = {3: jnp.inf, 4: jnp.nan, 8: -jnp.inf}
    with standard_promotion():
        params_a, state_a = mlp_params(), tx.init(mlp_params())
        params_b, state_b = mlp_params(), tx.init(mlp_params())
        for i, x in enumerate(xs):
            params_a, state_a = train_step(params_a, state_a, x, jnp.float32(faults.get(i, 0.0)))
            if i not in faults:
                params_b, state_b = train_step(params_b, state_b, x, jnp.float32(0.0))
    assert_trees_bitwise_equal(params_a, params_b)
    assert_trees_bitwise_equal(state_a.inner_state, state_b.inner_state)
    adam_count = state_a.inner_state[1][0].count
    assert int(adam_count) == len(xs) - len(faults)
    assert int(state_a.skipped_steps) == 3 and int(state_b.skipped_steps) == 0


# ---------------------------------------------------------------------------------------------
# jit: one trace


def test_no_retrace_across_growth_overflow_and_new_static_values():
    traces = []
    tx = loss_scaling(
        optax.sgd(0.1, momentum=0.9), DynamicLossScale(jnp.float16(4), growth_interval=2)
    )

    @jax.jit
    def step(params, state, poison):
        traces.append(1)
        grads = jax.grad(lambda p: scale_loss(jnp.sum(p["w"] ** 2), state))(params)
        grads = {"w": grads["w"] + poison}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    scales = []
    for poison in (0.0, 0.0, 0.0, jnp.inf, 0.0, jnp.nan, 0.0, 0.0):
        params, state = step(params, state, jnp.float32(poison))
        scales.append(float(state.scale))
    assert scales == [4, 8, 8, 4, 4, 2, 2, 4]  # grew twice, backed off twice
    assert len(traces) == 1

    static_traces = []

    @jax.jit
    def static_step(state):
        static_traces.append(1)
        return scale_loss(jnp.array(1.0), state)

    for value in (1.0, 128, 2.0**10, np.float16(8)):
        assert float(
            static_step(loss_scaling(optax.sgd(1.0), StaticLossScale(value)).init(params))
        ) == float(value)
    assert len(static_traces) == 1


# ---------------------------------------------------------------------------------------------
# Sharding over 8 fake CPU devices


@pytest.fixture
def mesh():
    devices = jax.devices()[:8]
    assert len(devices) == 8, "conftest.py must give 8 CPU devices"
    return jax.sharding.Mesh(np.array(devices), ("x",))


def test_sharded_state_matches_params_and_overflow_check_is_global(mesh):
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    params = {"w": jax.device_put(jnp.linspace(-1.0, 1.0, 32), sharding)}
    tx = loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)))
    state0 = tx.init(params)
    step = jax.jit(tx.update)
    grads = {"w": jax.device_put(jnp.ones(32) * state0.scale, sharding)}
    updates, state1 = step(grads, state0, params)
    assert updates["w"].sharding.is_equivalent_to(sharding, 1)
    trace0 = state0.inner_state[1][0].trace["w"]
    trace1 = state1.inner_state[1][0].trace["w"]
    assert trace0.sharding.is_equivalent_to(sharding, 1)
    assert trace1.sharding.is_equivalent_to(trace0.sharding, 1)
    assert bool(state1.applied)

    # One inf on the last device's shard skips the step on every shard.
    bad = {"w": jax.device_put(jnp.ones(32).at[31].set(jnp.inf), sharding)}
    assert bad["w"].addressable_shards[7].data[-1] == jnp.inf
    updates, state2 = step(bad, state1, params)
    assert not bool(state2.applied)
    np.testing.assert_array_equal(updates["w"], np.zeros(32, np.float32))
    assert_trees_bitwise_equal(state2.inner_state, state1.inner_state)
    assert state2.inner_state[1][0].trace["w"].sharding.is_equivalent_to(sharding, 1)


def test_sharding_in_types_state_matches_init_and_update():
    # optax's sharding_test pattern: with explicit axes, the types (shardings included) of the
    # state from init and from update must be equal.
    explicit = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = jax.sharding.NamedSharding(explicit, jax.P(None, "x"))
    with jax.set_mesh(explicit):
        params = jnp.zeros((2, 8, 4), dtype=jnp.float32, out_sharding=sharding)
        tx = loss_scaling(optax.sgd(0.1, momentum=0.9))
        state0 = tx.init(params)
        _, state1 = jax.jit(tx.update)(params, state0, params)
        assert jax.tree.map(jax.typeof, state0) == jax.tree.map(jax.typeof, state1)


# ---------------------------------------------------------------------------------------------
# Checkpoint and resume


def _checkpoint_run(tmp_path, save):
    """10 steps; when ``save`` restores everything after step 5 from a checkpoint first."""
    tx = loss_scaling(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        DynamicLossScale(2.0**8, growth_interval=2, min_scale=1.0),
    )
    train_step = make_train_step(tx)
    xs = jax.random.normal(jax.random.key(2), (10, 16, 4))
    faults = {2: jnp.inf, 6: jnp.nan}
    with standard_promotion():
        params, state = mlp_params(), tx.init(mlp_params())
        for i, x in enumerate(xs):
            if i == 5 and save is not None:
                params, state = save(params, state, fresh=(mlp_params(), tx.init(mlp_params())))
            params, state = train_step(params, state, x, jnp.float32(faults.get(i, 0.0)))
    return params, state


@pytest.mark.slow
def test_orbax_checkpoint_resume_is_bit_identical(tmp_path):
    def save_and_restore(params, state, fresh):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
            checkpointer.wait_until_finished()
            target = jax.tree.map(
                ocp.utils.to_shape_dtype_struct, {"params": fresh[0], "opt_state": fresh[1]}
            )
            restored = checkpointer.restore(tmp_path / "ckpt", target)
        # The fresh state differs from the saved one (scale, counter, Adam moments).
        assert float(fresh[1].scale) != float(state.scale) or int(fresh[1].counter) != int(
            state.counter
        )
        return restored["params"], restored["opt_state"]

    expected = _checkpoint_run(tmp_path, save=None)
    resumed = _checkpoint_run(tmp_path, save=save_and_restore)
    assert_trees_bitwise_equal(resumed, expected)
    assert float(expected[1].scale) != 2.0**8  # the scale moved, and resumed from the checkpoint


def test_flax_serialization_resume_is_bit_identical(tmp_path):
    def save_and_restore(params, state, fresh):
        blob = flax.serialization.to_bytes((params, state))
        return flax.serialization.from_bytes(fresh, blob)

    expected = _checkpoint_run(tmp_path, save=None)
    resumed = _checkpoint_run(tmp_path, save=save_and_restore)
    assert_trees_bitwise_equal(resumed, expected)


def test_flax_state_dicts_name_the_array_fields_and_restore_the_targets_hyperparameters():
    # The layout flax.struct dataclasses gave: checkpoints written before keep loading.
    ls = DynamicLossScale(64.0, counter=3, growth_interval=7, min_scale=2.0)
    state_dict = flax.serialization.to_state_dict(ls)
    assert list(state_dict) == ["loss_scale", "counter"]
    assert float(state_dict["loss_scale"]) == 64.0 and int(state_dict["counter"]) == 3
    assert list(flax.serialization.to_state_dict(StaticLossScale(4.0))) == ["loss_scale"]
    assert flax.serialization.to_state_dict(NoOpLossScale()) == {}
    target = DynamicLossScale(8.0, growth_interval=7, min_scale=2.0)
    restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(ls))
    assert type(restored) is DynamicLossScale
    assert_trees_bitwise_equal(restored, ls)
    assert (restored.growth_interval, restored.min_scale) == (7, 2.0)
    with pytest.raises(ValueError, match=r"Missing field\(s\) \['counter'\]"):
        flax.serialization.from_state_dict(target, {"loss_scale": np.float32(1.0)})
    with pytest.raises(ValueError, match=r"Unknown field\(s\) \['period'\]"):
        flax.serialization.from_state_dict(target, {**state_dict, "period": 1})


# ---------------------------------------------------------------------------------------------
# Gradient accumulation with optax.MultiSteps


def test_multisteps_scale_changes_once_per_optimizer_step():
    k = 3
    tx = loss_scaling(optax.MultiSteps(optax.sgd(1.0), k), DynamicLossScale(8.0, growth_interval=1))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    used, nonzero = [], []
    with standard_promotion():
        for i in range(3 * k):
            used.append(float(scale_loss(jnp.array(1.0), state)))
            updates, state = step({"w": jnp.full(2, float(i)) * state.scale}, state, params)
            nonzero.append(bool(jnp.any(updates["w"] != 0)))
    assert used == [8, 8, 8, 16, 16, 16, 32, 32, 32]
    assert nonzero == [False, False, True] * 3
    # The mean of the unscaled micro-batch gradients 0, 1, 2 of the last window is 7.
    np.testing.assert_array_equal(updates["w"], -np.full(2, 7.0, np.float32))


def _run_micro_batches(tx, params, batches):
    """Feeds ``(gradient, poison)`` micro-batches, scaled as the loss would be, through ``tx``;
    returns the params, the state and whether each step was applied."""
    step = jax.jit(tx.update)
    p, s = params, tx.init(params)
    applied = []
    for g, poison in batches:
        updates, s = step({"w": (g + poison) * s.scale}, s, p)
        p = optax.apply_updates(p, updates)
        applied.append(bool(s.applied))
    return p, s, applied


def test_multisteps_non_finite_micro_batch_skips_its_window_without_corrupting():
    k = 3
    inner = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-2))
    tx = loss_scaling(optax.MultiSteps(inner, k), DynamicLossScale(2.0**10, growth_interval=1))
    params = {"w": jnp.linspace(-1.0, 1.0, 4)}
    micro = [jnp.linspace(0.1, 0.4, 4) * (i + 1) for i in range(4 * k)]
    poisoned_window = {3, 4, 5}
    run = functools.partial(_run_micro_batches, tx, params)

    with standard_promotion():
        p_a, s_a, applied_a = run([(g, jnp.nan if i == 4 else 0.0) for i, g in enumerate(micro)])
        p_b, s_b, _ = run([(g, 0.0) for i, g in enumerate(micro) if i not in poisoned_window])
    assert applied_a == [False, False, True, False, False, False] + [False, False, True] * 2
    assert_trees_bitwise_equal(p_a, p_b)
    ms_a, ms_b = s_a.inner_state, s_b.inner_state
    assert_trees_bitwise_equal(ms_a.inner_opt_state, ms_b.inner_opt_state)
    assert int(ms_a.gradient_step) == int(ms_b.gradient_step) == 3
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(ms_a.acc_grads))
    assert int(s_a.skipped_steps) == 1 and int(s_a.consecutive_skipped) == 0
    # Grew on windows 1, 3, 4 and backed off once on window 2 (scale constant within it).
    assert float(s_a.scale) == 2.0**10 * 2 / 2 * 2 * 2


def test_multisteps_around_loss_scaling_would_corrupt_the_accumulator():
    # Why the docs say loss_scaling(MultiSteps(...)): the other order accumulates the NaN and
    # MultiSteps' reset (0 * NaN) keeps it, so every later step is skipped too.
    tx = optax.MultiSteps(loss_scaling(optax.sgd(1.0), "static:1"), 2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    with standard_promotion():
        for g in (jnp.nan, 1.0, 1.0, 1.0):
            _, state = tx.update({"w": jnp.full(2, g)}, state, params)
    assert bool(jnp.isnan(state.acc_grads["w"]).all())
    assert not bool(state.inner_opt_state.applied)


# ---------------------------------------------------------------------------------------------
# The guide


def test_the_guides_loss_scaling_example_runs_and_prints_what_it_says(capsys):
    import pathlib
    import re

    guide = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "loss_scaling.md").read_text()
    section = guide.split("\n## ", 1)[0]
    assert "scale -> grad -> unscale -> clip -> update" in section
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with standard_promotion(), warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the guide uses no deprecated name
        exec(compile(code, "docs/loss_scaling.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["32768.0", "True", "0"]


# ---------------------------------------------------------------------------------------------
# One name per concept


@pytest.mark.parametrize("name", ["get_loss_scale", "loss_scale_for", "find_loss_scaling_state"])
def test_the_unreleased_aliases_are_gone(name):
    # Their concepts have one name each: loss_scaling's loss_scale spec (or the scale classes),
    # Policy.needs_loss_scaling, loss_scaling_info.
    assert name not in mpjax.__all__
    with pytest.raises(AttributeError, match=name):
        getattr(mpjax, name)
    for module in ("loss_scale", "loss_scaling", "loss_scaling_readers"):
        assert not hasattr(importlib.import_module(f"mpjax.optim.{module}"), name), module


# ---------------------------------------------------------------------------------------------
# A scale that cannot die


def test_default_floor_survives_a_burst_of_overflows_and_recovers():
    """300 overflows in a row leave the default scale at its floor of 1 (without a floor it
    reaches exactly 0 after about 140, forever), every step skipped and counted; clean steps
    then grow it back, and a small float16 gradient survives scaling all along."""
    ls = DynamicLossScale()
    assert ls.min_scale == 1.0
    adjust = jax.jit(lambda ls, finite: ls.adjust(finite))
    for _ in range(300):
        ls = adjust(ls, jnp.array(False))
    assert float(ls.loss_scale) == 1.0
    for _ in range(2 * 2000):
        ls = adjust(ls, jnp.array(True))
    assert float(ls.loss_scale) == 4.0
    assert float(ls.scale(jnp.array(1e-7, F16))) > 0  # 1e-7 is a float16 subnormal, not 0

    no_floor = DynamicLossScale(min_scale=None)
    for _ in range(150):
        no_floor = adjust(no_floor, jnp.array(False))
    assert float(no_floor.loss_scale) == 0.0


def test_a_scale_at_the_floor_still_counts_skips_for_check_overflow():
    tx = loss_scaling(optax.sgd(1.0), DynamicLossScale(4.0))
    params = {"w": jnp.ones(1)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    for _ in range(5):
        _, state = step({"w": jnp.full(1, jnp.inf)}, state, params)
    assert float(state.scale) == 1.0 and int(state.consecutive_skipped) == 5
    with pytest.raises(PersistentOverflowError, match=r"The last 5 .*loss scale is now 1\."):
        check_overflow(state, max_consecutive=5)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: DynamicLossScale(1e-40), r"loss_scale must be at least float32's smallest normal"),
        (lambda: StaticLossScale(1e-40), r"loss_scale must be at least float32's smallest normal"),
        (
            lambda: DynamicLossScale(min_scale=1e-40),
            r"min_scale must be at least float32's smallest normal number .* or None, got 1e-40",
        ),
        (
            lambda: DynamicLossScale(backoff_factor=1e-50),
            r"backoff_factor must be at least float32's smallest normal .*scale of 0",
        ),
        (
            lambda: DynamicLossScale(backoff_factor=1e-40),
            r"backoff_factor must be at least float32's smallest normal",
        ),
        (
            lambda: DynamicLossScale(growth_factor=1e300),
            r"growth_factor must be greater than 1 and finite in float32 .*got 1e\+300",
        ),
        (
            lambda: DynamicLossScale(growth_factor=1 + 1e-10),
            r"growth_factor must be greater than 1 and finite in float32",
        ),
        (
            lambda: DynamicLossScale(growth_interval=2**31),
            r"growth_interval must be an integer from 1 to 2\*\*31 - 1 .*got 2147483648",
        ),
        (lambda: DynamicLossScale(counter=2**31), r"counter must be below 2\*\*31 - 1"),
        (lambda: DynamicLossScale(counter=2**31 - 1), r"counter must be below 2\*\*31 - 1"),
        (
            lambda: DynamicLossScale(0.5),
            r"outside \[min_scale, max_scale\] = \[1.0, None\]; pass a lower min_scale "
            r"\(or min_scale=None",
        ),
    ],
)
def test_values_that_break_in_float32_or_int32_are_rejected(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_largest_valid_hyperparameters_are_accepted():
    ls = DynamicLossScale(
        counter=2**31 - 3, growth_interval=2**31 - 1, backoff_factor=1e-30, growth_factor=1e30
    )
    ls = ls.adjust(True)  # counts up to 2**31 - 2 without wrapping around
    assert int(ls.counter) == 2**31 - 2 and float(ls.loss_scale) == 2.0**15
    ls = ls.adjust(True)  # the interval's last step: grows and resets
    assert int(ls.counter) == 0 and float(ls.loss_scale) == np.float32(2.0**15 * 1e30)
    assert float(ls.adjust(False).loss_scale) == np.float32(np.float32(2.0**15 * 1e30) * 1e-30)
    assert float(DynamicLossScale(0.5, min_scale=None).loss_scale) == 0.5


@pytest.mark.parametrize("loss", ["x", jnp.array(3), jnp.array(True), None, [1.0]])
def test_scale_loss_rejects_a_loss_that_is_not_floating(loss):
    state = loss_scaling(optax.sgd(1.0), "static:4").init(jnp.ones(1))
    with pytest.raises(TypeError, match="scale_loss: loss must be a floating-point array"):
        scale_loss(loss, state)


def test_scale_loss_takes_a_python_float():
    state = loss_scaling(optax.sgd(1.0), "static:4").init(jnp.ones(1))
    out = scale_loss(0.5, state)
    assert out.dtype == F32 and float(out) == 2.0


# ---------------------------------------------------------------------------------------------
# MultiSteps anywhere inside the wrapped transformation


def _nested_multisteps(inner, k):
    return {
        "bare": optax.MultiSteps(inner, k),
        "in_chain": optax.chain(optax.clip_by_global_norm(100.0), optax.MultiSteps(inner, k)),
        "chain_of_chain": optax.chain(
            optax.identity(), optax.chain(optax.clip(100.0), optax.MultiSteps(inner, k))
        ),
    }


@pytest.mark.parametrize("where", ["bare", "in_chain", "chain_of_chain"])
def test_multisteps_anywhere_adjusts_once_per_optimizer_step(where):
    k = 3
    tx = loss_scaling(
        _nested_multisteps(optax.sgd(1.0), k)[where], DynamicLossScale(8.0, growth_interval=1)
    )
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    used, applied = [], []
    with standard_promotion():
        for i in range(3 * k):
            used.append(float(scale_loss(jnp.array(1.0), state)))
            _, state = step({"w": jnp.full(2, float(i)) * state.scale}, state, params)
            applied.append(bool(state.applied))
    assert used == [8, 8, 8, 16, 16, 16, 32, 32, 32]
    assert applied == [False, False, True] * 3


@pytest.mark.parametrize("where", ["in_chain", "chain_of_chain"])
def test_multisteps_in_a_chain_skips_a_poisoned_window_bit_exactly(where):
    k = 3
    inner = optax.adam(1e-2)
    tx = loss_scaling(
        _nested_multisteps(inner, k)[where], DynamicLossScale(2.0**10, growth_interval=1)
    )
    params = {"w": jnp.linspace(-1.0, 1.0, 4)}
    micro = [jnp.linspace(0.1, 0.4, 4) * (i + 1) for i in range(3 * k)]
    run = functools.partial(_run_micro_batches, tx, params)

    with standard_promotion():
        p_a, s_a, applied_a = run([(g, jnp.nan if i == 4 else 0.0) for i, g in enumerate(micro)])
        p_b, s_b, _ = run([(g, 0.0) for i, g in enumerate(micro) if i not in {3, 4, 5}])
    assert applied_a == [False, False, True, False, False, False, False, False, True]
    assert_trees_bitwise_equal(p_a, p_b)
    (ms_a,) = [x for x in jax.tree.leaves(s_a, is_leaf=_is_ms) if _is_ms(x)]
    (ms_b,) = [x for x in jax.tree.leaves(s_b, is_leaf=_is_ms) if _is_ms(x)]
    assert_trees_bitwise_equal(ms_a.inner_opt_state, ms_b.inner_opt_state)
    assert int(ms_a.gradient_step) == 2
    assert int(s_a.skipped_steps) == 1


def _is_ms(x):
    return isinstance(x, optax.MultiStepsState)


def test_two_multisteps_inside_one_loss_scaling_is_a_clear_error():
    tx = loss_scaling(
        optax.chain(optax.MultiSteps(optax.sgd(1.0), 2), optax.MultiSteps(optax.sgd(1.0), 2))
    )
    with pytest.raises(ValueError, match="inner holds more than one optax.MultiSteps"):
        tx.init({"w": jnp.ones(1)})


# ---------------------------------------------------------------------------------------------
# Many devices: axis_name


N_DEVICES = 8


def _per_device_step(axis_name):
    """One loss-scaled SGD step per device inside shard_map, each device with its own
    gradients (device 3's overflows), unchecked as such code often runs; returns each
    device's params and loss-scaling state, stacked."""
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = loss_scaling(optax.sgd(0.1), DynamicLossScale(8.0), axis_name=axis_name)
    params = jnp.ones(4)
    state = tx.init(params)

    def body(grads, params, state):
        updates, state = tx.update(grads[0], state, params)
        new = optax.apply_updates(params, updates)
        return new[None], jax.tree.map(lambda x: x[None], state)

    grads = jnp.ones((N_DEVICES, 4)).at[3, 0].set(jnp.inf)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("data"), P(), P()),
        out_specs=(P("data"), P("data")),
        check_vma=False,
    )
    return jax.jit(fn)(grads, params, state)


def test_axis_name_makes_every_device_skip_a_step_one_device_overflowed():
    params, state = _per_device_step("data")
    np.testing.assert_array_equal(params, np.ones((N_DEVICES, 4), np.float32))
    np.testing.assert_array_equal(state.scale, np.full(N_DEVICES, 4.0, np.float32))
    np.testing.assert_array_equal(state.skipped_steps, np.ones(N_DEVICES, np.int32))
    check_overflow(state, max_consecutive=2)  # the copies agree: one skip, under the limit
    with pytest.raises(PersistentOverflowError, match="The last 1 optimizer steps"):
        check_overflow(state, max_consecutive=1)


def test_without_axis_name_devices_diverge_and_check_overflow_says_so():
    params, state = _per_device_step(None)
    assert sorted(set(np.asarray(state.scale).tolist())) == [4.0, 8.0]  # the control
    assert not np.array_equal(params[3], params[0])
    with pytest.raises(ValueError, match="devices disagree.*axis_name"):
        check_overflow(state, max_consecutive=10)


@pytest.mark.parametrize("axis_name", [1, (), ("data", 2), b"data"])
def test_axis_name_of_the_wrong_type_is_a_clear_error(axis_name):
    with pytest.raises(TypeError, match="axis_name must be None, a mapped axis name"):
        loss_scaling(optax.sgd(1.0), axis_name=axis_name)


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis): the constructors accept exactly what works, the rule is PyTorch's

ANYTHING = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.complex_numbers(),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
)


def _floor_ok(scale):
    return np.isfinite(scale) and scale >= np.finfo(np.float32).tiny


@settings(max_examples=200, deadline=None)
@given(value=ANYTHING)
def test_any_initial_scale_is_accepted_only_if_it_works_in_float32(value):
    try:
        ls = DynamicLossScale(value, min_scale=None)
    except (TypeError, ValueError):
        with np.errstate(over="ignore", under="ignore"):
            # Usable: a float32 scale above the floor that the default growth factor (2) can
            # still grow without overflowing (beyond 2**127 it never could).
            usable = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and _floor_ok(np.float32(value))
                and np.isfinite(np.float32(value) * np.float32(2))
            )
        assert not usable, value
        return
    scale = float(ls.loss_scale)
    assert ls.loss_scale.dtype == F32 and _floor_ok(np.float32(scale))


@settings(max_examples=100, deadline=None)
@given(
    growth=ANYTHING,
    backoff=ANYTHING,
    interval=ANYTHING,
    min_scale=ANYTHING,
)
def test_any_hyperparameters_either_raise_clearly_or_keep_the_scale_alive(
    growth, backoff, interval, min_scale
):
    try:
        ls = DynamicLossScale(
            1.0 if min_scale is None else 2.0**15,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=interval,
            min_scale=min_scale,
        )
    except (TypeError, ValueError):
        return
    counter_max = np.iinfo(np.int32).max
    assert 1 <= ls.growth_interval <= counter_max
    for finite in [False] * 40 + [True] * 3:
        ls = ls.adjust(finite)
        scale = np.float32(ls.loss_scale)
        assert np.isfinite(scale) and 0 <= int(ls.counter) < counter_max
        if ls.min_scale is not None:
            assert scale >= np.float32(ls.min_scale) > 0


@settings(max_examples=60, deadline=None)
@given(
    growth=st.floats(1.01, 64.0),
    backoff=st.floats(0.01, 0.99),
    interval=st.integers(1, 6),
    min_scale=st.one_of(st.none(), st.floats(1e-3, 1.0)),
    max_scale=st.one_of(st.none(), st.floats(1e3, 1e9)),
    initial=st.floats(1.0, 1e3),
    finite=st.lists(st.booleans(), max_size=30),
)
def test_the_update_rule_is_pytorchs_with_the_clamps(
    growth, backoff, interval, min_scale, max_scale, initial, finite
):
    ls = DynamicLossScale(
        initial,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    scale, tracker = np.float32(initial), 0
    for f in finite:
        ls = ls.adjust(f)
        scale, tracker = torch_rule(
            scale, tracker, f, growth, backoff, interval, min_scale, max_scale
        )
        if 0 < scale < np.finfo(np.float32).tiny:
            # Backed off below float32's normal range (no floor): XLA's CPU backend flushes a
            # subnormal result to zero where NumPy, and a GPU, keep it.
            break
        assert float(ls.loss_scale) == float(scale)
        assert int(ls.counter) == tracker


# ---------------------------------------------------------------------------------------------
# Bad input to the transformations


@pytest.mark.parametrize("wrapper", [loss_scaling, mpjax.master_weights])
@pytest.mark.parametrize(
    "inner, message",
    [
        (None, "got None of type NoneType"),
        (
            "adam",
            r"got the string 'adam': build the optimizer, e\.g\. optax\.adam\(learning_rate\)",
        ),
        (optax.adam, r"got the function adam: call it to build the transformation, adam\("),
        (5, "got 5 of type int"),
    ],
)
def test_wrapping_something_that_is_not_a_transformation_is_a_clear_error(wrapper, inner, message):
    name = wrapper.__name__
    with pytest.raises(TypeError, match=rf"{name}: inner must be an optax GradientTransformation"):
        wrapper(inner)
    with pytest.raises(TypeError, match=message):
        wrapper(inner)


def _bad_updates():
    params = {"w": jnp.ones(2)}
    return [
        (None, params, TypeError, "update got grads=None"),
        (
            {"w": 1.0},
            params,
            TypeError,
            r"gradients must be arrays, got 1.0 of type float at grads\['w'\]",
        ),
        (
            {"w": jnp.ones(3)},
            params,
            ValueError,
            r"grads\['w'\] has shape \(3,\) but params\['w'\] has shape \(2,\)",
        ),
        ({"v": jnp.ones(2)}, params, ValueError, "the grads tree does not match the params tree"),
        (
            {"w": jnp.ones(2)},
            {"w": jnp.ones(2, jnp.int32)},
            TypeError,
            r"params\['w'\] is int32, and a floating-point update would be truncated",
        ),
    ]


@pytest.mark.parametrize("wrapper", [loss_scaling, mpjax.master_weights])
@pytest.mark.parametrize("case", range(5))
def test_update_rejects_bad_gradients_naming_the_path(wrapper, case):
    grads, params, error, message = _bad_updates()[case]
    tx = wrapper(optax.sgd(1.0))
    state = tx.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
    with pytest.raises(error, match=f"{wrapper.__name__}: {message}"):
        tx.update(grads, state, params)


@pytest.mark.parametrize(
    "wrapper, state_type",
    [(loss_scaling, "LossScalingState"), (mpjax.master_weights, "MasterWeightsState")],
)
def test_update_with_a_state_of_another_transformation_says_how_to_get_the_right_one(
    wrapper, state_type
):
    params = {"w": jnp.ones(2)}
    tx = wrapper(optax.sgd(1.0))
    for wrong, kind in ((None, "NoneType"), (optax.adam(1.0).init(params), "tuple")):
        with pytest.raises(
            TypeError,
            match=rf"update got a state of type {kind}, not the {state_type} .*tx\.init\(params\)",
        ):
            tx.update(params, wrong, params)


# ---------------------------------------------------------------------------------------------
# Checking a restored state


def _restored(scale, counter=0, skipped=0):
    """A state built by the code (default floor 1), its leaves replaced as a checkpoint would."""
    state = loss_scaling(optax.sgd(1.0)).init({"w": jnp.ones(1)})
    ls = state.loss_scale._from_fields(
        **{
            **vars(state.loss_scale),
            "loss_scale": jnp.float32(scale),
            "counter": jnp.int32(counter),
        }
    )
    return state._replace(loss_scale=ls, skipped_steps=jnp.int32(skipped))


def test_check_loss_scaling_accepts_what_the_transform_can_continue_from():
    mpjax.check_loss_scaling(_restored(2.0**15, counter=7, skipped=3))
    mpjax.check_loss_scaling(optax.sgd(1.0).init({"w": jnp.ones(1)}))  # no loss scaling


@pytest.mark.parametrize(
    "state, message",
    [
        (
            _restored(2.0**-20),
            r"outside \[min_scale, max_scale\] = \[1.0, None\] of this optimizer",
        ),
        (_restored(float("nan")), r"the scale \[nan\] is not positive and finite"),
        (_restored(0.0), "is not positive and finite"),
        (_restored(4.0, counter=-1), r"counter \[-1\] is negative"),
        (_restored(4.0, skipped=-5), r"skipped_steps \[-5\] is negative"),
    ],
)
def test_check_loss_scaling_rejects_a_state_this_optimizer_cannot_continue(state, message):
    with pytest.raises(ValueError, match=f"check_loss_scaling: .*{message}"):
        mpjax.check_loss_scaling(state)


ODD_LEAVES = st.one_of(
    st.floats(allow_nan=True),
    st.integers(-5, 5),
    st.text(max_size=3),
    st.none(),
    st.sampled_from(
        [
            jnp.ones(2),
            jnp.ones(3),
            jnp.ones(2, jnp.int32),
            jnp.ones(2, jnp.bfloat16),
            jnp.array([jnp.inf, 1.0]),
            np.ones(2, np.float32),
            jnp.ones((2, 1)),
        ]
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    wrapper=st.sampled_from([loss_scaling, mpjax.master_weights]),
    grads=st.one_of(ODD_LEAVES, st.dictionaries(st.sampled_from(["w", "v"]), ODD_LEAVES)),
)
def test_update_with_any_gradients_works_or_raises_a_clear_error(wrapper, grads):
    """Whatever ``update`` is handed as gradients, it either runs, returning floating updates
    shaped like the params, or raises TypeError/ValueError naming the transformation;
    never an AttributeError from deep inside."""
    params = {"w": jnp.ones(2)}
    tx = wrapper(optax.sgd(1.0))
    state = tx.init(params)
    try:
        updates, _ = tx.update(grads, state, params)
    except (TypeError, ValueError) as e:
        assert str(e).startswith(f"{wrapper.__name__}: "), str(e)
        return
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    # Shaped like the param; in the gradient's dtype (loss scaling) or the param's (master).
    assert updates["w"].shape == (2,) and updates["w"].dtype in (F32, BF16)


@settings(max_examples=40, deadline=None)
@given(inner=st.one_of(ODD_LEAVES, st.sampled_from([optax.adam, optax.chain, len, object()])))
def test_wrapping_anything_but_a_transformation_raises_type_error(inner):
    for wrapper in (loss_scaling, mpjax.master_weights):
        with pytest.raises(TypeError, match=f"{wrapper.__name__}: inner must be an optax"):
            wrapper(inner)


# ---------------------------------------------------------------------------------------------
# scaled_value_and_grad: the scale cannot be forgotten


def _sq_loss(p, x):
    return jnp.mean((x @ p["w"] + p["b"]) ** 2)


def _sq_params():
    return {"w": jnp.full((3, 2), 0.5, F32), "b": jnp.zeros(2, F32)}


def test_scaled_value_and_grad_returns_the_loss_unscaled_and_the_gradients_scaled():
    tx = loss_scaling(optax.sgd(0.1), "static:1024")
    params, x = _sq_params(), jnp.ones((4, 3))
    state = tx.init(params)
    loss, grads = mpjax.scaled_value_and_grad(_sq_loss)(state, params, x)
    true_loss, true_grads = jax.value_and_grad(_sq_loss)(params, x)
    np.testing.assert_allclose(loss, true_loss, rtol=1e-6)
    assert loss.dtype == F32
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda p: p.dtype, params)
    jax.tree.map(lambda g, t: np.testing.assert_allclose(g, 1024 * t, rtol=1e-6), grads, true_grads)
    # What update expects: the updates are those of the true gradients.
    updates, state = tx.update(grads, state, params)
    jax.tree.map(
        lambda u, t: np.testing.assert_allclose(u, -0.1 * t, rtol=1e-6), updates, true_grads
    )
    assert bool(state.applied)


def test_scaled_value_and_grad_without_loss_scaling_is_value_and_grad():
    params, x = _sq_params(), jnp.ones((4, 3))
    for state in (optax.adam(1.0).init(params), mpjax.master_weights(optax.sgd(1.0)).init(params)):
        loss, grads = mpjax.scaled_value_and_grad(_sq_loss)(state, params, x)
        true_loss, true_grads = jax.value_and_grad(_sq_loss)(params, x)
        np.testing.assert_allclose(loss, true_loss, rtol=1e-6)
        jax.tree.map(lambda g, t: np.testing.assert_allclose(g, t, rtol=1e-6), grads, true_grads)


def test_scaled_value_and_grad_takes_has_aux_argnums_and_keywords():
    tx = loss_scaling(optax.sgd(0.1), "static:8")
    params, x = _sq_params(), jnp.ones((4, 3))
    state = tx.init(params)

    def loss_fn(p, x, *, offset):
        loss = _sq_loss(p, x) + offset
        return loss, {"offset_loss": loss}

    (loss, aux), (gp, gx) = mpjax.scaled_value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state, params, x, offset=1.0
    )
    true_loss, (tp, tx_) = jax.value_and_grad(
        lambda p, x: loss_fn(p, x, offset=1.0)[0], argnums=(0, 1)
    )(params, x)
    np.testing.assert_allclose(loss, true_loss, rtol=1e-6)
    np.testing.assert_allclose(aux["offset_loss"], true_loss, rtol=1e-6)
    np.testing.assert_allclose(gx, 8 * tx_, rtol=1e-6)
    jax.tree.map(lambda g, t: np.testing.assert_allclose(g, 8 * t, rtol=1e-6), gp, tp)


def test_scaled_value_and_grad_trains_under_jit_without_retracing_and_skips_overflow():
    # A JAX config context that code run earlier in the process left suspended in a generator
    # (the whole suite runs in one process) exits when the garbage collector frees it, setting
    # this thread's dtype promotion back to what it was then: between two calls of `step`
    # that is a new trace context, and JAX retraces. The full suite failed this test so, on
    # its last call, on two JAX versions; collecting first keeps such exits out of the test.
    gc.collect()
    # loss_scaling wraps the rest: clipping sees the true gradients, Adam never a skipped step.
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    tx = loss_scaling(inner, DynamicLossScale(2.0**10, growth_interval=2))
    params, x = _sq_params(), jnp.ones((4, 3))
    state, reference, ref_state = tx.init(params), params, inner.init(params)
    traces = []

    @jax.jit
    def step(params, state, x):
        traces.append(1)
        loss, grads = mpjax.scaled_value_and_grad(_sq_loss)(state, params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    @jax.jit
    def ref_step(params, state, x):
        grads = jax.grad(_sq_loss)(params, x)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with standard_promotion():
        for _ in range(4):
            params, state, loss = step(params, state, x)
            reference, ref_state = ref_step(reference, ref_state, x)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), params, reference)
        assert float(state.scale) == 2.0**12 and len(traces) == 1
        before = state
        params_before = params
        params, state, loss = step(params, state, x.at[0, 0].set(jnp.inf))  # overflows
    assert len(traces) == 1 and not bool(state.applied) and int(state.skipped_steps) == 1
    assert_trees_bitwise_equal(params, params_before)
    assert_trees_bitwise_equal(state.inner_state, before.inner_state)  # Adam's count stays


def test_scaled_value_and_grad_never_makes_an_inf_of_a_float16_loss():
    # 5 * 2**15 is beyond float16's range: the scaled loss is computed in float32, so not even
    # the (discarded) scaled value is inf, and jax_debug_infs stays quiet.
    tx = loss_scaling(optax.sgd(1e-3), "dynamic")
    params = {"w": jnp.ones(2, F16)}
    state = tx.init(params)
    with jax.debug_infs(True):
        loss, grads = mpjax.scaled_value_and_grad(lambda p: jnp.sum(p["w"]) + 3)(state, params)
    assert loss.dtype == F16 and float(loss) == 5.0
    assert grads["w"].dtype == F16 and np.all(np.asarray(grads["w"], F32) == 2.0**15)
    _, state = tx.update(grads, state, params)
    assert bool(state.applied)


def test_scaled_value_and_grad_with_flax_linen_params():
    import flax.linen as nn

    policy = mpjax.get_policy("mixed_float16")
    model = mpjax.linen.apply_policy(nn.Dense(3), policy)
    x = jnp.ones((4, 5))
    params = model.init(jax.random.key(0), x)["params"]
    tx = loss_scaling(optax.adam(1e-2), "dynamic" if policy.needs_loss_scaling else "none")
    state = tx.init(params)

    def loss_fn(params, x):
        return jnp.mean(model.apply({"params": params}, x) ** 2)

    @jax.jit
    def step(params, state, x):
        loss, grads = mpjax.scaled_value_and_grad(loss_fn)(state, params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    with standard_promotion():
        losses = []
        for _ in range(5):
            params, state, loss = step(params, state, x)
            losses.append(float(loss))
    assert losses[-1] < losses[0] and int(state.skipped_steps) == 0
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {F32}


def _bad_helper_calls():
    tx = loss_scaling(optax.sgd(1.0))
    params, x = _sq_params(), jnp.ones((4, 3))
    state = tx.init(params)
    svg = mpjax.scaled_value_and_grad
    return {
        "fun": (lambda: svg(_sq_loss(params, x)), TypeError, r"fun must be the loss function"),
        "argnums": (lambda: svg(_sq_loss, argnums="0"), TypeError, r"argnums must be an int"),
        "argnums_bool": (lambda: svg(_sq_loss, argnums=True), TypeError, r"argnums .*got True"),
        "argnums_empty": (lambda: svg(_sq_loss, argnums=()), TypeError, r"argnums .*got \(\)"),
        "has_aux": (lambda: svg(_sq_loss, has_aux="yes"), TypeError, r"has_aux must be a bool"),
        "opt_state_none": (
            lambda: svg(_sq_loss)(None, params, x),
            TypeError,
            r"opt_state must be the optimizer state .*got None",
        ),
        "opt_state_last": (
            lambda: svg(lambda p, s, x: _sq_loss(p, x))(params, state, x),
            TypeError,
            r"the optimizer state goes first",
        ),
        "not_a_pair": (
            lambda: svg(_sq_loss, has_aux=True)(state, params, x),
            TypeError,
            r"with has_aux=True fun must return a pair \(loss, aux\)",
        ),
        "not_scalar": (
            lambda: svg(lambda p, x: x @ p["w"])(state, params, x),
            TypeError,
            r"fun must return a scalar loss, got shape \(4, 2\)",
        ),
        "integer_loss": (
            lambda: svg(lambda p, x: jnp.int32(1))(state, params, x),
            TypeError,
            r"the loss fun returns must be a floating-point array",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_helper_calls()))
def test_scaled_value_and_grad_rejects_bad_input_naming_it(case):
    call, error, message = _bad_helper_calls()[case]
    with pytest.raises(error, match=f"scaled_value_and_grad.*{message}"):
        call()


# ---------------------------------------------------------------------------------------------
# loss_scaling must wrap the rest of the optimizer: misplacements the state shows are refused


def _misplaced():
    params = {"w": jnp.ones(2)}
    ls = loss_scaling(optax.sgd(1.0), "static:8")
    return {
        "after_clip": (
            optax.chain(optax.clip_by_global_norm(1.0), ls).init(params),
            r"after another transformation \(opt_state\[0\] is EmptyState\)",
            "optax.chain(optax.clip_by_global_norm(1.0), mpjax.loss_scaling(",
        ),
        "before_adam": (
            optax.chain(loss_scaling(optax.clip(1.0)), optax.adam(1.0)).init(params),
            r"before a transformation that keeps state \(opt_state\[1\] is tuple\)",
            "optax.chain(mpjax.loss_scaling(optax.clip_by_global_norm(1.0)), optax.adam(lr))",
        ),
        "nested_chain": (
            optax.chain(optax.identity(), optax.chain(optax.clip(1.0), ls)).init(params),
            r"\(opt_state\[1\]\[1\]\) sits inside an optax.chain, after another "
            r"transformation \(opt_state\[0\] is EmptyState\)",
            "optax.chain(optax.clip_by_global_norm(1.0), mpjax.loss_scaling(",
        ),
        "inside_multisteps": (
            optax.MultiSteps(ls, 2).init(params),
            r"inside optax.MultiSteps",
            "optax.MultiSteps(mpjax.loss_scaling(inner), k)",
        ),
    }


@pytest.mark.parametrize("case", list(_misplaced()))
def test_a_loss_scaling_that_does_not_wrap_the_rest_is_refused_showing_the_fix(case):
    state, why, wrong = _misplaced()[case]
    params = {"w": jnp.ones(2)}
    readers = {
        "scale_loss": lambda s: scale_loss(jnp.float32(1.0), s),
        "loss_scaling_info": loss_scaling_info,
        "check_overflow": check_overflow,
        "check_loss_scaling": mpjax.check_loss_scaling,
        "scaled_value_and_grad": lambda s: mpjax.scaled_value_and_grad(quadratic_sum)(s, params),
    }
    for name, read in readers.items():
        with pytest.raises(ValueError, match=f"{name}: mpjax.loss_scaling must wrap") as info:
            read(state)
        message = str(info.value)
        assert re.search(why, message), message
        assert f"\n  wrong: {wrong}" in message, message
        assert "\n  right: mpjax.loss_scaling(" in message, message
    # Under jit too: the check reads the state's structure, not its values.
    with pytest.raises(ValueError, match="must wrap the whole optimizer"):
        jax.jit(lambda s: scale_loss(jnp.float32(1.0), s))(state)


def quadratic_sum(p):
    return jnp.sum(p["w"] ** 2)


def test_the_adam_count_bug_the_check_prevents():
    # Why chain(loss_scaling(clip), adam) is refused: Adam's count moves on a skipped step.
    params = {"w": jnp.ones(2)}
    tx = optax.chain(loss_scaling(optax.clip(1.0), "static:8"), optax.adam(1.0))
    state = tx.init(params)
    with standard_promotion():
        _, state = tx.update({"w": jnp.full(2, jnp.inf)}, state, params)
    assert not bool(state[0].applied) and int(state[1][0].count) == 1


# ---------------------------------------------------------------------------------------------
# The readers refuse what is not an optimizer state


@pytest.mark.parametrize(
    "opt_state, error, message",
    [
        (None, TypeError, r"opt_state must be the optimizer state .*got None of type NoneType"),
        (3, TypeError, r"opt_state must be the optimizer state .*got 3 of type int"),
        (jnp.ones(2), TypeError, r"opt_state must be the optimizer state .*ArrayImpl"),
        ("adam", TypeError, r"opt_state must be the optimizer state .*got 'adam' of type str"),
        (
            {"w": jnp.ones(2), "b": jnp.zeros(1)},
            TypeError,
            r"opt_state holds no optax state .*only 2 arrays or values: params, gradients",
        ),
        (
            flax.serialization.to_state_dict(loss_scaling(optax.sgd(1.0)).init({"w": jnp.ones(2)})),
            TypeError,
            r"opt_state holds the fields of a LossScalingState in a mapping",
        ),
    ],
    ids=["none", "int", "array", "str", "params", "state_dict"],
)
def test_readers_reject_what_is_not_an_optimizer_state(opt_state, error, message):
    readers = {
        "scale_loss": lambda s: scale_loss(jnp.float32(1.0), s),
        "loss_scaling_info": loss_scaling_info,
        "check_overflow": lambda s: check_overflow(s, 3),
        "check_loss_scaling": mpjax.check_loss_scaling,
        "scaled_value_and_grad": lambda s: mpjax.scaled_value_and_grad(quadratic_sum)(
            s, {"w": jnp.ones(2)}
        ),
    }
    for name, read in readers.items():
        with pytest.raises(error, match=f"{name}: {message}"):
            read(opt_state)


def test_scale_loss_rejects_an_8_bit_loss():
    state = loss_scaling(optax.sgd(1.0)).init(jnp.ones(1))
    with pytest.raises(TypeError, match=r"scale_loss: loss is float8_e4m3fn, which cannot hold"):
        scale_loss(jnp.ones((), jnp.float8_e4m3fn), state)


def test_check_overflow_has_a_default_limit():
    tx = loss_scaling(optax.sgd(1.0), "static:8")
    params = {"w": jnp.ones(1)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(24):
        _, state = update({"w": jnp.full(1, jnp.inf)}, state, params)
    check_overflow(state)  # 24 in a row: within the default
    _, state = update({"w": jnp.full(1, jnp.inf)}, state, params)
    with pytest.raises(PersistentOverflowError, match=r"The last 25 .*limit: 25"):
        check_overflow(state)


def test_a_growth_factor_under_which_the_scale_never_grows_is_refused():
    with pytest.raises(
        ValueError, match=r"growth_factor 3e\+38 times the initial loss_scale 32768"
    ):
        DynamicLossScale(growth_factor=3e38)
    with pytest.raises(ValueError, match="growth_factor .*could never grow"):
        DynamicLossScale(2.0**100, growth_factor=2.0**30)
    # With a cap the growth lands on max_scale, so the same factor works.
    ls = DynamicLossScale(growth_factor=3e38, max_scale=1e30, growth_interval=1)
    assert float(ls.adjust(True).loss_scale) == np.float32(1e30)


# ---------------------------------------------------------------------------------------------
# Params and gradients the four transformations cannot train


WRAPPERS = {
    "loss_scaling": lambda: loss_scaling(optax.sgd(1.0)),
    "master_weights": lambda: mpjax.master_weights(optax.sgd(1.0)),
    "state_precision": lambda: mpjax.state_precision(optax.sgd(1.0, momentum=0.9), "bf16"),
    "low_precision_params": lambda: mpjax.low_precision_params(optax.sgd(1.0), "kahan"),
}


@pytest.mark.parametrize("name", list(WRAPPERS))
@pytest.mark.parametrize(
    "params, message",
    [
        (None, r"init got params=None"),
        (
            {"w": jnp.ones(2), "name": "mlp"},
            r"params must be arrays, got 'mlp' of type str at params\['name'\]",
        ),
        (
            {"w": jnp.ones(2, jnp.float8_e4m3fn)},
            r"params\['w'\] is float8_e4m3fn, which cannot be trained as a param",
        ),
    ],
    ids=["none", "string", "fp8"],
)
def test_init_rejects_params_it_cannot_train_naming_the_path(name, params, message):
    with pytest.raises(TypeError, match=f"{name}: {message}"):
        WRAPPERS[name]().init(params)


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_update_rejects_a_string_param_and_8_bit_gradients(name):
    tx = WRAPPERS[name]()
    params = {"w": jnp.ones(2), "s": jnp.ones(())}
    state = tx.init(params)
    grads = {"w": jnp.ones(2), "s": jnp.ones(())}
    with pytest.raises(TypeError, match=rf"{name}: params must be arrays, got 'x' .*params\['s'\]"):
        tx.update(grads, state, {**params, "s": "x"})
    fp8 = {**grads, "w": jnp.ones(2, jnp.float8_e5m2)}
    with pytest.raises(TypeError, match=rf"{name}: gradients must be float16 or wider, got "):
        tx.update(fp8, state, params)


@pytest.mark.parametrize("name", ["loss_scaling", "state_precision"])
def test_update_without_params_checks_the_gradients_against_the_params_init_saw(name):
    tx = WRAPPERS[name]()
    state = tx.init({"w": jnp.ones(2)})
    for grads in ({"v": jnp.ones(2)}, [jnp.ones(2)], {"w": jnp.ones(2), "b": jnp.ones(1)}):
        with pytest.raises(
            ValueError, match=f"{name}: the grads tree does not match the params tree init"
        ):
            tx.update(grads, state)
    with pytest.raises(
        ValueError, match=rf"{name}: grads\['w'\] has shape \(3,\) but the param init was given"
    ):
        tx.update({"w": jnp.ones(3)}, state)
    tx.update({"w": jnp.ones(2)}, state)
    # One transformation initialized for two models takes the gradients of either.
    other = tx.init({"a": {"b": jnp.ones(3)}})
    tx.update({"a": {"b": jnp.ones(3)}}, other)
    tx.update({"w": jnp.ones(2)}, state)


@pytest.mark.parametrize("ls", [DynamicLossScale(), StaticLossScale(4.0), NoOpLossScale()])
@pytest.mark.parametrize(
    "flag, error, message",
    [
        (None, TypeError, r"must be a bool .*got None"),
        ("yes", TypeError, r"must be a bool .*got 'yes' of type str"),
        (1.5, TypeError, r"got 1.5 of type float"),
        (jnp.float32(1.0), TypeError, r"of type ArrayImpl"),
        (jnp.array([True, False]), ValueError, r"one bool for the whole step .*shape \(2,\)"),
    ],
)
def test_adjust_takes_one_bool_and_names_anything_else(ls, flag, error, message):
    with pytest.raises(error, match=f"adjust\\(grads_finite\\): grads_finite .*{message}"):
        ls.adjust(flag)
    for ok in (True, np.bool_(False), jnp.array(True)):
        ls.adjust(ok)
    jax.jit(lambda ls, f: ls.adjust(f))(ls, jnp.array(False))  # a traced bool
