"""mpjax.plan compiles for an H100 without one and reads what XLA's GPU compiler decided.

The compile tests need JAX's CUDA plugin (``pip install "mpjax[cuda12]"``, no GPU needed) and
skip with plan_unavailable's reason without it; the argument checks, the missing-plugin
errors and the text handling run everywhere. Shapes are tiny: each compile takes a fraction of
a second.
"""

import dataclasses
import json
import os
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import mpjax
from mpjax import jax_compat
from mpjax.optim import loss_scaling as loss_scaling_module
from mpjax.planning import deviceless
from mpjax.planning import devices as planning_devices
from mpjax.planning.devices import PlanUnavailableError, plan_unavailable
from mpjax.planning.hlo_text import HloShape, parse_module
from mpjax.planning.rows import loop_trip_counts, read_module
from mpjax.planning.targets import CHIPS, parse_target

# `mpjax.plan` is the function; the module is reached through sys.modules.
plan_module = sys.modules["mpjax.planning.plan"]

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
E4M3 = np.dtype(jnp.float8_e4m3fn)
JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3])
REASON = plan_unavailable()
needs_compiler = pytest.mark.skipif(REASON is not None, reason=f"the plan cannot compile: {REASON}")
M, K, N = 32, 64, 16
B, T, H, D = 2, 128, 4, 64


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def only(items):
    (item,) = items
    return item


def fp8_dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)


def attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def entry_computation(plan):
    return parse_module(plan.hlo_text).entry_computation


# --- What the plans show ----------------------------------------------------------------------


@needs_compiler
def test_a_bf16_matmul_is_one_bf16_gemm_of_2mnk_flops():
    plan = mpjax.plan(jnp.matmul)(sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16))
    gemm = only(plan.gemms)
    assert (gemm.lhs_dtype, gemm.rhs_dtype) == (BF16, BF16)
    assert gemm.flops == 2 * M * N * K and gemm.executions == 1
    # XLA's default without a GPU: a Triton GEMM fusion with an untuned tile.
    assert gemm.library == "triton"
    assert plan.target == "h100" and plan.device == "NVIDIA H100 80GB HBM3"
    assert plan.jax_version == jax.__version__ and plan.options == ()
    assert plan.flops_by_dtype() == {"bfloat16": 2 * M * N * K}
    assert plan.flop_share(jnp.bfloat16) == plan.flop_share("bfloat16") == 1.0


@needs_compiler
def test_without_triton_gemms_a_bf16_matmul_goes_to_cublas():
    x, w = sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16)
    plan = mpjax.plan(jnp.matmul, triton_gemm=False)(x, w)
    gemm = only(plan.gemms)
    # jax 0.8's XLA sends GEMMs that are not fp8 to legacy cuBLAS unless
    # xla_gpu_enable_cublaslt is set; by jax 0.10.2 cuBLASLt is what it picks.
    if JAX_VERSION >= (0, 10, 2):
        assert gemm.library == "cublaslt"
    elif JAX_VERSION < (0, 9):
        assert gemm.library == "cublas"
    assert (gemm.lhs_dtype, gemm.rhs_dtype, gemm.out_dtype) == (BF16, BF16, BF16)
    assert gemm.flops == 2 * M * N * K
    assert plan.options == (("xla_gpu_enable_triton_gemm", False),)
    assert plan.custom_calls == 1
    # compiler_options reach the compile: cuBLASLt asked for by name, in every version.
    options = {"xla_gpu_enable_cublaslt": True}
    lt = mpjax.plan(jnp.matmul, triton_gemm=False, compiler_options=options)(x, w)
    assert only(lt.gemms).library == "cublaslt"
    assert dict(lt.options) == {**options, "xla_gpu_enable_triton_gemm": False}


@needs_compiler
def test_an_f32_matmul_has_f32_operands():
    plan = mpjax.plan(jnp.matmul)(sds((M, K), jnp.float32), sds((K, N), jnp.float32))
    gemm = only(plan.gemms)
    assert (gemm.lhs_dtype, gemm.rhs_dtype) == (F32, F32)
    assert gemm.flops == 2 * M * N * K
    assert plan.flop_share(jnp.float32) == 1.0 and plan.flop_share(jnp.bfloat16) == 0.0


@needs_compiler
def test_cudnn_attention_is_one_fused_call_forward_and_one_backward():
    q = sds((B, T, H, D), jnp.bfloat16)
    forward = mpjax.plan(attention)(q, q, q)
    call = only(forward.attention)
    assert call.target.startswith("__cudnn$fmha") and not call.backward
    assert call.dtype == BF16 and call.flops == 4 * B * H * T * T * D
    assert forward.gemms == ()

    def loss(q, k, v):
        return attention(q, k, v).astype(jnp.float32).sum()

    backward = mpjax.plan(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q)
    calls = {a.backward: a for a in backward.attention}
    assert sorted(calls) == [False, True]
    assert calls[True].target.endswith("Backward") and calls[True].dtype == BF16
    assert calls[True].flops == 8 * B * H * T * T * D
    assert backward.flop_share(jnp.bfloat16) == 1.0
    assert backward.custom_calls >= 2


@needs_compiler
@pytest.mark.parametrize("triton_gemm", [None, False])
def test_an_fp8_dot_general_stays_an_fp8_gemm(triton_gemm):
    a, b = sds((M, K), jnp.float8_e4m3fn), sds((K, N), jnp.float8_e4m3fn)
    plan = mpjax.plan(fp8_dot, triton_gemm=triton_gemm)(a, b)
    gemm = only(plan.gemms)
    assert (gemm.lhs_dtype, gemm.rhs_dtype, gemm.out_dtype) == (E4M3, E4M3, BF16)
    assert gemm.library == ("triton" if triton_gemm is None else "cublaslt_fp8")
    assert gemm.flops == 2 * M * N * K
    assert plan.flop_share("fp8") == plan.flop_share(jnp.float8_e4m3fn) == 1.0
    assert plan.flop_share(jnp.bfloat16) == 0.0


@needs_compiler
def test_a_scatter_add_shows_with_the_dtype_it_accumulates_in():
    def embedding_grad(idx, rows):
        return jnp.zeros((50, 16), jnp.float32).at[idx].add(rows)

    plan = mpjax.plan(embedding_grad)(sds((8,), jnp.int32), sds((8, 16), jnp.float32))
    scatter = only(plan.scatters)
    assert scatter.dtype == F32 and scatter.name in {
        i.name for i in entry_computation(plan).instructions
    }
    assert plan.gemms == () and plan.fusions >= 1


@needs_compiler
def test_flop_shares_over_the_operand_dtypes_sum_to_one():
    def mixed(x, w, x32, w32, q):
        bf16 = (x @ w).sum() + attention(q, q, q).sum()
        return bf16.astype(jnp.float32) + (x32 @ w32).sum()

    args = (
        sds((M, K), jnp.bfloat16),
        sds((K, N), jnp.bfloat16),
        sds((M, 2 * K), jnp.float32),
        sds((2 * K, N), jnp.float32),
        sds((B, T, H, D), jnp.bfloat16),
    )
    plan = mpjax.plan(mixed)(*args)
    by_dtype = plan.flops_by_dtype()
    bf16 = 2 * M * N * K + 4 * B * H * T * T * D
    assert by_dtype == {"bfloat16": bf16, "float32": 2 * M * N * 2 * K}
    assert plan.total_flops == sum(by_dtype.values())
    assert sum(plan.flop_share(name) for name in by_dtype) == pytest.approx(1.0)
    assert plan.flop_share(jnp.bfloat16) == bf16 / plan.total_flops


