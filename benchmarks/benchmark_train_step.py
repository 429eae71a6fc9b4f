"""Benchmark the example GPT's train step under several precision setups, side by side.

Each JAX variant is the full jitted train step of examples/train_transformer.py (forward,
backward, clipping, AdamW and, where it applies, loss scaling) on the same model shape and
batch; each PyTorch variant is the same model and recipe in PyTorch (benchmarks/torch_gpt.py),
run when torch is installed and reported as skipped otherwise:

    python benchmarks/benchmark_train_step.py                        # tiny preset, CPU: minutes
    python benchmarks/benchmark_train_step.py --preset small         # GPU
    python benchmarks/benchmark_train_step.py --preset medium        # GPU; layers scanned

Per variant it reports compile time (PyTorch: the first step, which compiles), the median
and minimum step time over --steps timed steps after
--warmup steps (each step waits for its result), tokens/s, model FLOPs per step, achieved
FLOP/s and MFU against the device's dense peak where the table below knows it, XLA's memory
estimate for the compiled step and, where the device reports it, peak device memory (PyTorch:
``torch.cuda.max_memory_allocated``), and the bytes per parameter that the params and the
optimizer state take (JAX: ``mpjax.memory_report`` of the variant's real train state; PyTorch:
the model's parameters and ``optimizer.state`` after the timed steps), by part.

The fp8 rows (``fp8_mpjax``, ``fp8_autocast``) run the blocks' dense matmuls under
``mixed_bfloat16_fp8``: e4m3 operands forward and e5m2 gradients backward with current
scaling, GEMMs on the fp8 values, which Hopper and Ada GPUs run as fp8 GEMMs (Triton's or
cuBLASLt's). The delayed rows (``fp8_delayed_mpjax``, ``fp8_delayed_autocast``) do the same
with delayed scaling: the scales come from the amax history the train state carries, known
before the step starts, so quantizing a tensor need not wait for its amax (which the step still
records, for the next one). Compare them with the bf16 rows of the same run (``--variants``
with ``FP8_KEYS``). On CPU fp8 is emulated: slower, not faster.

Each JAX row also records its GPU plan (``--plan``): read from the compiled step on a GPU, or
compiled for an H100 without one (``--plan h100``, or ``--plan-only`` for the plans alone).

    python benchmarks/benchmark_train_step.py --preset medium \
        --variants bf16_mpjax fp8_mpjax fp8_delayed_mpjax bf16_autocast fp8_autocast \
        fp8_delayed_autocast torch_bf16_sdpa   # H100

Besides the activation-precision rows, the optimizer rows keep bfloat16 params and differ in
how the optimizer updates them (f32 master weights, rounding to nearest, stochastic rounding,
Kahan compensation) and in how Adam's moments are stored (f32, bf16, or blockwise quantized
to 8 or 4 bits by ``mpjax.quantized_state``): 14 down to about 3 bytes per parameter.

Each variant runs in a fresh subprocess, so peak memory is its own and no variant warms a cache
for the next. Results go to benchmarks/results/<platform>_<preset>.json and .md.

On CPU the absolute numbers say little about accelerators (XLA's CPU backend has no bf16 GEMM
and converts bf16 operands to f32); the ratios between variants show the overhead a policy
adds. Background load on a shared machine moves step times by several percent.

Model FLOPs per step = tokens per step x (6 N + 12 L d T): 6 FLOPs per weight per token for the
forward and backward matmuls (N excludes the position embedding, a lookup), plus the attention
score and value matmuls (2 x 2 L T d forward, twice that backward). Remat or padding would add
hardware FLOPs that MFU deliberately does not count.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from importlib.util import find_spec
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mpjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
# mpjax and the example from this tree, installed or not (a GPU image reaches no registry).
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the same train step.

    Attributes:
      key: short name for --variants and file contents.
      name: what the table shows.
      policy: the mpjax policy string (for PyTorch: float32, mixed_bfloat16 or mixed_float16,
        the last with ``GradScaler``).
      mode: how the policy reaches the model (``train_transformer.build_model``'s ``mode``).
      loss_scale: ``--loss-scale`` of the training script.
      matmul_precision: ``jax.default_matmul_precision`` for the whole step, or None for JAX's
        default (TF32 for f32 matmuls on Ampere and Hopper GPUs, full f32 on CPU).
      attention: ``fused`` or ``naive`` (JAX); ``sdpa`` or ``naive`` (PyTorch).
      framework: ``jax`` or ``torch``.
      master_weights, param_rounding, mu_dtype, nu_dtype, state_rounding, state_format: the
        training script's optimizer settings (``--master-weights``, ``--param-rounding``,
        ``--mu-dtype``, ``--nu-dtype``, ``--state-rounding``, ``--state-format``), JAX rows
        only.
    """

    key: str
    name: str
    policy: str
    mode: str = "hand"
    loss_scale: str = "none"
    matmul_precision: str | None = None
    attention: str = "fused"
    framework: str = "jax"
    master_weights: bool = True
    param_rounding: str = "nearest"
    mu_dtype: str | None = None
    nu_dtype: str | None = None
    state_rounding: str = "nearest"
    state_format: str = "none"


# mixed_bfloat16_fp8 with delayed scaling: train_transformer.FP8_DELAYED (this module imports
# the training script only where a variant runs).
FP8_DELAYED = "p=f32,c=bf16,o=f32,fp8=delayed"

