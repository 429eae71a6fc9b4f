"""The example's mixture of experts planned for GPUs (``--experts 8 --top-k 2 --plan ...``): its
expert GEMMs stay grouped kernels, at the model's FLOPs, in fp8 or block-scaled where the policy
says. Each plan compiles in a process of its own (Mosaic GPU compiles for one GPU architecture
per process), so these share nothing with the example's other tests (tests/test_example.py) and
CI's slow suite runs them beside those, in its other process."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_transformer as tt  # noqa: E402
from test_example import MOE_FLAGS  # noqa: E402

import mpjax  # noqa: E402
from mpjax import jax_compat  # noqa: E402

# The example's MoE in one block: every GEMM the step runs, at a quarter of its compile time.
FLAGS = [*MOE_FLAGS, "--n-layer", "1"]
RUNS = 1 * 2 * 3  # one block's two grouped GEMMs, forward and both gradients


def _plan_lines(*argv: str) -> str:
    """The example's --plan output, in a process of its own: Mosaic GPU compiles its kernels
    for one GPU architecture per process."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_transformer.py"), *argv],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_the_moe_step_planned_for_an_h100_runs_the_models_expert_flops_in_grouped_kernels():
    if mpjax.plan_unavailable() is not None:
        pytest.skip(f"the plan cannot compile: {mpjax.plan_unavailable()}")
    printed = _plan_lines(*FLAGS, "--plan", "h100")
    cfg = tt.parse_args(FLAGS).model_config()
    tokens = tt.BATCH_SIZE * cfg.block_size
    expected = cfg.expert_flops_per_token() * tokens  # 2 grouped GEMMs a layer, 3 passes
    match = re.search(r"grouped GEMMs: (\d+) kernel runs \(([\d.]+)G FLOPs", printed)
    assert match is not None, printed
    assert int(match[1]) == RUNS
    assert abs(float(match[2]) * 1e9 - expected) <= 0.1 * expected
    assert "expanded dense" not in printed


@pytest.mark.slow
# mixed_bfloat16_fp8_rowwise takes the same kernels, e4m3 both ways, which
# tests/test_grouped_fp8.py compiles for an H100.
@pytest.mark.parametrize("policy", ["mixed_bfloat16_fp8"])
def test_the_moe_step_planned_for_an_h100_runs_its_expert_gemms_in_fp8(policy):
    if mpjax.plan_unavailable() is not None:
        pytest.skip(f"the plan cannot compile: {mpjax.plan_unavailable()}")
    if policy == "mixed_bfloat16_fp8" and not jax_compat.mosaic_mixed_fp8_wgmma():
        pytest.skip("this JAX's Mosaic GPU multiplies no e5m2 by e4m3: its backward stays dense")
    printed = _plan_lines(*FLAGS, "--policy", policy, "--plan", "h100")
    match = re.search(
        r"grouped GEMMs: (\d+) kernel runs \(([\d.]+)G FLOPs[^)]*; ([^;)]*)\)", printed
    )
    assert match is not None, printed
    assert int(match[1]) == RUNS  # forward and both gradients of every expert GEMM
    shares = dict(part.rsplit(" ", 1) for part in match[3].split(", "))
    fp8 = sum(float(v.rstrip("%")) for k, v in shares.items() if k.startswith("float8"))
    assert fp8 >= 80.0, shares  # in fact all of them
    assert "expanded dense" not in printed


@pytest.mark.slow
def test_the_moe_step_at_a_capacity_runs_its_experts_block_scaled_on_a_b200():
    """MXFP8 with a capacity runs every expert GEMM, forward and both gradients, as a batched
    block-scaled GEMM over each expert's slots: 2048 tokens x top-2 over 8 experts at capacity
    1.25 are 640 slots each, 1.25 times the rows' FLOPs, all of them block-scaled. (NVFP4 takes
    the same route: tests/test_grouped_capacity.py reads its e2m1 GEMMs.)"""
    if mpjax.plan_unavailable("b200") is not None:
        pytest.skip(f"the plan cannot compile: {mpjax.plan_unavailable('b200')}")
    policy = "p=f32,c=bf16,o=f32,fp8=mxfp8;capacity=1.25"
    printed = _plan_lines(*FLAGS, "--d-model", "256", "--policy", policy, "--plan", "b200")
    match = re.search(
        r"experts at a capacity: (\d+) batched GEMM runs, [^(]*\(every slot multiplied: "
        r"([\d.]+)x\), ([\d.]+)% of them block-scaled",
        printed,
    )
    assert match is not None, printed
    assert int(match[1]) == RUNS  # forward and both gradients of every expert GEMM
    assert float(match[2]) == 1.25 and float(match[3]) >= 80.0  # in fact all of them
    assert "expanded dense" not in printed and "grouped GEMMs:" not in printed


@pytest.mark.slow
def test_the_moe_step_planned_for_a_b200_runs_the_models_expert_flops_in_grouped_kernels():
    """All three GEMMs of every expert in kernels, JAX's forward and for the input gradient,
    mpjax's for the weights': within 10% of the model's expert FLOPs, though the weight
    gradient counts the most rows its padded operand can hold. The sort compiles with XLA's."""
    if mpjax.plan_unavailable("b200") is not None:
        pytest.skip(f"the plan cannot compile: {mpjax.plan_unavailable('b200')}")
    flags = [*FLAGS, "--d-model", "256"]  # Blackwell's kernels tile the features by 256
    printed = _plan_lines(*flags, "--plan", "b200")
    cfg = tt.parse_args(flags).model_config()
    expected = cfg.expert_flops_per_token() * tt.BATCH_SIZE * cfg.block_size
    match = re.search(r"grouped GEMMs: (\d+) kernel runs \(([\d.]+)G FLOPs", printed)
    assert match is not None, printed
    assert int(match[1]) == RUNS
    assert expected <= float(match[2]) * 1e9 <= 1.1 * expected
    assert "expanded dense" not in printed
    assert "compiled with xla_gpu_enable_cub_radix_sort=False" in printed