@needs_compiler
def test_gemms_in_a_scanned_loop_count_its_trip_count():
    def layers(ws, x):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    plan = mpjax.plan(layers, triton_gemm=False)(
        sds((4, K, K), jnp.bfloat16), sds((M, K), jnp.bfloat16)
    )
    gemm = only(plan.gemms)
    assert gemm.executions == 4 and gemm.computation != entry_computation(plan).name
    assert plan.total_flops == 4 * 2 * M * K * K


@needs_compiler
def test_arrays_pytrees_keywords_and_jitted_functions_with_static_arguments():
    def f(params, x, *, scale):
        return (x @ params["w"]) * scale

    params = {"w": jnp.ones((K, N), jnp.bfloat16)}  # concrete arrays: only shape and dtype count
    plan = mpjax.plan(f)(params, jnp.ones((M, K), jnp.bfloat16), scale=2.0)
    assert only(plan.gemms).flops == 2 * M * N * K

    jitted = jax.jit(lambda x, w, transpose: (x @ w.T) if transpose else x @ w, static_argnums=2)
    plan = mpjax.plan(jitted)(sds((M, K), jnp.bfloat16), sds((N, K), jnp.bfloat16), True)
    assert only(plan.gemms).flops == 2 * M * N * K


@needs_compiler
@pytest.mark.parametrize(
    "target, device", [("a100", "NVIDIA A100-SXM4-80GB"), ("h200", "NVIDIA H200 141GB HBM3e")]
)
def test_the_other_targets_compile(target, device):
    plan = mpjax.plan(jnp.matmul, target.upper())(
        sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16)
    )
    assert (plan.target, plan.device) == (target, device)
    assert only(plan.gemms).lhs_dtype == BF16
    gpus = {c for c in CHIPS if CHIPS[c].platform == "gpu"}  # Blackwell's: test_blackwell_plan
    assert gpus == {"h100", "a100", "h200", "b200", "gb200", "b300", "gb300"}


@needs_compiler
def test_the_plan_is_a_value_with_a_table_and_a_json_form():
    plan = mpjax.plan(fp8_dot, triton_gemm=False)(
        sds((M, K), jnp.float8_e4m3fn), sds((K, N), jnp.float8_e4m3fn)
    )
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["target"] == "h100" and data["options"] == {"xla_gpu_enable_triton_gemm": False}
    gemm = only(data["gemms"])
    assert gemm["library"] == "cublaslt_fp8" and gemm["lhs_dtype"] == "float8_e4m3fn"
    assert gemm["flops"] == 2 * M * N * K and data["flops_by_dtype"] == {
        "float8_e4m3fn": gemm["flops"]
    }
    text = str(plan)
    assert text == plan.table()
    assert "cublaslt_fp8" in text and "float8_e4m3fn 100.0%" in text
    assert "no autotuning" in text and "no timings" in text and "deviceless" in text
    assert "hlo_text" not in repr(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fusions = 0


@needs_compiler
def test_a_plan_reads_the_hlo_of_a_compile_on_the_gpu_itself():
    """On a GPU the benchmark reads the plan of the step it compiled (autotuned); the same
    HLO gives the same rows, and the plan says it was autotuned instead of deviceless."""
    deviceless = mpjax.plan(fp8_dot, triton_gemm=False)(
        sds((M, K), jnp.float8_e4m3fn), sds((K, N), jnp.float8_e4m3fn)
    )
    plan = mpjax.Plan.from_hlo_text(deviceless.hlo_text, device="NVIDIA H100 80GB HBM3")
    assert plan.autotuned and not deviceless.autotuned
    assert (plan.gemms, plan.attention, plan.scatters) == (
        deviceless.gemms,
        deviceless.attention,
        deviceless.scatters,
    )
    assert (plan.fusions, plan.custom_calls) == (deviceless.fusions, deviceless.custom_calls)
    assert "autotuned" in str(plan) and "deviceless" not in str(plan)
    assert plan.to_dict()["autotuned"] is True


def test_a_plan_from_hlo_text_needs_hlo_text():
    with pytest.raises(TypeError, match="HLO module's text, got bytes"):
        mpjax.Plan.from_hlo_text(b"HloModule m", device="x")
    with pytest.raises(ValueError, match="starts with 'HloModule'"):
        mpjax.Plan.from_hlo_text("module @jit_f {}", device="x")


# --- Errors -----------------------------------------------------------------------------------


def test_an_unknown_target_is_a_value_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown target 'v100'.*'a100', 'b200', .*'h200'"):
        mpjax.plan(jnp.matmul, "v100")
    with pytest.raises(ValueError, match="unknown target"):
        plan_unavailable("tpu")


def test_bad_arguments_are_type_errors_naming_them():
    with pytest.raises(
        TypeError, match=r"plan\(fn\): fn must be the function to inspect, got 3 of type int"
    ):
        mpjax.plan(3)
    with pytest.raises(TypeError, match="triton_gemm must be None, True or False"):
        mpjax.plan(jnp.matmul, triton_gemm="off")
    with pytest.raises(TypeError, match="compiler_options must be a mapping"):
        mpjax.plan(jnp.matmul, compiler_options=[("xla_gpu_enable_triton_gemm", False)])
    with pytest.raises(ValueError, match="set one of them"):
        mpjax.plan(
            jnp.matmul, triton_gemm=False, compiler_options={"xla_gpu_enable_triton_gemm": True}
        )


def test_flop_share_names_its_valid_choices():
    plan = plan_module.Plan("h100", "H100", jax.__version__, (), (), (), (), 0, 0)
    assert plan.flop_share("fp8") == 0.0 and plan.total_flops == 0
    with pytest.raises(ValueError, match="'fp8', 'fp4', 'block_scaled' or a dtype"):
        plan.flop_share("int4ish")


@pytest.fixture
def fresh_devices():
    planning_devices.target_devices.cache_clear()
    yield
    planning_devices.target_devices.cache_clear()


def test_without_the_cuda_plugin_the_error_says_how_to_install_it(monkeypatch, fresh_devices):
    monkeypatch.setattr(deviceless, "cuda_plugin_installed", lambda: False)
    x = sds((M, K), jnp.bfloat16)
    with pytest.raises(PlanUnavailableError) as error:
        mpjax.plan(jnp.matmul)(x, sds((K, N), jnp.bfloat16))
    message = str(error.value)
    assert 'pip install "mpjax[cuda12]"' in message and "JAX_PLATFORMS=cpu" in message
    assert "without a GPU" in message
    assert plan_unavailable() == message
    assert isinstance(error.value, RuntimeError)


def test_a_plugin_that_did_not_start_gets_the_environment_variables(monkeypatch, fresh_devices):
    def not_registered(spec, topology):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(deviceless, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(deviceless, "cuda_topology", not_registered)
    reason = plan_unavailable("a100")
    assert "did not start" in reason and "topology not implemented for cuda" in reason
    assert "JAX_PLATFORMS=cpu" in reason and "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1" in reason


# --- What differs between JAX versions (mpjax.jax_compat, mpjax.planning.deviceless) ---------


@pytest.mark.skipif(not deviceless.libtpu_installed(), reason="needs libtpu (the tpu extra)")
def test_tpu_topology_gives_one_chip_and_a_slice():
    # The libtpu of jax 0.8 refuses a slice smaller than its default host of 2x2x1 chips
    # unless it is told the host's size; newer ones assume it.
    devices = deviceless.tpu_topology("v5p:1x1x1").devices
    assert len(devices) == 1 and devices[0].device_kind == "TPU v5"
    assert len(deviceless.tpu_topology("v5e:1x1").devices) == 1
    assert len(deviceless.tpu_topology("v5p:2x2x1").devices) == 4


def test_cuda_version_checks_are_skipped_only_where_no_cuda_platform_is_asked_for(monkeypatch):
    for platforms, skipped in [("cpu", True), ("tpu,cpu", True), ("cuda,cpu", False)]:
        monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
        jax_compat._compile_only_environment(platforms)
        assert ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in os.environ) == skipped
    for platforms in ("gpu", ""):
        monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
        jax_compat._compile_only_environment(platforms)
        assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ


def test_libtpu_is_shared_between_processes_only_where_no_tpu_platform_is_asked_for(monkeypatch):
    # Compile-only use needs no exclusive lock on libtpu: a benchmark's worker processes each
    # compile for a TPU target while the parent has loaded libtpu too.
    for platforms, shared in [("cpu", True), ("cuda,cpu", True), ("tpu,cpu", False), ("", False)]:
        monkeypatch.delenv("ALLOW_MULTIPLE_LIBTPU_LOAD", raising=False)
        jax_compat._compile_only_environment(platforms)
        assert ("ALLOW_MULTIPLE_LIBTPU_LOAD" in os.environ) == shared


SPEC = """gpu_device_info {
  core_count: 132
  scalar_unit_description {
    rate_infos {
      key: 4
    }
  }
  runtime_version: "12.8.0"
  name: "GPU"
}
platform_name: "CUDA"
"""


def test_fields_an_old_jaxlib_lacks_are_dropped_blocks_included():
    no_block = deviceless._drop_field(SPEC, 3, "scalar_unit_description")
    assert "rate_infos" not in no_block and "core_count: 132\n  runtime_version" in no_block
    # A line number that does not hold the field (a shifted text) falls back to its name.
    assert deviceless._drop_field(SPEC, 1, "name") == SPEC.replace('  name: "GPU"\n', "")
    assert deviceless._version_block(SPEC, "runtime_version") == (
        "runtime_version {\n  major: 12\n  minor: 8\n  patch: 0\n}\n"
    )


@needs_compiler
def test_an_unknown_field_of_the_target_description_is_dropped_and_named():
    spec = planning_devices._spec(CHIPS["h100"].spec).replace(
        "  core_count: 132\n", "  core_count: 132\n  no_such_field: 3\n  no_such_block {\n  }\n"
    )
    made = deviceless.cuda_topology(spec)
    assert made.topology is not None
    assert {"GpuDeviceInfoProto.no_such_field", "GpuDeviceInfoProto.no_such_block"} <= set(
        made.dropped
    )
    # jaxlib 0.8.1 knows neither the finer GPU description nor where the CUDA version moved;
    # jax 0.12 knows the whole shipped spec.
    dropped = deviceless.cuda_topology(planning_devices._spec(CHIPS["h100"].spec)).dropped
    if JAX_VERSION < (0, 9):
        assert "GpuDeviceInfoProto.runtime_version" in dropped
    if JAX_VERSION >= (0, 12):
        assert dropped == ()


@needs_compiler
def test_old_jaxlibs_compile_untuned_and_print_through_a_dump():
    mpjax.plan(jnp.matmul)(sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16))
    learned = deviceless._deviceless
    # Seen in jax 0.8.1: Triton GEMMs want autotuning and the executable has no HLO text;
    # jax 0.10.2 and later need neither workaround.
    if JAX_VERSION < (0, 9):
        assert learned == {"untuned": True, "dump": True}
    if JAX_VERSION >= (0, 10, 2):
        assert not any(learned.values())