# The f32 "default" row is the baseline for the speedup column; "bf16_hand" is the honest
# baseline for mpjax's rows (an undtyped Flax model would run f32 GEMMs and flatter them), and
# "torch_bf16_sdpa" (torch.compile + autocast + flash attention) the peer they race.
VARIANTS = [
    Variant("f32", "float32, default matmul precision", "float32"),
    Variant("f32_highest", "float32, precision=highest", "float32", matmul_precision="highest"),
    Variant(
        "bf16_mpjax", "mixed_bfloat16, mpjax.linen.apply_policy", "mixed_bfloat16", mode="mpjax"
    ),
    Variant(
        "bf16_mpjax_naive",
        "mixed_bfloat16, mpjax.linen.apply_policy, naive attention",
        "mixed_bfloat16",
        mode="mpjax",
        attention="naive",
    ),
    Variant("bf16_autocast", "mixed_bfloat16, mpjax.autocast", "mixed_bfloat16", mode="autocast"),
    # fp8 rows: the dense matmuls of the blocks with e4m3/e5m2 operands (current scaling), the
    # output head and attention in bf16; compare with bf16_mpjax / bf16_autocast. Their MFU
    # column still counts against the bf16 peak, so fp8 can pass 100% of it.
    Variant(
        "fp8_mpjax",
        "mixed_bfloat16_fp8, mpjax.linen.apply_policy",
        "mixed_bfloat16_fp8",
        mode="mpjax",
    ),
    Variant(
        "fp8_autocast", "mixed_bfloat16_fp8, mpjax.autocast", "mixed_bfloat16_fp8", mode="autocast"
    ),
    # The same with delayed scaling (the training script's FP8_DELAYED): the train state
    # carries each fp8 matmul's scales and amax history, and the step updates them.
    Variant(
        "fp8_delayed_mpjax",
        "fp8 delayed scaling, mpjax.linen.apply_policy",
        FP8_DELAYED,
        mode="mpjax",
    ),
    Variant(
        "fp8_delayed_autocast", "fp8 delayed scaling, mpjax.autocast", FP8_DELAYED, mode="autocast"
    ),
    # Finer fp8: a power-of-two scale per row of each operand (torchao's rowwise recipe), and
    # the block formats of Blackwell GPUs (an e8m0 scale per 32 values, or NVFP4's e4m3 scale
    # per 16 and one per tensor, its gradients in MXFP8); the head in bf16 as for fp8.
    Variant(
        "fp8_rowwise_mpjax",
        "mixed_bfloat16_fp8_rowwise, mpjax.linen.apply_policy",
        "mixed_bfloat16_fp8_rowwise",
        mode="mpjax",
    ),
    Variant(
        "mxfp8_mpjax",
        "mixed_bfloat16_mxfp8, mpjax.linen.apply_policy",
        "mixed_bfloat16_mxfp8",
        mode="mpjax",
    ),
    Variant(
        "nvfp4_mpjax",
        "mixed_bfloat16_nvfp4, mpjax.linen.apply_policy",
        "mixed_bfloat16_nvfp4",
        mode="mpjax",
    ),
    Variant("bf16_hand", "mixed_bfloat16, dtype=bf16 by hand", "mixed_bfloat16"),
    Variant(
        "bf16_hand_naive",
        "mixed_bfloat16, dtype=bf16 by hand, naive attention",
        "mixed_bfloat16",
        attention="naive",
    ),
    Variant(
        "f16_dynamic",
        "mixed_float16 + dynamic loss scaling, mpjax",
        "mixed_float16",
        mode="mpjax",
        loss_scale="dynamic",
    ),
    # Optimizer rows: bfloat16 params (the norms' stay f32 under the example's rule), and what
    # the optimizer keeps for them. Plain optax on bf16 params ("bf16_nearest") keeps Adam's
    # moments in bf16 too, computed in bf16; the low_precision_params rows compute in f32.
    Variant(
        "bf16_master",
        "bfloat16 params + f32 master weights, f32 Adam",
        "bfloat16",
        mode="mpjax",
    ),
    Variant(
        "bf16_nearest",
        "bfloat16 params, no master weights (optax: bf16 Adam)",
        "bfloat16",
        mode="mpjax",
        master_weights=False,
    ),
    Variant(
        "bf16_sr",
        "bfloat16 params, stochastic rounding, f32 Adam",
        "bfloat16",
        mode="mpjax",
        master_weights=False,
        param_rounding="stochastic",
    ),
    Variant(
        "bf16_kahan",
        "bfloat16 params, Kahan compensation, f32 Adam",
        "bfloat16",
        mode="mpjax",
        master_weights=False,
        param_rounding="kahan",
    ),
    Variant(
        "bf16_sr_state_bf16",
        "bfloat16 params, stochastic rounding, bf16 Adam (stochastic)",
        "bfloat16",
        mode="mpjax",
        master_weights=False,
        param_rounding="stochastic",
        mu_dtype="bfloat16",
        nu_dtype="bfloat16",
        state_rounding="stochastic",
    ),
    # Adam's moments blockwise quantized (mpjax.quantized_state), dequantized to f32 for the
    # update and quantized again, stochastically: about 4 bytes a parameter with 8-bit moments.
    *(
        Variant(
            f"bf16_sr_state_{fmt}",
            f"bfloat16 params, stochastic rounding, {fmt} Adam (stochastic)",
            "bfloat16",
            mode="mpjax",
            master_weights=False,
            param_rounding="stochastic",
            state_format=fmt,
            state_rounding="stochastic",
        )
        for fmt in ("dynamic8", "e4m3", "dynamic4")
    ),
    Variant(
        "bf16_master_state_bf16",
        "bfloat16 params + f32 master weights, bf16 Adam (stochastic)",
        "bfloat16",
        mode="mpjax",
        mu_dtype="bfloat16",
        nu_dtype="bfloat16",
        state_rounding="stochastic",
    ),
    Variant(
        "torch_f32",
        "PyTorch float32 (TF32 on GPU), SDPA",
        "float32",
        attention="sdpa",
        framework="torch",
    ),
    Variant(
        "torch_bf16_sdpa",
        "PyTorch torch.compile + autocast bf16, SDPA",
        "mixed_bfloat16",
        attention="sdpa",
        framework="torch",
    ),
    Variant(
        "torch_bf16_naive",
        "PyTorch torch.compile + autocast bf16, naive attention",
        "mixed_bfloat16",
        attention="naive",
        framework="torch",
    ),
    Variant(
        "torch_f16_sdpa",
        "PyTorch autocast f16 + GradScaler, SDPA",
        "mixed_float16",
        attention="sdpa",
        framework="torch",
    ),
]
TORCH_MISSING = 'torch is not installed (pip install -e ".[bench]")'
# The rows that differ in how the optimizer stores and updates bf16 params, and the f32 row
# they compare with: `--variants f32 bf16_master ...` runs only them.
OPTIMIZER_KEYS = (
    "f32",
    "bf16_master",
    "bf16_nearest",
    "bf16_sr",
    "bf16_kahan",
    "bf16_sr_state_bf16",
    "bf16_master_state_bf16",
)
# The rows with quantized Adam moments and the bf16-moment row they compare with (on the
# `small` preset or larger: the tiny one's width, 128, is not a multiple of the 8-bit formats'
# blocks of 256, so those rows would keep most moments in f32 there).
QUANTIZED_STATE_KEYS = (
    "bf16_sr_state_bf16",
    "bf16_sr_state_dynamic8",
    "bf16_sr_state_e4m3",
    "bf16_sr_state_dynamic4",
)

