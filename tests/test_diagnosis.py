"""mpjax.diagnose: every statistic against NumPy on the same values, the non-finite birth, the
precision lost per module, and recommendations that fix the problem planted for them."""

import collections
import json
import os
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close_in_norm, tolerance

import mpjax
from mpjax.doctor import range_stats, side_by_side
from mpjax.doctor.range_stats import DTYPES, RangeStats

# mixed_float16 with its gradients reduced in float16, as JAX computes them: the weight
# gradients of these tests, sums over a batch, overflow or flush float16 there (reduced in
# mixed_float16's own reduce dtype, float32, they do not).
F16_GRADIENTS = "p=f32,c=f16,o=f32,r=f16"


def _numpy_shares(values: np.ndarray, dtype: str, scale: float = 1.0) -> tuple[float, ...]:
    """Overflow, subnormal and flush-to-zero shares of the finite ``values`` (times ``scale``)
    rounded to ``dtype`` by NumPy (ml_dtypes)."""
    x = values[np.isfinite(values)].astype(np.float32) * np.float32(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.abs(x.astype(jnp.dtype(dtype)).astype(np.float32))
    tiny = np.float32(ml_dtypes.finfo(jnp.dtype(dtype)).smallest_normal)
    n = max(x.size, 1)
    return (
        np.sum(~np.isfinite(r)) / n,
        np.sum(np.isfinite(r) & (r > 0) & (r < tiny)) / n,
        np.sum((x != 0) & (r == 0)) / n,
    )


def _assert_stats_match(stats: RangeStats, values: np.ndarray):
    values = np.asarray(values, np.float32).ravel()
    finite = values[np.isfinite(values)]
    nonzero = np.abs(finite[finite != 0])
    assert stats.count == values.size
    assert stats.nonfinite == values.size - finite.size
    assert stats.zeros == np.sum(finite == 0)
    assert stats.amax == np.max(np.abs(finite), initial=0.0)
    assert stats.min_nonzero == (np.min(nonzero) if nonzero.size else np.inf)
    exponents = np.floor(np.log2(nonzero)).astype(int)
    expected = np.bincount(exponents - range_stats.LOG2_MIN, minlength=stats.histogram.size)
    np.testing.assert_array_equal(stats.histogram, expected)
    for dtype in DTYPES:
        shares = stats.shares(dtype)
        assert (shares.overflow, shares.subnormal, shares.flush) == pytest.approx(
            _numpy_shares(values, dtype), abs=0
        ), dtype


def _summary(values) -> RangeStats:
    counts, extremes = jax.jit(range_stats.summarize)(values)
    return RangeStats.from_summary(np.asarray(counts), np.asarray(extremes))


def _assert_table_and_verdict_agree(report):
    """The default view (str) keeps to 100 columns and its table shows exactly the modules the
    verdict keeps in float32; every module whose values overflow the dtype they run in, where
    a non-finite value is born or whose error is above max_error is one of them; the "at"
    column never points into mpjax."""
    text = str(report)
    assert max(map(len, text.splitlines())) <= 100
    assert text.splitlines()[1].startswith("verdict: ")
    flagged = {r.where for r in report.modules if r.as_run.overflow > 0}
    flagged |= {r.module for r in report.errors if r.local > report.max_error}
    flagged |= {report.birth.module} if report.birth is not None else set()
    assert flagged == set(report.keep)
    assert (report.rules is None) == (not report.keep)
    assert ("the policy keeps every module" in text) == (not report.keep)
    rows = text.split("\nmodule ", 1)[1].split("\n\n")[0].splitlines()[2:] if report.keep else []
    assert {row.split()[0] for row in rows} == {m or "<root>" for m in report.keep}
    for row in rows:
        overflow = row.split()[4]
        if overflow != "0":
            assert row.split()[0] in {m or "<root>" for m in flagged}
    package = os.path.dirname(mpjax.__file__) + os.sep
    located = [r.location for r in report.errors] + [report.birth.location if report.birth else ""]
    assert not any(location.startswith(package) for location in located), located


# --- Statistics -------------------------------------------------------------------------------


def test_bounds_are_where_rounding_changes_what_a_value_is():
    f16, e4m3 = range_stats.bounds("float16"), range_stats.bounds("float8_e4m3fn")
    # 65520 is halfway between float16's largest, 65504, and the next step: a tie to even, inf.
    assert float(f16.overflow) == 65520.0
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(np.float32(65520.0)))
    assert np.isfinite(np.float16(np.nextafter(np.float32(65520.0), np.float32(0))))
    # float8_e4m3fn: 464 (halfway from 448 to 480) rounds to even 448; just above it is NaN.
    assert float(e4m3.overflow) == float(np.nextafter(np.float32(464.0), np.float32(1e9)))
    # 2**-25 is half of float16's smallest subnormal: a tie, to even zero.
    assert float(f16.nonzero) == float(np.nextafter(np.float32(2.0**-25), np.float32(1)))