# --- The text form of HLO ---------------------------------------------------------------------


def test_hlo_text_reads_tuples_inline_operands_comments_and_json():
    module = parse_module(
        """HloModule m, entry_computation_layout={(bf16[2,4]{1,0})->bf16[2,2]{1,0}}

%fused (p: bf16[2,4]) -> bf16[2,2] {
  %p = bf16[2,4]{1,0} parameter(0)
  ROOT %d = bf16[2,2]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main.1 (a.1: bf16[2,4]) -> bf16[2,2] {
  %a.1 = bf16[2,4]{1,0} parameter(0), sharding={replicated}
  %c = (bf16[2,2]{1,0}, s8[64]{0}) custom-call(bf16[2,4]{1,0} %a.1, /*index=1*/%a.1), custom_call_target="__cublas$lt$matmul", backend_config={"k": {"dims": ["1"]}, "s": "a, b}"}
  %f = bf16[2,2]{1,0} fusion(%a.1), kind=kCustom, calls=%fused, metadata={op_name="jit(f)/dot"}
  ROOT %g = bf16[2,2]{1,0} get-tuple-element(%c), index=0
}
"""
    )
    entry = module.entry_computation
    assert module.entry == "main.1" and set(module.computations) == {"fused", "main.1"}
    c = entry["c"]
    assert c.is_tuple and c.shapes == (HloShape("bf16", (2, 2)), HloShape("s8", (64,)))
    assert c.operands == ("a.1", "a.1") and c.custom_call_target == "__cublas$lt$matmul"
    assert c.operand_shapes == (HloShape("bf16", (2, 4)), None)
    assert c.backend_config() == {"k": {"dims": ["1"]}, "s": "a, b}"}
    assert entry.operand_shape(c, 1) == HloShape("bf16", (2, 4))
    assert entry["f"].called_computations() == ("fused",) and entry["g"].root
    assert module.computations["fused"]["p"].operands == ()
    # A computation may close with its attributes (a TPU7x's SparseCore ones do).
    threaded = parse_module(
        "%sc (p: f32[2]) -> f32[2] {\n  ROOT %p = f32[2]{0} parameter(0)\n}, "
        'execution_thread="sparsecore"\n\nENTRY %main (a: f32[2]) -> f32[2] {\n'
        "  ROOT %a = f32[2]{0} parameter(0)\n}\n"
    )
    assert set(threaded.computations) == {"sc", "main"} and threaded.entry == "main"


