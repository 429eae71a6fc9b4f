"""Block-scaled (MXFP8, NVFP4) and rowwise fp8 matmuls: quantization against the formats'
definitions (OCP MX, NVIDIA's NVFP4) written out in numpy, matmuls forward and backward against
the same arithmetic written by hand, the operand dtypes of every GEMM read from the jaxpr under
autocast, linen, NNX and Equinox, the fallback for a contraction the block does not divide, and
the errors."""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from tolerances import tolerance

import mpjax
from mpjax import block_scaled, fp8

DENSE = (((1,), (0,)), ((), ()))
E4M3, E2M1, E8M0 = (np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float4_e2m1fn, jnp.float8_e8m0fnu))


@pytest.fixture(autouse=True)
def _quiet_emulation():
    """Every matmul here runs emulated (the CPU has no block-scaled kernels): the warning is
    tested on its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", block_scaled.EmulationWarning)
        yield


def normal(shape, seed, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def across_binades(shape, seed):
    """Values whose blocks span 2**-30 to 2**30: every block its own magnitude."""
    rng = np.random.default_rng(seed)
    exponents = rng.integers(-30, 30, (*shape[:-1], shape[-1] // 32)).repeat(32, -1)
    return (rng.standard_normal(shape) * 2.0**exponents).astype(np.float32)


# --- The formats, written out in numpy ------------------------------------------------------


def ocp_mxfp8(x):
    """OCP MX (v1.0, section 6.3) for E4M3 elements, per block of 32 along the last axis."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        shared = np.floor(np.log2(amax)) - 8  # emax of e4m3
    shared = np.where(amax > 0, np.clip(shared, -127, 127), -127)
    scale = np.where(np.isfinite(amax), 2.0**shared, np.nan)
    elements = np.clip(blocks / np.where(np.isfinite(scale), scale, 1.0), -448, 448)
    elements = np.where(np.isfinite(blocks), elements, np.nan)
    return elements.astype(ml_dtypes.float8_e4m3fn).reshape(x.shape), scale[..., 0]


def nvfp4(x):
    """NVFP4 per block of 16 along the last axis: a float32 tensor scale mapping amax to 6 * 448,
    e4m3 block scales, e2m1 elements (round to nearest even, saturating)."""
    blocks = x.reshape(*x.shape[:-1], -1, 16).astype(np.float32)
    amax = np.float32(np.abs(blocks).max())
    tensor = np.float32(amax / np.float32(6 * 448)) if amax > 0 else np.float32(1)
    block_amax = np.abs(blocks).max(-1, keepdims=True)
    scale = (block_amax / np.float32(6) / tensor).astype(ml_dtypes.float8_e4m3fn)
    divisor = scale.astype(np.float32) * tensor
    with np.errstate(divide="ignore", invalid="ignore"):
        elements = np.where(divisor > 0, blocks / divisor, 0)
    elements = np.clip(elements, -6, 6).astype(ml_dtypes.float4_e2m1fn)
    return elements.reshape(x.shape), scale[..., 0].astype(np.float32), tensor


def test_mxfp8_quantization_is_the_ocp_definition_across_binades():
    x = across_binades((8, 256), 0)
    q = block_scaled.quantize(jnp.asarray(x), "mxfp8")
    data, scale = ocp_mxfp8(x)
    assert q.data.dtype == E4M3 and q.scales.dtype == E8M0 and q.scales.shape == (8, 8)
    np.testing.assert_array_equal(np.asarray(q.scales.astype(jnp.float32)), scale)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))


def test_mxfp8_saturates_the_top_of_a_block_and_keeps_zeros_and_non_finite_values_visible():
    x = np.zeros((4, 32), np.float32)
    x[0] = np.linspace(0, 31, 32)  # amax 31: scale 2**(4 - 8); 28 and above land on 448
    x[2, :2] = [np.inf, 1.0]
    x[3, :2] = [np.nan, 1.0]
    q = block_scaled.quantize(jnp.asarray(x), "mxfp8")
    scales = np.asarray(q.scales.astype(jnp.float32))[:, 0]
    assert scales[0] == 2.0**-4
    np.testing.assert_array_equal(np.asarray(q.data[0, 28:].astype(jnp.float32)), [448.0] * 4)
    assert scales[1] == 2.0**-127 and not np.asarray(q.data[1].astype(jnp.float32)).any()
    assert np.isnan(scales[2:]).all()  # the NaN scale: every product of the block is NaN
    dequantized = np.asarray(block_scaled.dequantize(q))
    assert np.isnan(dequantized[2:]).all() and (dequantized[1] == 0).all()