# The fp8 rows and the bf16 rows they race: `--variants bf16_mpjax fp8_mpjax ...`.
FP8_KEYS = (
    "bf16_mpjax",
    "fp8_mpjax",
    "fp8_delayed_mpjax",
    "bf16_autocast",
    "fp8_autocast",
    "fp8_delayed_autocast",
    "torch_bf16_sdpa",
)

# Dense peak FLOP/s per device by matmul kind. Matched against jax's device_kind, first match
# wins (so the PCIe H100 comes before the SXM one). H200 has H100's compute; an A100 has no fp8.
PEAK_FLOPS = [
    ("H100 PCIe", {"bf16": 756e12, "f16": 756e12, "tf32": 378e12, "f32": 51e12, "fp8": 1513e12}),
    ("H100", {"bf16": 989e12, "f16": 989e12, "tf32": 495e12, "f32": 67e12, "fp8": 1979e12}),
    ("H200", {"bf16": 989e12, "f16": 989e12, "tf32": 495e12, "f32": 67e12, "fp8": 1979e12}),
    ("A100", {"bf16": 312e12, "f16": 312e12, "tf32": 156e12, "f32": 19.5e12}),
]

BATCH_SIZES = {"tiny": 16, "small": 16, "medium": 8, "small-moe": 8}


def matmul_kind(compute_dtype: str, matmul_precision: str | None, platform_name: str) -> str:
    """Which peak a variant's matmuls run against: bf16, f16, tf32 or f32."""
    if compute_dtype == "bfloat16":
        return "bf16"
    if compute_dtype == "float16":
        return "f16"
    # JAX's default precision lets GPUs run f32 matmuls on TF32 Tensor Cores.
    if platform_name == "gpu" and matmul_precision in (
        None,
        "default",
        "bfloat16",
        "tensorfloat32",
    ):
        return "tf32"
    return "f32"


