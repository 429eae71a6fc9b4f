"""The example's training step compiled for an H100, on this machine without one.

What mpjax promises a GPU runs, checked in XLA's optimized GPU HLO (:func:`mpjax.plan`):
under ``mixed_bfloat16`` every matmul FLOP has bf16 operands (Tensor Core GEMMs), attention is
cuDNN's fused kernel forward and backward, and the embedding gradient's scatter-add
accumulates in f32; under ``mixed_bfloat16_fp8``, and with delayed scaling (the train state
carrying the fp8 scales), the dense layers' GEMMs take fp8 operands (e4m3 forward, e5m2
gradients) with XLA's default flags and with Triton GEMMs off, the head bf16; under
``mixed_float16`` with loss scaling, the same in float16. For the ``small`` preset and the
scanned ``medium`` one.

These need JAX's CUDA plugin (``pip install "mpjax[cuda12]"``, no GPU needed) and skip without
it; CI installs it and sets ``MPJAX_REQUIRE_GPU_PLAN``, which turns a missing plugin into an
error. Each plan is one compile of a whole training step (tens of seconds on two cores).
"""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from mpjax.planning.devices import plan_unavailable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train_transformer as tt  # noqa: E402

REASON = plan_unavailable()
# Slow: each plan compiles a whole training step for the H100 (`python -m pytest -m slow`).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"the plan cannot compile: {REASON}"),
]

BF16, F16, F32 = (np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
BATCH = {"small": 16, "medium": 8}
# fp8 with current scaling, and with delayed scaling (the train state carries the scales).
FP8_POLICIES = pytest.mark.parametrize(
    "policy", ["mixed_bfloat16_fp8", tt.FP8_DELAYED], ids=["current", "delayed"]
)


@functools.cache
def example_plan(preset, policy, scan_layers=False, triton_gemm=None, target="h100"):
    """The plan of the example's own train step (forward, backward, clipping, AdamW and loss
    scaling where the policy has it) for one batch of the benchmark's size, for ``target``."""
    cfg = tt.TrainConfig(policy=policy, preset=preset, scan_layers=scan_layers)
    model_config = cfg.model_config()
    precision = mpjax.get_policy(policy)
    model = tt.build_model(model_config, precision, cfg.mode)
    tx = tt.make_optimizer(cfg, precision)
    state = jax.eval_shape(
        lambda: tt.init_state(model, tx, seed=0, seq_len=model_config.block_size)
    )
    tokens = jax.ShapeDtypeStruct((1, BATCH[preset], model_config.block_size), jnp.int32)
    step = tt.make_train_step(model, tx)
    plan = mpjax.plan(step, target, triton_gemm=triton_gemm)
    return model_config, plan(state, tokens, tokens)


def _executions(items, **match):
    return sum(x.executions for x in items if all(getattr(x, k) == v for k, v in match.items()))


def assert_attention_is_cudnn(plan, config, dtype):
    """One cuDNN fused attention forward per layer, one backward per layer (a forward may be
    recomputed for the backward), in ``dtype``: no attention is left to XLA's GEMMs."""
    assert _executions(plan.attention, backward=True, dtype=dtype) == config.n_layer, str(plan)
    assert _executions(plan.attention, backward=False, dtype=dtype) >= config.n_layer
    assert all(a.target.startswith("__cudnn$fmha") for a in plan.attention)
    # Every batched GEMM (q k^T, p v) would be attention that did not reach cuDNN.
    assert not [g for g in plan.gemms if len(g.lhs_shape) > 3], str(plan)


def assert_embedding_scatter_in_f32(plan):
    assert plan.scatters and {s.dtype for s in plan.scatters} == {F32}, str(plan)


@pytest.mark.parametrize(
    "preset, scan_layers", [("small", False), ("medium", True)], ids=["small", "medium-scan"]
)
def test_mixed_bfloat16_runs_every_matmul_flop_on_bf16_tensor_cores(preset, scan_layers):
    config, plan = example_plan(preset, "mixed_bfloat16", scan_layers)
    assert plan.flop_share(jnp.bfloat16) == 1.0, str(plan)
    assert {(g.lhs_dtype, g.rhs_dtype) for g in plan.gemms} == {(BF16, BF16)}
    assert_attention_is_cudnn(plan, config, BF16)
    assert_embedding_scatter_in_f32(plan)


# Delayed scaling's step compiles to the same GEMMs as current scaling's (the benchmark's
# plans record both presets); checking it on the small step keeps CI's compiles to what differs.
@pytest.mark.parametrize(
    "preset, scan_layers, policy",
    [
        ("small", False, "mixed_bfloat16_fp8"),
        ("medium", True, "mixed_bfloat16_fp8"),
        ("small", False, tt.FP8_DELAYED),
    ],
    ids=["small-current", "medium-scan-current", "small-delayed"],
)
def test_fp8_runs_the_dense_layers_on_fp8_tensor_cores_and_the_head_in_bf16(
    preset, scan_layers, policy
):
    """Each of a block's four dense layers is three fp8 GEMMs (forward e4m3 x e4m3, both
    gradients e5m2 x e4m3), whether the scales are current or delayed; the head and cuDNN
    attention stay bf16."""
    config, plan = example_plan(preset, policy, scan_layers)
    fp8 = [g for g in plan.gemms if g.lhs_dtype.itemsize == 1 and g.rhs_dtype.itemsize == 1]
    assert sum(g.executions for g in fp8) == 3 * 4 * config.n_layer, str(plan)
    kinds = {(g.lhs_dtype.name, g.rhs_dtype.name) for g in fp8}
    assert kinds <= {
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
    }, kinds
    others = [g for g in plan.gemms if g not in fp8]
    assert {(g.lhs_dtype, g.rhs_dtype) for g in others} == {(BF16, BF16)}, str(plan)
    assert plan.flop_share("fp8") >= 0.8, str(plan)
    assert plan.flop_share("fp8") + plan.flop_share(jnp.bfloat16) == pytest.approx(1.0)
    assert_attention_is_cudnn(plan, config, BF16)


@FP8_POLICIES
def test_fp8_gemms_stay_fp8_with_triton_gemms_off(policy):
    """Without Triton GEMMs every GEMM is a cuBLASLt call: the fp8 ones its fp8 form."""
    config, plan = example_plan("small", policy, triton_gemm=False)
    libraries = {g.library for g in plan.gemms if g.lhs_dtype.itemsize == 1}
    assert libraries == {"cublaslt_fp8"}, str(plan)
    assert _executions(plan.gemms, library="cublaslt_fp8") == 3 * 4 * config.n_layer
    assert plan.flop_share("fp8") >= 0.8


def test_mixed_float16_with_loss_scaling_runs_every_matmul_flop_on_f16_tensor_cores():
    config, plan = example_plan("small", "mixed_float16")
    assert plan.flop_share(jnp.float16) == 1.0, str(plan)
    assert_attention_is_cudnn(plan, config, F16)
    assert_embedding_scatter_in_f32(plan)