def test_nvfp4_quantization_is_the_two_level_definition():
    x = across_binades((4, 128), 1) * 1e-3
    x = x / np.abs(x).max() * 3000.0  # the tensor scale matters: amax past 6 * 448
    q = block_scaled.quantize(jnp.asarray(x), "nvfp4")
    data, scale, tensor = nvfp4(x)
    assert q.data.dtype == E2M1 and q.scales.dtype == E4M3 and q.scales.shape == (4, 8)
    assert np.float32(q.tensor_scale) == tensor
    np.testing.assert_array_equal(np.asarray(q.scales.astype(jnp.float32)), scale)
    np.testing.assert_array_equal(np.asarray(q.data.astype(jnp.float32)), data.astype(np.float32))


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_dequantized_values_are_within_half_a_step_of_the_format(name):
    fmt = block_scaled.FORMATS[name]
    x = normal((16, 512), 2, 100.0)
    q = block_scaled.quantize(x, name)
    error = np.abs(np.asarray(block_scaled.dequantize(q)) - np.asarray(x))
    # Half a unit in the last place of the elements (3 and 1 mantissa bits), relative, and half
    # the smallest subnormal step of the block (absolute); MXFP8 may also saturate a block's
    # top binade from 448 to 512 times its scale.
    step = {"mxfp8": 2.0**-4, "nvfp4": 2.0**-2}[name]
    smallest = {"mxfp8": 2.0**-10, "nvfp4": 2.0**-2}[name]
    scale = np.asarray(q.scales.astype(jnp.float32)).repeat(fmt.block, -1) * float(q.tensor_scale)
    bound = np.maximum(step * np.abs(np.asarray(x)), smallest * scale)
    saturated = np.abs(np.asarray(x)) > fmt.data_max * scale
    assert (error[~saturated] <= bound[~saturated] * (1 + 1e-6)).all()
    excess = np.abs(np.asarray(x)) - fmt.data_max * scale  # what saturation takes off
    assert (error[saturated] <= excess[saturated] + 1e-6 * np.abs(np.asarray(x))[saturated]).all()


# --- The matmul, against the same arithmetic by hand ----------------------------------------


def hand_written(lhs, rhs, name, hadamard=False, tiles=False):
    """``lhs @ rhs`` and its gradients with each GEMM's operands quantized along that GEMM's
    contraction (rounded to nearest), dequantized, and multiplied in float32: what the
    block-scaled GEMMs compute. ``tiles``: the weight ``rhs`` in 16 x 16 tiles, the same in
    both GEMMs that read it; ``hadamard``: both inputs of the weight gradient transformed along
    the tokens first."""

    def qdq(x):  # quantized along the last axis
        return block_scaled.dequantize(block_scaled.quantize(x, name))

    def weight(w):  # rhs as the forward GEMM's (N, K) operand
        return block_scaled.dequantize(block_scaled.quantize_tiles(w, name)) if tiles else qdq(w)

    def transform(x):
        return block_scaled.hadamard_transform(x) if hadamard else x

    out = qdq(lhs) @ weight(rhs.T).T

    def grads(g):
        w_t = weight(rhs.T).T if tiles else qdq(rhs)  # (K, N): blocked along N
        dlhs = qdq(g) @ w_t.T
        drhs = (qdq(transform(g.T)) @ qdq(transform(lhs.T)).T).T
        return dlhs, drhs

    return out, grads


# (format, the recipe's ingredients turned on): stochastic rounding has tests of its own.
ARITHMETIC = [
    ("mxfp8", {}),
    ("nvfp4", {}),
    ("nvfp4", {"hadamard": True}),
    ("nvfp4", {"tiles": True}),
    ("nvfp4", {"hadamard": True, "tiles": True}),
]


