"""Blackwell targets of :func:`mpjax.plan`: B200, GB200 and B300 compiled for on this machine
without one, and the block-scaled GEMMs (MXFP8, NVFP4) that ``jax.nn.scaled_dot_general``
becomes there, counted with their data dtypes' FLOPs at the chips' fp8 and fp4 peaks; on an H100,
which has no block-scaled GEMM kernels, the plan says they are emulated.

The compiles need JAX's CUDA plugin (``pip install "mpjax[cuda12]"``, no GPU needed) and skip
without it, saying why; with ``MPJAX_REQUIRE_GPU_PLAN`` set (CI) they run, and a missing plugin
fails them. Each compiles one small matmul, forward or forward and backward (a few seconds on
two cores). The tests of target names and of plans read from HLO text need nothing.
"""

import functools
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from mpjax.planning.devices import plan_unavailable
from mpjax.planning.targets import CHIPS, parse_target

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_h100_plan import example_plan  # noqa: E402  (the example's step, planned)

REASON = plan_unavailable("b200")
needs_plugin = pytest.mark.skipif(
    REASON is not None and not os.environ.get("MPJAX_REQUIRE_GPU_PLAN"),
    reason=f"the plan cannot compile for a B200: {REASON}",
)

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
E4M3, E8M0, E2M1 = (
    np.dtype(jnp.float8_e4m3fn),
    np.dtype(jnp.float8_e8m0fnu),
    np.dtype(jnp.float4_e2m1fn),
)
# A matmul x[M, K] @ w[K, N], each dimension a different multiple of the 32-element blocks.
M, K, N = 1024, 512, 768
DIMS = (((1,), (0,)), ((), ()))


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def scaled_matmul(mode):
    """``x @ w`` as a block-scaled matmul in ``mode`` (``"mxfp8"``, ``"nvfp4"``), forward and
    both gradients, writing bf16."""
    config = jax.nn.get_scaled_dot_general_config(mode)

    def matmul(x, w):
        return jax.nn.scaled_dot_general(
            x, w, DIMS, preferred_element_type=jnp.bfloat16, configs=[config] * 3
        )

    return matmul


def value_and_grad(mode):
    # The loss's cotangent depends on the output, so XLA has no constant cotangent to quantize
    # at compile time (a plain sum's takes it seconds).
    matmul = scaled_matmul(mode)

    def loss(x, w):
        return jnp.sum(jnp.square(matmul(x, w).astype(jnp.float32)))

    return jax.value_and_grad(loss, argnums=(0, 1))


def plan_of(fn, target, *args):
    """``mpjax.plan(fn, target)(*args)`` under JAX's standard dtype promotion: JAX's NVFP4
    quantization divides bf16 values by a float32 global scale, which the suite's strict
    promotion refuses."""
    with jax.numpy_dtype_promotion("standard"):
        return mpjax.plan(fn, target)(*args)


def block_scaled(plan):
    return [g for g in plan.gemms if g.block_scaled]


# --- Targets ----------------------------------------------------------------------------------


def test_blackwell_targets_parse_as_chips_and_clusters():
    for name, device in (
        ("b200", "NVIDIA B200"),
        ("gb200", "NVIDIA GB200"),
        ("b300", "NVIDIA B300"),
        ("gb300", "NVIDIA GB300"),
    ):
        target = parse_target(name.upper())
        assert (target.name, target.topology, target.chips) == (name, "1x1x1", 1)
        assert target.chip.device == device and target.chip.spec == f"{name}.txtpb"
        assert target.chip.block_scaled_gemms and target.chip.compute_capability[0] == 10
    assert parse_target("b200:8").topology == "1x1x8" and parse_target("b200:8").chips == 8
    assert parse_target("gb200:2x4").topology == "1x2x4" and parse_target("gb200:2x4").chips == 8
    assert parse_target("b300:4x8").topology == "1x4x8"
    assert CHIPS["b300"].compute_capability == CHIPS["gb300"].compute_capability == (10, 3)
    assert CHIPS["h100"].compute_capability == (9, 0) and not CHIPS["h100"].block_scaled_gemms
    assert CHIPS["v5p"].compute_capability is None and not CHIPS["v5p"].block_scaled_gemms


