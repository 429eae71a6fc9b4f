"""gpu_plan compiles for an H100 without one and reads what XLA's GPU compiler decided.

The compile tests need JAX's CUDA plugin (``pip install "mpjax[cuda12]"``, no GPU needed) and
skip with gpu_plan_unavailable's reason without it; the argument checks, the missing-plugin
errors and the text handling run everywhere. Shapes are tiny: each compile takes a fraction of
a second.
"""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpjax
from mpjax import jax_compat
from mpjax.inspection.gpu_plan import TARGETS, GpuCompilerUnavailableError, gpu_plan_unavailable
from mpjax.inspection.hlo_text import HloShape, parse_module

# `mpjax.gpu_plan` is the function; the module is reached through sys.modules.
gpu_plan_module = sys.modules["mpjax.inspection.gpu_plan"]

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
E4M3 = np.dtype(jnp.float8_e4m3fn)
JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3])
REASON = gpu_plan_unavailable()
needs_compiler = pytest.mark.skipif(REASON is not None, reason=f"gpu_plan cannot run: {REASON}")
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
    plan = mpjax.gpu_plan(jnp.matmul)(sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16))
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
    plan = mpjax.gpu_plan(jnp.matmul, triton_gemm=False)(x, w)
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
    lt = mpjax.gpu_plan(jnp.matmul, triton_gemm=False, compiler_options=options)(x, w)
    assert only(lt.gemms).library == "cublaslt"
    assert dict(lt.options) == {**options, "xla_gpu_enable_triton_gemm": False}


@needs_compiler
def test_an_f32_matmul_has_f32_operands():
    plan = mpjax.gpu_plan(jnp.matmul)(sds((M, K), jnp.float32), sds((K, N), jnp.float32))
    gemm = only(plan.gemms)
    assert (gemm.lhs_dtype, gemm.rhs_dtype) == (F32, F32)
    assert gemm.flops == 2 * M * N * K
    assert plan.flop_share(jnp.float32) == 1.0 and plan.flop_share(jnp.bfloat16) == 0.0


@needs_compiler
def test_cudnn_attention_is_one_fused_call_forward_and_one_backward():
    q = sds((B, T, H, D), jnp.bfloat16)
    forward = mpjax.gpu_plan(attention)(q, q, q)
    call = only(forward.attention)
    assert call.target.startswith("__cudnn$fmha") and not call.backward
    assert call.dtype == BF16 and call.flops == 4 * B * H * T * T * D
    assert forward.gemms == ()

    def loss(q, k, v):
        return attention(q, k, v).astype(jnp.float32).sum()

    backward = mpjax.gpu_plan(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q)
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
    plan = mpjax.gpu_plan(fp8_dot, triton_gemm=triton_gemm)(a, b)
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

    plan = mpjax.gpu_plan(embedding_grad)(sds((8,), jnp.int32), sds((8, 16), jnp.float32))
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
    plan = mpjax.gpu_plan(mixed)(*args)
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

    plan = mpjax.gpu_plan(layers, triton_gemm=False)(
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
    plan = mpjax.gpu_plan(f)(params, jnp.ones((M, K), jnp.bfloat16), scale=2.0)
    assert only(plan.gemms).flops == 2 * M * N * K

    jitted = jax.jit(lambda x, w, transpose: (x @ w.T) if transpose else x @ w, static_argnums=2)
    plan = mpjax.gpu_plan(jitted)(sds((M, K), jnp.bfloat16), sds((N, K), jnp.bfloat16), True)
    assert only(plan.gemms).flops == 2 * M * N * K


@needs_compiler
@pytest.mark.parametrize(
    "target, device", [("a100", "NVIDIA A100-SXM4-80GB"), ("h200", "NVIDIA H200 141GB HBM3e")]
)
def test_the_other_targets_compile(target, device):
    plan = mpjax.gpu_plan(jnp.matmul, target.upper())(
        sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16)
    )
    assert (plan.target, plan.device) == (target, device)
    assert only(plan.gemms).lhs_dtype == BF16
    assert set(TARGETS) == {"h100", "a100", "h200"}


