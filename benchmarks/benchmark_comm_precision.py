"""What an FSDP step sends between devices, by dtype, under each reduce dtype: planned for a TPU
slice and for a GPU cluster without either.

The model is the example GPT (``examples/gpt.py``) at 4 layers of d_model 1024 with a
32000-token vocabulary, trained by the example's step (AdamW, global-norm clipping) on a batch
of 16 x 1024 tokens, its params and optimizer state sliced FSDP-style over every device of the
target and the batch split over all of them. For each policy it compiles the step for each
target with :func:`mpjax.plan` and records every collective: kind, dtype, bytes per device and
step, whether it belongs to the backward pass, and the modules whose values it carries.

    JAX_PLATFORMS=cpu python benchmarks/benchmark_comm_precision.py                # v5p:2x2x2, h100:8
    JAX_PLATFORMS=cpu python benchmarks/benchmark_comm_precision.py --targets v5p:2x2x2

Needs ``pip install -e ".[tpu,cuda12]"`` (libtpu and JAX's CUDA plugin install without the
hardware). Nothing runs: the bytes are what XLA compiled; the times are XLA's estimates (TPU).
Results go to ``--out-dir`` as ``comm_precision.json`` and ``comm_precision.md``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import importlib.metadata
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import train_transformer  # noqa: E402

import mpjax  # noqa: E402

SETTINGS = {
    "f32 reduce (the default)": "mixed_bfloat16",
    "bf16 reduce": "p=f32,c=bf16,o=f32,r=bf16",
}
TARGETS = ("v5p:2x2x2", "h100:8")
MODEL = {"vocab_size": 32000, "n_layer": 4, "n_head": 16, "d_model": 1024, "block_size": 1024}
BATCH = 16


def plan_step(target: str, policy: str, batch: int = BATCH) -> mpjax.Plan:
    """The plan of the example's train step for ``MODEL`` under ``policy`` on ``target``,
    every large param sliced over all of its devices (the example's own ``--plan``)."""
    devices = mpjax.plan_mesh(target).devices.size
    cfg = train_transformer.parse_args(
        ["--policy", policy, "--batch-size", str(batch), "--fsdp", str(devices), "--plan", target]
    )
    model_config = dataclasses.replace(cfg.model_config(), **MODEL)
    return train_transformer.plan_step(cfg, model_config)


def summarize(plan: mpjax.Plan) -> dict:
    """The plan's collectives by kind and dtype (bytes per device and step), forward and
    backward apart, each with the modules it carries; memory and, on a TPU, the estimate."""
    by_dtype: dict[str, int] = collections.Counter()
    rows = []
    for c in plan.collectives:
        total = c.total_bytes
        pass_ = "backward" if c.backward else "forward"
        by_dtype[f"{c.kind} {c.dtype.name} {pass_}"] += total
        rows.append(
            {
                "kind": c.kind,
                "dtype": c.dtype.name,
                "bytes": total,
                "devices": c.devices,
                "backward": c.backward,
                "modules": list(c.modules),
            }
        )
    memory = plan.memory
    return {
        "collective_bytes": dict(sorted(by_dtype.items())),
        "collectives": rows,
        "memory_per_device_bytes": None if memory is None else memory.total_bytes,
        "fits": None if memory is None else memory.fits,
        "estimated_seconds": plan.estimated_seconds,
        "estimated_mfu": plan.mfu(),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def markdown(results: dict) -> str:
    lines = [
        "# What the FSDP step sends, by dtype, under each reduce dtype",
        "",
        f"The example GPT at {MODEL}, batch {BATCH} x {MODEL['block_size']}, AdamW, params "
        "and optimizer state sliced over every device. MiB per device and step, compiled "
        "without the hardware (`benchmarks/benchmark_comm_precision.py`).",
        "",
    ]
    for target, settings in results["targets"].items():
        keys = sorted({k for s in settings.values() for k in s["collective_bytes"]})
        names = list(settings)
        lines += [f"## {target}", "", "| collective | " + " | ".join(names) + " |"]
        lines.append("| --- |" + " ---: |" * len(names))
        for key in keys:
            cells = [_mib(settings[n]["collective_bytes"].get(key, 0)) for n in names]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        totals = [_mib(sum(settings[n]["collective_bytes"].values())) for n in names]
        lines.append("| **all** | " + " | ".join(f"**{t}**" for t in totals) + " |")
        estimates = [settings[n]["estimated_seconds"] for n in names]
        if any(e is not None for e in estimates):
            cells = ["-" if e is None else f"{e * 1e3:.2f} ms" for e in estimates]
            lines.append("| estimated step (XLA) | " + " | ".join(cells) + " |")
        memory = [settings[n]["memory_per_device_bytes"] for n in names]
        lines.append(
            "| memory per device | "
            + " | ".join("-" if m is None else f"{m / 1e9:.2f} GB" for m in memory)
            + " |"
        )
        lines.append("")
        for name in names:
            f32_gathers = collections.Counter()
            for row in settings[name]["collectives"]:
                if row["kind"] == "all-gather" and row["dtype"] == "float32":
                    f32_gathers[", ".join(row["modules"]) or "-"] += row["bytes"]
            text = "; ".join(f"{m}: {_mib(b)} MiB" for m, b in sorted(f32_gathers.items()))
            lines.append(f"- {name}: float32 all-gathers carry {text or 'nothing'}.")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS))
    parser.add_argument(
        "--out-dir", default=str(ROOT / "benchmarks" / "results" / "comm_precision")
    )
    args = parser.parse_args(argv)
    versions = {}
    for package in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "flax", "optax"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    results: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions,
        "model": MODEL,
        "batch": BATCH,
        "targets": {},
    }
    for target in args.targets:
        results["targets"][target] = {}
        for name, policy in SETTINGS.items():
            summary = summarize(plan_step(target, policy))
            summary["policy"] = policy
            results["targets"][target][name] = summary
            print(target, name, {k: _mib(v) for k, v in summary["collective_bytes"].items()})
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm_precision.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "comm_precision.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