def test_every_statistic_matches_numpy_on_the_same_values():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(20_000) * np.exp2(rng.uniform(-35, 20, 20_000))
    values = values.astype(np.float32)
    # Values exactly at the bounds, zeros and non-finite ones. (bfloat16's subnormals are
    # float32 subnormals, which XLA flushes to zero: they count as zeros, left out here.)
    special = [
        float(getattr(range_stats.bounds(d), f)) for d in DTYPES for f in range_stats._FIELDS
    ]
    special = [v for v in special if v >= np.finfo(np.float32).smallest_normal]
    values[: len(special)] = special
    values[len(special) : len(special) + 4] = [0.0, -0.0, np.inf, np.nan]
    _assert_stats_match(_summary(values), values)


def test_merged_statistics_are_those_of_the_union():
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(300) * 1e3).astype(np.float32)
    b = (rng.standard_normal(500) * 1e-6).astype(np.float32)
    _assert_stats_match(RangeStats.merge([_summary(a), _summary(b)]), np.concatenate([a, b]))


def test_loss_scale_shares_match_numpy_on_the_scaled_values():
    rng = np.random.default_rng(2)
    values = (rng.standard_normal(5000) * np.exp2(rng.uniform(-40, 12, 5000))).astype(np.float32)
    stats = _summary(values)
    for k in (0, 3, 10, 24, 32):
        shares = stats.shares("float16", k)
        expected = _numpy_shares(values, "float16", 2.0**k)
        assert (shares.overflow, shares.subnormal, shares.flush) == pytest.approx(expected, abs=0)


def test_excluded_values_are_counted_apart_and_left_out_of_every_statistic():
    rng = np.random.default_rng(5)
    values = (rng.standard_normal(4000) * np.exp2(rng.uniform(-30, 20, 4000))).astype(np.float32)
    excluded = rng.uniform(size=values.size) < 0.3
    values[excluded] = np.finfo(np.float32).min
    values[np.flatnonzero(excluded)[:3]] = [np.inf, 0.0, 1.0]
    counts, extremes = jax.jit(range_stats.summarize)(values, excluded)
    stats = RangeStats.from_summary(np.asarray(counts), np.asarray(extremes))
    assert stats.masked == excluded.sum()
    _assert_stats_match(stats, values[~excluded])


def test_unknown_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="float64.*float16, bfloat16, float8_e4m3fn"):
        mpjax.diagnose(jnp.tanh, policy="mixed_float16", dtypes=["float16", "float64"])
    with pytest.raises(ValueError, match="'fp17'"):
        mpjax.diagnose(jnp.tanh, policy="mixed_float16", dtypes=["fp17"])
    with pytest.raises(TypeError, match="list of dtypes"):
        mpjax.diagnose(jnp.tanh, policy="mixed_float16", dtypes="float16")


# --- Ranges of a function -------------------------------------------------------------------


def _exact_inputs():
    # Small integers and powers of two: every product and sum is exact in float32.
    x = np.arange(-12, 12, dtype=np.float32).reshape(4, 6)
    w = np.exp2(np.arange(-9, 9, dtype=np.float32)).reshape(6, 3)
    return x, w


def _layers(x, w):
    with jax.named_scope("proj"):
        h = x @ w
    with jax.named_scope("act"):
        y = h * 0.5
    return jnp.sum(y)


def test_ranges_per_module_and_operation_match_numpy_forward_and_backward():
    x, w = _exact_inputs()
    report = mpjax.diagnose(_layers, policy="mixed_bfloat16")(x, w)
    h = x @ w
    _assert_stats_match(report.module("proj").stats, h)
    _assert_stats_match(report.op("dot_general").stats, h)
    _assert_stats_match(report.module("act").stats, h * 0.5)
    # Backward: the cotangent of y is ones, of h 0.5 everywhere (mul), then the two matmuls
    # give dx = 0.5 @ w.T and dw = x.T @ 0.5.
    half = np.full_like(h, 0.5)
    _assert_stats_match(report.op("mul", backward=True).stats, half)
    _assert_stats_match(
        report.op("dot_general", backward=True).stats,
        np.concatenate([(half @ w.T).ravel(), (x.T @ half).ravel()]),
    )
    data = json.loads(report.to_json())
    assert {m["where"] for m in data["modules"]} >= {"proj", "act"}
    assert data["policy"] == "p=f32,c=bf16,o=f32"
    text = report.table()
    assert "proj" in text and "bf16 over/sub/ftz" in text
    assert "<- f16 max" in report.histogram("proj") or "2^" in report.histogram("proj")


@pytest.mark.slow
def test_the_histogram_plot_draws_each_share_and_the_dtypes_limits(monkeypatch):
    matplotlib.use("Agg")
    x, w = _exact_inputs()
    report = mpjax.diagnose(_layers, policy="mixed_float16")(x, w)
    ax = report.plot("proj", "act")
    for line, where in zip(ax.lines, ("proj", "act")):
        stats = report.module(where).stats
        np.testing.assert_array_equal(line.get_ydata(), stats.histogram / stats.finite)
        assert line.get_xdata()[0] == range_stats.LOG2_MIN
    limits = {line.get_label(): line.get_xdata()[0] for line in ax.lines[2:]}
    assert limits["f16 max"] == np.log2(np.float32(65520.0))
    # Just below 2**-14 (float16's smallest normal), values round up to it.
    assert limits["f16 normal"] == np.log2(range_stats.bounds("float16").normal)
    assert -14.001 < limits["f16 normal"] < -14
    assert len(limits) == 3 * len(report.dtypes)
    everything = report.plot(backward=True).lines[0]
    assert everything.get_label().startswith("all backward values")
    with pytest.raises(KeyError, match="No backward values for 'nowhere'"):
        report.plot("nowhere", backward=True)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot("proj")


