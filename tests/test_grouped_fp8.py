"""fp8 grouped GEMMs (mpjax.grouped.fp8, mpjax.grouped.kernels): a mixture of experts' three
GEMMs on fp8 operands with a scale per expert (tensorwise) or per row (rowwise), forward and
backward, against float64 and against the same arithmetic written by hand, at magnitudes from
1e-3 to the thousands; under the fp8 policies through autocast and linen; mpjax's own Hopper
kernels in Pallas's GPU interpreter and compiled for an H100 without one; bad input."""

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from tolerances import tolerance

import mpjax
from mpjax import fp8, jax_compat
from mpjax.grouped import blackwell
from mpjax.grouped import fp8 as gf
from mpjax.grouped import kernels as gk
from mpjax.grouped import matmul as gm
from mpjax.inspection.matmuls import iter_equations

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
E4M3, E5M2 = fp8.E4M3, fp8.E5M2
SIZES = np.array([40, 0, 120, 64, 16])  # a group of none, rows past the sum (M = 256)
M, K, N = 256, 128, 128
U8 = float(jnp.finfo(E4M3).eps) / 2  # e4m3's unit roundoff, 2**-4
SUBNORMAL = 2.0**-9  # e4m3's smallest subnormal: the absolute spacing below its normals


def _operands(scale=1.0, seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K)) * scale
    # The experts' weights an order of magnitude apart: one scale per expert keeps each one's bits.
    spread = jnp.asarray([1.0, 10.0, 0.1, 3.0, 30.0])[:, None, None]
    w = jax.random.normal(kw, (len(SIZES), K, N)) / np.sqrt(K) * spread
    g = jax.random.normal(kg, (M, N))
    return x, w, jnp.asarray(SIZES, jnp.int32), g


def _ragged(x, w, sizes):
    """The ragged dot in float64, row by row."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for group, size in enumerate(np.asarray(sizes)):
        out[start : start + size] = x[start : start + size] @ w[group]
        start += size
    return out


def _row_scale(per_group, sizes):
    """Each row's group's value, the rows past the groups given the last group's."""
    rows = np.repeat(np.asarray(per_group, np.float64), np.asarray(sizes), axis=0)
    return np.concatenate([rows, np.repeat(rows[-1:], M - len(rows), axis=0)])


# --- Numbers: tensorwise ---------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-3, 1.0, 3000.0])
def test_tensorwise_forward_is_within_fp8_rounding_of_float64(scale):
    # Each operand rounds to e4m3 within u8 of itself, or within half a subnormal step of its
    # scale below e4m3's normals; the products sum in f32 and round once to bf16.
    x, w, sizes, _ = _operands(scale)
    ours = gf.grouped_fp8_dot(x, w, sizes, compute=BF16)
    assert ours.dtype == BF16
    sx = float(fp8.current_scale(x.astype(BF16), E4M3))
    sw = np.array([float(fp8.current_scale(e.astype(BF16), E4M3)) for e in w])
    used = int(SIZES.sum())
    sw_rows = _row_scale(sw, SIZES)[:used, None]
    ax, aw = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    magnitude = _ragged(ax, aw, sizes)[:used]
    # bf16 operands first (the compute dtype), then e4m3: 2 roundings each side.
    u = float(jnp.finfo(BF16).eps) / 2
    relative = 2 * (U8 + u) + 4 * U8 * u + U8**2 + tolerance(F32, K) + u
    absolute = SUBNORMAL / 2 * (sx * _ragged(np.ones_like(ax), aw, sizes)[:used])
    absolute += SUBNORMAL / 2 * sw_rows * ax[:used].sum(1, keepdims=True) * 1.5
    error = np.abs(np.asarray(ours[:used], np.float64) - _ragged(x, w, sizes)[:used])
    bound = relative * magnitude + absolute
    assert (error <= bound).all(), float((error / bound).max())
    assert not np.asarray(ours[used:]).any()  # rows past the groups: zero