@needs_compiler
def test_the_plan_is_a_value_with_a_table_and_a_json_form():
    plan = mpjax.gpu_plan(fp8_dot, triton_gemm=False)(
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
    deviceless = mpjax.gpu_plan(fp8_dot, triton_gemm=False)(
        sds((M, K), jnp.float8_e4m3fn), sds((K, N), jnp.float8_e4m3fn)
    )
    plan = mpjax.GpuPlan.from_hlo_text(deviceless.hlo_text, device="NVIDIA H100 80GB HBM3")
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
        mpjax.GpuPlan.from_hlo_text(b"HloModule m", device="x")
    with pytest.raises(ValueError, match="starts with 'HloModule'"):
        mpjax.GpuPlan.from_hlo_text("module @jit_f {}", device="x")


# --- Errors -----------------------------------------------------------------------------------


def test_an_unknown_target_is_a_value_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown target 'v100'.*'a100', 'h100', 'h200'"):
        mpjax.gpu_plan(jnp.matmul, "v100")
    with pytest.raises(ValueError, match="unknown target"):
        gpu_plan_unavailable("tpu")


def test_bad_arguments_are_type_errors_naming_them():
    with pytest.raises(
        TypeError, match=r"gpu_plan\(fn\): fn must be the function to inspect, got 3 of type int"
    ):
        mpjax.gpu_plan(3)
    with pytest.raises(TypeError, match="triton_gemm must be None, True or False"):
        mpjax.gpu_plan(jnp.matmul, triton_gemm="off")
    with pytest.raises(TypeError, match="compiler_options must be a mapping"):
        mpjax.gpu_plan(jnp.matmul, compiler_options=[("xla_gpu_enable_triton_gemm", False)])
    with pytest.raises(ValueError, match="set one of them"):
        mpjax.gpu_plan(
            jnp.matmul, triton_gemm=False, compiler_options={"xla_gpu_enable_triton_gemm": True}
        )


def test_flop_share_names_its_valid_choices():
    plan = gpu_plan_module.GpuPlan("h100", "H100", jax.__version__, (), (), (), (), 0, 0)
    assert plan.flop_share("fp8") == 0.0 and plan.total_flops == 0
    with pytest.raises(ValueError, match="'fp8' or a dtype"):
        plan.flop_share("int4ish")


@pytest.fixture
def fresh_devices():
    gpu_plan_module._device.cache_clear()
    yield
    gpu_plan_module._device.cache_clear()


def test_without_the_cuda_plugin_the_error_says_how_to_install_it(monkeypatch, fresh_devices):
    monkeypatch.setattr(jax_compat, "cuda_plugin_installed", lambda: False)
    x = sds((M, K), jnp.bfloat16)
    with pytest.raises(GpuCompilerUnavailableError) as error:
        mpjax.gpu_plan(jnp.matmul)(x, sds((K, N), jnp.bfloat16))
    message = str(error.value)
    assert 'pip install "mpjax[cuda12]"' in message and "JAX_PLATFORMS=cpu" in message
    assert "without a GPU" in message
    assert gpu_plan_unavailable() == message
    assert isinstance(error.value, RuntimeError)


def test_a_plugin_that_did_not_start_gets_the_environment_variables(monkeypatch, fresh_devices):
    def not_registered(spec):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(jax_compat, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(jax_compat, "cuda_topology", not_registered)
    reason = gpu_plan_unavailable("a100")
    assert "did not start" in reason and "topology not implemented for cuda" in reason
    assert "JAX_PLATFORMS=cpu" in reason and "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1" in reason


# --- What differs between JAX versions (mpjax.jax_compat) ---------------------------------------


def test_cuda_version_checks_are_skipped_only_where_no_cuda_platform_is_asked_for(monkeypatch):
    for platforms, skipped in [("cpu", True), ("tpu,cpu", True), ("cuda,cpu", False)]:
        monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
        jax_compat._skip_cuda_checks_off_cuda(platforms)
        assert ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in os.environ) == skipped
    for platforms in ("gpu", ""):
        monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
        jax_compat._skip_cuda_checks_off_cuda(platforms)
        assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ


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
    no_block = jax_compat._drop_field(SPEC, 3, "scalar_unit_description")
    assert "rate_infos" not in no_block and "core_count: 132\n  runtime_version" in no_block
    # A line number that does not hold the field (a shifted text) falls back to its name.
    assert jax_compat._drop_field(SPEC, 1, "name") == SPEC.replace('  name: "GPU"\n', "")
    assert jax_compat._version_block(SPEC, "runtime_version") == (
        "runtime_version {\n  major: 12\n  minor: 8\n  patch: 0\n}\n"
    )


@needs_compiler
def test_an_unknown_field_of_the_target_description_is_dropped_and_named():
    spec = gpu_plan_module._spec("h100").replace(
        "  core_count: 132\n", "  core_count: 132\n  no_such_field: 3\n  no_such_block {\n  }\n"
    )
    made = jax_compat.cuda_topology(spec)
    assert made.topology is not None
    assert {"GpuDeviceInfoProto.no_such_field", "GpuDeviceInfoProto.no_such_block"} <= set(
        made.dropped
    )
    # jaxlib 0.8.1 knows neither the finer GPU description nor where the CUDA version moved;
    # jax 0.12 knows the whole shipped spec.
    dropped = jax_compat.cuda_topology(gpu_plan_module._spec("h100")).dropped
    if JAX_VERSION < (0, 9):
        assert "GpuDeviceInfoProto.runtime_version" in dropped
    if JAX_VERSION >= (0, 12):
        assert dropped == ()


@needs_compiler
def test_old_jaxlibs_compile_untuned_and_print_through_a_dump():
    mpjax.gpu_plan(jnp.matmul)(sds((M, K), jnp.bfloat16), sds((K, N), jnp.bfloat16))
    learned = jax_compat._deviceless
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


@needs_compiler
def test_mixed_fp8_dots_compile_with_xla_defaults_exactly_where_jax_compat_says():
    """jax_compat.mixed_fp8_dots decides whether mpjax.fp8 writes its e5m2 x e4m3 backward
    GEMMs on fp8 operands; XLA's Triton GEMMs of older JAX refuse them."""

    def mixed(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    args = sds((M, K), jnp.float8_e5m2), sds((K, N), jnp.float8_e4m3fn)
    try:
        plan = mpjax.gpu_plan(mixed)(*args)
    except Exception as error:  # XLA's compile error; its type differs between versions
        assert not jax_compat.mixed_fp8_dots(), error
        assert "same types" in str(error)
    else:
        assert jax_compat.mixed_fp8_dots()
        assert only(plan.gemms).lhs_dtype == np.dtype(jnp.float8_e5m2)
    # With Triton GEMMs off, cuBLASLt takes them in every version.
    plan = mpjax.gpu_plan(mixed, triton_gemm=False)(*args)
    assert only(plan.gemms).library in ("cublaslt_fp8", "cublas")