def test_blackwell_peaks_are_the_published_dense_ones():
    tera = 1e12
    assert dict(CHIPS["b200"].peak_flops) == {
        "bf16": 2250 * tera,
        "fp8": 4500 * tera,
        "fp4": 9000 * tera,
        "tf32": 1100 * tera,
        "f32": 75 * tera,
    }
    assert CHIPS["gb200"].peak_flops["fp4"] == 2 * CHIPS["gb200"].peak_flops["fp8"] == 10000 * tera
    assert CHIPS["b300"].peak_flops["fp4"] == 13500 * tera
    assert CHIPS["gb300"].peak_flops["fp4"] == 6 * CHIPS["gb300"].peak_flops["bf16"] == 15000 * tera
    assert {CHIPS[c].hbm_bandwidth for c in ("b200", "gb200", "b300")} == {8e12}
    assert CHIPS["gb300"].hbm_bandwidth == 7.93e12  # XLA's description: 7.928 TB/s


def test_an_unknown_target_names_the_blackwell_ones_and_their_clusters():
    with pytest.raises(ValueError, match=r"unknown target 'b100'.*'b200', 'b300', 'gb200'") as info:
        mpjax.plan(jnp.matmul, "b100")
    assert "'gb200:2x4'" in str(info.value) and "'b200:8'" in str(info.value)
    for bad in ("gb200:0x4", "b200:", "gb:8", "b200:2x2x2"):
        with pytest.raises(ValueError, match="unknown target"):
            parse_target(bad)


@needs_plugin
@pytest.mark.parametrize("target", ["b200", "gb200", "b300", "gb300"])
def test_blackwell_targets_compile(target):
    plan = mpjax.plan(jnp.matmul, target)(sds((M, K)), sds((K, N)))
    assert (plan.target, plan.device) == (target, CHIPS[target].device)
    (gemm,) = plan.gemms
    assert (gemm.lhs_dtype, gemm.rhs_dtype, gemm.flops) == (BF16, BF16, 2 * M * N * K)
    assert not gemm.block_scaled and gemm.scale_dtype is None
    assert plan.memory.capacity_bytes == CHIPS[target].hbm_bytes
    assert plan.roofline_seconds == pytest.approx(2 * M * N * K / CHIPS[target].peak_flops["bf16"])