def _causal_attention(q, k):
    # Flax's attention: the masked scores filled with finfo(float32).min before the softmax.
    mask = nn.make_causal_mask(jnp.ones(q.shape[:2]))
    with jax.named_scope("attn"):
        out = nn.dot_product_attention(q, k, k, mask=mask)
    return jnp.sum(out**2)


@pytest.mark.slow
def test_mask_fills_are_counted_apart_not_as_overflow():
    q, k = jax.random.normal(jax.random.key(0), (2, 2, 6, 2, 4))
    report = mpjax.diagnose(_causal_attention, policy="mixed_float16")(q, k)
    attn = report.module("attn").stats
    assert all(attn.shares(d).overflow == 0 for d in DTYPES)
    # Each (batch, head) masks the 15 keys above the diagonal of its 6 queries: the select
    # writes them, the softmax's sub, exp and div compute from them.
    masked = 2 * 2 * 15
    assert report.op("select_n").stats.masked == masked
    assert report.op("exp").stats.masked == masked
    assert attn.masked >= 4 * masked
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
    causal = np.tril(np.ones((6, 6), bool))
    np.testing.assert_allclose(
        report.op("select_n").stats.amax,
        np.max(np.abs(np.asarray(scores)[..., causal])),
        rtol=tolerance(jnp.float32, 4),
    )
    assert report.birth is None and report.rules is None
    assert json.loads(report.to_json())["modules"][0]["masked"] >= 0


@pytest.mark.slow
def test_equinox_attention_mask_fills_are_counted_apart():
    mha = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0))
    mask = np.tril(np.ones((5, 5), bool))

    def attend(q):
        with jax.named_scope("attn"):
            return jnp.sum(mha(q, q, q, mask=mask) ** 2)

    q = jax.random.normal(jax.random.key(1), (5, 8))
    report = mpjax.diagnose(attend, policy="mixed_float16")(q)
    attn = report.module("attn").stats
    assert attn.amax < 100 and all(attn.shares(d).overflow == 0 for d in DTYPES)
    assert report.op("select_n").stats.masked == 2 * 10  # 2 heads, 10 above the diagonal
    assert report.rules is None


# --- Non-finite birth and precision lost ----------------------------------------------------


def _overflowing(x):
    with jax.named_scope("gram"):
        g = x @ x.T  # 8 * 100**2 = 80000: past float16's 65504
    with jax.named_scope("head"):
        return jnp.sum(jnp.tanh(g))


def test_the_first_non_finite_value_is_named_with_its_module_primitive_and_line():
    report = mpjax.diagnose(_overflowing, policy="mixed_float16")(jnp.full((2, 8), 100.0))
    birth = report.birth
    assert (birth.module, birth.primitive, birth.dtype, birth.backward) == (
        "gram",
        "dot_general",
        "float16",
        False,
    )
    assert birth.nonfinite == 4
    assert birth.location.startswith(__file__) and "_overflowing" in birth.location
    # Under bfloat16 nothing overflows.
    assert (
        mpjax.diagnose(_overflowing, policy="mixed_bfloat16")(jnp.full((2, 8), 100.0)).birth is None
    )


def _rounding(x):
    with jax.named_scope("round"):
        y = x.astype(jnp.bfloat16)
    with jax.named_scope("after"):
        return (y * 2).astype(jnp.float32)


@pytest.mark.slow
def test_the_error_entering_a_module_is_its_own_the_accumulated_one_includes_what_came_in():
    x = np.random.default_rng(3).standard_normal(256).astype(np.float32)
    report = mpjax.diagnose(_rounding, policy="float32")(x)
    rounded = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    expected = np.linalg.norm(rounded - x) / np.linalg.norm(x)
    assert report.error("round").local == pytest.approx(expected, rel=1e-5)
    assert report.error("round").primitive == "convert_element_type"
    # Doubling is exact: nothing enters in "after", but its values carry the rounding.
    assert report.error("after").local == 0.0
    assert report.error("after").accumulated == pytest.approx(expected, rel=1e-5)


def test_a_non_finite_value_copied_into_an_operation_is_not_born_there():
    def log_of_flat(x):
        with jax.named_scope("flat"):
            flat = x.reshape(-1)
        with jax.named_scope("log"):
            return jnp.sum(jnp.log(flat))

    doctor = mpjax.diagnose(log_of_flat, policy="mixed_bfloat16")
    born = doctor(np.array([[1.0, 0.0], [2.0, 3.0]], np.float32)).birth
    assert (born.module, born.primitive, born.nonfinite) == ("log", "log", 1)
    # An inf given as input reaches the log through the reshape: nothing is born.
    assert doctor(np.array([[1.0, np.inf], [2.0, 3.0]], np.float32)).birth is None


# --- How the evaluation runs -------------------------------------------------------------------


def _layered(n):
    def f(x, ws):
        for i in range(n):
            with jax.named_scope(f"layer{i}"):
                x = jnp.tanh(x @ ws[i])
        return jnp.sum(x)

    return f