def peak_flops(device_kind: str, kind: str) -> float | None:
    for pattern, peaks in PEAK_FLOPS:
        if pattern.lower() in device_kind.lower():
            return peaks.get(kind)
    return None


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every variant of one run shares: the model, the batch, how long to time."""

    preset: str
    batch_size: int
    seq_len: int | None
    steps: int
    warmup: int
    scan_layers: bool
    remat: str
    # Which GPU plan each JAX row records: "auto" (on a GPU, the plan of the compiled step;
    # elsewhere none), a target ("h100", "a100", "h200": compiled for it without one, through
    # mpjax.plan), or "none".
    plan: str = "auto"
    # PyTorch rows: torch.compile the model and loss (False: eager, for quick CPU rehearsals,
    # where Inductor's C++ compile takes minutes).
    torch_compile: bool = True
    # Experts in each block's mixture (the training script's --experts); 0: the preset's.
    experts: int = 0

    def train_config(self, variant: Variant):
        import train_transformer as tt

        return tt.TrainConfig(
            preset=self.preset,
            policy=variant.policy,
            loss_scale=variant.loss_scale,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            steps=1000,
            warmup_steps=10,
            attention=variant.attention if variant.framework == "jax" else "fused",
            scan_layers=self.scan_layers,
            remat=self.remat,
            experts=self.experts,
            mode=variant.mode,
            master_weights=variant.master_weights,
            param_rounding=variant.param_rounding,
            mu_dtype=variant.mu_dtype,
            nu_dtype=variant.nu_dtype,
            state_rounding=variant.state_rounding,
            state_format=variant.state_format,
        )


def _time_steps(step, setup: Setup) -> tuple[list[float], float]:
    """Runs ``step()`` (which waits for its result) ``warmup + steps`` times; returns the timed
    steps' seconds and the last loss."""
    times, loss = [], float("nan")
    for i in range(setup.warmup + setup.steps):
        t0 = time.perf_counter()
        loss = step()
        if i >= setup.warmup:
            times.append(time.perf_counter() - t0)
    return times, loss


def _row(
    variant: Variant,
    setup: Setup,
    times: list[float],
    loss: float,
    compile_s: float,
    device_kind: str,
    platform_name: str,
    compiled_bytes: int | None,
    peak_bytes: int | None,
    optimizer: str,
    memory: mpjax.MemoryReport,
) -> dict:
    """One result row, the same keys for every framework. ``optimizer`` describes the
    optimizer; ``memory`` counts the params and the optimizer state."""
    import mpjax

    mcfg = setup.train_config(variant).model_config()
    policy = mpjax.get_policy(variant.policy)
    step_s = statistics.median(times)
    tokens = setup.batch_size * mcfg.block_size
    flops = tokens * mcfg.flops_per_token()
    kind = matmul_kind(policy.compute_dtype.name, variant.matmul_precision, platform_name)
    peak = peak_flops(device_kind, kind)
    return {
        "framework": variant.framework,
        "policy": str(policy),
        "attention": variant.attention,
        "matmul_kind": kind,
        "compile_s": compile_s,
        "step_s_median": step_s,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_s": tokens / step_s,
        "model_flops_per_step": flops,
        "achieved_flops_per_s": flops / step_s,
        "peak_flops_per_s": peak,
        "mfu": flops / step_s / peak if peak else None,
        "compiled_memory_bytes": compiled_bytes,
        "peak_bytes_in_use": peak_bytes,
        "optimizer": optimizer,
        **memory_fields(memory),
        "final_loss": loss,
    }


def memory_fields(memory: mpjax.MemoryReport) -> dict:
    """A row's memory columns from a memory report: bytes per parameter of params and optimizer
    state together and apart, and the report's rows (part, dtype, bytes, bytes_per_param)."""
    n = max(memory.param_count, 1)
    return {
        "bytes_per_param": memory.bytes_per_param,
        "param_bytes_per_param": memory.param_bytes / n,
        "state_bytes_per_param": memory.state_bytes / n,
        "memory_parts": memory.to_dict()["rows"],
    }


def torch_memory(model, optimizer) -> mpjax.MemoryReport:
    """An ``mpjax.MemoryReport`` of a PyTorch model's parameters and its optimizer's state
    tensors (``numel * element_size``), by the state's keys (AdamW: ``step``, ``exp_avg``,
    ``exp_avg_sq``); per parameter means per floating-point parameter element."""
    import jax.numpy as jnp
    import torch

    import mpjax

    def dtype_name(t) -> str:
        return mpjax.policy.short_dtype_name(jnp.dtype(str(t.dtype).removeprefix("torch.")))

    totals: dict[tuple[str, str], int] = {}

    def add(part: str, t) -> None:
        key = (part, dtype_name(t))
        totals[key] = totals.get(key, 0) + t.numel() * t.element_size()

    params = list(model.parameters())
    for p in params:
        add("params", p)
    for per_param in optimizer.state.values():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                add(name, value)
    count = sum(p.numel() for p in params if p.is_floating_point())
    rows = tuple(mpjax.MemoryRow(part, dtype, n) for (part, dtype), n in totals.items())
    return mpjax.MemoryReport(count, rows)


PLAN_DTYPES = ("bfloat16", "float16", "fp8", "float32")


