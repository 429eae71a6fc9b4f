"""Grouped GEMMs (mpjax.grouped.matmul, mpjax.ragged_dot): a mixture of experts' ragged dot and
both of its gradients stay grouped, in the compute dtype with the weights' gradient in the
reduce dtype, under autocast, linen, NNX and Equinox; their numbers against float32 and against
the same arithmetic written by hand, at magnitudes up to the thousands; the kernels JAX's GPUs
get, chosen per target when lowered (compiled for an H100 and a B200 without one, and run in
Pallas's GPU interpreter); bad input."""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from tolerances import tolerance

import mpjax
from mpjax import jax_compat
from mpjax.grouped import matmul as gm
from mpjax.inspection.matmuls import iter_equations

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
SIZES = np.array([40, 0, 120, 64, 16])  # a group of none, rows past the sum (M = 256)
M, K, N = 256, 128, 128


def _operands(scale=1.0, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (M, K)) * scale
    w = jax.random.normal(kw, (len(SIZES), K, N)) / np.sqrt(K)
    return x, w, jnp.asarray(SIZES, jnp.int32)


def _reference(x, w, sizes):
    """The ragged dot in float64, row by row: each row times its group's matrix."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        out[start : start + size] = x[start : start + size] @ w[g]
        start += size
    return out


def _grouped_equations(fn, *args):
    return [e for e, _ in iter_equations(fn, *args) if e.primitive.name == "grouped_matmul"]


def _forms(equations):
    """``{form: (lhs dtype, rhs dtype, out dtype)}`` of the grouped GEMMs of a jaxpr."""
    return {
        e.params["form"]: tuple(np.dtype(v.aval.dtype) for v in (*e.invars[:2], e.outvars[0]))
        for e in equations
    }


BF16_GEMMS = {
    "forward": (BF16, BF16, BF16),
    "input_gradient": (BF16, BF16, BF16),
    "weight_gradient": (BF16, BF16, F32),  # the reduce dtype of f32-stored weights
}


# --- The grouped GEMM and its numbers ------------------------------------------------------


def test_in_float32_it_is_lax_ragged_dot_forward_and_backward():
    x, w, sizes = _operands()
    ours = gm.grouped_dot(x, w, sizes, compute=jnp.float32)
    np.testing.assert_allclose(ours, _reference(x, w, sizes), rtol=0, atol=1e-4)
    assert not np.asarray(ours[int(SIZES.sum()) :]).any()  # rows past the groups: zero

    def loss(ragged):
        return lambda x, w: jnp.sum(jnp.sin(ragged(x, w)))

    expected = jax.grad(loss(lambda x, w: lax.ragged_dot(x, w, sizes)), (0, 1))(x, w)
    got = jax.grad(loss(lambda x, w: gm.grouped_dot(x, w, sizes, compute=F32)), (0, 1))(x, w)
    for a, b, n in zip(got, expected, (N, M)):  # dx contracts N, dw the tokens
        np.testing.assert_allclose(a, b, rtol=tolerance(F32, n), atol=tolerance(F32, n))


@pytest.mark.parametrize("scale", [1.0, 300.0, 3000.0])
def test_bf16_is_within_one_rounding_of_float32_and_the_hand_written_bf16(scale):
    # Operands rounded to bf16 (each product off by at most 2u), summed in f32 over K, the
    # result rounded once to bf16: relative to the sum of the products' magnitudes.
    x, w, sizes = _operands(scale)
    ours = gm.grouped_dot(x, w, sizes, compute=BF16)
    assert ours.dtype == BF16
    magnitude = _reference(jnp.abs(x), jnp.abs(w), sizes)
    u = float(jnp.finfo(BF16).eps) / 2
    bound = (2 * u + tolerance(F32, K) + u) * magnitude
    error = np.abs(np.asarray(ours, np.float64) - _reference(x, w, sizes))
    assert (error <= bound).all(), float((error / np.maximum(bound, 1e-30)).max())
    hand = lax.ragged_dot(
        x.astype(BF16), w.astype(BF16), sizes, preferred_element_type=jnp.float32
    ).astype(BF16)
    same_rounding = (tolerance(F32, K) + 2 * u) * magnitude  # another order, then one rounding
    assert (
        np.abs(np.asarray(ours, np.float64) - np.asarray(hand, np.float64)) <= same_rounding
    ).all()


def test_the_weight_gradient_is_written_in_the_reduce_dtype():
    x, w, sizes = _operands(30.0)

    def loss(w, reduce):
        y = gm.grouped_dot(x, w, sizes, compute=BF16, reduce=reduce)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    wide = jax.grad(loss)(w, F32)
    narrow = jax.grad(loss)(w, BF16)
    assert wide.dtype == narrow.dtype == F32  # cast back to the weights' dtype either way
    # The reduce dtype keeps what bf16 rounds away: the narrow one holds bf16 values only.
    assert (np.asarray(narrow) == np.asarray(narrow.astype(BF16).astype(F32))).all()
    assert not (np.asarray(wide) == np.asarray(wide.astype(BF16).astype(F32))).all()
    assert _forms(_grouped_equations(jax.grad(loss), w, F32)) == BF16_GEMMS


def test_it_vmaps_and_jits_without_tracing_again():
    x, w, sizes = _operands()
    traces = []

    @jax.jit
    def step(xs):
        traces.append(1)
        return jax.vmap(lambda x: gm.grouped_dot(x, w, sizes, compute=BF16))(xs)

    xs = jnp.stack([x, 2 * x])
    out = step(xs)
    step(xs + 1)
    assert len(traces) == 1 and out.shape == (2, M, N)
    np.testing.assert_array_equal(out[1], gm.grouped_dot(2 * x, w, sizes, compute=BF16))


def test_weights_stored_transposed_are_recognized():
    x, w, sizes = _operands()
    wt = jnp.swapaxes(w, 1, 2)  # [G, N, K]: PyTorch's Linear layout
    np.testing.assert_allclose(
        gm.grouped_dot(x, wt, sizes, compute=F32, transposed=True),
        gm.grouped_dot(x, w, sizes, compute=F32),
        rtol=0,
        atol=1e-5,
    )
    forward = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), [0], [0])
    stored_transposed = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
    batched = lax.RaggedDotDimensionNumbers((((2,), (1,)), ((0,), (0,))), [1], [])
    assert gm.grouped_form(forward, 2, 3) is False
    assert gm.grouped_form(stored_transposed, 2, 3) is True
    assert gm.grouped_form(batched, 3, 3) is None


# --- Under a policy: autocast, linen, NNX, Equinox -------------------------------------------


def _experts(x, w, sizes):
    """An unmodified model's expert layer: JAX's own ragged dot, written in float32."""
    return jnp.tanh(lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32))


def test_autocast_runs_a_ragged_dot_grouped_forward_and_backward():
    x, w, sizes = _operands(100.0)
    fast = mpjax.autocast(_experts, "mixed_bfloat16")
    grad = jax.grad(lambda x, w: jnp.sum(fast(x, w, sizes)), (0, 1))
    equations = list(iter_equations(grad, x, w))
    assert not [e for e, _ in equations if e.primitive.name == "ragged_dot_general"]
    assert _forms(_grouped_equations(grad, x, w)) == BF16_GEMMS
    gx, gw = grad(x, w)
    assert gx.dtype == gw.dtype == F32
    report = mpjax.describe(fast)(x, w, sizes)
    (row,) = [r for r in report if r.primitive == "ragged_dot_general"]
    assert row.category == "grouped" and row.ran == ("bf16", "bf16", "int32")
    # The same against float32, within the rounding of bf16 operands and a bf16 result.
    exact = _reference(x, w, sizes)
    u = float(jnp.finfo(BF16).eps) / 2
    got = np.arctanh(np.clip(np.asarray(fast(x, w, sizes), np.float64), -1 + 1e-7, 1 - 1e-7))
    saturated = np.abs(exact) > 3  # tanh is flat there: nothing to compare
    bound = (3 * u + tolerance(F32, K)) * _reference(jnp.abs(x), jnp.abs(w), sizes)
    bound += 1e-6 / (1 - np.tanh(np.minimum(np.abs(exact), 3)) ** 2)  # the f32 tanh's rounding
    assert (np.abs(got - exact)[~saturated] <= bound[~saturated]).all()


class _LinenExperts(nn.Module):
    @nn.compact
    def __call__(self, x, sizes):
        w = self.param("experts", nn.initializers.lecun_normal(), (len(SIZES), K, N))
        return _experts(x, w, sizes)


class _NnxExperts(nnx.Module):
    def __init__(self, rngs):
        self.experts = nnx.Param(jax.random.normal(rngs.params(), (len(SIZES), K, N)) / 8)

    def __call__(self, x, sizes):
        return _experts(x, self.experts[...], sizes)


class _EqxExperts(eqx.Module):
    experts: jax.Array

    def __call__(self, x, sizes):
        return _experts(x, self.experts, sizes)


def test_linen_nnx_and_equinox_models_run_their_ragged_dots_grouped():
    x, w, sizes = _operands()
    linen = mpjax.linen.apply_policy(_LinenExperts(), "mixed_bfloat16")
    variables = linen.init(jax.random.key(0), x, sizes)
    linen_grad = jax.grad(lambda v: jnp.sum(linen.apply(v, x, sizes)))
    assert _forms(_grouped_equations(linen_grad, variables)) == BF16_GEMMS
    assert jax.tree.leaves(linen_grad(variables))[0].dtype == F32

    model = _NnxExperts(nnx.Rngs(0))
    mpjax.nnx.set_policy(model, "mixed_bfloat16")
    nnx_grad = nnx.grad(lambda m: jnp.sum(m(x, sizes)))
    assert _forms(_grouped_equations(nnx_grad, model)) == BF16_GEMMS

    wrapped = mpjax.equinox.apply_policy(_EqxExperts(w), "mixed_bfloat16")
    eqx_grad = eqx.filter_grad(lambda m: jnp.sum(m(x, sizes)))
    assert _forms(_grouped_equations(eqx_grad, wrapped)) == BF16_GEMMS
    report = mpjax.describe(wrapped)(x, sizes)
    assert report.rows[0].matmuls == (("bf16,bf16@grouped", 3),)


def test_float16_and_a_full_precision_region():
    x, w, sizes = _operands()
    f16 = mpjax.autocast(_experts, "mixed_float16")
    grad = jax.grad(lambda x, w: jnp.sum(f16(x, w, sizes)), (0, 1))
    assert {form: dtypes[0] for form, dtypes in _forms(_grouped_equations(grad, x, w)).items()} == {
        form: F16 for form in gm.FORMS
    }

    def kept(x, w, sizes):
        with mpjax.full_precision():
            return _experts(x, w, sizes)

    exact = mpjax.autocast(kept, "mixed_bfloat16")
    (matmul,) = mpjax.inspect_matmuls(exact)(x, w, sizes)
    assert matmul.primitive == "ragged_dot_general" and matmul.lhs_dtype == F32


@pytest.mark.parametrize(
    "policy, precision",
    [("float32", "highest"), ("p=f32,c=f32,o=f32,f32_matmul=bf16_3x", "bf16_3x")],
)
def test_float32_grouped_gemms_run_at_the_policys_float32_precision(policy, precision):
    # At JAX's default a TPU multiplies f32 operands in one bf16 pass and a recent GPU in
    # TF32: the policy's f32_matmul_precision reaches all three grouped GEMMs, as any matmul.
    x, w, sizes = _operands()
    f32 = mpjax.autocast(_experts, policy)
    grad = jax.grad(lambda x, w: jnp.sum(f32(x, w, sizes)), (0, 1))
    report = mpjax.inspect_matmuls(grad)(x, w)
    assert [(m.grouped, m.f32_precision) for m in report] == [
        (form, precision) for form in ("forward", "input_gradient", "weight_gradient")
    ]
    direct = mpjax.inspect_matmuls(
        lambda x, w: mpjax.ragged_dot(x, w, sizes, precision=lax.Precision.HIGHEST)
    )(x, w)
    assert [m.f32_precision for m in direct] == ["highest"]


# --- mpjax.ragged_dot ------------------------------------------------------------------------


def test_ragged_dot_outside_a_policy_runs_grouped_in_the_operands_dtype():
    x, w, sizes = (a.astype(BF16) if a.dtype == F32 else a for a in _operands())
    out = mpjax.ragged_dot(x, w, sizes)
    assert out.dtype == BF16
    assert mpjax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).dtype == F32
    grad = jax.grad(lambda x, w: jnp.sum(mpjax.ragged_dot(x, w, sizes).astype(F32)), (0, 1))
    assert _forms(_grouped_equations(grad, x, w)) == {form: (BF16,) * 3 for form in gm.FORMS}


def test_ragged_dot_inside_a_policy_takes_the_regions_dtype():
    x, w, sizes = _operands()

    def model(x, w):
        return jnp.sum(mpjax.ragged_dot(x, w, sizes))

    grad = jax.grad(mpjax.autocast(model, "mixed_bfloat16"), (0, 1))
    assert _forms(_grouped_equations(grad, x, w)) == BF16_GEMMS


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([3, -1])), ValueError, "negative"),
        ((jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([5, 4])), ValueError, "sum to 9"),
        ((jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([3, 2, 1])), ValueError, "one size"),
        ((jnp.ones((8, 4)), jnp.ones((2, 5, 3)), jnp.array([3, 2])), ValueError, "lhs's K"),
        ((jnp.ones((8, 4)), jnp.ones((4, 3)), jnp.array([3, 2])), ValueError, "rhs must be"),
        ((jnp.ones((2, 8, 4)), jnp.ones((2, 4, 3)), jnp.array([3, 2])), ValueError, "lhs must"),
        ((jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([3.0, 2.0])), TypeError, "integers"),
    ],
)
def test_bad_input_is_an_error_naming_the_argument(args, error, message):
    with pytest.raises(error, match=rf"^mpjax.ragged_dot\(\): .*{message}"):
        mpjax.ragged_dot(*args)


def test_traced_group_sizes_are_checked_for_shape_only():
    x, w = jnp.ones((8, 4)), jnp.ones((2, 4, 3))
    out = jax.jit(mpjax.ragged_dot)(x, w, jnp.array([3, 2]))
    assert out.shape == (8, 3) and not np.asarray(out[5:]).any()


# --- The kernels: which GPUs get one, and for what ------------------------------------------


@pytest.mark.parametrize(
    "major, form, lhs, rhs, dtype, reason",
    [
        (9, "forward", (4096, 1024), (8, 1024, 2048), BF16, None),
        (
            9,
            "forward",
            (4096, 1024),
            (8, 1024, 2048),
            F32,
            "bfloat16, float16 or float8 operands, not float32",
        ),
        (9, "forward", (4096, 1000), (8, 1000, 2048), BF16, "K=1000 is not a multiple of 64"),
        (9, "forward", (64, 1024), (8, 1024, 2048), F16, "fewer than the kernel's block"),
        (9, "input_gradient", (4096, 2048), (8, 1000, 2048), BF16, "K=1000 is not a multiple"),
        (9, "weight_gradient", (4096, 1024), (4096, 2048), BF16, None),
        (9, "weight_gradient", (4095, 1024), (4095, 2048), BF16, "the tokens (4095)"),
        (10, "forward", (4096, 1024), (8, 1024, 2048), BF16, None),
        (10, "forward", (4000, 1024), (8, 1024, 2048), BF16, "the tokens (4000)"),
        (10, "input_gradient", (4096, 2048), (8, 1024, 2048), BF16, None),
        (10, "weight_gradient", (4096, 1024), (4096, 2048), BF16, None),  # mpjax's kernel
        (10, "weight_gradient", (4095, 1024), (4095, 2048), BF16, None),  # the tokens padded
        (10, "weight_gradient", (4096, 1000), (4096, 2048), BF16, "K=1000 is not a multiple"),
        (10, "weight_gradient", (0, 1024), (0, 2048), BF16, "no tokens"),
        (8, "forward", (4096, 1024), (8, 1024, 2048), BF16, "compute capability 8"),
    ],
)
def test_kernel_refusals_name_the_reason(major, form, lhs, rhs, dtype, reason):
    refusal = gm.kernel_refusal(major, form, lhs, rhs, dtype)
    assert refusal is None if reason is None else reason in refusal


@pytest.mark.slow
@pytest.mark.skipif(
    not jax_compat.mosaic_gpu_interpretable(), reason="this JAX has no Mosaic GPU interpreter"
)
@pytest.mark.parametrize("form", gm.FORMS)
def test_the_hopper_kernels_compute_what_xla_does(form):
    # JAX's kernels in Pallas's GPU interpreter, as mpjax calls them for an H100: the
    # transposed weights of the input gradient, the argument order of the weight gradient,
    # the rows past the groups zeroed.
    x, w, sizes = (a.astype(BF16) if a.dtype == F32 else a for a in _operands(seed=1))
    g = jax.random.normal(jax.random.key(2), (M, N)).astype(BF16)
    lhs, rhs = {"forward": (x, w), "input_gradient": (g, w), "weight_gradient": (x, g)}[form]
    with jax_compat.mosaic_gpu_interpreted():
        kernel = gm._hopper(lhs, rhs, sizes, form=form, out_dtype=F32)
    xla = gm._xla_cpu(lhs, rhs, sizes, form=form, out_dtype=F32)
    reduction = {"forward": K, "input_gradient": N, "weight_gradient": M}[form]
    scale = float(jnp.max(jnp.abs(xla)))
    rtol = tolerance(F32, reduction) + tolerance(BF16, 0)  # the kernel writes bf16
    np.testing.assert_allclose(kernel, xla, rtol=rtol, atol=rtol * scale)


# Group sizes for mpjax's Blackwell weight-gradient kernel in 3 SMs, its tiles 2 x 3 per
# group: groups without tokens (first, between and last), of one token, of a whole block and
# one more (3 steps), more than the 4 stages of its ring (11 steps), rows past the groups.
BLACKWELL_SIZES = [0, 700, 1, 129, 0, 255, 0]


@pytest.mark.slow
@pytest.mark.skipif(
    not jax_compat.mosaic_gpu_interpretable(), reason="this JAX has no Mosaic GPU interpreter"
)
@pytest.mark.parametrize("scale", [1.0, 1000.0])
def test_the_blackwell_weight_gradient_kernel_computes_each_experts_gradient(scale):
    # mpjax's kernel in Pallas's GPU interpreter, with its race detector, as mpjax calls it
    # for a B200 (tests/test_grouped_fp8.py runs it on fp8): each SM's tiles of groups of every
    # size in a row, so a stage of the ring is refilled across tiles and groups. Against
    # float64, at magnitudes up to the thousands.
    rows, k, n = 1100, 256, 384
    sizes = jnp.asarray(BLACKWELL_SIZES, jnp.int32)
    kx, kg = jax.random.split(jax.random.key(3))
    x = (jax.random.normal(kx, (rows, k)) * scale).astype(BF16)
    g = jax.random.normal(kg, (rows, n)).astype(BF16)
    with jax_compat.mosaic_gpu_interpreted(cores=3, detect_races=True):
        kernel = gm._blackwell(x, g, sizes, form="weight_gradient", out_dtype=F32)
    x64, g64 = np.asarray(x, np.float64), np.asarray(g, np.float64)
    ends = np.cumsum(BLACKWELL_SIZES)
    exact = np.stack(
        [
            x64[end - size : end].T @ g64[end - size : end]
            for size, end in zip(BLACKWELL_SIZES, ends)
        ]
    )
    assert kernel.dtype == F32 and kernel.shape == (len(BLACKWELL_SIZES), k, n)
    assert not np.asarray(kernel[np.asarray(BLACKWELL_SIZES) == 0]).any()  # no tokens: zeros
    # float32 accumulation of bf16 products (exact in float32) over each group's tokens
    magnitude = np.stack(
        [
            np.abs(x64[end - size : end]).T @ np.abs(g64[end - size : end])
            for size, end in zip(BLACKWELL_SIZES, ends)
        ]
    )
    assert (np.abs(np.asarray(kernel, np.float64) - exact) <= tolerance(F32, 700) * magnitude).all()


def test_the_blackwell_weight_gradient_kernel_refuses_what_it_cannot_tile():
    from mpjax.grouped import blackwell

    starts, blocks = jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32)
    x, g = jnp.zeros((256, 128), BF16), jnp.zeros((256, 256), BF16)
    with pytest.raises(ValueError, match="one dtype"):
        blackwell.transposed_ragged_dot(x, g.astype(F16), starts, blocks)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        blackwell.transposed_ragged_dot(x.astype(E4M3), g, starts, blocks)
    w, groups = jnp.zeros((2, 128, 256), E4M3), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="must be float8_e4m3fn or float8_e5m2"):
        blackwell.ragged_dot(x, w.astype(BF16), groups, transpose_rhs=False)
    with pytest.raises(ValueError, match="must share K"):
        blackwell.ragged_dot(x.astype(E4M3), w, groups, transpose_rhs=True)
    with pytest.raises(ValueError, match="multiples of 128"):
        blackwell.transposed_ragged_dot(x[:, :100], g, starts, blocks)
    with pytest.raises(ValueError, match="share their rows"):
        blackwell.transposed_ragged_dot(x[:200], g[:200], starts, blocks)


# --- Compiled for GPUs without one (one process per architecture: Mosaic GPU compiles for
# one per process) ------------------------------------------------------------------------------

_COMPILE = """
import re, sys, warnings, jax, jax.numpy as jnp, mpjax
from mpjax.grouped import matmul as gm
M, K, N, G = 2048, 1024, 2048, 8
args = (jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((G, K, N), jnp.float32),
        jax.ShapeDtypeStruct((G,), jnp.int32))