def _evaluate(n):
    x, ws = np.ones((4, 8), np.float32), [np.full((8, 8), 0.1, np.float32)] * n
    f = jax.value_and_grad(mpjax.autocast(_layered(n), "mixed_bfloat16"))
    closed = jax.make_jaxpr(f)(x, ws)
    kernels = side_by_side.Kernels()
    evaluation = side_by_side.Evaluation(True, kernels)
    flat = [x, *ws]
    outs = evaluation.run(closed, [side_by_side.to_exact(v) for v in flat], flat)
    return evaluation, kernels, outs


def test_layers_alike_share_their_compiled_kernels():
    two, kernels_two, _ = _evaluate(2)
    five, kernels_five, (exact, actual) = _evaluate(5)
    assert len(kernels_five) == len(kernels_two)
    # Every layer is measured (the first also casts the float32 input, the last feeds the sum).
    per_layer = collections.Counter(s.module for s in five.sites)
    assert per_layer["layer1"] == per_layer["layer2"] == per_layer["layer3"] > 0
    # The evaluation's outputs are the function's, exactly and as it ran.
    value, grads = jax.value_and_grad(_layered(5))(
        np.ones((4, 8), np.float32), [np.full((8, 8), 0.1, np.float32)] * 5
    )
    np.testing.assert_allclose(exact[0], value, rtol=tolerance(jnp.float32, 8))
    np.testing.assert_allclose(actual[0], value, rtol=tolerance(jnp.bfloat16, 8) * 5)


def test_a_scan_is_evaluated_step_by_step_in_the_modules_of_its_body():
    def stacked(x, ws):
        def layer(h, w):
            with jax.named_scope("layer"):
                h = jnp.maximum(h @ w, 0.0)
            return h, jnp.sum(h)

        h, sums = jax.lax.scan(layer, x, ws)
        return jnp.sum(h) + jnp.sum(sums)

    x, _ = _exact_inputs()
    ws = np.stack([np.eye(6, dtype=np.float32) * s for s in (2.0, -0.5, 4.0)])
    report = mpjax.diagnose(stacked, policy="mixed_bfloat16")(x, ws)
    steps = [x @ ws[0]]
    for w in ws[1:]:
        steps.append(np.maximum(steps[-1], 0) @ w)
    # Every step's values, measured in the body's module, as NumPy computes them.
    _assert_stats_match(report.op("dot_general").stats, np.concatenate(steps))
    _assert_stats_match(report.op("max").stats, np.maximum(np.concatenate(steps), 0))
    assert report.module("layer").stats.amax == np.max(np.abs(steps)) == 24


def test_each_value_is_dropped_after_the_last_equation_that_reads_it():
    closed = jax.make_jaxpr(lambda x: (jnp.sin(x) * 2 + jnp.cos(x), x))(1.0)
    jaxpr = closed.jaxpr
    dead = side_by_side.Kernels().dead_after(jaxpr)
    for i, eqn in enumerate(jaxpr.eqns):
        for var in eqn.outvars:
            readers = [j for j, e in enumerate(jaxpr.eqns) if var in e.invars]
            if var in jaxpr.outvars:
                assert all(var not in d for d in dead.values())
            else:
                assert var in dead[max(readers, default=i)]
    # The input is read by sin and cos, and returned: it stays too.
    assert all(jaxpr.invars[0] not in d for d in dead.values())


@pytest.mark.slow
def test_a_platform_dependent_attention_is_measured_in_the_default_branch_this_platform_runs():
    q = np.random.default_rng(4).standard_normal((1, 16, 2, 8)).astype(np.float32)

    def attend(q):
        with jax.named_scope("attn"):
            return jnp.sum(mpjax.dot_product_attention(q, q, q, is_causal=True))

    report = mpjax.diagnose(attend, policy="mixed_bfloat16")(q)
    ops = {r.where for r in report.ops}
    if mpjax.jax_compat.lowering_platform() == "cuda":  # cuDNN's branch: one equation
        assert "cond" in ops
    else:
        assert "cond" not in ops and {"dot_general", "exp"} <= ops
    assert report.module("attn").stats.count > 0
    attn = report.module("attn").stats
    assert all(attn.shares(d).overflow == 0 for d in DTYPES)
    if mpjax.jax_compat.lowering_platform() != "cuda":  # the mask's fill, counted apart
        assert report.op("select_n").stats.masked == 2 * 15 * 16 // 2

    # A branch written for this very platform (as cuDNN's is for CUDA) may take only its own
    # dtypes: the conditional is measured as one equation, typed as written.
    def own_branch(x):
        here = {mpjax.jax_compat.lowering_platform(): jnp.sin}
        return jnp.sum(jax.lax.platform_dependent(x, **here, default=jnp.cos))

    ops = {r.where for r in mpjax.diagnose(own_branch, policy="mixed_bfloat16")(q).ops}
    assert "cond" in ops and "sin" not in ops


# --- Recommendations ------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Hand-written: the mean square as a dot product, which autocast runs in float16."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        mean_square = jnp.einsum("...d,...d->...", x, x)[..., None] / x.shape[-1]
        return x * jax.lax.rsqrt(mean_square + 1e-6) * scale


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="up")(x)
        return nn.Dense(4, name="out")(RMSNorm(name="norm")(h))