@pytest.mark.parametrize("scale", [1e-3, 3000.0])
def test_tensorwise_is_the_hand_written_fp8_arithmetic(scale):
    # The same quantization written out with mpjax.fp8's functions, multiplied in float32:
    # another order of the same f32 sum, then the one rounding to bf16.
    x, w, sizes, g = _operands(scale)
    xb, wb = x.astype(BF16), w.astype(BF16)
    sx = fp8.current_scale(xb, E4M3)
    sw = jnp.stack([fp8.current_scale(e, E4M3) for e in wb])
    xq, wq = fp8.quantize(xb, E4M3, sx), fp8.quantize(wb, E4M3, sw[:, None, None])
    products = lax.ragged_dot(
        xq.astype(F32), wq.astype(F32), sizes, precision=lax.Precision.HIGHEST
    )
    row = jnp.asarray(_row_scale(sw, SIZES), F32)
    used = int(SIZES.sum())
    hand = np.asarray((products * sx * row[:, None])[:used], np.float64)
    ours = np.asarray(gf.grouped_fp8_dot(x, w, sizes, compute=BF16)[:used], np.float64)
    magnitude = np.asarray(
        lax.ragged_dot(jnp.abs(xq.astype(F32)), jnp.abs(wq.astype(F32)), sizes, precision="highest")
        * sx
        * row[:, None],
        np.float64,
    )[:used]
    u = float(jnp.finfo(BF16).eps) / 2
    assert (np.abs(ours - hand) <= (tolerance(F32, K) + 2 * u) * magnitude).all()

    # Backward: e5m2 gradient against the e4m3 weights (input gradient), e4m3 tokens against
    # it (weight gradient), the weights' gradient written in f32.
    def loss(x, w):
        y = gf.grouped_fp8_dot(x, w, sizes, compute=BF16, reduce=F32)
        return jnp.sum(y.astype(F32) * g)

    dx, dw = jax.grad(loss, (0, 1))(x, w)
    sg = fp8.current_scale(g.astype(BF16), E5M2)
    gq = fp8.quantize(g.astype(BF16), E5M2, sg)
    dims_dx = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
    hand_dx = lax.ragged_dot_general(
        gq.astype(F32), wq.astype(F32), sizes, dims_dx, precision="highest"
    ) * (sg * row[:, None])
    dims_dw = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])
    hand_dw = lax.ragged_dot_general(
        xq.astype(F32), gq.astype(F32), sizes, dims_dw, precision="highest"
    ) * (sx * sg)
    np.testing.assert_allclose(
        dx[:used],
        hand_dx[:used].astype(BF16).astype(F32),
        rtol=tolerance(F32, N) + 2 * u,
        atol=float(jnp.max(jnp.abs(hand_dx))) * tolerance(F32, N),
    )
    np.testing.assert_allclose(
        dw,
        hand_dw,
        rtol=tolerance(F32, M),
        atol=float(jnp.max(jnp.abs(hand_dw))) * tolerance(F32, M),
    )


def test_one_scale_per_expert_keeps_a_small_expert_from_an_outlier_experts_range():
    x, w, sizes, _ = _operands()
    w = w.at[4].multiply(1e4)  # one expert's weights 3e5 times another's
    ours = np.asarray(gf.grouped_fp8_dot(x, w, sizes, compute=F32), np.float64)
    exact = _ragged(x, w, sizes)
    small = slice(40, 160)  # the rows of expert 2, the smallest weights
    error = np.linalg.norm(ours[small] - exact[small]) / np.linalg.norm(exact[small])
    assert error < 2 * U8  # one e4m3 rounding of each operand, not the outlier's
    # One scale for all the experts' weights would flush that expert to e4m3's subnormals.
    shared = fp8.current_scale(w, E4M3)
    flushed = fp8.quantize(w[2], E4M3, shared).astype(F32) * shared
    assert float(jnp.linalg.norm(flushed - w[2]) / jnp.linalg.norm(w[2])) > 0.5


def test_non_finite_values_stay_non_finite():
    x, w, sizes, _ = _operands()
    out = gf.grouped_fp8_dot(x.at[3, 5].set(jnp.inf), w, sizes, compute=BF16)
    assert not np.isfinite(np.asarray(out[3], F32)).all()  # for loss scaling to skip
    assert np.isfinite(np.asarray(out[60:], F32)).all()  # the other groups keep their scales

    def loss(w, g_scale):
        y = gf.grouped_fp8_dot(x, w, sizes, compute=BF16, reduce=F32)
        return jnp.sum(y.astype(F32) * g_scale)

    dw = jax.grad(loss)(w, jnp.float32(jnp.inf))
    assert not np.isfinite(np.asarray(dw)).all()