@pytest.mark.parametrize("name, ingredients", ARITHMETIC, ids=lambda v: str(v))
def test_block_scaled_matmul_is_the_quantized_arithmetic_forward_and_backward(name, ingredients):
    lhs = normal((64, 128), 3, 4.0).astype(jnp.bfloat16)
    rhs = normal((128, 96), 4, 0.05).astype(jnp.bfloat16)
    g = normal((64, 96), 5).astype(jnp.bfloat16)
    flags = (
        {}
        if name == "mxfp8"
        else dict(
            hadamard=ingredients.get("hadamard", False),
            weight_blocks_2d=ingredients.get("tiles", False),
            stochastic_rounding=False,
        )
    )

    @jax.jit
    def both(lhs, rhs, g):
        dot = lambda a, b: block_scaled.dot_general(a, b, DENSE, name, **flags)  # noqa: E731
        out, vjp = jax.vjp(dot, lhs, rhs)
        f32 = [x.astype(jnp.float32) for x in (lhs, rhs, g)]
        expected, grads = hand_written(f32[0], f32[1], name, **ingredients)
        return (out, *vjp(g)), (expected, *grads(f32[2]))

    (out, dlhs, drhs), (expected, expected_dlhs, expected_drhs) = both(lhs, rhs, g)
    assert out.dtype == jnp.bfloat16
    for got, want, n in (
        (out, expected, 128),
        (dlhs, expected_dlhs, 96),
        (drhs, expected_drhs, 64),
    ):
        got, want = np.asarray(got, np.float32), np.asarray(want)
        # The same products in another order, the result rounded to bf16 once.
        bound = tolerance(np.float32, n) + tolerance(jnp.bfloat16, 0)
        assert np.abs(got - want).max() <= bound * np.abs(want).max() * 2, name


