"""Precision study: the tiny GPT trained for the same steps under each precision setup.

In the spirit of the table in Mixed Precision Training (Micikevicius et al., ICLR 2018): the
same model, data, seed, batches and schedule, changing only how numbers are stored and
computed. Writes the table into docs/precision_study.md (between the table markers, so the
discussion around it stays), docs/precision_study.json (every logged
step), docs/precision_study_loss.png (validation and training loss curves) and
docs/precision_study_loss_scale.png (the loss scale and skipped steps of the float16 runs).

    python examples/precision_study.py               # 8 runs x 300 steps, ~14 min on 2 CPU cores
    python examples/precision_study.py --steps 100 --runs f32 mixed_bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_transformer as tt  # noqa: E402

import mpjax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Run:
    key: str
    label: str
    policy: str
    loss_scale: str = "auto"
    master_weights: bool = True
    seed: int = 0
    mode: str = tt.MODE  # how the policy reaches the model (train_transformer's --mode)


RUNS = [
    Run("f32", "float32", "float32"),
    Run("mixed_bf16", "mixed bf16 (f32 params)", "mixed_bfloat16"),
    Run("mixed_f16_dynamic", "mixed f16 + dynamic loss scaling", "mixed_float16", "dynamic"),
    Run("mixed_f16_none", "mixed f16, no loss scaling", "mixed_float16", "none"),
    Run("pure_bf16_master", "pure bf16 params + f32 master weights", "bfloat16"),
    Run("pure_bf16", "pure bf16 params, no master weights", "bfloat16", master_weights=False),
    # Written by hand, pure bf16 stores the LayerNorm gains in bf16 too (module rules keep
    # norms f32): where rounding freezes parameters first.
    Run(
        "pure_bf16_hand",
        "pure bf16 params incl. norms, no master weights",
        "bfloat16",
        master_weights=False,
        mode="hand",
    ),
    # Another seed (init and batches) in f32: how far apart two equally good runs end up, the
    # yardstick for every difference above.
    Run("f32_seed1", "float32, seed 1 (noise reference)", "float32", seed=1),
]


def run_all(runs: list[Run], steps: int, out_root: pathlib.Path) -> dict:
    results = {}
    for run in runs:
        print(f"\n=== {run.key}: {run.label} ===", flush=True)
        cfg = tt.TrainConfig(
            policy=run.policy,
            loss_scale=run.loss_scale,
            master_weights=run.master_weights,
            steps=steps,
            warmup_steps=max(1, steps // 16),
            log_interval=5,
            eval_interval=max(5, steps // 10),
            ckpt_interval=0,
            sample_bytes=0,
            progress=False,
            out=str(out_root / run.key),
            num_devices=1,
            seed=run.seed,
            mode=run.mode,
        )
        t0 = time.perf_counter()
        try:
            summary = tt.train(cfg)
            stopped = None
        except tt.TrainingStopped as e:
            summary, stopped = None, str(e)
            print(f"stopped: {e}")
        log_lines = (out_root / run.key / "log.jsonl").read_text().splitlines()
        log = [json.loads(row) for row in log_lines]
        results[run.key] = {
            **dataclasses.asdict(run),
            "policy_resolved": str(mpjax.get_policy(run.policy)),
            "optimizer": tt.describe_optimizer(cfg, mpjax.get_policy(run.policy)),
            "wall_s": time.perf_counter() - t0,
            "final_val_loss": summary["final_val_loss"] if summary else None,
            "unigram_baseline": summary["unigram_baseline"] if summary else None,
            "tokens_per_s": summary["tokens_per_s"] if summary else None,
            "skipped_steps": log[-1]["skipped_steps"] if log else None,
            "final_loss_scale": log[-1]["loss_scale"] if log else None,
            "stopped": stopped,
            "log": log,
        }
    return results


def table(results: dict, steps: int) -> str:
    base = results.get("f32", {}).get("final_val_loss")
    baseline = next(
        (r["unigram_baseline"] for r in results.values() if r["unigram_baseline"]), None
    )
    rows = [
        "| run | policy (p,c,o) | mode | optimizer | final val loss (nats/byte) | vs f32 | skipped steps | final loss scale |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results.values():
        val = r["final_val_loss"]
        val_s = "stopped" if val is None else f"{val:.4f}"
        delta = "-" if val is None or base is None else f"{val - base:+.4f}"
        rows.append(
            f"| {r['label']} | `{r['policy_resolved']}` | {r['mode']} | "
            f"{r['optimizer'].removeprefix('AdamW, ')} | "
            f"{val_s} | {delta} | {r['skipped_steps']} | {r['final_loss_scale']:g} |"
        )
    head = (
        f"Tiny GPT (0.84M params), {steps} steps of 16 x 128 bytes of Python stdlib source, "
        "same seed, batches and schedule for every run but the noise reference; validation loss on the same 8 held-out "
        "batches, in nats per byte"
        + (f" (unigram baseline {baseline:.4f})" if baseline else "")
        + ". Run on CPU: params, activations and matmul outputs are rounded to bf16/f16 as on a "
        "GPU (matmuls accumulate in f32 on both), but XLA's CPU backend may keep some fused "
        "elementwise intermediates in f32, so a GPU run will not match bit for bit."
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


TABLE_START, TABLE_END = "<!-- table:start -->", "<!-- table:end -->"


def write_table(path: pathlib.Path, md: str) -> None:
    """Puts ``md`` between the table markers of ``path``, creating the file if needed."""
    block = f"{TABLE_START}\n{md}{TABLE_END}"
    if path.exists() and TABLE_START in (text := path.read_text()) and TABLE_END in text:
        head, rest = text.split(TABLE_START, 1)
        path.write_text(head + block + rest.split(TABLE_END, 1)[1])
    else:
        path.write_text(
            "# Precision study\n\nWritten by `python examples/precision_study.py`.\n\n"
            f"{block}\n\n![loss curves](precision_study_loss.png)\n\n"
            "![loss scale](precision_study_loss_scale.png)\n"
        )


def plot(results: dict, out_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results.values():
        log = r["log"]
        val = [(e["step"], e["val_loss"]) for e in log if "val_loss" in e]
        if val:
            ax_val.plot(*zip(*val), marker="o", ms=3, label=r["label"])
        ax_train.plot([e["step"] for e in log], [e["loss"] for e in log], lw=1, label=r["label"])
    for ax, title in ((ax_val, "validation loss"), (ax_train, "training loss (logged steps)")):
        ax.set_xlabel("step")
        ax.set_ylabel("nats / byte")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    baseline = next(
        (r["unigram_baseline"] for r in results.values() if r["unigram_baseline"]), None
    )
    if baseline:
        ax_val.axhline(baseline, color="gray", ls="--", lw=1, label="unigram baseline")
    ax_val.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "precision_study_loss.png", dpi=110)
    plt.close(fig)

    f16 = {
        k: r
        for k, r in results.items()
        if mpjax.get_policy(r["policy"]).compute_dtype == np.dtype(np.float16)
    }
    fig, (ax_scale, ax_skip) = plt.subplots(1, 2, figsize=(12, 4))
    for r in f16.values():
        steps = [e["step"] for e in r["log"]]
        ax_scale.plot(steps, [e["loss_scale"] for e in r["log"]], label=r["label"])
        ax_skip.plot(steps, [e["skipped_steps"] for e in r["log"]], label=r["label"])
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_title("loss scale (1 = no loss scaling)")
    ax_skip.set_title("skipped steps (cumulative)")
    for ax in (ax_scale, ax_skip):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "precision_study_loss_scale.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--runs", nargs="+", choices=[r.key for r in RUNS], default=[r.key for r in RUNS]
    )
    p.add_argument("--docs", default=str(ROOT / "docs"), help="where the table and plots go")
    p.add_argument("--out", default=str(ROOT / "runs" / "precision_study"), help="run folders")
    args = p.parse_args(argv)
    if args.steps < 20:
        p.error(f"--steps must be at least 20, got {args.steps}")
    runs = [r for r in RUNS if r.key in args.runs]
    out_root = pathlib.Path(args.out)
    if out_root.exists():
        import shutil

        shutil.rmtree(out_root)  # the study always starts fresh: it owns this folder
    results = run_all(runs, args.steps, out_root)
    docs = pathlib.Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    md = table(results, args.steps)
    write_table(docs / "precision_study.md", md)
    (docs / "precision_study.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, docs)
    print("\n" + md)
    print(f"wrote {docs / 'precision_study.md'}, precision_study.json and the two PNGs in {docs}")


if __name__ == "__main__":
    main()