# --- Numbers: rowwise -------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-3, 3000.0])
def test_rowwise_is_within_fp8_rounding_of_float64_forward_and_backward(scale):
    # Power-of-two scales per row: each operand within u8 of itself (or half a subnormal step
    # of its row's scale), e4m3 in all three GEMMs, the scales applied exactly.
    x, w, sizes, g = _operands(scale)
    used = int(SIZES.sum())

    def loss(x, w):
        y = gf.grouped_fp8_dot(x, w, sizes, compute=F32, reduce=F32, recipe="rowwise")
        return jnp.sum(y * g), y

    (_, y), (dx, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)
    exact_y = _ragged(x, w, sizes)[:used]
    gx = np.asarray(g, np.float64)
    exact_dx = np.zeros((M, K))
    exact_dw = np.zeros(w.shape)
    start = 0
    for e, size in enumerate(SIZES):
        rows = slice(start, start + size)
        exact_dx[rows] = gx[rows] @ np.asarray(w[e], np.float64).T
        exact_dw[e] = np.asarray(x[rows], np.float64).T @ gx[rows]
        start += size
    for got, exact in ((y[:used], exact_y), (dx[:used], exact_dx[:used]), (dw, exact_dw)):
        got = np.asarray(got, np.float64)
        # In norm: random rounding errors of relative size u8 per operand, 2 operands.
        assert np.linalg.norm(got - exact) <= 2 * U8 * np.linalg.norm(exact)
    assert not np.asarray(dx[used:]).any()


def test_rowwise_weight_gradient_scales_each_experts_tokens_on_their_own():
    # One expert's tokens a million times another's: scaled per expert and column, the small
    # expert's gradient keeps its bits.
    x, w, sizes, g = _operands()
    x = x.at[:40].multiply(1e6)  # expert 0's tokens

    def loss(w):
        y = gf.grouped_fp8_dot(x, w, sizes, compute=F32, reduce=F32, recipe="rowwise")
        return jnp.sum(y * g)

    dw = np.asarray(jax.grad(loss)(w), np.float64)
    rows = slice(160, 224)  # expert 3's tokens
    exact = np.asarray(x[rows], np.float64).T @ np.asarray(g[rows], np.float64)
    assert np.linalg.norm(dw[3] - exact) <= 2 * U8 * np.linalg.norm(exact)


# --- What runs in which dtype -------------------------------------------------------------


def _forms(fn, *args):
    return {
        e.params["form"]: tuple(np.dtype(v.aval.dtype) for v in (*e.invars[:2], e.outvars[0]))
        for e, _ in iter_equations(fn, *args)
        if e.primitive.name == "grouped_matmul"
    }


TENSORWISE = {
    "forward": (E4M3, E4M3, F32),
    "input_gradient": (E5M2, E4M3, F32),
    "weight_gradient": (E4M3, E5M2, F32),
}
ROWWISE = dict.fromkeys(gm.FORMS, (E4M3, E4M3, F32))


@pytest.mark.parametrize(
    "policy, forms, label",
    [
        ("mixed_bfloat16_fp8", TENSORWISE, "grouped fp8"),
        ("p=f32,c=bf16,o=f32,fp8=delayed", TENSORWISE, "grouped fp8"),
        ("p=f32,c=bf16,o=f32,fp8=rowwise", ROWWISE, "grouped fp8 rowwise"),
    ],
)
def test_fp8_policies_run_a_ragged_dot_in_fp8_forward_and_backward(policy, forms, label):
    x, w, sizes, _ = _operands()

    def loss(x, w):
        return jnp.sum(lax.ragged_dot(x, w, sizes).astype(F32) ** 2)

    fn = mpjax.autocast(loss, policy)
    grads = jax.grad(fn, (0, 1))
    assert _forms(grads, x, w) == forms
    dx, dw = grads(x, w)
    assert dx.dtype == dw.dtype == F32
    (row,) = [r for r in mpjax.describe(fn)(x, w) if r.primitive == "ragged_dot_general"]
    assert (row.category, row.ran) == (label, ("float8_e4m3fn", "float8_e4m3fn", "int32"))


def test_a_linen_mixture_of_experts_under_the_fp8_policy():
    class Experts(nn.Module):
        @nn.compact
        def __call__(self, x, sizes):
            w = self.param("w", nn.initializers.normal(0.05), (len(SIZES), K, N))
            return lax.ragged_dot(x, w, sizes)

    x, _, sizes, _ = _operands()
    model = mpjax.linen.apply_policy(Experts(), "mixed_bfloat16_fp8")
    variables = model.init(jax.random.key(0), x, sizes)
    forms = _forms(jax.grad(lambda v: jnp.sum(model.apply(v, x, sizes).astype(F32))), variables)
    assert forms == TENSORWISE


def test_block_formats_are_refused_by_name():
    x, w, sizes, _ = _operands()
    with pytest.raises(ValueError, match=r"grouped_fp8_dot\(recipe=...\).*'mxfp8'"):
        gf.grouped_fp8_dot(x, w, sizes, compute=BF16, recipe="mxfp8")
    with pytest.raises(ValueError, match="bfloat16, float16 or float32; got int8"):
        gf.grouped_fp8_dot(x, w, sizes, compute=jnp.int8)