def plan_target(value: str) -> str:
    """``--plan``'s value: auto, none, or a target of ``mpjax.plan`` (a GPU, a TPU chip or a
    TPU slice)."""
    from mpjax.planning.targets import parse_target

    if value in ("auto", "none"):
        return value
    try:
        return parse_target(value, caller="--plan").name
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def plan_fields(plan: mpjax.Plan, model_flops: float | None = None) -> dict:
    """A row's ``plan``: where it comes from, the share of matmul FLOPs (GEMMs and fused
    attention) on each operand dtype and the precision of the float32 ones, its GEMMs (fp8
    among them), fused attention calls, the dtypes its scatters accumulate in, kernel counts,
    the memory per device against the device's, and the times: XLA's estimate (TPU) with the
    MFU of ``model_flops`` (per step and device) at that estimate, and the roofline bound.
    Counts are per step (loop trip counts included)."""
    fp8 = sum(g.executions for g in plan.gemms if g.lhs_dtype.itemsize == g.rhs_dtype.itemsize == 1)
    memory = plan.memory
    return {
        "source": "autotuned" if plan.autotuned else f"deviceless {plan.target}",
        "device": plan.device,
        "platform": plan.platform,
        "compiled": plan.compiled,
        "memory": None
        if memory is None
        else {
            "temp_bytes": memory.temp_bytes,
            "total_bytes": memory.total_bytes,
            "capacity_bytes": memory.capacity_bytes,
            "fits": memory.fits,
            "margin_bytes": memory.margin_bytes,
        },
        "estimated_step_s": plan.estimated_seconds,
        "estimated_mfu": plan.mfu(model_flops) if model_flops else plan.mfu(),
        "bytes_accessed": plan.bytes_accessed,
        "roofline_step_s": plan.roofline_seconds,
        "fusion_bytes": plan.fusion_bytes,
        "fusion_step_s": plan.fusion_seconds,
        "float32_precisions": plan.float32_precisions(),
        "flop_share": {d: plan.flop_share(d) for d in PLAN_DTYPES},
        "matmul_flops": plan.total_flops,
        "gemms": sum(g.executions for g in plan.gemms),
        "fp8_gemms": fp8,
        "block_scaled_gemms": sum(g.executions for g in plan.gemms if g.block_scaled),
        "block_scaled_flop_share": plan.flop_share("block_scaled"),
        "gemm_libraries": sorted({g.library for g in plan.gemms}),
        "attention_forward": sum(a.executions for a in plan.attention if not a.backward),
        "attention_backward": sum(a.executions for a in plan.attention if a.backward),
        "scatter_dtypes": sorted({s.dtype.name for s in plan.scatters}),
        "gemm_kinds": gemm_kinds(plan),
        "fusions": plan.fusions,
        "custom_calls": plan.custom_calls,
    }