@needs_compiler
def test_mixed_fp8_dots_compile_with_xla_defaults_exactly_where_jax_compat_says():
    """jax_compat.mixed_fp8_dots decides whether mpjax.fp8 writes its e5m2 x e4m3 backward
    GEMMs on fp8 operands; XLA's Triton GEMMs of older JAX refuse them."""

    def mixed(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    args = sds((M, K), jnp.float8_e5m2), sds((K, N), jnp.float8_e4m3fn)
    try:
        plan = mpjax.plan(mixed)(*args)
    except Exception as error:  # XLA's compile error; its type differs between versions
        assert not jax_compat.mixed_fp8_dots(), error
        assert "same types" in str(error)
    else:
        assert jax_compat.mixed_fp8_dots()
        assert only(plan.gemms).lhs_dtype == np.dtype(jnp.float8_e5m2)
    # With Triton GEMMs off, cuBLASLt takes them in every version.
    plan = mpjax.plan(mixed, triton_gemm=False)(*args)
    assert only(plan.gemms).library in ("cublaslt_fp8", "cublas")


# --- TPU targets ------------------------------------------------------------------------------
# These compile with libtpu (`pip install "mpjax[tpu]"`, no TPU needed) and skip without it; CI
# installs it and sets MPJAX_REQUIRE_TPU_PLAN, which turns a missing libtpu into an error.

TPU_REASON = plan_unavailable("v5p")
needs_libtpu = pytest.mark.skipif(
    TPU_REASON is not None, reason=f"the plan cannot compile for a TPU: {TPU_REASON}"
)


@needs_libtpu
def test_a_tpu_plan_reads_the_matrix_unit_matmuls_memory_and_xla_estimate():
    p = mpjax.plan(jnp.matmul, "v5p")(sds((M * 8, K * 8), jnp.bfloat16), sds((K * 8, N * 8), BF16))
    gemm = only(p.gemms)
    assert (p.platform, p.target, p.devices) == ("tpu", "v5p", 1)
    assert gemm.library == "mxu" and gemm.lhs_dtype == gemm.rhs_dtype == BF16
    assert gemm.flops == 2 * (M * 8) * (N * 8) * (K * 8) == p.total_flops
    assert p.flop_share(jnp.bfloat16) == 1.0
    # XLA's estimate, the roofline bound at v5p's published bf16 peak, and the MFU between them.
    assert p.estimated_seconds is not None and p.estimated_seconds > 0
    assert p.roofline_seconds == pytest.approx(p.total_flops / CHIPS["v5p"].peak_flops["bf16"])
    assert p.mfu() == pytest.approx(p.total_flops / (p.estimated_seconds * p.peak_flops))
    assert p.mfu(model_flops=p.total_flops / 2) == pytest.approx(p.mfu() / 2)
    assert p.memory.fits and p.memory.capacity_bytes == CHIPS["v5p"].hbm_bytes
    assert p.memory.argument_bytes == 2 * (M * 8 * K * 8 + K * 8 * N * 8)
    data = json.loads(json.dumps(p.to_dict()))
    assert data["estimated_seconds"] == p.estimated_seconds and data["memory"]["fits"] is True
    text = str(p)
    assert "estimated time per call (XLA's cost model, an estimate)" in text
    assert "roofline bound" in text and "TPU plan for v5p" in text
    with pytest.raises(ValueError, match="model_flops must be a positive number"):
        p.mfu(model_flops=-1)


@needs_libtpu
def test_a_tpu_batched_matmul_written_as_a_convolution_counts_only_what_it_sums():
    # XLA's TPU compiler writes a batched matmul as a convolution whose batch dimensions are
    # dilated windows: they sum over nothing, so the FLOPs are those of the batched matmul.
    batch, i, j, k = 3, 128, 256, 64
    p = mpjax.plan(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), "v5p")(
        sds((batch, i, j), jnp.bfloat16), sds((batch, j, k), jnp.bfloat16)
    )
    assert p.total_flops == 2 * batch * i * j * k
    # Its gradients are two more batched matmuls of the same size, one written with the
    # dilation and padding of a transpose: they sum over nothing more either.
    loss = lambda a, b: jnp.einsum("bij,bjk->bik", a, b).astype(jnp.float32).sum()  # noqa: E731
    grads = mpjax.plan(jax.grad(loss, argnums=(0, 1)), "v5p")(
        sds((batch, i, j), jnp.bfloat16), sds((batch, j, k), jnp.bfloat16)
    )
    assert grads.total_flops == 2 * (2 * batch * i * j * k)


def _tpu_convolution_flops(lhs: str, rhs: str, out: str, attributes: str) -> int:
    """The FLOPs a TPU plan counts for one ``convolution`` of the given shapes and attributes."""
    text = f"""HloModule m, entry_computation_layout={{}}

ENTRY %main (p0: {lhs}, p1: {rhs}) -> {out} {{
  %p0 = {lhs} parameter(0)
  %p1 = {rhs} parameter(1)
  ROOT %conv = {out} convolution(%p0, %p1), {attributes}
}}
"""
    return only(read_module(parse_module(text), "tpu")["gemms"]).flops


def test_a_tpu_convolution_counts_the_window_taps_that_read_real_input():
    # The attention backward of a 4-device step (batch 2, 4 heads, 128 x 32 per head) writes
    # P^T x dO with its batch windows over a padded base rather than a dilated one: each output
    # element meets one real tap there, so the FLOPs are those of the batched matmul.
    flops = _tpu_convolution_flops(
        "bf16[2,128,4,32]",
        "bf16[2,4,128,128]",
        "bf16[2,4,128,32]",
        "window={size=2x4 stride=2x4 pad=1_1x3_3 lhs_dilate=1x3 rhs_reversal=1x1}, "
        "dim_labels=0f1b_01oi->01fb",
    )
    assert flops == 2 * (2 * 4) * 128 * 128 * 32
    # An ordinary 3x3 convolution padded to keep an 8x8 image: a border output reads fewer
    # real pixels (22 real taps along each axis rather than 8 x 3).
    flops = _tpu_convolution_flops(
        "f32[1,8,8,16]",
        "f32[3,3,16,32]",
        "f32[1,8,8,32]",
        "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f",
    )
    assert flops == 2 * 32 * 16 * (8 * 3 - 2) ** 2


@needs_libtpu
def test_a_tpu_plan_shows_the_precision_of_each_float32_matmul():
    x = sds((256, 256), jnp.float32)
    default = mpjax.plan(jnp.matmul, "v5p")(x, x)
    highest = mpjax.plan(lambda a, b: jnp.matmul(a, b, precision="highest"), "v5p")(x, x)
    assert default.float32_precisions() == {"default": 2 * 256**3}
    assert highest.float32_precisions() == {"highest": 2 * 256**3}
    assert only(highest.gemms).precision == "highest"
    # At HIGHEST a TPU multiplies float32 in six bf16 passes, one at DEFAULT: the roofline bound
    # says so (XLA's own estimate may not).
    assert highest.roofline_seconds == pytest.approx(6 * default.roofline_seconds)
    assert "float32 matmuls at precision: highest 100.0%" in str(highest)