@pytest.mark.parametrize(
    "dimension_numbers, lhs_shape, rhs_shape",
    [
        ((((2,), (0,)), ((), ())), (2, 32, 64), (64, 32)),  # a dense layer on [batch, seq, d]
        ((((2,), (2,)), ((0,), (0,))), (4, 32, 64), (4, 64, 64)),  # batched, like q @ k^T
        ((((1, 2), (1, 0)), ((), ())), (32, 4, 16), (16, 4, 32)),  # two contracted axes, crossed
    ],
)
def test_block_scaled_matmul_takes_any_dot_general_layout(dimension_numbers, lhs_shape, rhs_shape):
    lhs, rhs = normal(lhs_shape, 6), normal(rhs_shape, 7)

    def both(dot):
        @jax.jit
        def run(lhs, rhs):
            out, vjp = jax.vjp(dot, lhs, rhs)
            return (out, *vjp(jnp.ones_like(out)))

        return run(lhs, rhs)

    got = both(lambda a, b: block_scaled.dot_general(a, b, dimension_numbers))
    want = both(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        # Two e4m3 roundings of the operands: about 2 * 2**-4 relative, in the L2 norm.
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < 0.1


def test_an_overflow_reaches_the_output_and_the_gradients():
    lhs = normal((32, 64), 8).at[3, 5].set(jnp.inf)
    out, vjp = jax.vjp(lambda a, b: block_scaled.dot_general(a, b, DENSE), lhs, normal((64, 32), 9))
    assert not np.isfinite(np.asarray(out[3])).any() and np.isfinite(np.asarray(out[4])).all()
    g = jnp.ones_like(out).at[0, 0].set(jnp.inf)
    assert not all(np.isfinite(np.asarray(d)).all() for d in vjp(g))


def test_the_emulation_warns_once_per_format(monkeypatch):
    monkeypatch.setattr(block_scaled, "_warned", set())
    x, w = normal((32, 64), 10), normal((64, 32), 11)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            block_scaled.dot_general(x, w, DENSE, "mxfp8")
        block_scaled.dot_general(x, w, DENSE, "nvfp4")
        with block_scaled.compiling_for_target():
            block_scaled.dot_general(x, w, DENSE, "nvfp4")
    emulated = [w for w in caught if issubclass(w.category, block_scaled.EmulationWarning)]
    assert len(emulated) == 2, [str(w.message) for w in emulated]
    assert "mxfp8 matmuls run emulated on this backend (cpu)" in str(emulated[0].message)


def test_bad_block_scaled_calls_name_what_is_wrong():
    x, w = normal((32, 40), 12), normal((40, 32), 13)
    with pytest.raises(ValueError, match=r"K=40 not a multiple of mxfp8's block of 32"):
        block_scaled.dot_general(x, w, DENSE)
    with pytest.raises(
        ValueError, match=r"Unknown block format 'mxfp6'; valid formats: 'mxfp8', 'nvfp4'"
    ):
        block_scaled.dot_general(x, w, DENSE, "mxfp6")
    with pytest.raises(TypeError, match="format must be a block format's name"):
        block_scaled.quantize(x, 8)
    with pytest.raises(ValueError, match="last axis must be a multiple of the block size 16"):
        block_scaled.quantize(x[:, :24], "nvfp4")
    with pytest.raises(ValueError, match="must be bfloat16, float16 or float32; got float64"):
        with jax.enable_x64(True):
            block_scaled.dot_general(jnp.ones((32, 32), jnp.float64), jnp.ones((32, 32)), DENSE)
    with pytest.raises(ValueError, match="precision=...\\) must be None"):
        block_scaled.dot_general(x[:, :32], w[:32], DENSE, precision=jax.lax.Precision.HIGHEST)
    assert block_scaled.unaligned((64, 64), (64, 48), DENSE, "nvfp4") is None
    assert block_scaled.unaligned((24, 64), (64, 40), DENSE, "nvfp4") == (
        "N=40, M=24 not a multiple of nvfp4's block of 16 (lhs (24, 64), rhs (64, 40))"
    )
    with pytest.raises(ValueError, match="hadamard=True is an ingredient of NVFP4's training"):
        block_scaled.dot_general(x[:, :32], w[:32], DENSE, "mxfp8", hadamard=True)
    with pytest.raises(TypeError, match="stochastic_rounding must be True, False or None"):
        block_scaled.dot_general(x[:, :32], w[:32], DENSE, "nvfp4", stochastic_rounding=1)
    with pytest.raises(TypeError, match="key=...\\) must be a PRNG key"):
        block_scaled.dot_general(x[:, :32], w[:32], DENSE, "nvfp4", key=3)
    with pytest.raises(ValueError, match="must be one of 16; got 8"):
        block_scaled.hadamard_transform(x, 8)
    with pytest.raises(ValueError, match="last axis must be a multiple of size=16"):
        block_scaled.hadamard_transform(x[:, :24])
    with pytest.raises(ValueError, match="last two axes must be multiples of the tile size 16"):
        block_scaled.quantize_tiles(x[:24, :32])


# --- Rowwise fp8 ------------------------------------------------------------------------------


def test_rowwise_scales_are_the_smallest_powers_of_two_that_fit_each_row():
    x = jnp.array([[896.0, 3.0, 0.0], [1.0, 0.5, 0.0], [0.0, 0.0, 0.0], [jnp.inf, 1.0, 0.0]])
    scales = np.asarray(fp8.rowwise_scale(x, (1,), fp8.E4M3)).ravel()
    np.testing.assert_array_equal(scales, [2.0, 2.0**-8, 1.0, 1.0])
    assert np.asarray(fp8.rowwise_scale(x, (0,), fp8.E4M3)).shape == (1, 3)


def test_rowwise_keeps_a_row_of_small_values_that_one_scale_per_tensor_loses():
    x = jnp.concatenate([jnp.full((1, 64), 3e4), normal((31, 64), 14, 1e-3)]).astype(jnp.bfloat16)
    w = jnp.eye(64, dtype=jnp.bfloat16)
    exact = np.asarray(x, np.float32)[1:]

    def error(y):
        return float(np.abs(np.asarray(y, np.float32)[1:] - exact).max() / np.abs(exact).max())

    assert error(fp8.rowwise_dot_general(x, w, DENSE)) <= 2.0**-4  # one e4m3 rounding
    assert error(fp8.dot_general(x, w, DENSE)) > 0.5  # the tensor's scale flushes the row


def test_rowwise_matmul_is_the_rowwise_arithmetic_forward_and_backward():
    lhs = normal((2, 32, 64), 15, 3.0).astype(jnp.bfloat16)
    rhs = (normal((64, 48), 16) * jnp.logspace(-3, 3, 48)).astype(jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    g = normal((2, 32, 48), 17).astype(jnp.bfloat16)

    def qdq(x, contract):
        scale = fp8.rowwise_scale(x, contract, fp8.E4M3)
        return fp8.quantize(x, fp8.E4M3, scale).astype(jnp.float32) * scale

    @jax.jit
    def both(lhs, rhs, g):
        out, vjp = jax.vjp(lambda a, b: fp8.rowwise_dot_general(a, b, dims), lhs, rhs)
        f = [a.astype(jnp.float32) for a in (lhs, rhs, g)]
        want = (
            jnp.einsum("bsk,kn->bsn", qdq(f[0], (2,)), qdq(f[1], (0,))),
            jnp.einsum("bsn,kn->bsk", qdq(f[2], (2,)), qdq(f[1], (1,))),
            jnp.einsum("bsk,bsn->kn", qdq(f[0], (0, 1)), qdq(f[2], (0, 1))),
        )
        return (out, *vjp(g)), want

    got_all, want = both(lhs, rhs, g)
    for got, w, n in zip(got_all, want, (64, 48, 64)):
        assert got.dtype == jnp.bfloat16
        bound = tolerance(np.float32, n) + tolerance(jnp.bfloat16, 0)
        assert np.abs(np.asarray(got, np.float32) - w).max() <= bound * np.abs(w).max() * 2


# --- Through policies: the operand dtypes of every GEMM, forward and backward ----------------


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(nn.gelu(nn.Dense(64)(x)))
        scores = jnp.einsum("bqd,bkd->bqk", h, h)  # batched, like attention: stays bf16
        h = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), h)
        return nn.Dense(32, name="head")(h)