def gemm_kinds(plan: mpjax.Plan) -> list[dict]:
    """The plan's GEMMs per step grouped by operand dtypes and the library that runs them:
    ``{"lhs", "rhs", "library", "gemms", "flops"}``, the most FLOPs first."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for g in plan.gemms:
        group = groups.setdefault((g.lhs_dtype.name, g.rhs_dtype.name, g.library), [0, 0])
        group[0] += g.executions
        group[1] += g.flops * g.executions
    return [
        {"lhs": lhs, "rhs": rhs, "library": library, "gemms": n, "flops": flops}
        for (lhs, rhs, library), (n, flops) in sorted(groups.items(), key=lambda kv: -kv[1][1])
    ]


def deviceless_plan(step, target: str, *args, model_flops: float | None = None) -> dict | str:
    """The plan of ``step`` compiled for ``target`` without the hardware, or why there is
    none."""
    import mpjax

    reason = mpjax.plan_unavailable(target)
    if reason is not None:
        return reason
    return plan_fields(mpjax.plan(step, target)(*args), model_flops)


def build_jax_variant(variant: Variant, setup: Setup, abstract: bool = False):
    """What one JAX variant trains, as the training script builds it: ``(cfg, policy, model,
    tx, state)``, the initial ``TrainState`` on the first device (or, if ``abstract``, its
    shapes and dtypes only)."""
    import jax
    import train_transformer as tt

    import mpjax

    cfg = setup.train_config(variant)
    tt.validate(cfg)
    policy = mpjax.get_policy(cfg.policy)
    mcfg = cfg.model_config()
    model = tt.build_model(mcfg, policy, variant.mode)
    tx = tt.make_optimizer(cfg, policy)
    if abstract:
        state = jax.eval_shape(lambda: tt.init_state(model, tx, 0, mcfg.block_size))
    else:
        state = jax.device_put(tt.init_state(model, tx, 0, mcfg.block_size), jax.devices()[0])
    return cfg, policy, model, tx, state


def run_jax_variant(variant: Variant, setup: Setup) -> dict:
    """Compiles and times one JAX variant in this process; returns its result row."""
    import jax
    import numpy as np
    import train_transformer as tt

    import mpjax

    cfg, policy, model, tx, state = build_jax_variant(variant, setup)
    mcfg = cfg.model_config()
    device = jax.devices()[0]
    # Before the step donates the state's buffers; the steps keep every shape and dtype.
    memory = mpjax.memory_report(state.params, state.opt_state)
    data = tt.load_corpus(None, max_bytes=2_000_000)
    x, y = (
        jax.device_put(a, device)
        for a in tt.sample_batch(
            data, np.random.default_rng(0), (1, setup.batch_size), mcfg.block_size
        )
    )

    train_step = tt.make_train_step(model, tx)
    with jax.default_matmul_precision(variant.matmul_precision):
        t0 = time.perf_counter()
        compiled = jax.jit(train_step, donate_argnums=0).lower(state, x, y).compile()
        compile_s = time.perf_counter() - t0
        # Before the step donates the state: the plan reads its shapes.
        if setup.plan == "auto" and device.platform == "gpu":
            plan = plan_fields(
                mpjax.Plan.from_hlo_text(compiled.as_text(), device=device.device_kind)
            )
        elif setup.plan in ("auto", "none"):
            plan = None
        else:
            plan = deviceless_plan(train_step, setup.plan, state, x, y)

    def step() -> float:
        nonlocal state
        state, metrics = compiled(state, x, y)
        return float(metrics["loss"])  # waits for the step

    times, loss = _time_steps(step, setup)
    mem = compiled.memory_analysis()
    compiled_bytes = None
    if mem is not None:
        compiled_bytes = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes
        )
    stats = device.memory_stats() or {}
    return _row(
        variant,
        setup,
        times,
        loss,
        compile_s,
        device.device_kind,
        device.platform,
        compiled_bytes,
        stats.get("peak_bytes_in_use"),
        tt.describe_optimizer(cfg, policy),
        memory,
    ) | {"plan": plan}


def plan_jax_variant(variant: Variant, setup: Setup) -> dict:
    """One JAX variant's GPU plan alone, compiled for ``setup.plan`` without running a step
    (the state is abstract): the row of a ``--plan-only`` run."""
    import jax
    import jax.numpy as jnp
    import train_transformer as tt

    cfg, policy, model, tx, state = build_jax_variant(variant, setup, abstract=True)
    mcfg = cfg.model_config()
    tokens = jax.ShapeDtypeStruct((1, setup.batch_size, mcfg.block_size), jnp.int32)
    flops = setup.batch_size * mcfg.block_size * mcfg.flops_per_token()
    with jax.default_matmul_precision(variant.matmul_precision):
        plan = deviceless_plan(
            tt.make_train_step(model, tx), setup.plan, state, tokens, tokens, model_flops=flops
        )
    return {"framework": variant.framework, "policy": str(policy), "plan": plan}


def run_torch_variant(variant: Variant, setup: Setup) -> dict:
    """Times one PyTorch variant in this process; returns its result row. The first step
    compiles (``torch.compile`` is lazy): its time is the compile time."""
    import numpy as np
    import torch
    import torch_gpt
    import train_transformer as tt

    cfg = setup.train_config(variant)
    mcfg = cfg.model_config()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # JAX's default precision runs f32 matmuls on TF32 Tensor Cores; so does this row.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    step_fn = torch_gpt.TrainStep(
        mcfg, variant.policy, variant.attention, device, cfg, compile=setup.torch_compile
    )
    data = tt.load_corpus(None, max_bytes=2_000_000)
    x, y = (
        torch.from_numpy(a[0].astype(np.int64)).to(device)
        for a in tt.sample_batch(
            data, np.random.default_rng(0), (1, setup.batch_size), mcfg.block_size
        )
    )

    def step() -> float:
        loss = step_fn(x, y)
        step_fn.synchronize()
        return float(loss)

    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = _time_steps(step, setup)
    if device == "cuda":
        kind = torch.cuda.get_device_name()
        peak = torch.cuda.max_memory_allocated()
    else:
        kind, peak = platform.processor() or platform.machine(), None
    optimizer = (
        f"torch.optim.AdamW{' (fused)' if device == 'cuda' else ''}, "
        f"{'GradScaler' if step_fn.scaler.is_enabled() else 'no loss scaling'}, f32 params"
    )
    return _row(
        variant,
        setup,
        times,
        loss,
        compile_s,
        kind,
        device.replace("cuda", "gpu"),
        None,
        peak,
        optimizer,
        torch_memory(step_fn.model, step_fn.optimizer),
    ) | {"plan": None}  # XLA's plan: PyTorch rows have none


def torch_available() -> bool:
    """Whether the PyTorch rows can run (torch importable here)."""
    return find_spec("torch") is not None


def _versions() -> dict:
    names = ("jax", "jaxlib", "flax", "optax", "numpy", "mpjax", "torch")
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    import mpjax

    out["mpjax"] = out["mpjax"] or mpjax.__version__
    out["python"] = platform.python_version()
    return out


def device_info(device) -> dict:
    """The ``device`` entry of a report, from a JAX device of this process."""
    return {
        "kind": device.device_kind,
        "platform": device.platform,
        "count": 1,
        "host": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def new_report(setup: Setup, keys, device: dict, plan_only: bool = False) -> dict:
    """A report with no results yet: the date, ``device`` (:func:`device_info`), the library
    versions, the setup and the variants ``keys`` names, in the table's order."""
    import train_transformer as tt

    cfg = tt.TrainConfig(preset=setup.preset, seq_len=setup.seq_len).model_config()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device,
        "versions": _versions(),
        "config": {
            "preset": setup.preset,
            "n_params": cfg.num_params(),
            "batch_size": setup.batch_size,
            "seq_len": cfg.block_size,
            "steps": setup.steps,
            "warmup": setup.warmup,
            "scan_layers": setup.scan_layers,
            "remat": setup.remat,
            "plan": setup.plan,
            "torch_compile": setup.torch_compile,
            "plan_only": plan_only,
            "flops_formula": "tokens * (6 * N + 12 * n_layer * d_model * seq_len)",
        },
        "variants": {v.key: dataclasses.asdict(v) for v in VARIANTS if v.key in keys},
        "results": {},
    }