@needs_libtpu
def test_a_step_that_does_not_fit_says_by_how_much():
    # 120,000 x 120,000 float32 scores: 57.6 GB of temporaries on a 16 GiB v5e.
    p = mpjax.plan(lambda a: jnp.tanh(a @ a.T) @ a, "v5e")(sds((120_000, 1024), jnp.float32))
    assert not p.compiled and not p.memory.fits and p.memory.margin_bytes < 0
    assert 15 * 2**30 < p.memory.available_bytes <= CHIPS["v5e"].hbm_bytes
    assert p.gemms == () and "does NOT fit" in str(p) and "missing" in str(p)


@needs_libtpu
def test_a_tpu_slice_plans_each_device_of_a_sharded_step():
    mesh = mpjax.plan_mesh("v5p:2x2x1", (4,), ("data",))
    assert mesh.devices.size == 4 and mesh.axis_names == ("data",)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16, sharding=sharded)
    w = sds((512, 256), jnp.bfloat16)  # no sharding: replicated on the slice
    p = mpjax.plan(jnp.matmul, "v5p:2x2x1")(x, w)
    assert p.devices == 4 and p.total_flops == 2 * (64 // 4) * 512 * 256
    with pytest.raises(ValueError, match="multiply to the 4 devices of 'v5p:2x2x1'"):
        mpjax.plan_mesh("v5p:2x2x1", (3,), ("data",))


@needs_libtpu
def test_a_tpu_plan_finds_pallas_attention_and_says_what_its_estimate_leaves_out():
    def step(q, k, v):
        def loss(*qkv):
            return mpjax.dot_product_attention(*qkv, is_causal=True).astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    b, t, n, h = 2, 256, 2, 64
    arg = sds((b, t, n, h), jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        p = mpjax.plan(step, "v5p")(arg, arg, arg)
    # Pallas's forward kernel, and its backward as two (dK/dV, dQ): nominal FLOPs of two
    # matmuls forward and four backward, no materialized [B, H, T, T] scores.
    assert [a.backward for a in p.attention] == [False, True, True]
    assert {a.target for a in p.attention} == {"tpu_custom_call"}
    assert sum(a.flops for a in p.attention) == 3 * 4 * b * n * t * t * h
    assert p.gemms == ()  # no score matmul left to XLA
    # The backward kernels declare no cost: XLA's estimate leaves their work out, and says so.
    assert p.modelled_flops < p.total_flops
    assert "count only what their own cost estimates declare" in p.summary()


@needs_libtpu
def test_a_cost_model_figure_that_is_no_time_is_no_estimate(monkeypatch):
    # XLA's cost model has returned a negative time (a v5e step with many custom calls): the
    # plan then has no estimate rather than a nonsense one.
    compile_for = deviceless.deviceless_compile

    def negative(lowered, options):
        result = compile_for(lowered, options)
        return result._replace(cost={**result.cost, "optimal_seconds": -483.0})

    monkeypatch.setattr(deviceless, "deviceless_compile", negative)
    p = mpjax.plan(jnp.matmul, "v5e")(sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16))
    assert p.estimated_seconds is None and p.mfu() is None and p.rejected_seconds == -483.0
    assert "estimated time" not in p.summary() and "roofline bound" in p.summary()
    assert "no time estimate: XLA's cost model gave -483 s for one call" in p.summary()
    # A scanned step's estimate comes from its compile unrolled (seen negative for the 1b
    # step on 64 TPU7x chips): its loops are then not modelled, and the summary says why.
    w = sds((K, K), jnp.bfloat16)

    def scanned(x, w):
        return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=4)[0]

    looped = mpjax.plan(scanned, "v5e")(sds((M, K), jnp.bfloat16), w)
    assert looped.estimated_seconds is None and not any(loop.modelled for loop in looped.loops)
    assert (
        "no time estimate: XLA's cost model counts a loop's body once, and for the step's 1 scan "
        "XLA's cost model gave -483 s for the step with them unrolled"
    ) in looped.summary()


@pytest.mark.parametrize(
    "target, reason", [("h100", REASON), ("v5p", TPU_REASON)], ids=["h100", "v5p"]
)
def test_a_loss_scaled_step_is_planned_without_its_host_callback(target, reason):
    # A host callback (the persistent-overflow warning's) cannot lower for a device this process
    # lacks: the plan traces the step without it, and the step still skips on overflow.
    if reason is not None:
        pytest.skip(reason)
    tx = mpjax.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.ones((M, K))}

    def step(params, state, x):
        loss, grads = mpjax.scaled_value_and_grad(lambda p: jnp.sum(x @ p["w"].T) ** 2)(
            state, params
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    p = mpjax.plan(step, target)(params, tx.init(params), sds((N, K), jnp.float32))
    assert p.compiled and not re.search(r'custom_call_target="[^"]*callback', p.hlo_text)
    jaxpr = str(jax.make_jaxpr(step)(params, tx.init(params), jnp.ones((N, K))))
    assert "debug_callback" in jaxpr  # traced as usual, the warning is there


def test_tpu_targets_are_checked_at_the_call():
    for bad in ("v5p:2x2", "v9", "v5p:", "tpu"):
        with pytest.raises(ValueError, match=r"unknown target .*'v5p:2x2x1'"):
            mpjax.plan(jnp.matmul, bad)
    with pytest.raises(ValueError, match="triton_gemm chooses between GPU GEMM libraries"):
        mpjax.plan(jnp.matmul, "v5e", triton_gemm=False)


def test_without_libtpu_the_error_says_how_to_install_it(monkeypatch, fresh_devices):
    monkeypatch.setattr(deviceless, "libtpu_installed", lambda: False)
    reason = plan_unavailable("v6e")
    assert 'pip install "mpjax[tpu]"' in reason and "JAX_PLATFORMS=cpu" in reason
    with pytest.raises(PlanUnavailableError, match="libtpu, which is not installed"):
        mpjax.plan(jnp.matmul, "v6e")(sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16))


# --- What a sharded step sends, and loops. --------------------------------------------------

_COLLECTIVES_HLO = """HloModule m, entry_computation_layout={}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: bf16[32,128], p1: f32[128,128], p2: f32[64], p3: bf16[16,8]) -> bf16[128,128] {
  %p0 = bf16[32,128] parameter(0)
  %gather = bf16[128,128] all-gather(%p0), replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}, dimensions={0}, metadata={op_name="jit(step)/jvp(M)/mpjax[p=f32,c=bf16,o=f32]fc/mpjax[p=f32,c=bf16,o=f32]fc/convert_element_type"}
  %p1 = f32[128,128] parameter(1)
  %scatter = f32[32,128] reduce-scatter(%p1), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(M))/mpjax[p=f32,c=bf16,o=f32]fc/dot_general"}
  %p2 = f32[64] parameter(2)
  %start = (f32[64], f32[64]) all-reduce-start(%p2), replica_groups=[4,2]<=[8], to_apply=%add
  %done = f32[64] all-reduce-done(%start)
  %p3 = bf16[16,8] parameter(3)
  %permute = bf16[16,8] collective-permute(%p3), source_target_pairs={{0,1},{1,0}}
  ROOT %out = bf16[128,128] copy(%gather)
}
"""