def gemms(report):
    """The (primitive, format or lhs dtype, rhs dtype) of each matmul, counted."""
    counts = {}
    for m in report:
        key = (m.block_format or m.primitive, m.lhs_dtype.name, m.rhs_dtype.name)
        counts[key] = counts.get(key, 0) + 1
    return counts


MXFP8_GEMM = ("mxfp8", "float8_e4m3fn", "float8_e4m3fn")
NVFP4_GEMM = ("nvfp4", "float4_e2m1fn", "float4_e2m1fn")
BF16_DOT = ("dot_general", "bfloat16", "bfloat16")
FP8_DOT = ("dot_general", "float8_e4m3fn", "float8_e4m3fn")


@pytest.mark.parametrize(
    "policy, expected",
    [
        # Two dense layers: 2 forward GEMMs and 4 backward (the custom VJP writes the first
        # layer's input gradient too, dead code that XLA removes); the batched einsums (2
        # forward, 4 backward) stay in bf16.
        ("mixed_bfloat16_mxfp8", {MXFP8_GEMM: 6, BF16_DOT: 6}),
        ("mixed_bfloat16_nvfp4", {NVFP4_GEMM: 6, BF16_DOT: 6}),
        ("p=f32,c=bf16,o=f32,fp8=nvfp4;plain", {NVFP4_GEMM: 6, BF16_DOT: 6}),
        ("mixed_bfloat16_fp8_rowwise", {FP8_DOT: 6, BF16_DOT: 6}),
        ("p=f32,c=bf16,o=f32,fp8=mxfp8;batched", {MXFP8_GEMM: 12}),
    ],
)
def test_autocast_runs_the_dense_layers_in_the_policys_format_forward_and_backward(
    policy, expected
):
    x = normal((2, 32, 64), 18)
    params = Mlp().init(jax.random.key(0), x)["params"]
    fn = mpjax.autocast(lambda p, x: Mlp().apply({"params": p}, x), policy)
    report = mpjax.inspect_matmuls(jax.grad(lambda p: jnp.mean(fn(p, x) ** 2)))(params)
    assert gemms(report) == expected, str(report)
    # Every block-scaled GEMM writes the compute dtype (NVFP4's forward f32, scaled after).
    outs = {(m.block_format, m.out_dtype.name) for m in report if m.block_format}
    assert outs <= {("mxfp8", "bfloat16"), ("nvfp4", "float32")}


def test_linen_rules_keep_the_head_in_bf16_and_describe_shows_each_format():
    x = normal((2, 32, 64), 19)
    rules = mpjax.Rules({"head": "mixed_bfloat16"}, default="mixed_bfloat16_mxfp8")
    model = mpjax.linen.apply_policy(Mlp(), rules)
    variables = model.init(jax.random.key(0), x)
    report = mpjax.describe(model, variables=variables)(x)
    rows = {row.path: dict(row.matmuls) for row in report.rows}
    assert rows["Dense_0"] == {"float8_e4m3fn,float8_e4m3fn@mxfp8": 3}
    assert rows["head"] == {"bf16,bf16": 3}


