"""Benchmark the example GPT's train step under several precision setups, side by side.

Each variant is the full jitted train step of examples/train_transformer.py (forward, backward,
clipping, AdamW and, where it applies, loss scaling) on the same model shape and batch:

    python benchmarks/benchmark_train_step.py                        # tiny preset, CPU: ~1-2 min
    python benchmarks/benchmark_train_step.py --preset small         # GPU
    python benchmarks/benchmark_train_step.py --preset medium --batch-size 8

Per variant it reports compile time, the median step time over --steps timed steps after
--warmup steps (each step waits for its result), tokens/s, model FLOPs per step, achieved
FLOP/s and MFU against the device's dense peak where the table below knows it, XLA's memory
estimate for the compiled step and, where the device reports it, peak device memory.

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

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the same train step.

    Attributes:
      key: short name for --variants and file contents.
      name: what the table shows.
      policy: the mpjax policy string.
      mode: how the policy reaches the model (``train_transformer.build_model``'s ``mode``).
      loss_scale: ``--loss-scale`` of the training script.
      matmul_precision: ``jax.default_matmul_precision`` for the whole step, or None for JAX's
        default (TF32 for f32 matmuls on Ampere and Hopper GPUs, full f32 on CPU).
    """

    key: str
    name: str
    policy: str
    mode: str = "hand"
    loss_scale: str = "none"
    matmul_precision: str | None = None


# The f32 "default" row is the baseline for the speedup column; "bf16_hand" is the honest
# baseline for mpjax's rows (an undtyped Flax model would run f32 GEMMs and flatter them).
VARIANTS = [
    Variant("f32", "float32, default matmul precision", "float32"),
    Variant("f32_highest", "float32, precision=highest", "float32", matmul_precision="highest"),
    Variant(
        "bf16_mpjax", "mixed_bfloat16, mpjax.linen.apply_policy", "mixed_bfloat16", mode="mpjax"
    ),
    Variant("bf16_autocast", "mixed_bfloat16, mpjax.autocast", "mixed_bfloat16", mode="autocast"),
    Variant("bf16_hand", "mixed_bfloat16, dtype=bf16 by hand", "mixed_bfloat16"),
    Variant(
        "f16_dynamic",
        "mixed_float16 + dynamic loss scaling, mpjax",
        "mixed_float16",
        mode="mpjax",
        loss_scale="dynamic",
    ),
]

# Dense peak FLOP/s per device by matmul kind. Matched against jax's device_kind, first match
# wins (so the PCIe H100 comes before the SXM one). H200 has H100's compute.
PEAK_FLOPS = [
    ("H100 PCIe", {"bf16": 756e12, "f16": 756e12, "tf32": 378e12, "f32": 51e12}),
    ("H100", {"bf16": 989e12, "f16": 989e12, "tf32": 495e12, "f32": 67e12}),
    ("H200", {"bf16": 989e12, "f16": 989e12, "tf32": 495e12, "f32": 67e12}),
    ("A100", {"bf16": 312e12, "f16": 312e12, "tf32": 156e12, "f32": 19.5e12}),
]

BATCH_SIZES = {"tiny": 16, "small": 16, "medium": 8}


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
            return peaks[kind]
    return None


def run_variant(
    variant: Variant, preset: str, batch_size: int, seq_len: int | None, steps: int, warmup: int
) -> dict:
    """Compiles and times one variant in this process; returns its result row."""
    import jax
    import numpy as np
    import train_transformer as tt

    import mpjax

    cfg = tt.TrainConfig(
        preset=preset,
        policy=variant.policy,
        loss_scale=variant.loss_scale,
        batch_size=batch_size,
        seq_len=seq_len,
        steps=1000,
        warmup_steps=10,
    )
    policy = mpjax.get_policy(cfg.policy)
    mcfg = cfg.model_config()
    device = jax.devices()[0]
    model = tt.build_model(mcfg, policy, variant.mode)
    tx = tt.make_optimizer(cfg, policy)
    state = jax.device_put(tt.init_state(model, tx, 0, mcfg.block_size), device)
    data = tt.load_corpus(None, max_bytes=2_000_000)
    x, y = (
        jax.device_put(a, device)
        for a in tt.sample_batch(data, np.random.default_rng(0), (1, batch_size), mcfg.block_size)
    )

    with jax.default_matmul_precision(variant.matmul_precision):
        t0 = time.perf_counter()
        compiled = (
            jax.jit(tt.make_train_step(model, tx), donate_argnums=0).lower(state, x, y).compile()
        )
        compile_s = time.perf_counter() - t0

    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, x, y)
        metrics["loss"].block_until_ready()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    loss = float(metrics["loss"])

    step_s = statistics.median(times)
    tokens = batch_size * mcfg.block_size
    flops = tokens * mcfg.flops_per_token()
    kind = matmul_kind(policy.compute_dtype.name, variant.matmul_precision, device.platform)
    peak = peak_flops(device.device_kind, kind)
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
    return {
        "policy": str(policy),
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
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "final_loss": loss,
    }