def test_a_plan_reads_collectives_with_their_kind_dtype_bytes_groups_and_module():
    from mpjax.planning.collectives import read_collectives

    rows = {c.name: c for c in read_collectives(parse_module(_COLLECTIVES_HLO))}
    assert set(rows) == {"gather", "scatter", "start", "permute"}  # a -done moves nothing more
    gather, scatter, start, permute = (rows[n] for n in ("gather", "scatter", "start", "permute"))
    # An FSDP parameter gathered in bf16 over the mesh's 4-device fsdp axis, for module fc.
    assert (gather.kind, gather.dtype, gather.bytes, gather.devices) == (
        "all-gather",
        BF16,
        128 * 128 * 2,
        4,
    )
    assert gather.module == "fc" and not gather.backward
    # Its gradient reduce-scattered in f32, in the backward pass; groups listed.
    assert (scatter.kind, scatter.dtype, scatter.bytes, scatter.devices) == (
        "reduce-scatter",
        F32,
        128 * 128 * 4,
        4,
    )
    assert scatter.module == "fc" and scatter.backward
    # An asynchronous all-reduce over iota groups of 2, outside any module; a permute.
    assert (start.kind, start.bytes, start.devices, start.module) == ("all-reduce", 256, 2, "")
    assert (permute.kind, permute.dtype, permute.bytes, permute.devices) == (
        "collective-permute",
        BF16,
        16 * 8 * 2,
        2,
    )


_LOOP_HLO = """HloModule m, entry_computation_layout={}

%cond (c: (s32[], f32[8,8])) -> pred[] {
  %c = (s32[], f32[8,8]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %b = (s32[], f32[8,8]) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[8,8] get-tuple-element(%b), index=1
  %y = f32[8,8] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,8]) tuple(%j, %y)
}

ENTRY %main (p: f32[8,8]) -> (s32[], f32[8,8]) {
  %p = f32[8,8] parameter(0)
  %start = s32[] constant(START)
  %init = (s32[], f32[8,8]) tuple(%start, %p)
  ROOT %loop = (s32[], f32[8,8]) while(%init), condition=%cond, body=%body
}
"""


@pytest.mark.parametrize("start, trips", [(0, 6), (2, 4)])
def test_a_loop_without_a_known_trip_count_is_counted_from_its_condition(start, trips):
    # A TPU compile writes no known_trip_count: the condition, counter < 6 from START, says it.
    fields = read_module(parse_module(_LOOP_HLO.replace("START", str(start))), "tpu")
    assert only(fields["gemms"]).executions == trips
    # Only a loop the program wrote (JAX's while, by its op name) counts as the step's loop,
    # not one XLA made itself (a matmul split over permutes carries the matmul's op name).
    for op_name, loops in (("jit(f)/while", (trips,)), ("jit(f)/dot_general", ())):
        text = _LOOP_HLO.replace("START", str(start)).replace(
            "body=%body", f'body=%body, metadata={{op_name="{op_name}"}}'
        )
        assert loop_trip_counts(parse_module(text)) == loops


@needs_libtpu
def test_a_sharded_step_on_a_tpu_slice_reports_what_it_sends_and_for_which_module():
    import flax.linen as nn

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(512, name="fc2")(jax.nn.gelu(nn.Dense(512, name="fc1")(x)))

    model = mpjax.linen.apply_policy(Mlp(), "mixed_bfloat16")
    mesh = mpjax.plan_mesh("v5p:2x2x1", (4,), ("fsdp",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows),
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((8, 512)))["params"],
    )
    x = jax.ShapeDtypeStruct((4096, 512), jnp.float32, sharding=rows)

    def grads(params, x):
        loss = lambda p: jnp.square(model.apply({"params": p}, x).astype(jnp.float32)).mean()  # noqa: E731
        return jax.grad(loss)(params)

    p = mpjax.plan(grads, "v5p:2x2x1")(params, x)
    kernels = [c for c in p.collectives if c.kind == "all-gather" and c.bytes == 512 * 512 * 2]
    # Each FSDP kernel is gathered whole, in bf16 (cast before the gather), for its own module.
    assert {c.module for c in kernels} == {"fc1", "fc2"}, p.table()
    assert all(c.dtype == BF16 and c.devices == 4 and not c.backward for c in kernels)
    # Their gradients leave over the same 4 devices in the backward pass.
    back = [c for c in p.collectives if c.backward and c.module in ("fc1", "fc2")]
    assert back and all(c.devices == 4 for c in back), p.table()
    moved = p.collective_bytes()
    assert moved["all-gather bfloat16"] >= 2 * 512 * 512 * 2
    assert "collectives per device and call: all-gather bfloat16" in p.summary()
    assert json.loads(json.dumps(p.to_dict()))["collective_bytes"] == moved


def test_gpu_clusters_are_named_by_hosts_and_gpus_per_host():

    assert parse_target("h100:2x8").topology == "1x2x8" and parse_target("h100:2x8").chips == 16
    assert parse_target("H100:8").topology == "1x1x8"
    assert parse_target("h100").topology == "1x1x1"
    for bad in ("h100:0x8", "h100:2x8x1", "v100:8", "h100:"):
        with pytest.raises(ValueError, match=r"unknown target .*'h100:2x8': 2 hosts of 8"):
            mpjax.plan(jnp.matmul, bad)


def test_peak_flops_follow_the_operand_dtypes_fp4_included():
    """fp4 operand pairs run at the chip's fp4 peak, falling back to fp8 and then bf16 where
    it has none; an fp8 operand with an fp4 one at the slower of the two; a bf16 operand with
    a narrower one at the bf16 peak."""
    from mpjax.planning.targets import parse_target

    e2m1, e4m3, e5m2 = "float4_e2m1fn", "float8_e4m3fn", "float8_e5m2"
    b200, h100, a100 = (parse_target(t) for t in ("b200", "h100", "a100"))
    assert b200.peak_flops(e2m1, e2m1) == 9000e12
    assert b200.peak_flops(e4m3, e5m2) == 4500e12
    assert b200.peak_flops(e4m3, e2m1) == b200.peak_flops(e2m1, e4m3) == 4500e12
    assert b200.peak_flops("bfloat16", e2m1) == b200.peak_flops("float16", "float16") == 2250e12
    assert b200.peak_flops("float32", e2m1) == 1100e12  # TF32 at the default precision
    assert b200.peak_flops("float32", "float32", "highest") == 75e12
    assert parse_target("b300").peak_flops(e2m1, e2m1) == 13500e12
    assert parse_target("gb200:2x4").peak_flops(e2m1, e2m1) == 10000e12
    assert h100.peak_flops(e2m1, e2m1) == h100.peak_flops(e4m3, e2m1) == 1979e12  # fp8's
    assert a100.peak_flops(e2m1, e2m1) == a100.peak_flops(e4m3, e4m3) == 312e12  # bf16's
    assert parse_target("v5p").peak_flops(e2m1, e2m1) == 459e12


