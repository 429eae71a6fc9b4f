"""Precision study: what each way of storing and updating numbers costs, several seeds each.

In the spirit of Mixed Precision Training (Micikevicius et al., ICLR 2018): the same small GPT,
data, batches and schedule under each precision setup, changing only how params, optimizer
state and gradients are stored, computed and rounded. The setups are chosen so that the
effects are real at a scale a CPU trains in minutes:

* a cosine schedule that decays to 1% of the peak learning rate, so the last part of every
  run takes Adam updates (about the learning rate in size) far below half the spacing of
  bfloat16 around typical weights: rounded to nearest they vanish, and pure bfloat16 params
  stop moving (the "unmoved" plot shows it step by step);
* a mean loss over every token of a batch, so the gradient reaching each logit is about
  ``p / tokens``: late in training many fall below float16's smallest subnormal, and without
  loss scaling they flush to zero (counted per gradient entry against a float32 reference).

Writes the table into docs/precision_study.md (between the table markers), every logged step
of every run into docs/precision_study.json, and three plots into docs/:
precision_study_loss.png, precision_study_unmoved.png, precision_study_gradients.png.

    python examples/precision_study.py                     # 29 setups x 3 seeds, ~2.75 h on 2 CPU cores
    python examples/precision_study.py --seeds 0 --setups f32 bf16_nearest bf16_sr --steps 300
    python examples/precision_study.py --add --setups mixed_bf16_fp8 mixed_bf16_fp8_head
    python examples/precision_study.py --render-only   # the table and plots from the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_transformer as tt  # noqa: E402

import mpjax  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The study's model and schedule: small enough for 27 runs on a CPU, long enough for the late,
# low-learning-rate phase where rounding decides whether params still move.
MODEL = dict(n_layer=2, d_model=64, n_head=4, seq_len=64, batch_size=16)
STEPS = 1200
LR, MIN_LR_RATIO = 3e-3, 0.01
EVAL_BATCHES = 32  # the same held-out batches for every run
# The scale of the gradient analysis's float16 run with loss scaling: the dynamic scale's
# default start.
ANALYSIS_SCALE = 2.0**15


@dataclasses.dataclass(frozen=True)
class Setup:
    """One precision setup; the fields are train_transformer's flags of the same names."""

    key: str
    label: str
    policy: str
    loss_scale: str = "auto"
    master_weights: bool = True
    param_rounding: str = "nearest"
    mu_dtype: str | None = None
    nu_dtype: str | None = None
    state_rounding: str = "nearest"
    state_format: str = "none"
    state_block_size: int | None = None
    fp8_head: bool = False
    # How the dtypes reach the model. bf16-param setups write them into the model ("hand"),
    # so every param is bf16, norms included (module rules would keep norms f32); the others
    # go through module rules, which give the same arithmetic for f32 params.
    mode: str = "mpjax"
    # A mixture of experts in place of each block's MLP (experts, 2 per token); 0: the MLP.
    experts: int = 0

    @property
    def reference(self) -> str:
        """The float32 setup its *vs f32* column pairs it with: the same model's."""
        return "moe_f32" if self.experts else "f32"


# Quantized moments (mpjax.quantized_state) in blocks of 64, d_model: the formats' own blocks
# (256, 128 for dynamic4) do not divide most of this small model's matrices, which would then
# keep f32 moments.
QUANTIZED_BLOCK = 64
QUANTIZED_LABELS = {"dynamic8": "8-bit dynamic", "e4m3": "e4m3", "dynamic4": "4-bit dynamic"}


def _quantized_setups() -> list[Setup]:
    """Each quantized format with f32 params, and with bf16 params and stochastic rounding of
    params and moments."""
    setups = []
    for fmt, name in QUANTIZED_LABELS.items():
        setups.append(
            Setup(
                f"f32_state_{fmt}",
                f"f32 params, {name} Adam moments",
                "float32",
                state_format=fmt,
                state_block_size=QUANTIZED_BLOCK,
            )
        )
        setups.append(
            Setup(
                f"bf16_sr_state_{fmt}",
                f"bf16 params and {name} Adam moments, all stochastic rounding",
                "bfloat16",
                master_weights=False,
                param_rounding="stochastic",
                state_format=fmt,
                state_block_size=QUANTIZED_BLOCK,
                state_rounding="stochastic",
                mode="hand",
            )
        )
    return setups