def _net():
    model = Net()
    x = jax.random.normal(jax.random.key(1), (8, 16)) * 40  # activations around 400 after "up"
    return model, model.init(jax.random.key(0), x), x


def _mse(y):
    return jnp.mean(y**2)


def _scaled_gram(x):
    with jax.named_scope("gram"):
        g = x @ x.T  # 8 * 100**2 = 80000: past float16's 65504
    with jax.named_scope("head"):
        return jnp.sum(g) / 1024


def test_the_recommended_rules_keep_the_overflowing_scope_in_float32_and_remove_the_overflow():
    x = jnp.full((2, 8), 100.0)
    report = mpjax.diagnose(_scaled_gram, policy="mixed_float16")(x)
    assert [r.key for r in report.rules.rules if not r.builtin] == ["gram"]
    assert "its dot_general (forward) runs in float16 and reaches 8e+04" in report.reasons[0]
    assert jnp.isinf(mpjax.autocast(_scaled_gram, "mixed_float16")(x))
    # In float32 for the matmul, the rest in float16: 4 * 80000 / 1024, exact in both.
    assert mpjax.autocast(_scaled_gram, rules=report.rules)(x) == _scaled_gram(x) == 312.5
    _assert_table_and_verdict_agree(report)
    again = mpjax.diagnose(_scaled_gram, policy=report.rules)(x)
    assert again.birth is None and again.rules is None
    _assert_table_and_verdict_agree(again)
    # The fix is true float32, even where the user opted the policy into a fast mode.
    fast = mpjax.get_policy("mixed_float16").with_f32_matmul_precision("bf16")
    fix = mpjax.diagnose(_scaled_gram, policy=fast)(x).rules.rules[0].policy
    assert fix.compute_dtype == jnp.float32 and fix.f32_matmul_precision == "highest"


@pytest.mark.slow
def test_the_recommended_rules_keep_the_overflowing_module_in_float32_and_remove_the_overflow():
    model, variables, x = _net()
    wrapped = mpjax.linen.apply_policy(model, "mixed_float16")
    report = mpjax.diagnose(wrapped, variables=variables, loss=_mse)(x)
    assert report.birth.module == "norm"
    assert [r.key for r in report.rules.rules if not r.builtin] == ["norm"]
    assert report.reasons[0].startswith("keep 'norm' in float32: its dot_general (forward) runs")
    assert "past float16's 65504" in report.reasons[0]
    # Under the policy, the rows whose mean square overflowed come out of the norm as zeros;
    # under the recommended rules the outputs are float32's up to float16 matmul rounding.
    exact = model.apply(variables, x)
    fixed = mpjax.linen.apply_policy(model, report.rules)
    assert jnp.linalg.norm(wrapped.apply(variables, x) - exact) > 0.3 * jnp.linalg.norm(exact)
    assert_close_in_norm(fixed.apply(variables, x), exact, tolerance(jnp.float16, 32))
    _assert_table_and_verdict_agree(report)
    again = mpjax.diagnose(fixed, variables=variables, loss=_mse)(x)
    assert again.birth is None and again.rules is None
    assert again.error("norm").local < 1e-6
    _assert_table_and_verdict_agree(again)


def test_the_loss_scale_range_keeps_float16_gradients_in_range():
    # The gradients of sum(v @ w), in float16: with respect to w, v's values c, from 2**-30 to
    # 2**4; with respect to v, w's ones; and the loss's cotangent, 1, cast to float16.
    c = np.exp2(np.linspace(-30, 4, 35)).astype(np.float32)
    report = mpjax.diagnose(lambda v, w: jnp.sum(v @ w), policy=F16_GRADIENTS)(
        c[None], np.ones((c.size, 1), np.float32)
    )
    values = np.concatenate([c, np.ones(c.size + 1, np.float32)])
    advice = report.loss_scale
    for candidate in advice.candidates:
        s = candidate.shares
        expected = _numpy_shares(values, "float16", 2.0**candidate.log2_scale)
        assert (s.overflow, s.subnormal, s.flush) == pytest.approx(expected, abs=0)
    # 2**4 * 2**11 = 32768 fits, 2**16 overflows; 2**-30 * 2**6 is float16's smallest
    # subnormal, and 2**-25 would round to zero. Unscaled, what is below 2**-25 flushes.
    assert (advice.low, advice.high) == (6, 11)
    assert _numpy_shares(values, "float16")[2] > 0.05
    low = _numpy_shares(values, "float16", 2.0**advice.low)
    assert low[2] <= mpjax.doctor.recommendations.FLUSH_TOLERANCE
    assert _numpy_shares(values, "float16", 2.0 ** (advice.high + 1))[0] > 0
    assert "2**11 overflows none of the 71 float16 gradient values" in advice.why
    # Under bfloat16 no gradient runs in float16: there is no loss scale to advise.
    assert (
        mpjax.diagnose(lambda v, w: jnp.sum(v @ w), policy="mixed_bfloat16")(
            c[None], np.ones((c.size, 1), np.float32)
        ).loss_scale
        is None
    )


class CausalBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm(name="ln")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h, h, mask=mask)
        return x + nn.Dense(x.shape[-1], name="mlp")(nn.gelu(x))


@pytest.mark.slow
def test_a_healthy_causal_attention_model_shows_no_overflow_and_its_table_agrees_with_the_verdict():
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    model = mpjax.linen.apply_policy(CausalBlock(), "mixed_float16")
    variables = model.init(jax.random.key(0), x)
    report = mpjax.diagnose(model, variables=variables, loss=_mse)(x)
    attention = [r for r in report.modules if r.where == "attn" and not r.backward]
    assert attention and attention[0].stats.masked > 0
    for row in report.modules:
        assert all(row.stats.shares(d).overflow == 0 for d in ("float16", "bfloat16")), row
        assert row.as_run.overflow == 0
    assert attention[0].stats.amax < 100
    assert report.keep == () and report.rules is None
    _assert_table_and_verdict_agree(report)
    text = str(report)
    assert "mask fills, counted apart" in text and "attn" in text
    assert len(text.splitlines()) < 20
    assert "f16 over/sub/ftz" in report.table() and "runs in" in report.table()


def _small_norm(x, w):
    with jax.named_scope("proj"):
        h = x @ w
    with jax.named_scope("norm"):  # a layer norm of small activations: large values inside
        mu = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
        y = (h - mu) * jax.lax.rsqrt(var + 1e-12)
    return jnp.mean(y[:, :4] ** 2)


def test_the_loss_scale_comes_from_the_gradients_that_run_in_float16():
    x = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 32)) * 1e-3
    rules = mpjax.Rules({"norm": "float32"}, default=F16_GRADIENTS)
    report = mpjax.diagnose(_small_norm, policy=rules)(x, w)
    # The float16 gradients: the norm's input gradient, cast to float16, and the matmul's two.
    h = x @ w
    g_h = jax.grad(lambda h: _small_norm(h, jnp.eye(32)))(h)
    amax = max(float(jnp.max(jnp.abs(g))) for g in (g_h, x.T @ g_h, g_h @ w.T))
    overflow = float(range_stats.bounds("float16").overflow)
    expected = max(k for k in range(33) if amax * 2.0**k < overflow)
    assert report.loss_scale.high == expected
    # The norm's backward, in float32, reaches far more: it would have set a lower ceiling.
    norm_amax = report.module("norm", backward=True).stats.amax
    assert norm_amax * 2.0**expected > 100 * overflow
    assert report.rules is None


def _two_matmuls(x, w):
    with jax.named_scope("steady"):
        a = x @ w
    with jax.named_scope("jumpy"):
        b = (x * x) @ w
    return jnp.sum(a) + jnp.sum(b)


@pytest.mark.slow
def test_fp8_fitness_is_judged_from_the_amax_across_batches():
    w = np.ones((4, 2), np.float32)
    x = np.ones((3, 4), np.float32)
    doctor = mpjax.diagnose(_two_matmuls, policy="mixed_bfloat16")
    one = doctor(x, w)
    assert one.fp8 and not any(m.fit for m in one.fp8)
    report = doctor.over([(x, w), (1.5 * x, w)])
    forward = {m.module: m for m in report.fp8 if not m.backward}
    # x's amax moves 1.5x, x*x's 2.25x, w's not at all.
    assert forward["steady"].ratio == pytest.approx(1.5) and forward["steady"].fit
    assert forward["jumpy"].ratio == pytest.approx(2.25) and not forward["jumpy"].fit
    assert forward["steady"].amax == ((1.0, 1.0), (1.5, 1.0))
    assert "2.25x across 2 batches" in forward["jumpy"].why