# --- mpjax's Hopper kernels ------------------------------------------------------------------


def test_groups_padded_to_the_block_start_on_a_block_of_their_own():
    x = jnp.arange(256 * 2, dtype=F32).reshape(256, 2)
    padded, starts, blocks = gk.pad_groups(x, jnp.asarray(SIZES))
    assert padded.shape == (gk.padded_rows(256, 5), 2)
    assert starts.tolist() == [0, 128, 128, 256, 384] and blocks.tolist() == [1, 0, 1, 1, 1]
    start = 0
    for first, size in zip(starts.tolist(), SIZES.tolist()):
        np.testing.assert_array_equal(padded[first : first + size], x[start : start + size])
        assert not np.asarray(padded[first + size : first + -(-size // 128) * 128]).any()
        start += size
    # And back, the rows past the groups zero; the tiles of 128 rows each hold one group's
    # rows or none (-1), as mpjax's Blackwell kernels read them.
    back = gk.unpad_groups(padded, jnp.asarray(SIZES), starts, 256)
    np.testing.assert_array_equal(back[: SIZES.sum()], x[: SIZES.sum()])
    assert not np.asarray(back[SIZES.sum() :]).any()
    assert back.dtype == x.dtype and back.shape == x.shape
    groups = blackwell.tile_groups(starts, blocks, padded.shape[0])
    assert groups.dtype == jnp.int32
    assert groups.tolist() == [0, 2, 3, 4] + [-1] * (padded.shape[0] // 128 - 4)


@pytest.mark.parametrize(
    "form, lhs, rhs, dtypes, reason",
    [
        ("forward", (256, 128), (4, 128, 256), (E4M3, E4M3), None),
        ("weight_gradient", (100, 128), (100, 256), (E4M3, E4M3), None),  # any token count
        ("forward", (256, 96), (4, 96, 256), (E4M3, E4M3), "K=96 is not a multiple of 128"),
        ("input_gradient", (256, 192), (4, 128, 192), (E4M3, E4M3), "N=192 is not a multiple"),
        ("forward", (64, 128), (4, 128, 128), (E4M3, E4M3), "64 tokens are fewer than"),
        ("forward", (256, 128), (4, 128, 256), (E4M3, BF16), "two fp8 operands"),
    ],
)
def test_fp8_kernel_refusals_name_the_reason(form, lhs, rhs, dtypes, reason):
    said = gm.kernel_refusal(9, form, lhs, rhs, *dtypes)
    assert said is None if reason is None else reason in said
    assert "are for Hopper (compute capability 9), not 8" in gm.kernel_refusal(
        8, "forward", (256, 128), (4, 128, 256), E4M3
    )


@pytest.mark.parametrize(
    "form, lhs, rhs, reason",
    [
        ("forward", (512, 128), (4, 128, 256), None),
        ("forward", (500, 128), (4, 128, 256), None),  # the tokens padded per expert
        ("input_gradient", (512, 256), (4, 128, 256), None),
        ("weight_gradient", (512, 128), (512, 256), None),
        ("weight_gradient", (512, 100), (512, 256), "K=100 is not a multiple of 128"),
        ("forward", (512, 128), (4, 128, 200), "N=200 is not a multiple of 128"),
        ("input_gradient", (512, 200), (4, 128, 200), "N=200 is not a multiple of 128"),
        ("forward", (0, 128), (4, 128, 256), "no tokens"),
    ],
)
def test_fp8_on_blackwell_takes_mpjaxs_kernels_where_they_take_the_shapes(form, lhs, rhs, reason):
    said = gm.kernel_refusal(10, form, lhs, rhs, E5M2, E4M3)
    assert said is None if reason is None else reason in said


def test_mixed_fp8_kernels_are_refused_where_this_jax_cannot_multiply_them():
    said = gm.kernel_refusal(9, "input_gradient", (256, 128), (4, 128, 128), E5M2, E4M3)
    if jax_compat.mosaic_mixed_fp8_wgmma():
        assert said is None
    else:
        assert said == "this JAX's Mosaic GPU multiplies no float8_e5m2 by float8_e4m3fn"


@pytest.mark.slow
@pytest.mark.skipif(
    not jax_compat.mosaic_gpu_interpretable(), reason="this JAX has no Mosaic GPU interpreter"
)
@pytest.mark.parametrize("gpu", ["hopper", "blackwell"])
@pytest.mark.parametrize("form", gm.FORMS)
def test_the_fp8_kernels_compute_what_xla_does(form, gpu):
    # mpjax's kernels in Pallas's GPU interpreter (with its race detector), as an H100 or a
    # B200 lowering calls them, against XLA's ragged dot on the same fp8 values: a group of
    # none, rows past the groups.
    x, w, sizes, g = _operands(seed=1)
    xq, wq = (
        fp8.quantize(x, E4M3, fp8.current_scale(x, E4M3)),
        fp8.quantize(w, E4M3, jnp.float32(0.01)),
    )
    gq = fp8.quantize(g, E5M2, fp8.current_scale(g, E5M2))
    lhs, rhs = {"forward": (xq, wq), "input_gradient": (gq, wq), "weight_gradient": (xq, gq)}[form]
    chosen = gm._hopper_fp8 if gpu == "hopper" else gm._blackwell_fp8
    with jax_compat.mosaic_gpu_interpreted(detect_races=True):
        kernel = chosen(lhs, rhs, sizes, form=form, out_dtype=F32)
    assert kernel.dtype == F32  # the float32 accumulation, for the recipe's scales
    xla = gm._xla_cpu(lhs, rhs, sizes, form=form, out_dtype=F32)
    reduction = {"forward": K, "input_gradient": N, "weight_gradient": M}[form]
    scale = float(jnp.max(jnp.abs(xla)))
    np.testing.assert_allclose(kernel, xla, rtol=0, atol=tolerance(F32, reduction) * scale)


_COMPILE = """
import re, sys, jax, jax.numpy as jnp, mpjax
from mpjax.grouped import fp8 as grouped_fp8
M, K, N, G = 2048, 1024, 2048, 8
args = (jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((G, K, N), jnp.float32),
        jax.ShapeDtypeStruct((G,), jnp.int32), jax.ShapeDtypeStruct((M, N), jnp.float32))
def loss(x, w, sizes, g):
    y = grouped_fp8.grouped_fp8_dot(x, w, sizes, compute=jnp.bfloat16, reduce=jnp.float32,
                                    recipe=sys.argv[2])
    return jnp.sum(y.astype(jnp.float32) * g)
plan = mpjax.plan(jax.value_and_grad(loss, (0, 1)), sys.argv[1])(*args)
print(len(re.findall(r'custom_call_target="mosaic_gpu_v2"', plan.hlo_text)))
print(plan.summary())
"""


def _compile(target, recipe):
    if mpjax.plan_unavailable() is not None:
        pytest.skip(f"the plan cannot compile: {mpjax.plan_unavailable()}")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_COMPILE), target, recipe],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    calls, summary = result.stdout.split("\n", 1)
    return int(calls), summary


@pytest.mark.slow
def test_a_b200_runs_all_three_fp8_gemms_in_mpjaxs_kernels():
    # mpjax's Blackwell kernels, e4m3 by e4m3 forward, e5m2 by e4m3 for the input gradient,
    # e4m3 by e5m2 for the weights', on the tokens padded per expert: each counted at the most
    # its operand holds (3072 rows for 2048 tokens in 8 experts, 1.5x its 8.59G of work).
    calls, summary = _compile("b200", "current")
    assert calls == 3
    assert "grouped GEMMs: 3 kernel runs (38.7G FLOPs at most for 25.8G of work" in summary
    assert (
        "float8_e4m3fn 33.3%, float8_e5m2 x float8_e4m3fn 33.3%, float8_e4m3fn x float8_e5m2 33.3%)"
    ) in summary
    assert "expanded dense" not in summary


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, shares",
    [
        (
            "current",
            "float8_e4m3fn x float8_e5m2 42.9%, float8_e4m3fn 28.6%, float8_e5m2 x "
            "float8_e4m3fn 28.6%",
        ),
        ("rowwise", "float8_e4m3fn 100.0%"),
    ],
)
def test_an_h100_runs_all_three_fp8_gemms_in_mpjaxs_kernels(recipe, shares):
    if not jax_compat.mosaic_mixed_fp8_wgmma() and recipe == "current":
        pytest.skip("this JAX's Mosaic GPU multiplies no e5m2 by e4m3")
    calls, summary = _compile("h100", recipe)
    assert calls == 3
    # The weight gradient contracts each expert's tokens padded to whole blocks: counted at
    # the most its operand holds, 3072 rows for 2048 tokens in 8 experts (1.5x its work).
    assert f"matmul FLOPs: 30.1G ({shares})" in summary
    assert "grouped GEMMs: 3 kernel runs (30.1G FLOPs at most for 25.8G of work" in summary
    assert "expanded dense" not in summary