@needs_plugin
def test_gpu_clusters_of_blackwell_chips_compile_through_the_plugins_topology():
    mesh = mpjax.plan_mesh("gb200:2x4", (2, 4), ("data", "fsdp"))
    assert mesh.devices.size == 8
    assert {d.device_kind for d in mesh.devices.flat} == {"NVIDIA GB200"}
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=rows)
    plan = mpjax.plan(jnp.matmul, "gb200:2x4")(x, w)
    assert plan.devices == 8 and plan.total_flops == 2 * (M // 8) * N * K  # one device's rows
    assert {c.kind for c in plan.collectives} == {"all-gather"}  # w's rows, gathered
    assert len(mpjax.plan_mesh("b200:8").devices) == 8


# --- Block-scaled GEMMs -----------------------------------------------------------------------


@needs_plugin
def test_mxfp8_value_and_grad_on_a_b200_is_three_block_scaled_fp8_gemms():
    plan = mpjax.plan(value_and_grad("mxfp8"), "b200")(sds((M, K)), sds((K, N)))
    gemms = block_scaled(plan)
    assert len(gemms) == len(plan.gemms) == 3, plan.table()
    for g in gemms:
        assert (g.library, g.lhs_dtype, g.rhs_dtype, g.scale_dtype) == (
            "cudnn_block_scaled",
            E4M3,
            E4M3,
            E8M0,
        )
        assert g.flops == 2 * M * N * K and g.out_dtype == BF16 and not g.emulated_block_scaled
    assert plan.block_scaled_flops == plan.total_flops == 3 * 2 * M * N * K
    assert plan.flop_share("block_scaled") >= 0.8  # here all of them
    assert plan.flop_share("fp8") == plan.flop_share(jnp.float8_e4m3fn) == 1.0
    assert plan.flops_by_dtype() == {"float8_e4m3fn": 3 * 2 * M * N * K}
    assert plan.roofline_seconds == pytest.approx(3 * 2 * M * N * K / 4500e12)
    assert not [g for g in plan.gemms if g.emulated_block_scaled]
    assert "block-scaled GEMMs: 3 runs" in plan.summary() and "emulated" not in plan.summary()
    text = plan.table()
    assert text.count("cudnn_block_scaled") == 3 and "float8_e4m3fn[1, 1024, 512]" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["block_scaled_flops"] == plan.total_flops
    assert {(g["block_scaled"], g["scale_dtype"], g["lhs_dtype"]) for g in data["gemms"]} == {
        (True, "float8_e8m0fnu", "float8_e4m3fn")
    }


@needs_plugin
def test_nvfp4_on_a_b200_is_an_fp4_block_scaled_gemm_at_the_fp4_peak():
    """JAX's NVFP4 forward matmul is block-scaled (f4e2m1fn data, f8e4m3fn scales, float32
    out); its gradients JAX computes as bf16 matmuls, by design."""
    forward = plan_of(scaled_matmul("nvfp4"), "b200", sds((M, K)), sds((K, N)))
    (gemm,) = forward.gemms
    assert (gemm.library, gemm.lhs_dtype, gemm.rhs_dtype, gemm.scale_dtype) == (
        "cudnn_block_scaled",
        E2M1,
        E2M1,
        E4M3,
    )
    assert gemm.flops == 2 * M * N * K and gemm.out_dtype == F32
    assert forward.flop_share("fp4") == forward.flop_share("block_scaled") == 1.0
    assert forward.roofline_seconds == pytest.approx(2 * M * N * K / 9000e12)

    plan = plan_of(value_and_grad("nvfp4"), "b200", sds((M, K)), sds((K, N)))
    assert len(block_scaled(plan)) == 1 and len(plan.gemms) == 3, plan.table()
    assert plan.flop_share("block_scaled") == pytest.approx(1 / 3)
    assert plan.flop_share(jnp.bfloat16) == pytest.approx(2 / 3)
    flops = 2 * M * N * K
    assert plan.roofline_seconds == pytest.approx(flops / 9000e12 + 2 * flops / 2250e12)
    assert "emulated" not in plan.summary()  # the bf16 gradients are JAX's, not emulation


@needs_plugin
@pytest.mark.parametrize(
    "target, mode, peak",
    [("gb200", "mxfp8", 5000e12), ("b300", "nvfp4", 13500e12), ("gb300", "nvfp4", 15000e12)],
)
def test_the_other_blackwell_chips_run_block_scaled_gemms_at_their_peaks(target, mode, peak):
    plan = plan_of(scaled_matmul(mode), target, sds((M, K)), sds((K, N)))
    assert [g.library for g in plan.gemms] == ["cudnn_block_scaled"], plan.table()
    assert plan.roofline_seconds == pytest.approx(2 * M * N * K / peak)


@needs_plugin
def test_on_an_h100_block_scaled_matmuls_are_said_to_be_emulated():
    """Hopper has no block-scaled GEMM kernels: XLA dequantizes each block-scaled matmul and
    runs it as a bf16 dot, and the plan says so."""
    plan = mpjax.plan(value_and_grad("mxfp8"), "h100")(sds((M, K)), sds((K, N)))
    assert not block_scaled(plan) and plan.block_scaled_flops == 0
    assert [g.emulated_block_scaled for g in plan.gemms] == [True] * 3, plan.table()
    assert {(g.lhs_dtype, g.rhs_dtype) for g in plan.gemms} == {(BF16, BF16)}
    assert plan.flop_share("block_scaled") == 0.0 and plan.flop_share(jnp.bfloat16) == 1.0
    assert plan.roofline_seconds == pytest.approx(3 * 2 * M * N * K / 989e12)
    assert (
        "block-scaled matmuls: emulated (no block-scaled GEMM kernels on h100, compute "
        "capability 9.0 < 10.0): 3 GEMM runs in bfloat16"
    ) in plan.summary()
    assert plan.to_dict()["block_scaled_flops"] == 0


# --- Read from HLO text -----------------------------------------------------------------------

BLOCK_SCALED_HLO = """HloModule m

%scaled (lhs: f8e4m3fn[2,64,128], rhs: f8e4m3fn[2,32,128], ls: f8e8m0fnu[2,64,4], rs: f8e8m0fnu[2,32,4]) -> bf16[2,64,32] {
  %lhs = f8e4m3fn[2,64,128]{2,1,0} parameter(0)
  %rhs = f8e4m3fn[2,32,128]{2,1,0} parameter(1)
  %ls = f8e8m0fnu[2,64,4]{2,1,0} parameter(2)
  %rs = f8e8m0fnu[2,32,4]{2,1,0} parameter(3)
  %cc = (bf16[2,64,32]{2,1,0}, u8[0]{0}) custom-call(%lhs, %rhs, %ls, %rs), custom_call_target="__cudnn$blockScaledDot", metadata={op_name="jit(f)/jit(_scaled_matmul)/scaled_matmul"}
  ROOT %out = bf16[2,64,32]{2,1,0} get-tuple-element(%cc), index=0
}

%emulated (a: bf16[2,64,128], b: bf16[2,32,128]) -> bf16[2,64,32] {
  %a = bf16[2,64,128]{2,1,0} parameter(0)
  %b = bf16[2,32,128]{2,1,0} parameter(1)
  ROOT %d = bf16[2,64,32]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
}

ENTRY %main (p0: f8e4m3fn[2,64,128], p1: f8e4m3fn[2,32,128], p2: f8e8m0fnu[2,64,4], p3: f8e8m0fnu[2,32,4], p4: bf16[2,64,128], p5: bf16[2,32,128]) -> (bf16[2,64,32], bf16[2,64,32]) {
  %p0 = f8e4m3fn[2,64,128]{2,1,0} parameter(0)
  %p1 = f8e4m3fn[2,32,128]{2,1,0} parameter(1)
  %p2 = f8e8m0fnu[2,64,4]{2,1,0} parameter(2)
  %p3 = f8e8m0fnu[2,32,4]{2,1,0} parameter(3)
  %p4 = bf16[2,64,128]{2,1,0} parameter(4)
  %p5 = bf16[2,32,128]{2,1,0} parameter(5)
  %call = bf16[2,64,32]{2,1,0} call(%p0, %p1, %p2, %p3), to_apply=%scaled
  %wrapped_dot = bf16[2,64,32]{2,1,0} fusion(%p4, %p5), kind=kLoop, calls=%emulated, metadata={op_name="jit(f)/transpose(jvp(jit(_scaled_matmul)))/scaled_matmul"}
  ROOT %t = (bf16[2,64,32]{2,1,0}, bf16[2,64,32]{2,1,0}) tuple(%call, %wrapped_dot)
}
"""


def test_block_scaled_and_emulated_gemms_are_read_from_hlo_text():
    """A ``__cudnn$blockScaledDot`` call (data ``(B, M, K)`` and ``(B, N, K)``, then their
    scales) is a block-scaled GEMM of ``2*B*M*N*K`` FLOPs with the data's dtypes; a dot in a
    fusion whose op name is a ``scaled_matmul`` is an emulated one."""
    plan = mpjax.Plan.from_hlo_text(BLOCK_SCALED_HLO, device="NVIDIA B200")
    (scaled,) = block_scaled(plan)
    (emulated,) = [g for g in plan.gemms if not g.block_scaled]
    flops = 2 * 2 * 64 * 32 * 128
    assert (scaled.name, scaled.computation, scaled.library) == (
        "cc",
        "scaled",
        "cudnn_block_scaled",
    )
    assert (scaled.lhs_dtype, scaled.rhs_dtype, scaled.scale_dtype) == (E4M3, E4M3, E8M0)
    assert scaled.flops == flops and scaled.block_scaled and not scaled.emulated_block_scaled
    assert (emulated.library, emulated.lhs_dtype, emulated.flops) == ("xla", BF16, flops)
    assert emulated.op_name.endswith("/scaled_matmul")  # the fusion's: its dot has none
    assert emulated.emulated_block_scaled
    assert plan.block_scaled_flops == flops and plan.flop_share("block_scaled") == 0.5
    assert plan.flop_share("fp8") == 0.5 and plan.flop_share("fp4") == 0.0
    summary = plan.summary()
    assert "block-scaled GEMMs: 1 run (1.05M FLOPs, 50.0% of the matmul FLOPs)" in summary
    assert (
        "block-scaled matmuls: emulated (the compile chose no block-scaled GEMM kernel for "
        "them): 1 GEMM run in bfloat16"
    ) in summary
    assert plan.roofline_seconds is None  # no target: no peaks


# --- mpjax's own block-scaled and rowwise matmuls -----------------------------------------------


def mpjax_value_and_grad(dot):
    def loss(x, w):
        return jnp.sum(dot(x, w).astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1))