def loss(x, w, sizes):
    y = gm.grouped_dot(x, w, sizes, compute=jnp.bfloat16, reduce=jnp.float32)
    return jnp.sum(y.astype(jnp.float32))
for target in sys.argv[1:]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        plan = mpjax.plan(jax.value_and_grad(loss, (0, 1)), target)(*args)
    calls = re.findall(r'custom_call_target="mosaic_gpu_v2"', plan.hlo_text)
    dense = [g.flops for g in plan.gemms if g.library not in ("mosaic", "mxu")]
    print(target, len(calls), dense, [str(w.message)[:60] for w in said if "Mosaic" in str(w.message)])
    print("summary", plan.summary().replace(chr(10), " | "))
"""


def _compile(*targets):
    if mpjax.plan_unavailable() is not None:
        pytest.skip(f"the plan cannot compile: {mpjax.plan_unavailable()}")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_COMPILE), *targets],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = [line.split(" ", 1)[1] for line in lines if line.split(" ")[0] in targets]
    summaries = [line.split(" ", 1)[1] for line in lines if line.startswith("summary ")]
    return list(zip(rows, summaries))


@pytest.mark.slow
def test_an_h100_runs_all_three_gemms_in_hopper_kernels():
    ((row, summary),) = _compile("h100")
    assert row == "3 [] []"  # three Mosaic kernels, no dense GEMM
    assert "grouped GEMMs: 3 kernel runs (25.8G FLOPs" in summary
    assert "matmul FLOPs: 25.8G (bfloat16 100.0%)" in summary  # the model's: 3 x 2 x M x K x N


@pytest.mark.slow
def test_a_tpu_runs_xlas_own_ragged_dot_kernels():
    if mpjax.plan_unavailable("v5p") is not None:
        pytest.skip(f"the plan cannot compile: {mpjax.plan_unavailable('v5p')}")
    ((row, summary),) = _compile("v5p")
    assert row.startswith("0 [] ")  # no Mosaic GPU kernel, no dense GEMM
    assert "grouped GEMMs: 3 kernel runs (25.8G FLOPs" in summary


@pytest.mark.slow
def test_a_b200_runs_all_three_gemms_in_kernels_and_a_second_architecture_falls_back():
    (b200, b200_summary), (h100, _) = _compile("b200", "h100")
    # JAX's Blackwell kernels forward and for the input gradient, mpjax's for the weights':
    # no dense GEMM. The weight gradient counts the most rows its padded operand holds, 2048
    # tokens and 127 per expert rounded up to blocks: 3072, 1.5x its 8.59G of work.
    assert b200 == "3 [] []"
    assert (
        "grouped GEMMs: 3 kernel runs (30.1G FLOPs at most for 25.8G of work, each expert's "
        "tokens padded to whole blocks where a kernel contracts over them; each token against "
        "its own expert only; bfloat16 100.0%)"
    ) in b200_summary
    # Mosaic compiled for the B200 first: the H100's GEMMs take XLA's path, said once each.
    calls, dense, said = h100.split(" ", 2)
    assert calls == "0" and said.count("Mosaic GPU compiled") == 3


M_BIG, K_BIG, N_BIG = 2048, 1024, 2048


# --- What a plan reads of them --------------------------------------------------------------

_HLO = """HloModule m, entry_computation_layout={}