def _versions() -> dict:
    names = ("jax", "jaxlib", "flax", "optax", "numpy", "mpjax")
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


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def markdown_table(report: dict) -> str:
    results = report["results"]
    # The ratio uses the fastest step: on a shared host, background load inflates medians
    # unevenly between variants, while the minimum is what the step costs uncontended.
    base = results.get("f32", {}).get("step_s_min")
    lines = [
        f"Train step of the `{report['config']['preset']}` GPT "
        f"({report['config']['n_params'] / 1e6:.2f}M params, batch "
        f"{report['config']['batch_size']} x {report['config']['seq_len']} tokens) on "
        f"{report['device']['count']} x {report['device']['kind']} ({report['device']['platform']}); "
        f"median of {report['config']['steps']} steps after {report['config']['warmup']} warmup.",
        "",
        "| variant | compile s | step ms (median) | step ms (min) | tokens/s | TFLOP/s | MFU | vs f32 (min) | XLA memory | peak memory |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in VARIANTS:
        r = results.get(v.key)
        if r is None:
            continue
        if "skipped" in r:
            lines.append(f"| {v.name} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        speedup = f"{base / r['step_s_min']:.2f}x" if base else "-"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}% ({r['matmul_kind']})"
        lines.append(
            f"| {v.name} | {r['compile_s']:.1f} | {1e3 * r['step_s_median']:.1f} | "
            f"{1e3 * r['step_s_min']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['achieved_flops_per_s'] / 1e12:.3f} | {mfu} | {speedup} | "
            f"{_fmt_bytes(r['compiled_memory_bytes'])} | {_fmt_bytes(r['peak_bytes_in_use'])} |"
        )
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
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--variants", nargs="+", choices=keys, default=keys)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--worker", choices=keys, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    batch_size = args.batch_size or BATCH_SIZES[args.preset]
    if batch_size <= 0 or args.steps <= 0 or args.warmup < 0:
        p.error("--batch-size and --steps must be positive and --warmup non-negative")

    if args.worker:
        variant = next(v for v in VARIANTS if v.key == args.worker)
        row = run_variant(variant, args.preset, batch_size, args.seq_len, args.steps, args.warmup)
        print("RESULT " + json.dumps(row))
        return

    import jax
    import train_transformer as tt

    device = jax.devices()[0]
    cfg = tt.TrainConfig(preset=args.preset, seq_len=args.seq_len).model_config()
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": {
            "kind": device.device_kind,
            "platform": device.platform,
            "count": 1,
            "host": platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "versions": _versions(),
        "config": {
            "preset": args.preset,
            "n_params": cfg.num_params(),
            "batch_size": batch_size,
            "seq_len": cfg.block_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "flops_formula": "tokens * (6 * N + 12 * n_layer * d_model * seq_len)",
        },
        "variants": {v.key: dataclasses.asdict(v) for v in VARIANTS if v.key in args.variants},
        "results": {},
    }
    for v in VARIANTS:
        if v.key not in args.variants:
            continue
        print(f"[{v.key}] {v.name} ...", flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            v.key,
            "--preset",
            args.preset,
            "--batch-size",
            str(batch_size),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        if args.seq_len:
            cmd += ["--seq-len", str(args.seq_len)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            report["results"][v.key] = {"skipped": f"failed (exit {proc.returncode})"}
            print(proc.stderr[-3000:], file=sys.stderr)
            continue
        report["results"][v.key] = json.loads(line[len("RESULT ") :])

    table = markdown_table(report)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{device.platform}_{args.preset}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(table)
    print("\n" + table)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")


if __name__ == "__main__":
    main()