@needs_compiler
def test_a_gpu_cluster_plans_each_device_of_a_sharded_step_and_what_it_sends():
    mesh = mpjax.plan_mesh("h100:2x8", (2, 8), ("data", "fsdp"))
    assert mesh.devices.size == 16
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=rows)  # f32 master, FSDP rows
    p = mpjax.plan(lambda x, w: x @ w.astype(jnp.bfloat16), "h100:2x8")(x, w)
    assert p.devices == 16 and p.platform == "gpu"
    assert p.total_flops == 2 * (1024 // 16) * 512 * 512  # one device's share
    # The weight is cast before it is gathered: the gather moves bf16, over all 16 GPUs.
    assert p.collective_bytes() == {"all-gather bfloat16": 512 * 512 * 2}, p.table()
    assert only(p.collectives).devices == 16
    assert "GPU plan for h100:2x8 (NVIDIA H100 80GB HBM3, 16 devices)" in str(p)


def test_a_combined_collective_names_the_modules_of_each_operand():
    from mpjax.planning.collectives import read_collectives

    region = "mpjax[p=f32,c=bf16,o=f32]"
    text = f"""HloModule m, entry_computation_layout={{}}

ENTRY %main (p0: f32[8], p1: f32[8], p2: f32[8], p3: f32[8]) -> (bf16[32], bf16[32]) {{
  %p0 = f32[8] parameter(0)
  %a = bf16[8] convert(%p0), metadata={{op_name="jit(f)/{region}h0/fc/convert_element_type"}}
  %p1 = f32[8] parameter(1)
  %b = bf16[8] convert(%p1), metadata={{op_name="jit(f)/{region}h1/fc/convert_element_type"}}
  ROOT %g = (bf16[32], bf16[32]) all-gather(%a, %b), replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, metadata={{op_name="jit(f)/{region}h0/fc/dot_general"}}
}}
"""
    (row,) = read_collectives(parse_module(text))
    assert row.modules == ("h0/fc", "h1/fc") and row.module == "h0/fc"
    assert (row.bytes, row.devices) == (2 * 32 * 2, 4)
    many = dataclasses.replace(row, modules=tuple(f"h{i}" for i in range(5)))
    assert many.modules_text == "h0, h1, h2 and 2 more"


def test_an_async_combined_collective_counts_every_value_by_dtype():
    """A GPU's combined collectives are async: ``((operands...), (results...))``. Each value
    counts, and one collective of two dtypes is two rows (the table of bytes by dtype)."""
    from mpjax.planning.collectives import read_collectives

    region = "mpjax[p=f32,c=bf16,o=f32]"
    text = f"""HloModule m, entry_computation_layout={{}}

ENTRY %main (p0: f32[2], p1: s32[2], p2: f32[64,8], p3: f32[32]) -> f32[8,8] {{
  %p0 = f32[2] parameter(0)
  %p1 = s32[2] parameter(1)
  %g = ((f32[2], s32[2]), (f32[16], s32[16])) all-gather-start(%p0, %p1), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, metadata={{op_name="jit(f)/{region}ln/all_gather"}}
  %gd = (f32[16], s32[16]) all-gather-done(%g)
  %p2 = f32[64,8] parameter(2)
  %w = f32[64,8] add(%p2, %p2), metadata={{op_name="jit(f)/transpose(jvp({region}))/{region}h0/fc/dot_general"}}
  %p3 = f32[32] parameter(3)
  %v = f32[32] add(%p3, %p3), metadata={{op_name="jit(f)/transpose(jvp({region}))/{region}h1/fc/dot_general"}}
  %r = ((f32[64,8], f32[32]), (f32[8,8], f32[4])) reduce-scatter-start(%w, %v), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, to_apply=%add, metadata={{op_name="jit(f)/transpose(jvp({region}))/{region}h0/fc/dot_general"}}
  ROOT %rd = (f32[8,8], f32[4]) reduce-scatter-done(%r)
}}
"""
    rows = [
        (c.name, c.kind, c.dtype.name, c.bytes, c.modules)
        for c in read_collectives(parse_module(text))
    ]
    assert rows == [
        ("g", "all-gather", "float32", 16 * 4, ()),
        ("g", "all-gather", "int32", 16 * 4, ()),
        ("r", "reduce-scatter", "float32", (64 * 8 + 32) * 4, ("h0/fc", "h1/fc")),
    ]


def test_a_collective_sends_its_ring_share_and_its_time_is_bounded_by_the_interconnect():
    from mpjax.planning.collectives import PlanCollective, seconds_bound, table_rows

    mib = 2**20
    gather = PlanCollective("g", "main", "all-gather", BF16, 8 * mib, devices=8, executions=2)
    reduce = dataclasses.replace(gather, name="r", kind="all-reduce", executions=1)
    permute = dataclasses.replace(gather, name="p", kind="collective-permute", devices=2)
    # A ring of 8: each device sends 7/8 of a gather, twice that of an all-reduce; a permute
    # sends it all.
    assert (gather.wire_bytes, reduce.wire_bytes, permute.wire_bytes) == (
        2 * 7 * mib,
        2 * 7 * mib,
        2 * 8 * mib,
    )
    assert seconds_bound([gather, reduce, permute], 600e9) == 44 * mib / 600e9
    header, rows = table_rows([gather], 600e9, estimate=0.01)
    assert header[-2:] == ("time bound", "of the estimate")
    assert rows[0][-2:] == (f"{14 * mib / 600e9 * 1e3:.3g} ms", f"{14 * mib / 600e9 / 0.01:.1%}")
    header, rows = table_rows([gather], 0.0, estimate=None)  # a GPU: no bandwidth to bound by
    assert header[-1] == "runs" and len(rows[0]) == len(header)
    assert mpjax.planning.targets.CHIPS["h100"].interconnect_bandwidth == 0.0


@needs_libtpu
def test_a_slice_libtpu_cannot_make_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"'v5p:3x5x7' is not a TPU slice: .*INVALID_ARGUMENT"):
        mpjax.plan_mesh("v5p:3x5x7")