@needs_plugin
@pytest.mark.parametrize("fmt, forward", [("mxfp8", E4M3), ("nvfp4", E2M1)], ids=["mxfp8", "nvfp4"])
def test_mpjax_block_scaled_matmuls_are_three_block_scaled_gemms_on_a_b200(fmt, forward):
    """All three GEMMs of mpjax's block-scaled matmul are cuDNN block-scaled ones, in the
    format: under NVFP4's recipe all three in fp4 (where JAX's own NVFP4 runs the gradients in
    bf16), the Hadamard transforms and the quantizations in the fusions around them."""
    dot = functools.partial(mpjax.block_scaled.dot_general, dimension_numbers=DIMS, format=fmt)
    plan = mpjax.plan(mpjax_value_and_grad(dot), "b200")(sds((M, K)), sds((K, N)))
    gemms = sorted((g.lhs_dtype.name, g.rhs_dtype.name, g.library) for g in plan.gemms)
    assert gemms == [(forward.name, forward.name, "cudnn_block_scaled")] * 3, str(plan)
    assert plan.flop_share("block_scaled") == 1.0


@needs_plugin
def test_rowwise_fp8_on_an_h100_is_one_fp8_gemm_per_matmul_scaled_after():
    """Each of the three GEMMs multiplies e4m3 values and writes f32; the outer product of the
    row scales multiplies that output in the fusion after it, as the tensor scales do."""
    dot = functools.partial(mpjax.fp8.rowwise_dot_general, dimension_numbers=DIMS)
    plan = mpjax.plan(mpjax_value_and_grad(dot), "h100")(sds((M, K)), sds((K, N)))
    assert [(g.lhs_dtype, g.rhs_dtype) for g in plan.gemms] == [(E4M3, E4M3)] * 3, str(plan)
    assert plan.flop_share("fp8") == 1.0