SETUPS = [
    Setup("f32", "float32", "float32"),
    Setup("mixed_bf16", "mixed bf16 (f32 params, bf16 compute)", "mixed_bfloat16"),
    Setup("bf16_master", "bf16 params + f32 master weights", "bfloat16", mode="hand"),
    Setup(
        "bf16_nearest",
        "bf16 params and Adam moments, round to nearest (plain optax)",
        "bfloat16",
        master_weights=False,
        mode="hand",
    ),
    Setup(
        "bf16_sr",
        "bf16 params, stochastic rounding",
        "bfloat16",
        master_weights=False,
        param_rounding="stochastic",
        mode="hand",
    ),
    Setup(
        "bf16_kahan",
        "bf16 params, Kahan compensation (bf16)",
        "bfloat16",
        master_weights=False,
        param_rounding="kahan",
        mode="hand",
    ),
    Setup(
        "bf16_sr_state_bf16",
        "bf16 params and bf16 mu, nu, all stochastic rounding",
        "bfloat16",
        master_weights=False,
        param_rounding="stochastic",
        mu_dtype="bfloat16",
        nu_dtype="bfloat16",
        state_rounding="stochastic",
        mode="hand",
    ),
    *_quantized_setups(),
    Setup(
        "mixed_bf16_fp8",
        "mixed bf16 + fp8 matmuls (current scaling), head in bf16",
        "mixed_bfloat16_fp8",
    ),
    Setup(
        "mixed_bf16_fp8_head",
        "mixed bf16 + fp8 matmuls (current scaling), head in fp8 too",
        "mixed_bfloat16_fp8",
        fp8_head=True,
    ),
    Setup(
        "mixed_bf16_fp8_rowwise",
        "mixed bf16 + fp8 matmuls (a scale per row), head in bf16",
        "mixed_bfloat16_fp8_rowwise",
    ),
    Setup(
        "mixed_bf16_mxfp8",
        "mixed bf16 + MXFP8 matmuls (a scale per 32 values), head in bf16",
        "mixed_bfloat16_mxfp8",
    ),
    # NVFP4 in all three GEMMs: by the format's definition alone, with NVIDIA's whole training
    # recipe (the preset's default), and with the recipe less each of its ingredients in turn.
    Setup(
        "mixed_bf16_nvfp4_plain",
        "mixed bf16 + NVFP4 matmuls, none of the recipe, head in bf16",
        "p=f32,c=bf16,o=f32,fp8=nvfp4;plain",
    ),
    Setup(
        "mixed_bf16_nvfp4",
        "mixed bf16 + NVFP4 matmuls, NVIDIA's recipe, head in bf16",
        "mixed_bfloat16_nvfp4",
    ),
    *(
        Setup(
            f"mixed_bf16_nvfp4_{option}",
            f"mixed bf16 + NVFP4 matmuls, the recipe less {what}, head in bf16",
            f"p=f32,c=bf16,o=f32,fp8=nvfp4;{option}",
        )
        for option, what in (
            ("no_hadamard", "the Hadamard transforms"),
            ("no_stochastic_rounding", "stochastic rounding"),
            ("no_2d", "16 x 16 weight tiles"),
        )
    ),
    # A mixture of experts (8 experts, 2 per token) in every block: float32, mpjax's grouped
    # GEMMs in bf16 with the router kept f32 by its built-in rule, and the same bf16 written by
    # hand (lax.ragged_dot on bf16 operands, the router in f32).
    Setup("moe_f32", "MoE, 8 experts top-2: float32", "float32", experts=8),
    Setup(
        "moe_mixed_bf16",
        "MoE: mixed bf16, grouped GEMMs, router f32 (mpjax)",
        "mixed_bfloat16",
        experts=8,
    ),
    Setup(
        "moe_bf16_hand",
        "MoE: bf16 written by hand (lax.ragged_dot), router f32",
        "mixed_bfloat16",
        experts=8,
        mode="hand",
    ),
    # MXFP8 on the same mixture: its experts grouped in bf16 (no grouped GEMM takes a block
    # format), or as batched MXFP8 GEMMs over each expert's slots at a capacity of 1.25 (384
    # slots of 256 rows on average here), rows past it dropped (mpjax.grouped.capacity).
    Setup(
        "moe_mxfp8",
        "MoE: mixed bf16 + MXFP8 dense matmuls, experts grouped in bf16",
        "mixed_bfloat16_mxfp8",
        experts=8,
    ),
    Setup(
        "moe_mxfp8_capacity",
        "MoE: mixed bf16 + MXFP8, experts too at a capacity of 1.25",
        "p=f32,c=bf16,o=f32,fp8=mxfp8;capacity=1.25",
        experts=8,
    ),
    Setup("mixed_f16_none", "mixed f16, no loss scaling", "mixed_float16", loss_scale="none"),
    Setup(
        "mixed_f16_dynamic",
        "mixed f16 + dynamic loss scaling",
        "mixed_float16",
        loss_scale="dynamic",
    ),
]
SEEDS = (0, 1, 2)