def run_variant(
    key: str,
    setup: Setup,
    plan_only: bool = False,
    timeout: float | None = None,
    env: dict | None = None,
) -> dict:
    """Runs one variant in a fresh subprocess (this script's worker) and returns its row; a
    PyTorch row without torch, a failed worker and one that runs past ``timeout`` seconds
    return ``{"skipped": why}``. ``env``: the subprocess's environment (default: this one's)."""
    variant = next(v for v in VARIANTS if v.key == key)
    if variant.framework == "torch" and not torch_available():
        return {"skipped": TORCH_MISSING}
    cmd = [
        sys.executable,
        __file__,
        *("--worker", key, "--preset", setup.preset, "--batch-size", str(setup.batch_size)),
        *("--steps", str(setup.steps), "--warmup", str(setup.warmup), "--remat", setup.remat),
        "--scan-layers" if setup.scan_layers else "--no-scan-layers",
        *("--plan", setup.plan),
        "--torch-compile" if setup.torch_compile else "--no-torch-compile",
        *(["--plan-only"] if plan_only else []),
    ]
    if setup.seq_len:
        cmd += ["--seq-len", str(setup.seq_len)]
    if setup.experts:
        cmd += ["--experts", str(setup.experts)]
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {timeout:.0f} s"}
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"skipped": f"failed (exit {proc.returncode})", "stderr_tail": proc.stderr[-3000:]}
    return json.loads(line[len("RESULT ") :])


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _fmt_per_param(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def plan_table(report: dict) -> list[str]:
    """The rows' plans as a markdown table (none if no row has one)."""
    rows = []
    for v in VARIANTS:
        plan = report["results"].get(v.key, {}).get("plan")
        if plan is None:
            continue
        if isinstance(plan, str):
            rows.append(f"| {v.name} | no plan: {plan} |" + " |" * 14)
            continue
        memory = plan.get("memory")
        if memory is None:
            held = "-"
        else:
            verdict = "fits" if memory["fits"] else "does not fit"
            held = f"{_gb(memory['temp_bytes'])} ({verdict})"
        if not plan.get("compiled", True):
            rows.append(f"| {v.name} | {plan['source']} |" + " |" * 8 + f" {held} |" + " |" * 5)
            continue
        shares = " | ".join(f"{100 * plan['flop_share'][d]:.1f}%" for d in PLAN_DTYPES)
        estimate = plan.get("estimated_step_s")
        mfu = plan.get("estimated_mfu")
        roofline = plan.get("roofline_step_s")
        moved, moving = plan.get("fusion_bytes"), plan.get("fusion_step_s")
        traffic = fused = "-"
        if moved is not None and moving is not None:
            traffic = f"{_gb(moved)}, {1e3 * moving:.2f} ms"
            if roofline is not None:
                fused = f"{1e3 * (roofline + moving):.1f} ms"
        times = (
            f"{'-' if estimate is None else f'{1e3 * estimate:.1f} ms'} | "
            f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
            f"{'-' if roofline is None else f'{1e3 * roofline:.1f} ms'} | {traffic} | {fused}"
        )
        rows.append(
            f"| {v.name} | {plan['source']} | {shares} | {plan['gemms']} ({plan['fp8_gemms']}) | "
            f"{plan['attention_forward']} / {plan['attention_backward']} | "
            f"{', '.join(plan['scatter_dtypes']) or '-'} | {plan['fusions']} | {held} | {times} |"
        )
    if not rows:
        return []
    return [
        "",
        "Plan of each row's step (`mpjax.plan`), per device: the share of matmul FLOPs (GEMMs "
        "and fused attention) on each operand dtype, GEMMs per step (fp8 ones), fused attention "
        "calls forward / backward, the dtypes scatters accumulate in, fusions, temporaries "
        "(XLA's memory analysis, against the device's memory), and the times: XLA's estimate "
        "(TPU only; an estimate, not a measurement), the MFU of the model FLOPs at that "
        "estimate, the roofline bound (matmul FLOPs at the published peak), and on a GPU the "
        "bytes its fusions that are no matmul move with their time at the published memory "
        "bandwidth, and the roofline with that time added (nothing overlapped).",
        "",
        "| variant | plan | bf16 | f16 | fp8 | f32 | GEMMs (fp8) | fused attention fwd / bwd "
        "| scatters | fusions | temporaries | estimated step | estimated MFU | roofline "
        "| fusions' traffic | roofline + traffic |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
        *rows,
    ]


def markdown_table(report: dict) -> str:
    if report["config"].get("plan_only"):
        return "\n".join(plan_table(report)[1:]) + "\n"
    results = report["results"]
    # The ratio uses the fastest step: on a shared host, background load inflates medians
    # unevenly between variants, while the minimum is what the step costs uncontended.
    base = results.get("f32", {}).get("step_s_min")
    peer = results.get("torch_bf16_sdpa", {}).get("step_s_min")
    cfg = report["config"]
    lines = [
        f"Train step of the `{report['config']['preset']}` GPT "
        f"({report['config']['n_params'] / 1e6:.2f}M params, batch "
        f"{report['config']['batch_size']} x {report['config']['seq_len']} tokens) on "
        f"{report['device']['count']} x {report['device']['kind']} ({report['device']['platform']}); "
        f"median of {report['config']['steps']} steps after {report['config']['warmup']} warmup; "
        f"JAX layers {'scanned' if cfg.get('scan_layers') else 'in a loop'}, remat "
        f"{cfg.get('remat', 'none')}. Every row comes from this one side-by-side run.",
        "",
        "| variant | compile s | step ms (median) | step ms (min) | tokens/s | TFLOP/s | MFU | vs f32 (min) | vs PyTorch bf16 SDPA (min) | bytes/param | XLA memory | peak memory |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in VARIANTS:
        r = results.get(v.key)
        if r is None:
            continue
        if "skipped" in r:
            lines.append(f"| {v.name} | skipped: {r['skipped']} | | | | | | | | | | |")
            continue
        speedup = f"{base / r['step_s_min']:.2f}x" if base else "-"
        vs_peer = f"{peer / r['step_s_min']:.2f}x" if peer else "-"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}% ({r['matmul_kind']})"
        lines.append(
            f"| {v.name} | {r['compile_s']:.1f} | {1e3 * r['step_s_median']:.1f} | "
            f"{1e3 * r['step_s_min']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['achieved_flops_per_s'] / 1e12:.3f} | {mfu} | {speedup} | "
            f"{vs_peer} | {_fmt_per_param(r.get('bytes_per_param'))} | "
            f"{_fmt_bytes(r['compiled_memory_bytes'])} | {_fmt_bytes(r['peak_bytes_in_use'])} |"
        )
    lines += plan_table(report)
    lines += [
        "",
        "bytes/param: the params and the optimizer state per parameter (JAX: "
        "`mpjax.memory_report` of the row's train state; PyTorch: the model's parameters and "
        "`optimizer.state`); gradients and activations are not counted.",
    ]
    load = report["device"].get("load_average_1min")
    if report["device"]["platform"] == "cpu":
        lines += [
            "",
            "On CPU only the ratios between rows mean anything: XLA's CPU backend has no "
            "bf16/f16 GEMM and converts to f32, and no MFU is given (no peak table)."
            + (
                f" Host load average at the start: {load:.1f} on {report['device']['cpu_count']} "
                "cores; background load moves step times, the min column less so."
                if load
                else ""
            ),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    keys = [v.key for v in VARIANTS]
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=list(BATCH_SIZES), default="tiny")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: 16, medium 8)")
    p.add_argument("--seq-len", type=int, help="default: the preset's block size")
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        help="experts in each block's mixture (default: the preset's)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--variants", nargs="+", choices=keys, default=keys)
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        help="JAX rows: blocks under nn.scan (default: on for medium, which compiles in "
        "seconds scanned and minutes in a loop)",
    )
    p.add_argument(
        "--remat",
        choices=["none", "full", "dots"],
        default="none",
        help="JAX rows: rematerialize each block in the backward pass",
    )
    p.add_argument(
        "--plan",
        type=plan_target,
        default="auto",
        help="the plan each JAX row records (mpjax.Plan: FLOP shares by operand dtype, fp8 "
        "GEMMs, fused attention, scatter dtypes, memory, and on a TPU XLA's estimated time): "
        "auto reads the compiled step's on a GPU and records none elsewhere; h100/a100/h200 "
        'compiles for that GPU without one (needs pip install "mpjax[cuda12]"); v4/v5e/v5p/'
        'v6e or a TPU slice (v5p:2x2x1) for that TPU (needs pip install "mpjax[tpu]"); none '
        "records none",
    )
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="only the JAX rows' plans (for --plan, an H100 with auto), compiled without the "
        "hardware and without running a step",
    )
    p.add_argument(
        "--torch-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="PyTorch rows: torch.compile the model and loss (--no-torch-compile: eager)",
    )
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--worker", choices=keys, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plan_only and args.plan == "none":
        p.error("--plan-only records plans: give --plan a GPU (or leave it at auto, an H100)")
    plan = "h100" if args.plan_only and args.plan == "auto" else args.plan
    batch_size = args.batch_size or BATCH_SIZES[args.preset]
    if batch_size <= 0 or args.steps <= 0 or args.warmup < 0:
        p.error("--batch-size and --steps must be positive and --warmup non-negative")
    deep = args.preset in ("medium", "small-moe")
    scan = deep if args.scan_layers is None else args.scan_layers
    setup = Setup(
        args.preset,
        batch_size,
        args.seq_len,
        args.steps,
        args.warmup,
        scan,
        args.remat,
        plan,
        args.torch_compile,
        args.experts,
    )

    if args.worker:
        variant = next(v for v in VARIANTS if v.key == args.worker)
        if args.plan_only:
            run = plan_jax_variant
        else:
            run = run_torch_variant if variant.framework == "torch" else run_jax_variant
        print("RESULT " + json.dumps(run(variant, setup)))
        return

    import jax

    # Initialized here only to name the device: without preallocation, so that on a GPU the
    # memory stays free for the subprocesses that run the rows (which preallocate as usual).
    child_env = dict(os.environ)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    device = jax.devices()[0]
    report = new_report(setup, args.variants, device_info(device), args.plan_only)
    for v in VARIANTS:
        if v.key not in args.variants:
            continue
        print(f"[{v.key}] {v.name} ...", flush=True)
        if v.framework == "torch" and args.plan_only:
            continue  # XLA's plan: PyTorch rows have none
        report["results"][v.key] = run_variant(v.key, setup, args.plan_only, env=child_env)
        if "skipped" in report["results"][v.key]:
            print(f"  skipped: {report['results'][v.key]['skipped']}")

    table = markdown_table(report)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{device.platform}_{args.preset}{'_plan' if args.plan_only else ''}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(table)
    print("\n" + table)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")


if __name__ == "__main__":
    main()