# --- Targets ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_nnx_and_autocast_targets_are_diagnosed_by_module():
    class Block(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(8, 8, use_bias=False, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return jnp.sum(self.proj(x) ** 2)

    model = Block()
    mpjax.nnx.set_policy(model, F16_GRADIENTS)
    report = mpjax.diagnose(model)(jnp.full((2, 8), 300.0))
    assert {r.where for r in report.modules} >= {"proj"}
    assert report.birth is not None and report.birth.module == "proj"
    assert report.policy.default == mpjax.get_policy(F16_GRADIENTS)
    f = mpjax.autocast(_overflowing, "mixed_float16")
    assert mpjax.diagnose(f)(jnp.full((2, 8), 100.0)).birth.module == "gram"


def test_bad_targets_options_and_inputs_get_clear_errors():
    with pytest.raises(TypeError, match="diagnose\\(\\) takes a function or"):
        mpjax.diagnose(3, policy="mixed_float16")
    with pytest.raises(ValueError, match="needs policy="):
        mpjax.diagnose(jnp.tanh)(jnp.ones(3))
    with pytest.raises(TypeError, match="`variables`.*only apply to a flax.linen module"):
        mpjax.diagnose(jnp.tanh, policy="mixed_float16", variables={})
    with pytest.raises(ValueError, match="max_error"):
        mpjax.diagnose(jnp.tanh, policy="mixed_float16", max_error=-1)
    doctor = mpjax.diagnose(lambda x, w: jnp.sum(x @ w), policy="mixed_float16")
    with pytest.raises(ValueError, match="cannot run on these inputs"):
        doctor(jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="loss=...\\) must return a floating scalar"):
        mpjax.diagnose(jnp.tanh, policy="mixed_float16", loss=lambda y: y)(jnp.ones(3))


# --- The batched loss of a model ---------------------------------------------------------------
# A loss function over a model, vmapped over the batch, as users write it. The inputs are 300:
# the gradients of the loss overflow float16 in the models' matmuls, not bfloat16.


class _EqxBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        # dropout_p=0.0 is a Python float: traced, it would turn the dropout on.
        self.attn = eqx.nn.MultiheadAttention(2, 8, dropout_p=0.0, key=k1)
        self.mlp = eqx.nn.Linear(8, 8, key=k2)

    def __call__(self, x):
        x = x + self.attn(x, x, x)
        return x + jax.vmap(self.mlp)(x)


class _EqxNet(eqx.Module):
    blocks: list

    def __init__(self, key):
        self.blocks = [_EqxBlock(k) for k in jax.random.split(key, 2)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _batched_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _batch(shape=(2, 3, 8)):
    return jnp.full(shape, 300.0), jnp.zeros(shape)


@pytest.mark.slow
def test_a_batched_loss_of_an_equinox_model_is_diagnosed_by_the_models_paths():
    model, (x, y) = _EqxNet(jax.random.key(0)), _batch()
    report = mpjax.diagnose(_batched_loss, policy=F16_GRADIENTS)(model, x, y)
    assert {"blocks[0].attn.query_proj", "blocks[1].mlp"} <= {r.where for r in report.modules}
    assert report.birth.module.startswith("blocks[") and report.birth.dtype == "float16"
    assert report.loss_scale is not None  # the backward pass was diagnosed too
    # Wrapped, the model carries its policy: no policy= needed.
    wrapped = mpjax.equinox.apply_policy(model, "mixed_bfloat16")
    own = mpjax.diagnose(_batched_loss)(wrapped, x, y)
    assert own.policy.default == mpjax.get_policy("mixed_bfloat16") and own.birth is None
    assert "blocks[1].attn.output_proj" in {r.where for r in own.modules}
    # policy= diagnoses the wrapped model under that policy instead.
    other = mpjax.diagnose(_batched_loss, policy=F16_GRADIENTS)(wrapped, x, y)
    assert other.birth.module.startswith("blocks[") and other.birth.dtype == "float16"


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.0, rngs=rngs)  # holds a PRNG key

    def __call__(self, x):
        return self.drop(self.proj(x))


class _NnxNet(nnx.Module):
    def __init__(self):
        self.blocks = nnx.List([_NnxBlock(nnx.Rngs(i)) for i in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.slow
def test_a_batched_loss_of_an_nnx_model_is_diagnosed_by_the_models_paths():
    model, (x, y) = _NnxNet(), _batch((2, 8))
    report = mpjax.diagnose(_batched_loss, policy=F16_GRADIENTS)(model, x, y)
    assert {"blocks/0/proj", "blocks/1/proj"} <= {r.where for r in report.modules}
    assert report.birth.module.startswith("blocks/") and report.birth.dtype == "float16"
    assert type(model.blocks[0]) is _NnxBlock  # the model is left as it was
    mpjax.nnx.set_policy(model, "mixed_bfloat16")
    own = mpjax.diagnose(_batched_loss)(model, x, y)
    assert own.policy.default == mpjax.get_policy("mixed_bfloat16") and own.birth is None
    assert "blocks/1/proj" in {r.where for r in own.modules}
    other = mpjax.diagnose(_batched_loss, policy=F16_GRADIENTS)(model, x, y)
    assert other.birth.module.startswith("blocks/") and other.birth.dtype == "float16"
    # Closed over, an NNX model cannot be run under other rules than its own: said, not ignored.
    closing = mpjax.diagnose(lambda x, y: _batched_loss(model, x, y), policy="mixed_float16")
    with pytest.raises(ValueError, match="not the p=f32,c=f16,o=f32 asked for.*as an argument"):
        closing(x, y)
    assert mpjax.diagnose(lambda x, y: _batched_loss(model, x, y))(x, y).birth is None


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(8, name="mlp")(nn.LayerNorm(name="ln")(x) * 300.0)
        return x + nn.Dropout(0.0, deterministic=False)(h), None


class _ScannedNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            _LinenBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=2,
        )
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(8, name="head")(x)


@pytest.mark.slow
def test_a_linen_model_with_scanned_layers_is_diagnosed_by_the_scanned_names():
    model, (x, y) = _ScannedNet(), _batch()
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    wrapped = mpjax.linen.apply_policy(model, "mixed_bfloat16")
    rngs = {"dropout": jax.random.key(2)}
    direct = mpjax.diagnose(wrapped, variables=variables, rngs=rngs, loss=_mse)(x)
    assert {"blocks/ln", "blocks/mlp", "head"} <= {r.where for r in direct.modules}

    def loss_fn(variables, x, y):  # a function of the variables, closing over the model
        return jnp.mean((wrapped.apply(variables, x, rngs=rngs) - y) ** 2)

    own = mpjax.diagnose(loss_fn)(variables, x, y)
    assert own.policy.default == mpjax.get_policy("mixed_bfloat16") and own.birth is None
    assert {"blocks/ln", "blocks/mlp", "head"} <= {r.where for r in own.modules}
    other = mpjax.diagnose(loss_fn, policy="mixed_float16")(variables, x, y)
    # Under float16 the first inf is the gradient cast to float16 where the scan hands it to
    # its layers (the forward pass keeps its bias adds in float16 and its cube in float32).
    # That cast is written by Flax's scan, outside the scanned module, so it counts for the root.
    birth = other.birth
    assert (birth.backward, birth.dtype, birth.primitive) == (
        True,
        "float16",
        "convert_element_type",
    ), birth
    assert birth.module == "" and "axes_scan.py" in birth.location


@pytest.mark.slow
def test_the_policy_of_a_function_is_that_of_its_models_or_asked_for():
    model = _EqxNet(jax.random.key(0))
    x, y = _batch()
    with pytest.raises(ValueError, match='needs policy=... for _batched_loss.*policy="mixed_bf'):
        mpjax.diagnose(_batched_loss)(model, x, y)
    bf16 = mpjax.equinox.apply_policy(model, "mixed_bfloat16")
    f16 = mpjax.equinox.apply_policy(model, "mixed_float16")

    def two(a, b, x, y):
        return _batched_loss(a, x, y) + _batched_loss(b, x, y)

    with pytest.raises(ValueError, match="different rules in two: _EqxNet under p=f32,c=bf16"):
        mpjax.diagnose(two)(bf16, f16, x, y)
    assert mpjax.diagnose(two, policy="float32")(bf16, f16, x, y).birth is None
    assert "call it with _batched_loss's inputs" in repr(mpjax.diagnose(_batched_loss))


def test_inputs_given_too_early_or_as_variables_get_the_curried_form():
    model, variables, x = _net()
    with pytest.raises(TypeError, match=r"second call.*diagnose\(target, policy=...\)\(\*inputs"):
        mpjax.diagnose(model, x)
    with pytest.raises(TypeError, match=r"diagnose\(model, variables=variables\)\(\*inputs\)"):
        mpjax.diagnose(model, policy="mixed_float16")(variables, x)
    with pytest.raises(ValueError, match="do not fit the variables"):
        mpjax.diagnose(model, policy="mixed_float16", variables=variables)(x[:, :5])
    doctor = mpjax.diagnose(model, policy="mixed_float16", variables=variables)
    assert repr(doctor).startswith("<Doctor of Net under p=f32,c=f16,o=f32: call it with")


# --- A mixture of experts' routing ---------------------------------------------------------


def _routed(scope):
    """A router's choice of 2 of 8 experts, its logits' matmul in the named scope ``scope``:
    the logits share a large common part and differ by a thousandth of it, below bf16's step."""

    def route(x, w):
        with jax.named_scope(scope):
            logits = x @ w
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        _, experts = jax.lax.top_k(probs, 2)
        return jnp.sum(probs * jax.nn.one_hot(experts[:, 0], 8))

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (256, 64)) + 3.0
    w = 0.5 + 1e-3 * jax.random.normal(kw, (64, 8))
    return route, x, w


def test_the_doctor_finds_tokens_routed_otherwise_than_in_float32_and_routes_their_logits_in_f32():
    route, x, w = _routed("scorer")
    report = mpjax.diagnose(route, policy="mixed_bfloat16")(x, w)
    (row,) = report.routing
    assert (row.logits_module, row.logits_dtype, row.recommend) == ("scorer", "bfloat16", True)
    assert row.flipped > 0.2  # the bf16 logits tie where float32's differ
    assert report.keep == ("scorer",)
    (rule,) = [r for r in report.rules.rules if not r.builtin]
    assert rule.key == "scorer" and rule.policy == mpjax.router_policy("mixed_bfloat16")
    assert report.reasons[-1].startswith("route 'scorer' in float32 (mpjax.router_policy)")
    assert "its logits' matmul runs in bfloat16" in report.reasons[-1]
    assert report.to_dict()["routing"][0]["recommend"] is True
    # Under the recommended rules every token goes where float32 sends it.
    again = mpjax.diagnose(route, policy=report.rules)(x, w)
    assert again.routing[0].flipped == 0 and again.rules is None
    assert "sends every token to the experts float32 does" in again.table()


class _Routed(nn.Module):
    router: str  # the name of the module of the router's logits

    @nn.compact
    def __call__(self, x):
        logits = nn.Dense(8, use_bias=False, name=self.router)(x)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        _, experts = jax.lax.top_k(probs, 2)
        return jnp.sum(probs * jax.nn.one_hot(experts[:, 0], 8))


@pytest.mark.parametrize("router, flipped", [("router", False), ("scorer", True)])
def test_a_linen_router_the_builtin_rule_names_routes_as_float32_does(router, flipped):
    _, x, w = _routed("")
    model = mpjax.linen.apply_policy(_Routed(router), "mixed_bfloat16")
    variables = {"params": {router: {"kernel": w}}}
    report = mpjax.diagnose(model, variables=variables)(x)
    (row,) = report.routing
    assert (row.flipped > 0, row.recommend) == (flipped, flipped)
    assert row.logits_dtype == ("bfloat16" if flipped else "float32")
    assert (report.rules is None) is not flipped