ENTRY %main (sizes: s32[8], x: bf16[2048,1024], w: bf16[8,1024,2048], g: bf16[2048,2048], m: bf16[2048,8192]) -> bf16[2048,2048] {
  %sizes = s32[8]{0} parameter(0)
  %x = bf16[2048,1024]{1,0} parameter(1)
  %w = bf16[8,1024,2048]{2,1,0} parameter(2)
  %g = bf16[2048,2048]{1,0} parameter(3)
  %m = bf16[2048,8192]{1,0} parameter(4)
  %k1 = bf16[2048,2048]{1,0} custom-call(%sizes, %x, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/jvp(grouped_matmul(forward, 2048x1024x2048))/body/mpmd_map"}
  %d1 = f32[8,1024,2048]{2,1,0} dot(%x, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/transpose(jvp(grouped_matmul(weight_gradient, 2048x1024x2048)))/ragged_dot_general"}
  %d2 = bf16[2048,2048]{1,0} dot(%m, %m), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/ragged_dot_general"}
  %other = bf16[2048,2048]{1,0} dot(%g, %g), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
  ROOT %k2 = bf16[2048,1024]{1,0} custom-call(%sizes, %g, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/transpose(jvp(grouped_matmul(input_gradient, 2048x1024x2048)))/body/mpmd_map"}
}
"""


_PADDED_HLO = """HloModule m, entry_computation_layout={}

ENTRY %main (starts: s32[8], blocks: s32[8], x: bf16[3072,1024], g: bf16[3072,2048]) -> f32[8,1024,2048] {
  %starts = s32[8]{0} parameter(0)
  %blocks = s32[8]{0} parameter(1)
  %x = bf16[3072,1024]{1,0} parameter(2)
  %g = bf16[3072,2048]{1,0} parameter(3)
  ROOT %k = f32[8,1024,2048]{2,1,0} custom-call(%starts, %blocks, %x, %g), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/transpose(jvp(grouped_matmul(weight_gradient, 2048x1024x2048)))/mpmd_map"}
}
"""


def test_a_plan_counts_a_padded_weight_gradient_kernel_at_the_most_its_operand_holds():
    # mpjax's Blackwell (and Hopper fp8) weight-gradient kernels take each expert's tokens
    # padded to whole blocks of 128 rows: 2048 tokens in 8 experts fill at most 3072 rows.
    (kernel,) = mpjax.Plan.from_hlo_text(_PADDED_HLO, device="NVIDIA B200").gemms
    work = 2 * 2048 * 1024 * 2048
    assert (kernel.grouped, kernel.flops, kernel.model_flops) == (
        "weight_gradient",
        work * 3 // 2,
        work,
    )
    summary = mpjax.Plan.from_hlo_text(_PADDED_HLO, device="NVIDIA B200").summary()
    assert "grouped GEMMs: 1 kernel run (12.9G FLOPs at most for 8.59G of work" in summary


def test_a_plan_reads_grouped_kernels_and_the_dense_gemms_xla_made_of_ragged_dots():
    plan = mpjax.Plan.from_hlo_text(_HLO, device="NVIDIA B200")
    work = 2 * 2048 * 1024 * 2048
    by_name = {g.name: g for g in plan.gemms}
    kernel = by_name["k1"]
    assert (kernel.library, kernel.grouped, kernel.flops, kernel.model_flops) == (
        "mosaic",
        "forward",
        work,
        work,
    )
    assert by_name["k2"].grouped == "input_gradient"
    dense = by_name["d1"]  # a grouped GEMM XLA expanded: 8x the work it needs
    assert (dense.grouped, dense.flops, dense.model_flops) == ("weight_gradient", 8 * work, work)
    assert by_name["d2"].grouped == "ragged_dot" and by_name["d2"].model_flops is None
    assert by_name["other"].grouped is None
    summary = plan.summary()
    assert "grouped GEMMs: 2 kernel runs (17.2G FLOPs" in summary
    assert "expanded dense by XLA: weight_gradient, 1 run, 68.7G FLOPs for 8.59G of work" in summary
    assert "expanded dense by XLA: ragged_dot, 1 run" in summary