def config(setup: Setup, seed: int, steps: int, out: pathlib.Path) -> tt.TrainConfig:
    """The run's settings: the setup's flags on the study's model and schedule."""
    fields = {f.name: getattr(setup, f.name) for f in dataclasses.fields(Setup)}
    del fields["key"], fields["label"]
    return tt.TrainConfig(
        **fields,
        **MODEL,
        steps=steps,
        lr=LR,
        min_lr_ratio=MIN_LR_RATIO,
        warmup_steps=max(1, steps // 20),
        log_interval=5,
        eval_interval=max(5, steps // 12),
        eval_batches=EVAL_BATCHES,
        ckpt_interval=steps,  # one checkpoint, at the end: the gradient analysis reads it
        sample_bytes=0,
        progress=False,
        out=str(out),
        num_devices=1,
        seed=seed,
    )


def _model_and_optimizer(cfg: tt.TrainConfig, policy: str | None = None):
    pol = mpjax.get_policy(policy or cfg.policy)
    model = tt.build_model(cfg.model_config(), pol, cfg.mode)
    return model, tt.make_optimizer(cfg, mpjax.get_policy(cfg.policy))


def memory(cfg: tt.TrainConfig) -> mpjax.MemoryReport:
    """Bytes of params and optimizer state per param, from the state's shapes and dtypes."""
    model, tx = _model_and_optimizer(cfg)

    def init(key):
        params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        return params, tx.init(params)

    return mpjax.memory_report(*jax.eval_shape(init, jax.random.key(0)))


def final_params(cfg: tt.TrainConfig):
    """The params a finished run saved in its last checkpoint."""
    model, tx = _model_and_optimizer(cfg)
    like = tt.init_state(model, tx, cfg.seed, cfg.seq_len)
    manager = tt._checkpoint_manager(cfg.out_dir() / "checkpoints")
    return tt.restore_state(manager, manager.latest_step(), like).params


def gradient_analysis(cfg: tt.TrainConfig, n_batches: int = 8) -> dict:
    """Which gradient entries float16 compute loses, on a run's final (float32) params.

    The same params and batches through the model three times: computing in float32 (the
    reference), in float16 without loss scaling, and in float16 with the loss scaled by
    ``ANALYSIS_SCALE`` (unscaled in float32). An entry is *flushed* when the reference is
    nonzero and the float16 gradient is exactly zero. Also returned: a histogram of
    log2 |d loss / d logits| in float32, the first gradient the backward pass casts to float16.
    """
    params = final_params(cfg)
    f32_model, _ = _model_and_optimizer(cfg, "float32")
    f16_model, _ = _model_and_optimizer(cfg, "mixed_float16")

    def grads(model, scale, x, y):
        g = jax.grad(lambda p: tt.loss_fn(model, p, x, y) * scale)(params)
        return jax.tree.map(lambda a: a.astype(jnp.float32) / scale, g)

    @jax.jit
    def counts(x, y):
        ref = jax.tree.leaves(grads(f32_model, 1.0, x, y))
        out = {"nonzero": sum(jnp.sum(r != 0) for r in ref)}
        for name, scale in (("unscaled", 1.0), ("scaled", ANALYSIS_SCALE)):
            got = jax.tree.leaves(grads(f16_model, scale, x, y))
            out[name] = sum(jnp.sum((r != 0) & (g == 0)) for r, g in zip(ref, got))
        logits = f32_model.apply({"params": params}, x).astype(jnp.float32)
        dlogits = jax.grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean())(
            logits
        )
        out["log2_dlogits"] = jnp.log2(jnp.abs(dlogits).reshape(-1))
        return out

    rng = np.random.default_rng(tt.VAL_SAMPLER_SEED)
    data = tt.split_corpus(tt.load_corpus(cfg.data, cfg.max_bytes), cfg.val_fraction)[1]
    totals = {"nonzero": 0, "unscaled": 0, "scaled": 0}
    log2 = []
    for _ in range(n_batches):
        x, y = tt.sample_batch(data, rng, (cfg.batch_size,), cfg.seq_len)
        c = jax.device_get(counts(jnp.asarray(x), jnp.asarray(y)))
        for k in totals:
            totals[k] += int(c[k])
        log2.append(c["log2_dlogits"])
    log2_all = np.concatenate(log2)
    finite = log2_all[np.isfinite(log2_all)]
    tiny = np.log2(float(jnp.finfo(jnp.float16).smallest_subnormal))
    normal = np.log2(float(jnp.finfo(jnp.float16).smallest_normal))
    hist, edges = np.histogram(finite, bins=np.arange(-48, 2))
    return {
        "flushed_unscaled": totals["unscaled"] / totals["nonzero"],
        "flushed_scaled": totals["scaled"] / totals["nonzero"],
        "nonzero_entries": totals["nonzero"],
        # Below half the smallest subnormal a float16 value rounds to 0; below the smallest
        # normal it keeps fewer than 11 significant bits.
        "dlogits_below_f16_subnormal": float(np.mean(log2_all < tiny - 1)),
        "dlogits_below_f16_normal": float(np.mean(log2_all < normal)),
        "dlogits_log2_hist": hist.tolist(),
        "dlogits_log2_edges": edges.tolist(),
    }


def run_all(setups: list[Setup], seeds: list[int], steps: int, out_root: pathlib.Path) -> dict:
    results = {}
    for setup in setups:
        entry = {**dataclasses.asdict(setup), "runs": {}}
        for seed in seeds:
            print(f"\n=== {setup.key}, seed {seed}: {setup.label} ===", flush=True)
            cfg = config(setup, seed, steps, out_root / f"{setup.key}_seed{seed}")
            t0 = time.perf_counter()
            try:
                summary, stopped = tt.train(cfg), None
            except tt.TrainingStopped as e:
                summary, stopped = None, str(e)
                print(f"stopped: {e}")
            log = [json.loads(r) for r in (cfg.out_dir() / "log.jsonl").read_text().splitlines()]
            run = {
                "wall_s": time.perf_counter() - t0,
                "final_val_loss": summary["final_val_loss"] if summary else None,
                "unigram_baseline": summary["unigram_baseline"] if summary else None,
                "skipped_steps": log[-1]["skipped_steps"] if log else None,
                "final_loss_scale": log[-1]["loss_scale"] if log else None,
                "stopped": stopped,
                "log": log,
            }
            if summary and mpjax.get_policy(setup.policy).compute_dtype == jnp.float16:
                run["gradients"] = gradient_analysis(cfg)
            entry["runs"][seed] = run
        cfg = config(setup, seeds[0], steps, out_root / "unused")
        entry["optimizer"] = tt.describe_optimizer(cfg, mpjax.get_policy(setup.policy))
        entry["policy_resolved"] = str(mpjax.get_policy(setup.policy))
        entry["memory"] = memory(cfg).to_dict()
        results[setup.key] = entry
    return results


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def late_unmoved(run: dict, steps: int) -> float:
    """Mean fraction of params left unchanged by the logged steps of the last fifth."""
    rows = [e["unmoved"] for e in run["log"] if e["step"] > 0.8 * steps]
    return statistics.fmean(rows) if rows else float("nan")


def summarize(results: dict, steps: int) -> dict:
    """Per setup: final val loss mean and sd over seeds, its difference from its float32
    setup (the same model's, :attr:`Setup.reference`) paired by seed, late unmoved fraction,
    skipped steps, flushed gradient entries."""
    references = {s.key: s.reference for s in SETUPS}
    out = {}
    for key, entry in results.items():
        reference = references.get(key, "f32")
        f32 = results.get(reference, {}).get("runs", {})
        runs = entry["runs"]
        finals = {s: r["final_val_loss"] for s, r in runs.items() if r["final_val_loss"]}
        diffs = [finals[s] - f32[s]["final_val_loss"] for s in finals if s in f32]
        grads = [r["gradients"] for r in runs.values() if "gradients" in r]
        out[key] = {
            "val": _mean_sd(list(finals.values())) if finals else None,
            "vs_f32": _mean_sd(diffs) if diffs and key != reference else None,
            "n": len(finals),
            "stopped": sum(r["stopped"] is not None for r in runs.values()),
            "unmoved": statistics.fmean(late_unmoved(r, steps) for r in runs.values()),
            "skipped": statistics.fmean(r["skipped_steps"] or 0 for r in runs.values()),
            "flushed": (
                (
                    statistics.fmean(g["flushed_unscaled"] for g in grads),
                    statistics.fmean(g["flushed_scaled"] for g in grads),
                )
                if grads
                else None
            ),
        }
    return out


def table(results: dict, steps: int) -> str:
    stats = summarize(results, steps)
    seeds = max(s["n"] for s in stats.values())
    rows = [
        "| setup | optimizer | bytes/param | final val loss | vs f32 (paired) | unmoved, last 20% | skipped | flushed grads: f16 / f16 x 2^15 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, entry in results.items():
        s = stats[key]
        val = "stopped" if s["val"] is None else f"{s['val'][0]:.4f} ± {s['val'][1]:.4f}"
        if s["stopped"]:
            val += f" ({s['stopped']} stopped)"
        vs = "-" if s["vs_f32"] is None else f"{s['vs_f32'][0]:+.4f} ± {s['vs_f32'][1]:.4f}"
        flushed = "-" if s["flushed"] is None else f"{s['flushed'][0]:.2%} / {s['flushed'][1]:.2%}"
        rows.append(
            f"| {entry['label']} | {entry['optimizer'].removeprefix('AdamW, ')} | "
            f"{entry['memory']['bytes_per_param']:.2f} | {val} | {vs} | {s['unmoved']:.1%} | "
            f"{s['skipped']:g} | {flushed} |"
        )
    head = (
        f"GPT of {MODEL['n_layer']} layers, d_model {MODEL['d_model']}, "
        f"{MODEL['batch_size']} x {MODEL['seq_len']} bytes of Python stdlib source per step, "
        f"{steps} steps of AdamW, learning rate {LR:g} cosine-decayed to {LR * MIN_LR_RATIO:g}; "
        f"{seeds} seeds per setup (init and batches; the same seeds for every setup). Final "
        f"validation loss on the same {EVAL_BATCHES} held-out batches in nats per byte, mean ± "
        "standard deviation over seeds; *vs f32* is the per-seed difference from the float32 "
        "run of the same seed (the MoE rows': the float32 MoE's), mean ± sd. *Unmoved*: the "
        "fraction of param elements a step left "
        "exactly unchanged, over the logged steps of the last fifth. *Flushed grads* (float16 "
        "compute rows): gradient entries that are nonzero in float32 and exactly zero in "
        "float16, on the run's final params, without and with a loss scale of 2^15. "
        "*bytes/param*: params and optimizer state (`mpjax.memory_report`). Run on CPU, where "
        "XLA may keep some fused elementwise intermediates in f32: a GPU run will not match "
        "bit for bit."
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
            "![unmoved params](precision_study_unmoved.png)\n\n"
            "![gradients](precision_study_gradients.png)\n"
        )


def _mean_curve(entry: dict, field: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min and max over seeds of a logged field (steps where every seed has it)."""
    per_seed = [
        {e["step"]: e[field] for e in r["log"] if field in e} for r in entry["runs"].values()
    ]
    steps = sorted(set.intersection(*(set(d) for d in per_seed)))
    values = np.array([[d[s] for s in steps] for d in per_seed])
    return steps, values.mean(0).tolist(), values.min(0).tolist(), values.max(0).tolist()


def plot(results: dict, steps: int, out_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_val, ax_late) = plt.subplots(1, 2, figsize=(13, 4.8))
    for entry in results.values():
        x, mean, lo, hi = _mean_curve(entry, "val_loss")
        (line,) = ax_val.plot(x, mean, marker="o", ms=3, label=entry["label"])
        ax_val.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
        late = [i for i, s in enumerate(x) if s >= steps // 2]
        ax_late.plot([x[i] for i in late], [mean[i] for i in late], marker="o", ms=3)
        ax_late.fill_between(
            [x[i] for i in late],
            [lo[i] for i in late],
            [hi[i] for i in late],
            color=line.get_color(),
            alpha=0.15,
        )
    ax_val.set_title("validation loss (mean over seeds; band: min to max)")
    ax_late.set_title("the second half, enlarged")
    for ax in (ax_val, ax_late):
        ax.set_xlabel("step")
        ax.set_ylabel("nats / byte")
        ax.grid(alpha=0.3)
    ax_val.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "precision_study_loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, entry in results.items():
        if not key.startswith(("f32", "bf16", "mixed_bf16")):
            continue
        x, mean, _, _ = _mean_curve(entry, "unmoved")
        ax.plot(x, mean, lw=1, label=entry["label"])
    lr_ax = ax.twinx()
    first = next(iter(results.values()))["runs"]
    log = next(iter(first.values()))["log"]
    lr_ax.plot([e["step"] for e in log], [e["lr"] for e in log], color="gray", ls="--", lw=1)
    lr_ax.set_yscale("log")
    lr_ax.set_ylabel("learning rate (dashed)")
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of param elements unchanged by the step")
    ax.set_title("params that did not move, per logged step (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left")
    fig.tight_layout()
    fig.savefig(out_dir / "precision_study_unmoved.png", dpi=110)
    plt.close(fig)

    analysed = [
        (e["label"], r["gradients"])
        for e in results.values()
        for r in e["runs"].values()
        if "gradients" in r
    ]
    if analysed:
        label, g = analysed[0]
        edges = np.array(g["dlogits_log2_edges"])
        fig, ax = plt.subplots(figsize=(9, 4.2))
        ax.bar(edges[:-1], g["dlogits_log2_hist"], width=1.0, align="edge", color="C0")
        tiny = np.log2(float(jnp.finfo(jnp.float16).smallest_subnormal))
        normal = np.log2(float(jnp.finfo(jnp.float16).smallest_normal))
        ax.axvline(tiny - 1, color="C3", ls="--", label="float16 rounds to 0 below")
        ax.axvline(normal, color="C1", ls="--", label="float16 subnormal below")
        ax.axvline(
            tiny - 1 - np.log2(ANALYSIS_SCALE),
            color="C2",
            ls=":",
            label="rounds to 0 below, with the loss x 2^15",
        )
        ax.set_xlabel("log2 |d loss / d logit| (float32)")
        ax.set_ylabel("entries")
        ax.set_title(f"logit gradients at the end of '{label}' (seed 0, 8 batches)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "precision_study_gradients.png", dpi=110)
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument(
        "--setups", nargs="+", choices=[s.key for s in SETUPS], default=[s.key for s in SETUPS]
    )
    p.add_argument("--docs", default=str(ROOT / "docs"), help="where the table and plots go")
    p.add_argument("--out", default=str(ROOT / "runs" / "precision_study"), help="run folders")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="train nothing: rewrite the table and plots from --docs' precision_study.json",
    )
    p.add_argument(
        "--add",
        action="store_true",
        help="train only --setups and put them into --docs' precision_study.json, next to the "
        "setups already there (which must have run --steps steps)",
    )
    args = p.parse_args(argv)
    docs = pathlib.Path(args.docs)
    if args.render_only:
        results = json.loads((docs / "precision_study.json").read_text())
        steps = max(
            e["step"] for r in results.values() for run in r["runs"].values() for e in run["log"]
        )
        for entry in results.values():  # the optimizer as the current code describes it
            setup = next(s for s in SETUPS if s.key == entry["key"])
            cfg = config(setup, 0, steps, pathlib.Path(args.out) / "unused")
            entry["optimizer"] = tt.describe_optimizer(cfg, mpjax.get_policy(setup.policy))
            entry["label"] = setup.label
    else:
        if args.steps < 100:
            p.error(f"--steps must be at least 100, got {args.steps}")
        setups = [s for s in SETUPS if s.key in args.setups]
        out_root = pathlib.Path(args.out)
        previous = {}
        if args.add:
            previous = json.loads((docs / "precision_study.json").read_text())
            done = {
                e["step"] for r in previous.values() for x in r["runs"].values() for e in x["log"]
            }
            if max(done) != args.steps:
                p.error(
                    f"--add: the study in {docs} ran {max(done)} steps, not --steps {args.steps}"
                )
            for setup in setups:
                for seed in args.seeds:
                    shutil.rmtree(out_root / f"{setup.key}_seed{seed}", ignore_errors=True)
        elif out_root.exists():
            shutil.rmtree(out_root)  # the study always starts fresh: it owns this folder
        # Through JSON, as the runs read back from it: seeds become string keys in both.
        new = json.loads(json.dumps(run_all(setups, args.seeds, args.steps, out_root)))
        # In SETUPS order, whichever run wrote them.
        merged = {**previous, **new}
        results = {s.key: merged[s.key] for s in SETUPS if s.key in merged}
        steps = args.steps
    docs.mkdir(parents=True, exist_ok=True)
    md = table(results, steps)
    write_table(docs / "precision_study.md", md)
    (docs / "precision_study.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, steps, docs)
    print("\n" + md)
    print(f"wrote {docs / 'precision_study.md'}, precision_study.json and the plots in {docs}")


if __name__ == "__main__":
    main()