@pytest.mark.parametrize(
    "target, reason", [("h100:8", REASON), ("v5p:2x2x2", TPU_REASON)], ids=["h100:8", "v5p:2x2x2"]
)
def test_a_loss_scaled_step_compiles_ahead_of_time_for_compile_only_devices(target, reason):
    """The route of JAX's AOT guide and MaxText's train_compile: a mesh of compile-only
    devices, arguments sharded on it, ``jax.jit(step).lower(...).compile()``. The
    persistent-overflow warning's host callback cannot lower there: the step leaves it out for
    platforms this process has no devices of (chosen when lowered), saying so once, and
    compiles, its collectives included; ``mpjax.compile_only()`` leaves it out silently."""
    if reason is not None:
        pytest.skip(reason)
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = mpjax.plan_mesh(target)
    tx = mpjax.loss_scaling(optax.sgd(0.1), "dynamic")

    def step(params, state, x):
        loss, grads = mpjax.scaled_value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(
            state, params
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def on_mesh(tree, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )

    params = {"w": jnp.ones((K, N))}
    args = (
        on_mesh(params, PartitionSpec()),
        on_mesh(jax.eval_shape(tx.init, params), PartitionSpec()),
        on_mesh(jax.ShapeDtypeStruct((8 * M, K), jnp.float32), PartitionSpec("data")),
    )
    local = (params, tx.init(params), jnp.ones((8, K)))
    jax.jit(step)(*local)  # run here first: traced, and cached, with the warning's callback
    loss_scaling_module._said_left_out.clear()
    with pytest.warns(mpjax.LossScalingWarning, match="left out of that compile") as said:
        plain = jax.jit(step).lower(*args).compile()
        jax.jit(lambda *a: step(*a)).lower(*args)  # another step: said once per platform
    assert len(said) == 1 and "mpjax.compile_only()" in str(said[0].message)
    assert "callback" not in (plain.as_text() or "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: nothing to say
        with mpjax.compile_only():
            lowered = jax.jit(step).lower(*args)
    assert "callback" not in (lowered.compile().as_text() or "")
    # The step traced to run here keeps the warning, and it lowers here with its callback.
    assert "debug_callback" in str(jax.make_jaxpr(jax.jit(step))(*local))
    assert "callback" in jax.jit(step).lower(*local).compile().as_text()


@pytest.mark.skipif(TPU_REASON is not None, reason=f"the plan cannot compile: {TPU_REASON}")
def test_ironwood_and_v6e_slices_are_targets_with_their_devices_and_peaks():
    """TPU7x (Ironwood): two devices per chip, each half the chip's 192 GiB and peaks; XLA's
    cost model gives an fp8 GEMM no less than the bf16 time there, where the published fp8
    peak is twice bf16's (the roofline shows the published one)."""
    assert parse_target("tpu7x").topology == "tpu7x:1x1x1"
    assert parse_target("tpu7x:2x2x1").chips == 4
    assert len(mpjax.plan_mesh("tpu7x:2x2x1").devices.flat) == 8
    assert len(mpjax.plan_mesh("v6e:4x4").devices.flat) == 16
    x = sds((4096, 4096), jnp.bfloat16)
    bf16 = mpjax.plan(jnp.matmul, "tpu7x:2x2x1")(x, x)
    assert bf16.device == "TPU7x" and bf16.memory.capacity_bytes == 96 * 2**30
    assert bf16.roofline_seconds == pytest.approx(2 * 4096**3 / (2307e12 / 2))
    q = sds((4096, 4096), jnp.float8_e4m3fn)

    def fp8(a, b):
        return jax.lax.dot_general(
            a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    narrow = mpjax.plan(fp8, "tpu7x:2x2x1")(q, q)
    assert narrow.roofline_seconds == pytest.approx(bf16.roofline_seconds / 2)
    assert narrow.estimated_seconds >= 0.95 * bf16.estimated_seconds  # no faster by XLA's model


@pytest.mark.skipif(TPU_REASON is not None, reason=f"the plan cannot compile: {TPU_REASON}")
def test_a_tpu7x_plan_reads_the_collectives_its_sparsecores_run():
    """A TPU7x offloads collectives to its SparseCores: the entry launches them with
    call-start/call-update/call-done, the all-gather or reduce-scatter itself in a computation
    of the SparseCore thread (closed by ``}, execution_thread="sparsecore"``). The plan reads
    them there, as it reads a v5p's in the entry: the FSDP step's weights gathered and its
    gradients reduce-scattered."""
    mesh = mpjax.plan_mesh("tpu7x:2x2x1")
    plan = mpjax.plan(_fsdp_step, "tpu7x:2x2x1")(*_fsdp_step_args(mesh, "data"))
    assert "call-start()" in plan.hlo_text and 'execution_thread="sparsecore"' in plan.hlo_text
    offloaded = {
        c.kind for c in plan.collectives if c.computation != parse_module(plan.hlo_text).entry
    }
    assert {"all-gather", "reduce-scatter"} <= offloaded, plan.summary()
    v5p = mpjax.plan(_fsdp_step, "v5p:2x2x1")(
        *_fsdp_step_args(mpjax.plan_mesh("v5p:2x2x1"), "data")
    )
    assert {c.kind for c in v5p.collectives} <= {c.kind for c in plan.collectives}


def _fsdp_step_args(mesh, axis):
    """An FSDP step's arguments on ``mesh``: weights sharded along ``axis``, the batch too."""
    from jax.sharding import NamedSharding, PartitionSpec

    def sharded(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    params = {
        "w1": sharded((512, 1024), PartitionSpec(axis)),
        "w2": sharded((1024, 512), PartitionSpec(axis)),
    }
    return params, sharded((64, 512), PartitionSpec(axis))


def _fsdp_step(params, x):
    def loss(p):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.mark.skipif(TPU_REASON is not None, reason=f"the plan cannot compile: {TPU_REASON}")
def test_a_step_sharded_on_the_users_own_topology_devices_keeps_its_shardings():
    """The route of JAX's topologies guide (and MaxText's train_compile): devices from the
    user's own get_topology_desc, other objects than plan_mesh's. The plan compiles the
    shardings given, and finds the collectives of the step's own compile."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu")
    own = jax.sharding.Mesh(np.asarray(topology.devices), ("fsdp",))
    args = _fsdp_step_args(own, "fsdp")
    plan = mpjax.plan(_fsdp_step, "v5p:2x2x2")(*args)
    ours = mpjax.plan(_fsdp_step, "v5p:2x2x2")(
        *_fsdp_step_args(mpjax.plan_mesh("v5p:2x2x2"), "data")
    )
    assert plan.collective_bytes() and plan.collective_bytes() == ours.collective_bytes()
    compiled = jax.jit(_fsdp_step).lower(*args).compile().as_text()
    for kind in ("all-gather", "reduce-scatter"):
        assert (kind in compiled) == any(c.kind == kind for c in plan.collectives), kind


@pytest.mark.skipif(TPU_REASON is not None, reason=f"the plan cannot compile: {TPU_REASON}")
def test_arguments_sharded_on_devices_that_cannot_be_the_targets_are_refused():
    cpu = jax.sharding.Mesh(np.asarray(jax.devices("cpu")[:8]), ("data",))
    with pytest.raises(
        ValueError, match=r"argument args\[0\]\['w1'\] is sharded over 8 cpu devices"
    ):
        mpjax.plan(_fsdp_step, "v5p:2x2x2")(*_fsdp_step_args(cpu, "data"))
    smaller = mpjax.plan_mesh("v5p:2x2x1")
    with pytest.raises(ValueError, match=r"4 tpu devices .* cannot be the 8 compile-only"):
        mpjax.plan(_fsdp_step, "v5p:2x2x2")(*_fsdp_step_args(smaller, "data"))
    with pytest.raises(ValueError, match="mpjax.plan_mesh\\('v5p:2x2x2', shape, names\\)"):
        mpjax.plan(_fsdp_step, "v5p:2x2x2")(*_fsdp_step_args(smaller, "data"))
    # A plain array, on one device, is replicated.
    plain = (jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), _fsdp_step_args(cpu, "data")[0]),)
    assert mpjax.plan(_fsdp_step, "v5p:2x2x2")(*plain, jnp.ones((64, 512))).compiled