def test_a_contraction_the_block_does_not_divide_runs_in_the_compute_dtype_and_says_why():
    fn = mpjax.autocast(lambda w, x: x @ w, "mixed_bfloat16_mxfp8")
    w, x = normal((40, 64), 20), normal((32, 40), 21)
    report = mpjax.inspect_matmuls(jax.grad(lambda w: jnp.sum(fn(w, x))))(w)
    assert gemms(report) == {BF16_DOT: 2}
    (row,) = [r for r in mpjax.describe(fn)(w, x) if r.primitive == "dot_general"]
    assert (
        row.category
        == "lower (not mxfp8: K=40 not a multiple of mxfp8's block of 32 (lhs (32, 40), rhs (40, 64)))"
    )


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.gelu(self.up(x)))


def test_nnx_and_equinox_models_run_block_scaled_forward_and_backward():
    x = normal((32, 64), 22)
    model = NnxMlp(nnx.Rngs(0))
    mpjax.nnx.set_policy(model, "mixed_bfloat16_nvfp4")
    graph, state = nnx.split(model)
    loss = lambda s: jnp.mean(nnx.merge(graph, s)(x) ** 2)  # noqa: E731
    assert gemms(mpjax.inspect_matmuls(jax.grad(loss))(state)) == {NVFP4_GEMM: 6}

    # Equinox layers multiply one example at a time, and a matvec's weight gradient contracts
    # an axis of 1: wrapped, they run in bf16 and say why; autocast over the vmapped call puts
    # the batch into each matmul, and every GEMM runs in MXFP8.
    keys = jax.random.split(jax.random.key(1))
    mlp = eqx.nn.Sequential(
        [eqx.nn.Linear(64, 64, key=keys[0]), eqx.nn.Linear(64, 32, key=keys[1])]
    )
    wrapped = mpjax.equinox.apply_policy(mlp, "mixed_bfloat16_mxfp8")
    with pytest.warns(mpjax.AutocastWarning, match="N=1 not a multiple of mxfp8's block of 32"):
        report = mpjax.describe(wrapped)(x[0])
    assert {dict(row.matmuls).get("bf16,bf16") for row in report.rows if row.path} == {3}
    fn = mpjax.autocast(lambda m, x: jax.vmap(m)(x), "mixed_bfloat16_mxfp8")
    grad = eqx.filter_grad(lambda m: jnp.mean(fn(m, x) ** 2))
    assert gemms(mpjax.inspect_matmuls(grad)(mlp)) == {MXFP8_GEMM: 6}


# --- Policies and recipes ----------------------------------------------------------------------


def test_the_new_presets_and_strings_name_the_recipes():
    assert mpjax.get_policy("mixed_bfloat16_mxfp8") == mpjax.MIXED_BFLOAT16_MXFP8
    assert str(mpjax.MIXED_BFLOAT16_NVFP4) == "p=f32,c=bf16,o=f32,fp8=nvfp4"
    assert mpjax.get_policy("p=f32,c=bf16,o=f32,fp8=rowwise") == mpjax.MIXED_BFLOAT16_FP8_ROWWISE
    assert mpjax.Fp8Recipe("mxfp8").block_scaled and not mpjax.Fp8Recipe("rowwise").block_scaled
    assert mpjax.Fp8Recipe.parse("rowwise;margin=1") == mpjax.Fp8Recipe("rowwise", margin=1)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: mpjax.Fp8Recipe("mxfp8", margin=1), ValueError, "does not apply to mxfp8"),
        (lambda: mpjax.Fp8Recipe("mxfp9"), ValueError, "'rowwise', 'mxfp8', 'nvfp4'; got 'mxfp9'"),
        (lambda: mpjax.get_policy("p=f32,c=bf16,fp8=nvfp8"), ValueError, "got 'nvfp8'"),
        (lambda: mpjax.get_policy("mixed_bfloat16_mxfp4"), ValueError, "mixed_bfloat16_mxfp4"),
    ],
)
def test_bad_recipes_and_policy_strings_name_the_valid_choices(make, error, match):
    with pytest.raises(error, match=match):
        make()