@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize(
    "policy, operands, scale, share",
    [
        ("mixed_bfloat16_mxfp8", E4M3, E8M0, "block_scaled"),
        ("mixed_bfloat16_nvfp4", E2M1, E4M3, "fp4"),
    ],
    ids=["mxfp8", "nvfp4"],
)
def test_the_example_small_step_runs_its_dense_layers_block_scaled_on_a_b200(
    policy, operands, scale, share
):
    """Every dense layer of every block runs its three GEMMs block-scaled, forward and
    backward: at least 80% of the matmul FLOPs. The rest is the tied output head and the
    embedding's gradient, kept in bf16 by the example's rule for fp8 policies. Under NVFP4's
    recipe all three in fp4: its Hadamard transforms are sums and differences in the fusions
    around the GEMMs, no matmul of their own."""
    config, plan = example_plan("small", policy, target="b200")
    scaled = [g for g in plan.gemms if g.block_scaled]
    assert sum(g.executions for g in scaled) == 3 * 4 * config.n_layer, str(plan)
    assert {(g.lhs_dtype, g.rhs_dtype, g.scale_dtype) for g in scaled} == {
        (operands, operands, scale)
    }
    assert {(g.lhs_dtype, g.rhs_dtype) for g in plan.gemms if not g.block_scaled} == {(BF16, BF16)}
    assert plan.flop_share(share) >= 0.8, str(plan)
