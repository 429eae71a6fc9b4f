"""Train a GPT-style byte-level language model under an mpjax precision policy.

The default run trains the `tiny` model on the Python standard library's own `.py` sources
(every machine with Python has them) in a few minutes on two CPU cores:

    python examples/train_transformer.py
    python examples/train_transformer.py --policy float32 --steps 400
    python examples/train_transformer.py --preset small --policy mixed_bfloat16 --batch-size 32  # GPU
    python examples/train_transformer.py --data path/to/text_or_folder --out runs/mine
    python examples/train_transformer.py --out runs/mine --resume   # continue where it stopped
    python examples/train_transformer.py --out runs/mine --overwrite  # delete that run, start afresh

One jitted train step does the forward and backward passes (over `--grad-accum` micro-batches),
the optimizer update and, with several devices, data parallelism over a `jax.sharding.Mesh`.
Every logged step goes to `<out>/log.jsonl`, the run's summary to `<out>/summary.json`, and
checkpoints (params, optimizer state, data-sampler state and step, and the fp8 scales and amax
histories under a delayed-scaling fp8 policy) to `<out>/checkpoints`.
A run never mixes with another. Without `--out`, the folder is named after the settings that
decide the run, so the same command run again finds its own run: a finished one is reported
again, an interrupted one continues from its newest checkpoint. A folder chosen with `--out`
that holds a run needs `--resume` to continue it or `--overwrite` to delete those three, and
`--resume` refuses a folder without a checkpoint. It resumes from the newest checkpoint that restores, saying which ones it skipped
as corrupt, on any number of devices: arrays are resliced onto the new mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import shutil
import sys
import sysconfig
import time
import traceback
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharding  # noqa: E402
from gpt import (  # noqa: E402
    ATTENTION,
    GPT,
    PRESETS,
    REMAT_POLICIES,
    Embed,
    GPTConfig,
    LayerNorm,
)

import mpjax  # noqa: E402

# -----------------------------------------------------------------------------
# Default configuration. Every value is a command-line flag (see --help).
PRESET = "tiny"  # model size: tiny (CPU, minutes), small (129M params), medium (354M params)
MODE = "mpjax"  # how the policy reaches the model: mpjax (module rules), hand, autocast
ATTENTION_IMPL = "fused"  # fused (jax.nn.dot_product_attention: cuDNN flash on GPU) or naive
SCAN_LAYERS = False  # run the blocks under nn.scan: one compiled block, for deep models
REMAT = "none"  # rematerialize each block in the backward pass: none, full or dots
EXPERTS = 0  # experts in the mixture that replaces each block's MLP; 0: a dense MLP
TOP_K = 2  # experts each token goes to
EXPERT_RATIO = None  # each expert's hidden width as a multiple of d_model; None: the MLP's
SHARED_EXPERT = False  # add an MLP every token goes through, beside the routed experts
POLICY = (
    "mixed_bfloat16"  # any mpjax policy: float32, mixed_bfloat16, mixed_bfloat16_fp8, bfloat16...
)
FP8_HEAD = False  # under an fp8 policy, run the (tied) output head in fp8 too
WIDE_EDGE_BLOCKS = (0, 0)  # under fp8 or a block format, first and last blocks kept in bf16
LOSS_SCALE = "auto"  # auto (dynamic for float16, none otherwise), dynamic, static:N or none
MASTER_WEIGHTS = True  # keep an f32 master copy when the policy stores params in bf16/f16
PARAM_ROUNDING = "nearest"  # without master weights: nearest, stochastic or kahan
MU_DTYPE = None  # Adam's first moment stored in this dtype (bf16, f32...); None: Adam's own
NU_DTYPE = None  # Adam's second moment likewise
STATE_ROUNDING = "nearest"  # how a narrower --mu-dtype/--nu-dtype is rounded: or stochastic
STATE_FORMAT = "none"  # Adam's moments blockwise quantized: none, dynamic8, e4m3 or dynamic4
STATE_BLOCK_SIZE = None  # elements per block of --state-format; None means the format's own
STEPS = 800  # optimizer steps
BATCH_SIZE = 16  # sequences per micro-batch (split over the devices)
GRAD_ACCUM = 1  # micro-batches per optimizer step, accumulated inside the jitted step
SEQ_LEN = None  # tokens (bytes) per sequence; None means the preset's block_size
LR = 3e-3  # peak learning rate, reached after the warmup
MIN_LR_RATIO = 0.1  # cosine decay ends at LR * MIN_LR_RATIO at the last step
WARMUP_STEPS = None  # linear warmup from 0; None means min(50, steps // 10)
WEIGHT_DECAY = 0.1  # AdamW decoupled weight decay, on matrices only (not norms or biases)
BETA1, BETA2 = 0.9, 0.95  # Adam moments (GPT-3 / nanoGPT values)
GRAD_CLIP = 1.0  # clip the global gradient norm; 0 disables clipping
EVAL_INTERVAL = 100  # steps between validation losses
EVAL_BATCHES = 8  # validation batches per evaluation (always the same ones)
LOG_INTERVAL = 10  # steps between logged lines; metrics are fetched from the device only here
CKPT_INTERVAL = 200  # steps between checkpoints (and one at the end); 0 disables checkpoints
DATA = None  # text file or folder; None means the standard library's .py sources
MAX_BYTES = 8_000_000  # cap on the corpus size, so loading stays fast
VAL_FRACTION = 0.1  # the last 10% of the (file-shuffled) corpus is the validation split
SEED = 0  # model init and the batch sampler
MAX_CONSECUTIVE_SKIPS = 25  # stop when this many steps in a row overflowed
SAMPLE_BYTES = 300  # bytes of text sampled from the trained model at the end; 0 disables
SAMPLE_PROMPT = "def "
TEMPERATURE = 0.8
# -----------------------------------------------------------------------------

MODEL_MODES = ("mpjax", "hand", "autocast")
STATE_FORMATS = ("none", *mpjax.QUANT_FORMATS)
# mixed_bfloat16_fp8 with delayed scaling (amax history of 1024 steps): --policy takes it.
FP8_DELAYED = "p=f32,c=bf16,o=f32,fp8=delayed"
FP8_COLLECTION = mpjax.linen.FP8_COLLECTION  # where the fp8 state sits among a model's variables
CORPUS_SHUFFLE_SEED = 1234  # fixed, so the corpus and its split do not depend on --seed
VAL_SAMPLER_SEED = 4321  # fixed, so every run is evaluated on the same validation windows


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; built from the command line by :func:`parse_args`."""

    preset: str = PRESET
    n_layer: int | None = None
    n_head: int | None = None
    d_model: int | None = None
    untied: bool = False
    attention: str = ATTENTION_IMPL
    scan_layers: bool = SCAN_LAYERS
    remat: str = REMAT
    experts: int = EXPERTS
    top_k: int = TOP_K
    expert_ratio: int | None = EXPERT_RATIO
    shared_expert: bool = SHARED_EXPERT
    policy: str = POLICY
    fp8_head: bool = FP8_HEAD
    wide_edge_blocks: tuple[int, int] = WIDE_EDGE_BLOCKS
    mode: str = MODE
    loss_scale: str = LOSS_SCALE
    master_weights: bool = MASTER_WEIGHTS
    param_rounding: str = PARAM_ROUNDING
    mu_dtype: str | None = MU_DTYPE
    nu_dtype: str | None = NU_DTYPE
    state_rounding: str = STATE_ROUNDING
    state_format: str = STATE_FORMAT
    state_block_size: int | None = STATE_BLOCK_SIZE
    steps: int = STEPS
    batch_size: int = BATCH_SIZE
    grad_accum: int = GRAD_ACCUM
    seq_len: int | None = SEQ_LEN
    lr: float = LR
    min_lr_ratio: float = MIN_LR_RATIO
    warmup_steps: int | None = WARMUP_STEPS
    schedule_steps: int | None = None
    weight_decay: float = WEIGHT_DECAY
    beta1: float = BETA1
    beta2: float = BETA2
    grad_clip: float = GRAD_CLIP
    eval_interval: int = EVAL_INTERVAL
    eval_batches: int = EVAL_BATCHES
    log_interval: int = LOG_INTERVAL
    ckpt_interval: int = CKPT_INTERVAL
    data: str | None = DATA
    max_bytes: int = MAX_BYTES
    val_fraction: float = VAL_FRACTION
    seed: int = SEED
    max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS
    num_devices: int = 0
    fsdp: int = 1
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    out: str | None = None
    resume: bool = False
    overwrite: bool = False
    sample_bytes: int = SAMPLE_BYTES
    sample_prompt: str = SAMPLE_PROMPT
    temperature: float = TEMPERATURE
    progress: bool = True
    diagnose_every: int = 0  # measure each module's amax and non-finite count every N steps
    diagnose: bool = False  # print mpjax.diagnose's report for the model and policy, no training
    diagnose_batch: int = 1  # sequences --diagnose runs on
    plan: str = ""  # print mpjax.plan's plan of the train step for this target, no training
    # The fields the user set (their command-line flags), which a resumed run checks against
    # its checkpoint; None (a config built in code) means every field not at its default.
    explicit: tuple[str, ...] | None = None

    def model_config(self) -> GPTConfig:
        base = PRESETS[self.preset]
        return dataclasses.replace(
            base,
            n_layer=self.n_layer or base.n_layer,
            n_head=self.n_head or base.n_head,
            d_model=self.d_model or base.d_model,
            block_size=self.seq_len or base.block_size,
            tie_embeddings=not self.untied,
            attention=self.attention,
            scan_layers=self.scan_layers,
            remat=self.remat,
            n_experts=self.experts or base.n_experts,
            top_k=self.top_k,
            expert_ratio=self.expert_ratio or base.expert_ratio,
            shared_expert=self.shared_expert or base.shared_expert,
        )

    def warmup(self) -> int:
        """Warmup steps: ``warmup_steps``, or by default min(50, a tenth of the run)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return min(50, self.schedule_length() // 10)

    def schedule_length(self) -> int:
        """Steps the learning-rate schedule spans: the run's, unless a resumed run was
        extended past it (then the schedule keeps its length and the extra steps run at its
        final rate)."""
        return self.schedule_steps or self.steps

    def run_name(self) -> str:
        """The default ``--out`` folder's name: the preset and the policy, then each setting
        that decides the trajectory and differs from its default (``--mode autocast`` adds
        ``_mode-autocast``, ``--no-master-weights`` ``_no-master-weights``), and ``--fsdp`` and ``--num-processes``
        where they are not 1. Runs with other
        settings train into folders of their own; the same command again finds its own run and
        continues it (:func:`continues_own_run`), or starts afresh with ``--overwrite``."""
        defaults = TrainConfig()
        parts = [self.preset, self.policy]
        for name in _TRAJECTORY_FIELDS:
            value = getattr(self, name)
            if name in ("preset", "policy") or value == getattr(defaults, name):
                continue
            flag = name.replace("_", "-")
            if isinstance(value, bool):
                parts.append(flag if value else f"no-{flag}")
            else:
                shown = pathlib.Path(value).name if name == "data" else value
                parts.append(f"{flag}-{shown}")
        if self.fsdp != 1:  # another mesh's run, so the commands for several devices do not
            parts.append(f"fsdp-{self.fsdp}")  # collide with a single device's run
        if self.num_processes != 1:
            parts.append(f"processes-{self.num_processes}")
        name = "_".join(str(part) for part in parts)
        return name.replace("=", "").replace(",", "_").replace(" ", "").replace("/", "-")

    def out_dir(self) -> pathlib.Path:
        return pathlib.Path(self.out or os.path.join("runs", self.run_name()))


# Fields that decide the trajectory: a resumed run takes them from its checkpoint, and a flag
# given with another value is refused. The others (devices and --fsdp, logging, checkpoint and
# evaluation intervals, remat) may change on resume: they change the reduction order or the
# output, not the run. --steps may grow: the run continues past its end (see
# TrainConfig.schedule_length).
_TRAJECTORY_FIELDS = (
    "preset",
    "mode",
    "n_layer",
    "n_head",
    "d_model",
    "untied",
    "attention",
    "scan_layers",
    "experts",
    "top_k",
    "expert_ratio",
    "shared_expert",
    "policy",
    "fp8_head",
    "wide_edge_blocks",
    "loss_scale",
    "master_weights",
    "param_rounding",
    "mu_dtype",
    "nu_dtype",
    "state_rounding",
    "state_format",
    "state_block_size",
    "schedule_steps",
    "batch_size",
    "grad_accum",
    "seq_len",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "data",
    "max_bytes",
    "val_fraction",
    "seed",
)


# ----------------------------------------------------------------------------- data


def default_corpus_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` files, sorted, third-party packages left out."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(
        p
        for p in root.rglob("*.py")
        if p.is_file() and not skip.intersection(p.relative_to(root).parts)
    )


def _folder_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def load_corpus(path: str | None = None, max_bytes: int = MAX_BYTES) -> np.ndarray:
    """Reads the training text as a ``uint8`` array of bytes.

    Args:
      path: a text file, a folder (every non-hidden file under it that is not binary), or
        None for the standard library's ``.py`` sources.
      max_bytes: keep at most this many bytes.

    Files are shuffled with a fixed seed before they are concatenated, so the cap and the
    validation split (the tail) draw from the whole corpus rather than from the first and last
    packages in alphabetical order. The result depends only on the files, never on ``--seed``.

    Raises:
      ValueError: if ``path`` does not exist or holds no text.
    """
    if max_bytes <= 0:
        raise ValueError(f"--max-bytes must be positive, got {max_bytes}.")
    if path is None:
        files = default_corpus_files()
    else:
        p = pathlib.Path(path)
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = _folder_files(p)
        else:
            raise ValueError(f"--data {path!r}: no such file or folder.")
    order = np.random.default_rng(CORPUS_SHUFFLE_SEED).permutation(len(files))
    chunks, total = [], 0
    for i in order:
        raw = files[i].read_bytes()
        if b"\0" in raw:  # binary file (image, archive, compiled code): not text
            continue
        chunks.append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    data = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    if data.size == 0:
        raise ValueError(f"--data {path!r}: found no text to train on.")
    return data


def split_corpus(data: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Splits the corpus into disjoint train (head) and validation (tail) byte ranges."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}.")
    n_val = int(round(len(data) * val_fraction))
    return data[: len(data) - n_val], data[len(data) - n_val :]


def sample_batch(
    data: np.ndarray, rng: np.random.Generator, shape: tuple[int, ...], seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Draws random windows: inputs ``x`` and next-byte targets ``y``, int32 ``[*shape, seq_len]``.

    The windows come from ``rng`` only, so the generator's state is the data position that a
    checkpoint must save.
    """
    if len(data) <= seq_len + 1:
        raise ValueError(
            f"The data split has {len(data)} bytes, too few for --seq-len {seq_len}: use more "
            "data or a shorter sequence."
        )
    starts = rng.integers(0, len(data) - seq_len, size=shape)
    idx = starts[..., None] + np.arange(seq_len + 1)
    window = data[idx].astype(np.int32)
    return window[..., :-1], window[..., 1:]


def unigram_cross_entropy(train: np.ndarray, val: np.ndarray) -> float:
    """Nats per byte of the validation split under the train split's byte frequencies.

    The baseline a language model must beat: a model that ignores context can do no better.
    Add-one smoothing keeps bytes unseen in training finite.
    """
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[val].mean())


# ----------------------------------------------------------------------------- model and optimizer


@dataclasses.dataclass(frozen=True)
class AutocastModel:
    """An unmodified model whose ``apply`` runs under :func:`mpjax.autocast`.

    ``init`` stores params in the policy's param dtype; autocast casts them at use. Under
    delayed-scaling fp8 it behaves like a wrapped linen model: ``init`` adds the state of the
    fp8 matmuls as the ``"fp8"`` collection (:func:`mpjax.fp8_state`) and ``apply`` runs with
    the state it is given there (:func:`mpjax.with_fp8_state`).
    """

    module: GPT
    policy: mpjax.Policy

    @property
    def config(self) -> GPTConfig:
        return self.module.config

    rules: dict = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def autocast(self):
        return mpjax.autocast(self.module.apply, self.policy, rules=self.rules)

    def init(self, *args, **kwargs):
        variables = self.policy.cast_to_param(self.module.init(*args, **kwargs))
        if not scales_fp8_delayed(self.policy):
            return variables
        state = mpjax.fp8_state(self.autocast)(variables, *args[1:], **kwargs)
        return {**variables, FP8_COLLECTION: state}

    def apply(self, variables, *args, **kwargs):
        if FP8_COLLECTION not in variables:
            return self.autocast(variables, *args, **kwargs)
        state = variables[FP8_COLLECTION]
        rest = {k: v for k, v in variables.items() if k != FP8_COLLECTION}
        return mpjax.with_fp8_state(self.autocast, state)(rest, *args, **kwargs)


def scales_fp8_delayed(policy: mpjax.Policy) -> bool:
    """Whether ``policy`` runs fp8 matmuls with delayed scaling, whose state the train state
    then carries."""
    return policy.fp8 is not None and policy.fp8.scaling == "delayed"


def head_rule(config: GPTConfig, policy: mpjax.Policy, fp8_head: bool, scope: str = "") -> dict:
    """The rule that keeps the output head (``wte.attend`` when tied, else ``head``) out of
    fp8, as fp8 recipes usually do: the logits' matmul is the most sensitive one. Empty
    without fp8, or with ``fp8_head``. ``scope`` prefixes the key: autocast sees Flax's named
    scopes, ``GPT/wte.attend`` for the tied head's method."""
    if policy.fp8 is None or fp8_head:
        return {}
    return {scope + ("wte*" if config.tie_embeddings else "head"): policy.with_fp8(None)}


def edge_block_rules(config: GPTConfig, policy: mpjax.Policy, wide: tuple[int, int]) -> dict:
    """Rules that keep the first and last blocks (``wide``: how many at each end) out of the
    policy's fp8 or block format, in its compute dtype, as NVIDIA's NVFP4 recipe keeps a few
    blocks at each end in bf16 (:func:`mpjax.edge_block_rules`). Empty for ``(0, 0)``.

    Raises:
      ValueError: for blocks kept wide under a policy with no fp8 or block format, or in a
        model whose blocks are scanned (one block, its params stacked: no block of its own to
        keep).
    """
    if not any(wide):
        return {}
    if policy.fp8 is None:
        raise ValueError(
            f"it keeps blocks out of a policy's fp8 or block format, and policy {policy} has "
            "none. Use it with mixed_bfloat16_nvfp4, mixed_bfloat16_mxfp8, "
            "mixed_bfloat16_fp8 or another policy with fp8=."
        )
    if config.scan_layers:
        raise ValueError(
            "it needs the blocks as modules of their own (h0, h1, ...), which --scan-layers "
            "replaces with one block run over stacked params."
        )
    blocks = [f"h{i}" for i in range(config.n_layer)]
    return mpjax.edge_block_rules(blocks, *wide, policy=policy.with_fp8(None))


def build_model(
    config: GPTConfig,
    policy: mpjax.Policy,
    mode: str = MODE,
    *,
    fp8_head: bool = FP8_HEAD,
    wide_edge_blocks: tuple[int, int] = WIDE_EDGE_BLOCKS,
):
    """The model a policy trains; every mode has linen's ``init``/``apply`` and the same params.

    Args:
      config: the model's shape.
      policy: the precision policy. With fp8 (``mixed_bfloat16_fp8``) every dense matmul runs
        in fp8 except the output head's, unless ``fp8_head``. With delayed-scaling fp8
        (``FP8_DELAYED``) ``init`` adds the matmuls' state as the ``"fp8"`` collection,
        and ``apply`` takes it back (:func:`model_variables`), in both modes that run fp8.
      mode: how the policy reaches the model:
        ``"mpjax"``: the unmodified model wrapped by :func:`mpjax.linen.apply_policy`, with
        class rules that treat the model's own ``LayerNorm`` and ``Embed`` like Flax's (norms:
        f32 params and statistics, output in the compute dtype; embeddings: rows out in the
        compute dtype, so the residual stream runs in it);
        ``"hand"``: the policy's dtypes written into the model by hand
        (``GPT(config, dtype=compute, param_dtype=param)``), the way Flax users do it today;
        ``"autocast"``: the unmodified model's ``apply`` under :func:`mpjax.autocast`.

      fp8_head: run the output head in fp8 too.
      wide_edge_blocks: how many of the first and of the last blocks keep the compute dtype
        under an fp8 or block-format policy (:func:`edge_block_rules`); mode ``"mpjax"`` only.

    Raises:
      ValueError: for an unknown ``mode``, an fp8 policy in ``"hand"`` mode (Flax's
        ``dtype`` attributes cannot say fp8), or ``wide_edge_blocks`` in another mode than
        ``"mpjax"`` or that :func:`edge_block_rules` refuses.
    """
    if any(wide_edge_blocks) and mode != "mpjax":
        raise ValueError(
            f"--wide-edge-blocks takes --mode mpjax (the model wrapped with rules); got {mode!r}."
        )
    if mode == "mpjax":
        # The head's rule first (the first matching rule wins); a tied head is the embedding,
        # so its rule keeps the embedding's rows in the compute dtype too.
        head = mpjax.embedding_policy(policy) if config.tie_embeddings else policy
        rules = {
            **head_rule(config, head, fp8_head),
            LayerNorm: mpjax.norm_policy,
            Embed: mpjax.embedding_policy,
        }
        if config.tie_embeddings and head_rule(config, head, fp8_head):
            # The tied head is the token embedding: its rule claims the embedding before the
            # embeddings' class rule, on purpose (the warning that says so is known here).
            warnings.filterwarnings(
                "ignore", r"rule '[\w.]*Embed' is ambiguous at 'wte'", mpjax.RuleWarning
            )
        wide = edge_block_rules(config, policy, wide_edge_blocks)
        if wide:
            # The first matching rule wins, and mpjax's built-in rules come after these: the
            # norms' and the router's rules go before the kept blocks', so that inside them
            # norms stay f32 and the router f32, as everywhere. That they overlap is the point:
            # the warning that says so is known here.
            if config.n_experts:
                rules[mpjax.rules.ROUTER_PATHS] = mpjax.router_policy
            rules.update(wide)
            warnings.filterwarnings(
                "ignore", r"rule 're:h\d+\(.*' is ambiguous at", mpjax.RuleWarning
            )
        return mpjax.linen.apply_policy(GPT(config), mpjax.Rules(rules, default=policy))
    if mode == "hand":
        if policy.fp8 is not None:
            raise ValueError(
                f"policy {policy} runs matmuls in fp8, which dtypes written by hand cannot "
                "express: use mode 'mpjax' or 'autocast'."
            )
        return GPT(config, dtype=policy.compute_dtype, param_dtype=policy.param_dtype)
    if mode == "autocast":
        rules = head_rule(config, policy, fp8_head, "GPT/")
        if config.n_experts:  # autocast matches scopes, and has no built-in rules
            rules["GPT/*/router"] = mpjax.router_policy(policy)
        return AutocastModel(GPT(config), policy, rules)
    raise ValueError(f"mode must be one of {', '.join(MODEL_MODES)}; got {mode!r}.")


def resolve_loss_scale(text: str, policy: mpjax.Policy) -> mpjax.LossScale:
    """The loss scale ``--loss-scale`` names; ``auto`` is dynamic where the policy needs loss
    scaling (``policy.needs_loss_scaling``: float16 compute or params), none elsewhere.

    Raises:
      ValueError: naming the flag, for anything but auto, none, dynamic or static:N (N > 0).
    """
    if text == "auto":
        text = "dynamic" if policy.needs_loss_scaling else "none"
    if text == "dynamic":
        return mpjax.DynamicLossScale()
    if text == "none":
        return mpjax.NoOpLossScale()
    kind, _, value = text.partition(":")
    problem = "unknown value"
    if kind == "static":
        try:
            return mpjax.StaticLossScale(float(value))
        except ValueError as e:
            problem = str(e)
    raise ValueError(
        f"--loss-scale must be auto, none, dynamic or static:N with N > 0, got {text!r} ({problem})"
    )


def uses_loss_scaling(cfg: TrainConfig, policy: mpjax.Policy) -> bool:
    return not isinstance(resolve_loss_scale(cfg.loss_scale, policy), mpjax.NoOpLossScale)


def make_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the end."""
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup(), cfg.schedule_length(), cfg.lr * cfg.min_lr_ratio
    )


def make_optimizer(cfg: TrainConfig, policy: mpjax.Policy) -> optax.GradientTransformation:
    """Gradient clipping then AdamW, inside mpjax's loss scaling and master weights as needed.

    The order of a step is scale -> grad -> unscale -> clip -> update (PyTorch's too): the
    clipping threshold applies to the true gradients. Loss scaling wraps the optimizer unless
    the loss scale is none (so f32 and bf16 runs pay nothing for it); a non-finite step then
    leaves params and optimizer state untouched. Master weights wrap outside it, as
    ``mpjax.master_weights`` recommends, when params are stored narrower than f32 (unless
    --no-master-weights): the optimizer then updates an f32 copy, with f32 Adam moments.
    Without them, --param-rounding stochastic or kahan lands the f32 updates on the bf16/f16
    params through ``mpjax.low_precision_params`` (nearest is plain ``optax.apply_updates``).
    --mu-dtype/--nu-dtype store Adam's moments through ``mpjax.state_precision``, or
    --state-format blockwise quantized through ``mpjax.quantized_state`` (8 or 4 bits a value,
    the update computed in f32), rounded as --state-rounding says. The two rounding keys come from --seed, each its own stream.
    Weight decay applies to matrices (kernels, embeddings) only, as in GPT-2 and nanoGPT:
    chosen by name, since scanned layers stack biases and norm scales into matrices too.
    """
    adamw = optax.adamw(
        make_schedule(cfg),
        b1=cfg.beta1,
        b2=cfg.beta2,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    moments = state_dtypes(cfg)
    if moments:
        adamw = mpjax.state_precision(
            adamw, moments, rounding=cfg.state_rounding, seed=_rounding_seed(cfg, 1)
        )
    if cfg.state_format != "none":
        adamw = mpjax.quantized_state(
            adamw,
            cfg.state_format,
            block_size=cfg.state_block_size,
            rounding=cfg.state_rounding,
            seed=_rounding_seed(cfg, 1),
        )
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    tx = optax.chain(clip, adamw)
    if uses_loss_scaling(cfg, policy):
        tx = mpjax.loss_scaling(tx, resolve_loss_scale(cfg.loss_scale, policy))
    if uses_master_weights(cfg, policy):
        tx = mpjax.master_weights(tx)
    elif uses_low_precision_params(cfg, policy):
        tx = mpjax.low_precision_params(tx, cfg.param_rounding, seed=_rounding_seed(cfg, 2))
    return tx


def _rounding_seed(cfg: TrainConfig, stream: int) -> jax.Array:
    """A key of its own for each rounding transformation, so their draws are independent."""
    return jax.random.fold_in(jax.random.key(cfg.seed), stream)


def state_dtypes(cfg: TrainConfig) -> dict[str, str]:
    """The Adam moments stored in a dtype of their own: ``{"mu": "bfloat16"}``, or empty."""
    return {
        name: dtype
        for name, dtype in (("mu", cfg.mu_dtype), ("nu", cfg.nu_dtype))
        if dtype is not None
    }


def decay_mask(params: Any) -> Any:
    """True for the leaves weight decay applies to: kernels and embedding tables."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params
    )


def uses_master_weights(cfg: TrainConfig, policy: mpjax.Policy) -> bool:
    return cfg.master_weights and jnp.finfo(policy.param_dtype).bits < 32


def uses_low_precision_params(cfg: TrainConfig, policy: mpjax.Policy) -> bool:
    return (
        not uses_master_weights(cfg, policy)
        and jnp.finfo(policy.param_dtype).bits < 32
        and cfg.param_rounding != "nearest"
    )


def describe_optimizer(cfg: TrainConfig, policy: mpjax.Policy) -> str:
    scale = resolve_loss_scale(cfg.loss_scale, policy)
    if isinstance(scale, mpjax.NoOpLossScale):
        scaling = "no loss scaling"
    else:
        kind = "dynamic" if isinstance(scale, mpjax.DynamicLossScale) else "static"
        scaling = f"{kind} loss scaling from {float(scale.loss_scale):g}"
    if uses_master_weights(cfg, policy):
        params = "f32 master weights"
    elif uses_low_precision_params(cfg, policy):
        params = f"no master weights, {cfg.param_rounding} param updates"
    elif cfg.master_weights:  # asked for (the default), but the params are their own f32 copy
        stored = mpjax.policy.short_dtype_name(policy.param_dtype)
        params = f"no master weights needed ({stored} params)"
    else:
        params = "no master weights"
    moments = "".join(
        f", {name} {mpjax.policy.short_dtype_name(mpjax.policy.storage_dtype(dtype, name))}"
        for name, dtype in state_dtypes(cfg).items()
    )
    if cfg.state_format != "none":
        block = cfg.state_block_size or mpjax.QUANT_FORMATS[cfg.state_format].block_size
        moments = f", moments {cfg.state_format} in blocks of {block}"
    if moments and cfg.state_rounding == "stochastic":
        moments += " (stochastic rounding)"
    return f"AdamW, {scaling}, {params}{moments}"


class TrainState(NamedTuple):
    """What a train step reads and returns; checkpointed as is."""

    step: jax.Array  # int32 scalar: optimizer steps taken (skipped ones included)
    params: Any
    opt_state: Any
    # The delayed-scaling fp8 state (scales and amax histories by matmul, f32), which each
    # step replaces with the next; empty unless the policy scales fp8 with delayed scaling.
    fp8: Any


class _StateWithoutFp8(NamedTuple):
    """What a checkpoint of a run without delayed-scaling fp8 holds: the train state less its
    empty ``fp8``, the layout such checkpoints always had (so older ones still resume)."""

    step: jax.Array
    params: Any
    opt_state: Any


def _checkpointed(state: TrainState) -> TrainState | _StateWithoutFp8:
    return state if jax.tree.leaves(state.fp8) else _StateWithoutFp8(*state[:3])


def model_variables(params: Any, fp8: Any = None) -> dict:
    """The variables ``model.apply`` takes: the params, and the delayed-scaling fp8 state
    (the ``"fp8"`` collection) where the policy has one."""
    return {"params": params, **({FP8_COLLECTION: fp8} if fp8 else {})}


def loss_fn(
    model: GPT,
    params: Any,
    x: jax.Array,
    y: jax.Array,
    fp8: Any = None,
    *,
    router_losses: bool = True,
) -> jax.Array:
    """Mean next-byte cross-entropy in nats, always from f32 logits; with experts, plus the
    routers' weighted load-balancing and z-losses (the objective trained; evaluation leaves
    them out, ``router_losses=False``).

    The model returns f32 logits, but a policy whose output dtype is bf16 (``"bfloat16"``) makes
    a wrapped model return bf16 ones: the log-sum-exp over the vocabulary needs f32 either way.
    ``fp8`` is the delayed-scaling fp8 state, where the policy has one: differentiated with
    respect to it, the loss gives the next state (:func:`make_train_step`).
    """
    variables = model_variables(params, fp8)
    if not model.config.n_experts:
        logits = model.apply(variables, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    logits, sown = model.apply(variables, x, mutable=["losses"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
    routing = sum(jnp.sum(v.astype(jnp.float32)) for v in jax.tree.leaves(sown["losses"]))
    return loss + routing if router_losses else loss


def make_train_step(model: GPT, tx: optax.GradientTransformation):
    """Returns ``train_step(state, x, y) -> (state, metrics)`` with ``x, y`` of shape
    ``[grad_accum, batch, seq_len]``.

    Gradient accumulation happens inside the step (a ``lax.scan`` over micro-batches, summing
    f32 gradients) so that one call is one optimizer step: the optimizer, the LR schedule and
    a loss-scaling transform each see exactly one update per step, and the loss scale is the
    same for every micro-batch of a step, as with PyTorch's GradScaler.

    Under delayed-scaling fp8 the loss is differentiated with respect to the fp8 state too,
    and that gradient is the next state: it never reaches the optimizer (it is not a gradient
    to unscale, clip or apply). Each micro-batch runs with the state the one before it left,
    so every micro-batch's amaxes enter the history (one entry each) and the scales of a
    micro-batch come from all those before it; the step keeps the last one's, which has seen
    them all. Summed or averaged states would mean nothing, and keeping any other micro-batch's
    would drop the amaxes of those after it. A step that loss scaling skips for non-finite
    gradients keeps the state it started with, as it keeps the params.
    """

    def micro_grads(params, fp8, opt_state, x, y):
        def scaled_loss(p, f):
            loss = loss_fn(model, p, x, y, f)
            # The scale that the loss-scaling transform will divide by in this step's update
            # (the loss as it is when the optimizer has no loss scaling).
            scaled = mpjax.scale_loss(loss, opt_state)
            return scaled, loss

        (grads, fp8), loss = jax.grad(scaled_loss, argnums=(0, 1), has_aux=True)(params, fp8)
        return grads, fp8, loss

    def train_step(state: TrainState, x: jax.Array, y: jax.Array):
        n_micro = x.shape[0]
        if n_micro == 1:
            grads, fp8, loss = micro_grads(state.params, state.fp8, state.opt_state, x[0], y[0])
        else:

            def body(carry, xy):
                acc, loss_sum, fp8 = carry
                g, fp8, loss = micro_grads(state.params, fp8, state.opt_state, *xy)
                acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
                return (acc, loss_sum + loss, fp8), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            carry = (zeros, jnp.zeros((), jnp.float32), state.fp8)
            (acc, loss_sum, fp8), _ = jax.lax.scan(body, carry, (x, y))
            # Average in f32, then store in each param's dtype, as a single batch would give.
            grads = jax.tree.map(lambda a, p: (a / n_micro).astype(p.dtype), acc, state.params)
            loss = loss_sum / n_micro
        # optax's Adam computes b1 ** count with an int32 count, which
        # jax_numpy_dtype_promotion="strict" rejects; the model above is strict-clean.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # Loss scale and skip counters; 1, 0 and 0 without loss scaling.
        info = mpjax.loss_scaling_info(opt_state)
        fp8 = jax.tree.map(lambda new, old: jnp.where(info.applied, new, old), fp8, state.fp8)
        metrics = {
            "loss": loss,
            "unmoved": unmoved_fraction(state.params, params),
            "loss_scale": info.loss_scale,
            "skipped_steps": info.skipped_steps,
            "consecutive_skipped": info.consecutive_skipped,
        }
        return TrainState(state.step + 1, params, opt_state, fp8), metrics

    return train_step


def unmoved_fraction(old: Any, new: Any) -> jax.Array:
    """The fraction of param elements a step left exactly as they were (f32 scalar): the
    updates that rounding to the params' dtype lost, and those of a skipped step."""
    total = sum(x.size for x in jax.tree.leaves(old))
    return sum(
        (
            jnp.mean((a == b).astype(jnp.float32)) * (a.size / total)
            for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))
        ),
        jnp.zeros((), jnp.float32),
    )


def init_state(
    model: GPT, tx: optax.GradientTransformation, seed: int, seq_len: int, mesh: Mesh | None = None
) -> TrainState:
    """Initial params (in the model's param dtype), optimizer state and delayed-scaling fp8
    state (where the policy has one), built in one jit: eager initialization dispatches and
    compiles every small op separately, which is slower.

    With a ``mesh``, every array is created where :func:`sharding.state_shardings` puts it
    (sliced over ``"fsdp"``), so no device ever holds the whole unsharded state; the fp8
    state is replicated: it is small, and every device reads all of it each step.
    """

    def init(key):
        variables = model.init(key, jnp.zeros((1, seq_len), jnp.int32))
        params = variables["params"]
        fp8 = variables.get(FP8_COLLECTION, {})
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), fp8)

    key = jax.random.key(seed)
    shardings = None
    if mesh is not None:
        abstract = jax.eval_shape(init, key)
        replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract.fp8)
        shardings = sharding.state_shardings(abstract, mesh)._replace(fp8=replicated)
    return jax.jit(init, out_shardings=shardings)(key)


def make_generate(model: GPT, length: int):
    """Returns a jitted ``generate(params, prompt, key, temperature, fp8=None)`` sampling
    ``length`` bytes (``fp8``: the delayed-scaling fp8 state, where the policy has one).

    The context is the last ``block_size`` bytes (a sliding window), recomputed for every new
    byte: slow for long outputs but simple, and plenty for a few hundred bytes.
    """
    block = model.config.block_size

    @jax.jit
    def generate(params, prompt: jax.Array, key: jax.Array, temperature: jax.Array, fp8=None):
        n_prompt = prompt.shape[0]
        buf = jnp.zeros((n_prompt + length,), jnp.int32).at[:n_prompt].set(prompt)

        def body(i, carry):
            buf, key = carry
            cur = n_prompt + i  # position of the byte to sample
            start = jnp.maximum(cur - block, 0)
            window = jax.lax.dynamic_slice(jnp.pad(buf, (0, block)), (start,), (block,))
            logits = model.apply(model_variables(params, fp8), window[None])[0, cur - start - 1]
            key, sub = jax.random.split(key)
            nxt = jax.random.categorical(sub, logits / temperature).astype(jnp.int32)
            return buf.at[cur].set(nxt), key

        buf, _ = jax.lax.fori_loop(0, length, body, (buf, key))
        return buf

    return generate


# ----------------------------------------------------------------------------- checkpoints


def _checkpoint_manager(directory: pathlib.Path):
    import orbax.checkpoint as ocp  # Deferred: only runs that checkpoint need orbax.

    return ocp.CheckpointManager(
        directory.resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
        # Named handlers let item_metadata read a checkpoint's tree without its arrays.
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )


def save_checkpoint(manager, state: TrainState, rng: np.random.Generator, cfg: TrainConfig):
    import orbax.checkpoint as ocp

    step = int(state.step)
    meta = {
        "step": step,
        # PCG64's 128-bit state as strings: JSON readers differ on integers above 2**53.
        "rng_state": json.dumps(rng.bit_generator.state),
        "config": {
            **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "explicit"},
            "warmup_steps": cfg.warmup(),
            "schedule_steps": cfg.schedule_length(),
        },
    }
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(_checkpointed(state)), meta=ocp.args.JsonSave(meta)
        ),
    )


# Fields that belong to one invocation, never taken from a checkpoint.
_INVOCATION_FIELDS = (
    "out",
    "resume",
    "overwrite",
    "progress",
    "coordinator",
    "num_processes",
    "process_id",
    "explicit",
    "diagnose_every",
    "diagnose",
    "diagnose_batch",
    "plan",
)


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not read: missing, truncated or overwritten."""


def _step_dir(manager, step: int) -> pathlib.Path:
    return pathlib.Path(manager.directory) / str(step)


def _root_cause(error: BaseException) -> str:
    """The innermost error's first line: orbax wraps tensorstore's errors, which name the array
    and the file, in messages that spell out the whole tensorstore spec."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    text = lines[0][:400] if lines else ""
    if type(error) in (ValueError, Exception) and text:  # tensorstore's: the message says it all
        return text
    return f"{type(error).__name__}: {text}"


def _is_restore_echo(error: BaseException | None) -> bool:
    """Whether ``error`` is orbax's own, or a read finishing after orbax's event loop closed."""
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    while error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        if any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames):
            return True
        error = error.__cause__ or error.__context__
    return False


def _drop_restore_echoes() -> None:
    """Keeps the echoes of a failed restore off the terminal, for the rest of the process.

    When one array of a checkpoint does not read, orbax raises at once while its other reads
    are still in flight; as they finish they report the failure again, as tracebacks through
    ``sys.unraisablehook`` and the ``asyncio`` logger, some of them at interpreter exit. The
    error this script raises names the file and the cause already, so those copies are
    dropped: unraisable errors from orbax's code or its closed event loop, and asyncio's
    errors (exceptions nobody retrieved), since this script runs no asyncio of its own.
    """
    previous = sys.unraisablehook
    if not getattr(previous, "drops_restore_echoes", False):

        def hook(report):
            if not _is_restore_echo(report.exc_value):
                previous(report)

        hook.drops_restore_echoes = True
        sys.unraisablehook = hook
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def read_checkpoint_meta(manager, step: int | None = None) -> dict | None:
    """Reads a checkpoint's metadata (step, sampler state, settings): the latest one's by
    default, or None when there is none.

    Raises:
      CorruptCheckpoint: naming the file that does not read, and why.
    """
    import orbax.checkpoint as ocp

    step = manager.latest_step() if step is None else step
    if step is None:
        return None
    where = _step_dir(manager, step) / "meta"
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises what the file system or the JSON parser raised
        raise CorruptCheckpoint(f"{where}: {_root_cause(e)}") from e
    missing = {"step", "rng_state", "config"} - set(meta if isinstance(meta, dict) else ())
    if missing:
        raise CorruptCheckpoint(f"{where}: lacks {', '.join(sorted(missing))}")
    return meta


def _explicit(cfg: TrainConfig) -> set[str]:
    if cfg.explicit is not None:
        return set(cfg.explicit)
    defaults = TrainConfig()
    return {
        f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)
    }


def resumed_config(cfg: TrainConfig, meta: dict, where: pathlib.Path) -> TrainConfig:
    """The settings a resumed run continues with: its checkpoint's, plus what may change.

    Every setting comes from the checkpoint unless its flag is given; a flag given with
    another value than the checkpoint's is taken where it does not change the run (logging,
    intervals, devices, remat) and refused where it does. ``--steps`` may grow past the checkpoint's (the run is extended), never
    below the step the checkpoint is at. Checkpoints that saved only the trajectory's fields
    resume too.

    Raises:
      ValueError: naming each conflicting flag with its checkpoint value and the value given.
    """
    saved, explicit = meta["config"], _explicit(cfg)
    # Older checkpoints saved "steps" among the trajectory and no schedule length.
    saved.setdefault("schedule_steps", saved.get("steps"))
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - set(_INVOCATION_FIELDS)
    changes, conflicts = {}, []
    for name, value in saved.items():
        if name not in fields or name == "steps":
            continue
        if isinstance(value, list):  # JSON keeps a tuple (--wide-edge-blocks) as a list
            value = tuple(value)
        if name not in explicit:
            changes[name] = value
        elif name in _TRAJECTORY_FIELDS and getattr(cfg, name) != value:
            flag = f"--{name.replace('_', '-')}"
            conflicts.append(f"{flag}: checkpoint {value!r}, given {getattr(cfg, name)!r}")
    if "warmup_steps" not in saved and "warmup_steps" not in explicit:
        changes["warmup_steps"] = 50  # older checkpoints: the default of their time
    steps = cfg.steps if "steps" in explicit else saved.get("steps", cfg.steps)
    if steps < meta["step"]:
        conflicts.append(
            f"--steps: the checkpoint is at step {meta['step']}, given --steps {steps}"
        )
    if conflicts:
        raise ValueError(
            f"--resume: the checkpoint in {where} was made with other settings "
            f"({'; '.join(conflicts)}). Leave those flags out to continue the run as it was "
            "(--resume --out is enough), pass --overwrite to start it afresh, or train into "
            "another --out."
        )
    # The flags given, kept: later checks tell the checkpoint's settings from the user's.
    return dataclasses.replace(cfg, **changes, steps=steps, explicit=tuple(sorted(explicit)))


def _leaf_name(path: tuple) -> str:
    """A leaf's name as orbax writes it: the keys, attributes and indices of its path joined by
    dots, ``opt_state.1.0.mu.wte.embedding``."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _misfits(saved: Any, like: TrainState) -> list[str]:
    """How the arrays a checkpoint holds (orbax's tree metadata) differ, by name, shape and
    dtype, from those of the state these settings build."""
    have = {a.name: a for a in jax.tree.leaves(saved)}
    want = {_leaf_name(p): a for p, a in jax.tree_util.tree_leaves_with_path(like)}
    problems = [f"{name} is not in the checkpoint" for name in want if name not in have]
    for name in sorted(have.keys() - want.keys()):
        problems.append(f"the checkpoint holds {name}, which these settings do not build")
    for name, a in want.items():
        b = have.get(name)
        if b is not None and (tuple(b.shape) != a.shape or str(b.dtype) != str(a.dtype)):
            problems.append(
                f"{name}: the checkpoint holds {b.dtype}{list(b.shape)}, these settings build "
                f"{a.dtype}{list(a.shape)}"
            )
    return problems


def restore_state(manager, step: int, like: TrainState) -> TrainState:
    """Restores the train state saved at ``step`` onto ``like``'s shardings: orbax reslices each
    array for the mesh of now, whatever devices saved it.

    First checks that the checkpoint holds the arrays ``like`` has, by name, shape and dtype,
    so that a checkpoint of other settings is told apart from a damaged one; after restoring,
    checks the loss-scaling state against the bounds of the optimizer built now.

    Raises:
      CorruptCheckpoint: naming the file or folder that does not read, and why.
      ValueError: for a checkpoint that does not fit the state these settings build.
    """
    import orbax.checkpoint as ocp

    _drop_restore_echoes()
    where = _step_dir(manager, step)
    try:
        saved = manager.item_metadata(step)["state"]
    except Exception as e:  # orbax raises what the file system or the JSON parser raised
        raise CorruptCheckpoint(f"{where / 'state'}: {_root_cause(e)}") from e
    if saved is None:  # newer orbax reads a missing tree metadata file as no metadata
        raise CorruptCheckpoint(f"{where / 'state' / '_METADATA'} is missing")
    checkpointed = _checkpointed(like)
    misfits = _misfits(saved, checkpointed)
    if misfits:
        more = f"; and {len(misfits) - 3} more" if len(misfits) > 3 else ""
        raise ValueError(
            f"--resume: the checkpoint of step {step} in {manager.directory} does not fit the "
            f"model and optimizer these settings build: {'; '.join(misfits[:3])}{more}."
        )
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), checkpointed
    )
    try:
        restored = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )
    # The tree fits, so what fails now is reading the arrays' files; tensorstore's errors
    # arrive wrapped in a bare Exception.
    except Exception as e:
        raise CorruptCheckpoint(f"{where / 'state'}: {_root_cause(e)}") from e
    state = like._replace(**dict(zip(checkpointed._fields, restored["state"])))
    mpjax.check_loss_scaling(state.opt_state)
    return state


def _unrestorable(manager, failed: list[tuple[int, CorruptCheckpoint]]) -> ValueError:
    reasons = "".join(f"\n  step {step}: {error}" for step, error in failed)
    return ValueError(
        f"--resume: no checkpoint in {manager.directory} restores:{reasons}\n"
        "Start afresh with --overwrite (it deletes them), or train into another --out."
    )


def newest_checkpoint_meta(manager) -> tuple[dict, list[tuple[int, CorruptCheckpoint]]]:
    """The metadata of the newest checkpoint whose metadata reads, and the newer checkpoints
    whose metadata did not (step and error).

    Raises:
      ValueError: listing each checkpoint and why, when no metadata reads.
    """
    failed = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            return read_checkpoint_meta(manager, step), failed
        except CorruptCheckpoint as e:
            failed.append((step, e))
    raise _unrestorable(manager, failed)


def restore_newest(
    manager, like: TrainState, meta: dict, failed: list[tuple[int, CorruptCheckpoint]]
) -> tuple[TrainState, dict]:
    """Restores the newest checkpoint that reads whole, from ``meta``'s down, and returns it
    with its metadata. Says which newer ones it skipped and why (``failed``: those skipped
    already), and moves those aside (``<step>.corrupt``), so that the resumed run can save its
    own checkpoints of those steps while their files stay for a look.

    Raises:
      ValueError: listing each checkpoint and why, when none restores; or when one does not
        fit these settings (see :func:`restore_state`).
    """
    failed = list(failed)
    for step in sorted(manager.all_steps(), reverse=True):
        if step > meta["step"]:
            continue
        try:
            meta = meta if step == meta["step"] else read_checkpoint_meta(manager, step)
            state = restore_state(manager, step, like)
        except CorruptCheckpoint as e:
            failed.append((step, e))
            continue
        if failed:
            _set_aside(manager, failed, step)
        return state, meta
    raise _unrestorable(manager, failed)


def _set_aside(manager, failed: list[tuple[int, CorruptCheckpoint]], resumed: int) -> None:
    """Says which checkpoints were corrupt and why, and renames each ``<step>.corrupt``."""
    moved = []
    for step, _ in failed:
        path = _step_dir(manager, step)
        target, n = path.with_name(f"{step}.corrupt"), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{step}.corrupt{n}")
        moved.append(target)
    for (step, error), target in zip(failed, moved):
        print(f"--resume: the checkpoint of step {step} is corrupt ({error}); moved to {target}")
    if jax.process_index() == 0:
        for (step, _), target in zip(failed, moved):
            _step_dir(manager, step).rename(target)
    if jax.process_count() > 1:  # every process lists the checkpoints only once they moved
        multihost_utils.sync_global_devices("set corrupt checkpoints aside")
    manager.reload()
    print(f"--resume: resuming from step {resumed}, the newest checkpoint that restores")


# ----------------------------------------------------------------------------- training


def _describe_experts(config: GPTConfig) -> str:
    """The mixture of experts in the banner's model line, or nothing for dense MLPs."""
    if not config.n_experts:
        return ""
    active = config.active_params() / 1e6
    shared = " + a shared expert" if config.shared_expert else ""
    return (
        f", {config.n_experts} experts of width {config.expert_width()}, top-{config.top_k}"
        f"{shared}: {active:.2f}M params active per token"
    )


def _describe_fp8(fp8: Any) -> str:
    """``; delayed fp8 state of 16 matmuls`` (a scanned one counts once per layer), or empty."""
    if not fp8:
        return ""
    n = sum(math.prod(meta.scale.shape[:-1]) for meta in fp8.values())
    return f"; delayed fp8 state of {n} matmuls"


class TrainingStopped(RuntimeError):
    """Training stopped early: persistent overflow, or a non-finite loss without loss scaling."""


def _layout(mesh: Mesh) -> str:
    """How the devices split the work: ``"2 replicas x 4 fsdp, 2 processes"``."""
    replicas = mesh.shape["data"]
    text = f"{replicas} replica{'s' * (replicas != 1)} x {mesh.shape['fsdp']} fsdp"
    return text + (f", {jax.process_count()} processes" if jax.process_count() > 1 else "")


def _devices(n: int) -> list:
    available = jax.devices()
    if n < 0 or n > len(available):
        raise ValueError(f"--num-devices must be between 0 (all) and {len(available)}, got {n}.")
    return available[: n or len(available)]


def validate(cfg: TrainConfig) -> None:
    """Checks flag values that argparse cannot, with messages naming the flag."""
    if cfg.preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {cfg.preset!r}.")
    positive = (
        "steps",
        "batch_size",
        "grad_accum",
        "eval_interval",
        "eval_batches",
        "log_interval",
        "max_consecutive_skips",
        "fsdp",
        "num_processes",
        "diagnose_batch",
    )
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ValueError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}."
            )
    if not 0 <= cfg.warmup() < cfg.schedule_length():
        raise ValueError(
            f"--warmup-steps must be in [0, --steps), got {cfg.warmup()} with --steps "
            f"{cfg.schedule_length()}."
        )
    if cfg.lr <= 0:
        raise ValueError(f"--lr must be positive, got {cfg.lr}.")
    if cfg.experts < 0:
        raise ValueError(f"--experts must be 0 (a dense MLP) or more, got {cfg.experts}.")
    experts = cfg.experts or PRESETS[cfg.preset].n_experts
    if experts and cfg.top_k > experts:
        raise ValueError(f"--top-k {cfg.top_k} must be at most the {experts} experts.")
    if cfg.temperature <= 0:
        raise ValueError(f"--temperature must be positive, got {cfg.temperature}.")
    policy = mpjax.get_policy(cfg.policy)
    if policy.fp8 is not None and cfg.mode == "hand":
        raise ValueError(
            f"--policy {cfg.policy} runs matmuls in fp8, which dtypes written by hand cannot "
            "express: use --mode mpjax or --mode autocast."
        )
    if any(cfg.wide_edge_blocks):
        if cfg.mode != "mpjax":
            raise ValueError(
                "--wide-edge-blocks takes --mode mpjax (the model wrapped with rules); got "
                f"--mode {cfg.mode}."
            )
        try:
            edge_block_rules(cfg.model_config(), policy, cfg.wide_edge_blocks)
        except ValueError as error:
            raise ValueError(
                f"--wide-edge-blocks {' '.join(map(str, cfg.wide_edge_blocks))}: {error}"
            ) from None
    resolve_loss_scale(cfg.loss_scale, policy)
    if cfg.param_rounding not in mpjax.PARAM_ROUNDINGS:
        raise ValueError(
            f"--param-rounding must be one of {', '.join(mpjax.PARAM_ROUNDINGS)}, got "
            f"{cfg.param_rounding!r}."
        )
    if cfg.param_rounding != "nearest" and uses_master_weights(cfg, policy):
        raise ValueError(
            f"--param-rounding {cfg.param_rounding} lands updates on the {policy.param_dtype.name} "
            "params instead of an f32 master copy: add --no-master-weights."
        )
    if cfg.param_rounding != "nearest" and jnp.finfo(policy.param_dtype).bits >= 32:
        raise ValueError(
            f"--param-rounding {cfg.param_rounding} applies to bf16/f16 params, but --policy "
            f"{cfg.policy} stores params in {policy.param_dtype.name}."
        )
    if cfg.state_rounding not in ("nearest", "stochastic"):
        raise ValueError(
            f"--state-rounding must be nearest or stochastic, got {cfg.state_rounding!r}."
        )
    for name in ("mu_dtype", "nu_dtype"):
        value = getattr(cfg, name)
        if value is not None:
            mpjax.policy.storage_dtype(value, f"--{name.replace('_', '-')}")
    if cfg.state_format not in STATE_FORMATS:
        raise ValueError(
            f"--state-format must be one of {', '.join(STATE_FORMATS)}, got {cfg.state_format!r}."
        )
    if cfg.state_format != "none" and state_dtypes(cfg):
        given = " and ".join(f"--{name}-dtype" for name in state_dtypes(cfg))
        raise ValueError(
            f"--state-format {cfg.state_format} stores Adam's moments quantized and {given} "
            "stores them in a dtype: pass one of them."
        )
    if cfg.state_block_size is not None:
        if cfg.state_format == "none":
            raise ValueError(
                f"--state-block-size {cfg.state_block_size} sizes the blocks of --state-format, "
                "which is none: add --state-format dynamic8, e4m3 or dynamic4."
            )
        mpjax.optim.quantization.check_block_size(cfg.state_block_size, "--state-block-size")
    if cfg.resume and cfg.overwrite:
        raise ValueError(
            "--resume continues the run in --out and --overwrite deletes it: pass one of them."
        )
    if cfg.num_processes > 1 and not cfg.coordinator:
        raise ValueError(
            f"--num-processes {cfg.num_processes} needs --coordinator host:port (process 0's)."
        )
    if not 0 <= cfg.process_id < cfg.num_processes:
        raise ValueError(
            f"--process-id must be in [0, --num-processes={cfg.num_processes}), got "
            f"{cfg.process_id}."
        )


def _write_jsonl(path: pathlib.Path, records: list[dict]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _keep_log_until(path: pathlib.Path, step: int) -> None:
    """On resume, drops log lines written after the checkpoint the run resumes from."""
    if not path.exists():
        return
    rows = path.read_text().splitlines()
    lines = [row for row in rows if row and json.loads(row)["step"] <= step]
    path.write_text("".join(row + "\n" for row in lines))


# What a run writes into --out, and all that --overwrite deletes.
_RUN_FILES = ("checkpoints", "log.jsonl", "summary.json", "ranges.jsonl")


def _checkpoint_steps(directory: pathlib.Path) -> list[int]:
    """The steps of the checkpoints in ``directory``: orbax names each one's folder by its step
    (and a save in progress otherwise)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _run_files(out_dir: pathlib.Path) -> list[str]:
    """Which of a run's files ``out_dir`` holds; an empty checkpoint folder counts for none."""
    found = []
    for name in _RUN_FILES:
        path = out_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def continues_own_run(cfg: TrainConfig, out_dir: pathlib.Path) -> bool:
    """Whether this run continues the one in ``out_dir`` without ``--resume``: the default
    folder (no ``--out``) is named after the settings that decide the run, so a checkpoint
    there is this command's own run, finished or interrupted. Running the same command again
    then reports a finished run, or continues an interrupted one, instead of failing; a folder
    chosen with ``--out`` is the user's, and needs ``--resume`` or ``--overwrite``."""
    return (
        cfg.out is None
        and not cfg.resume
        and not cfg.overwrite
        and bool(_checkpoint_steps(out_dir / "checkpoints"))
    )


def prepare_out(cfg: TrainConfig, out_dir: pathlib.Path) -> None:
    """Keeps runs apart: ``--resume`` needs a checkpoint in ``out_dir``, and a fresh run a
    folder without a run, unless ``--overwrite`` deletes that run's files (checkpoints, log and
    summary; nothing else in the folder).

    Raises:
      ValueError: naming the folder, what it holds, and the flags that would go on.
    """
    found = _run_files(out_dir) if out_dir.is_dir() else []
    checkpoints = _checkpoint_steps(out_dir / "checkpoints")
    if cfg.resume:
        if not checkpoints:
            held = f" (it holds {', '.join(found)})" if found else ""
            raise ValueError(
                f"--resume: {out_dir / 'checkpoints'} holds no checkpoint to continue from"
                f"{held}. To start a run there, leave --resume out"
                + (" and pass --overwrite." if found else ".")
            )
        return
    if found and not cfg.overwrite:
        remedy = (
            "pass --resume to continue it, or --overwrite to delete it and start afresh"
            if checkpoints
            else "it has no checkpoint to resume from: pass --overwrite to delete it and start "
            "afresh"
        )
        raise ValueError(
            f"--out {out_dir} already holds a run ({', '.join(found)}): {remedy}, or choose "
            "another --out."
        )
    if found and jax.process_index() == 0:
        print(f"--overwrite: deleting the run in {out_dir} ({', '.join(found)})")
        for name in found:
            path = out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    if cfg.overwrite and jax.process_count() > 1:  # no process writes before the folder is clear
        multihost_utils.sync_global_devices("--overwrite")


def resumed_layout(cfg: TrainConfig, available: int) -> TrainConfig:
    """The checkpoint's ``--num-devices`` and ``--fsdp`` where they fit the ``available``
    devices here; where they do not, all devices, and the largest slicing that divides both the
    checkpoint's ``--fsdp`` and the devices. A resumed run may change devices: that changes the
    reduction order, not the run. Flags given on the command line are kept as given."""
    explicit = _explicit(cfg)
    if "num_devices" not in explicit and cfg.num_devices > available:
        print(
            f"--resume: the checkpoint's --num-devices {cfg.num_devices} is more than the "
            f"{available} here: using them all (pass --num-devices to choose)"
        )
        cfg = dataclasses.replace(cfg, num_devices=0)
    n = cfg.num_devices or available
    if "fsdp" not in explicit and n % cfg.fsdp:
        fsdp = math.gcd(cfg.fsdp, n)
        print(
            f"--resume: the checkpoint's --fsdp {cfg.fsdp} does not divide the {n} devices "
            f"used here: slicing params over {fsdp} instead (pass --fsdp to choose)"
        )
        cfg = dataclasses.replace(cfg, fsdp=fsdp)
    return cfg


def diagnose(cfg: TrainConfig) -> mpjax.DiagnosisReport:
    """``mpjax.diagnose`` of the loss of the model and policy ``cfg`` gives, on
    ``--diagnose-batch`` sequences of the training corpus (a few are enough for the ranges;
    the doctor holds each value twice, exactly and as it runs, where a train step holds it
    once), at the initial params: the report ``--diagnose`` prints."""
    policy = mpjax.get_policy(cfg.policy)
    mcfg = cfg.model_config()
    train_data, _ = split_corpus(load_corpus(cfg.data, cfg.max_bytes), cfg.val_fraction)
    rng = np.random.default_rng(cfg.seed)
    x, y = sample_batch(train_data, rng, (cfg.diagnose_batch,), mcfg.block_size)
    model = build_model(
        mcfg, policy, cfg.mode, fp8_head=cfg.fp8_head, wide_edge_blocks=cfg.wide_edge_blocks
    )
    variables = jax.jit(model.init)(jax.random.key(cfg.seed), x)
    fp8 = variables.get("fp8")

    def loss(params, x, y):
        return loss_fn(model, params, x, y, fp8)

    # A wrapped model (mode "mpjax") runs under its own rules, the loss around it in float32,
    # as it trains; in the other modes the function runs under the policy.
    rules = None if cfg.mode == "mpjax" else policy
    return mpjax.diagnose(loss, policy=rules)(variables["params"], x, y)


def plan_step(cfg: TrainConfig, model_config: GPTConfig | None = None) -> mpjax.Plan:
    """``mpjax.plan`` of the train step ``cfg`` gives, for the target ``--plan`` names,
    compiled without it: the step ``train`` would compile, with its state sharded as it would
    train over the target's devices (``--fsdp`` of them slicing each large param, the batch
    split over all), and nothing run. The report ``--plan`` prints. ``model_config`` replaces
    the model ``cfg`` names (a shape no flag gives, such as another vocabulary)."""
    mesh_devices = mpjax.plan_mesh(cfg.plan).devices.flatten().tolist()
    if cfg.batch_size % len(mesh_devices):
        raise ValueError(
            f"--batch-size {cfg.batch_size} must be a multiple of the {len(mesh_devices)} "
            f"devices of --plan {cfg.plan}, since each device takes an equal share."
        )
    mesh = sharding.make_mesh(mesh_devices, cfg.fsdp)
    policy = mpjax.get_policy(cfg.policy)
    mcfg = dataclasses.replace(
        model_config or cfg.model_config(), block_input_sharding=sharding.activation_sharding(mesh)
    )
    model = build_model(
        mcfg, policy, cfg.mode, fp8_head=cfg.fp8_head, wide_edge_blocks=cfg.wide_edge_blocks
    )
    tx = make_optimizer(cfg, policy)
    abstract = jax.eval_shape(lambda: init_state(model, tx, cfg.seed, mcfg.block_size))
    shardings = sharding.state_shardings(abstract, mesh)
    replicated = NamedSharding(mesh, P())
    shardings = shardings._replace(fp8=jax.tree.map(lambda _: replicated, abstract.fp8))
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    x_spec = jax.ShapeDtypeStruct(
        (cfg.grad_accum, cfg.batch_size, mcfg.block_size),
        jnp.int32,
        sharding=sharding.batch_sharding(mesh),
    )
    return mpjax.plan(make_train_step(model, tx), cfg.plan)(state, x_spec, x_spec)


def largest_batch_that_fits(cfg: TrainConfig, devices: int) -> str:
    """What ``--plan`` says when the step does not fit: the largest batch (``--batch-size``
    halved, a multiple of the target's ``devices``) whose step fits in each device's memory,
    each try one compile."""
    batch = cfg.batch_size
    while batch // 2 >= devices and (batch // 2) % devices == 0:
        batch //= 2
        memory = plan_step(dataclasses.replace(cfg, batch_size=batch)).memory
        if memory is not None and memory.fits:
            return (
                f"--batch-size {batch} fits on {cfg.plan} ({memory}); "
                f"--grad-accum {cfg.grad_accum * cfg.batch_size // batch} keeps "
                f"{cfg.grad_accum * cfg.batch_size} sequences a step"
            )
    return f"no batch of at least {devices} sequences fits on {cfg.plan}: use more devices"


def train(cfg: TrainConfig) -> dict:
    """Runs (or resumes) training; returns the summary that is also written to summary.json.

    Raises:
      TrainingStopped: on persistent overflow or a non-finite loss that no loss scale covers.
      ValueError: for bad settings; an --out that holds a run (without --resume or
        --overwrite) or no checkpoint (with --resume); checkpoints that none restores.
    """
    validate(cfg)
    out_dir = cfg.out_dir()
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file; give a folder for the run.")
    if continues_own_run(cfg, out_dir):
        print(
            f"{out_dir} holds this command's run (its settings name the folder): continuing it "
            "as --resume does. --overwrite starts it afresh; --out trains into another folder."
        )
        cfg = dataclasses.replace(cfg, resume=True)
    # Checkpoints first: a resumed run takes its settings from its checkpoint, and a fresh run
    # must not mix with an old one.
    prepare_out(cfg, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "log.jsonl"
    manager = None
    if cfg.ckpt_interval > 0 or cfg.resume:
        manager = _checkpoint_manager(out_dir / "checkpoints")
    resume_meta, failed = None, []
    if cfg.resume:
        resume_meta, failed = newest_checkpoint_meta(manager)
        cfg = resumed_config(cfg, resume_meta, out_dir)
        validate(cfg)
        if resume_meta["step"] >= cfg.steps:
            return _finished_run(out_dir, resume_meta["step"])
        cfg = resumed_layout(cfg, len(jax.devices()))

    policy = mpjax.get_policy(cfg.policy)
    mcfg = cfg.model_config()
    seq_len = mcfg.block_size

    devices = _devices(cfg.num_devices)
    if cfg.batch_size % len(devices):
        remedy = ""
        if cfg.resume and "batch_size" not in _explicit(cfg):  # the checkpoint's, not the user's
            remedy = "; it is the run's own: pass --num-devices N, N dividing it"
        raise ValueError(
            f"--batch-size {cfg.batch_size} must be a multiple of the number of devices "
            f"({len(devices)}), since each device takes an equal share{remedy}."
        )
    mesh = sharding.make_mesh(devices, cfg.fsdp)
    mcfg = dataclasses.replace(mcfg, block_input_sharding=sharding.activation_sharding(mesh))
    replicated = NamedSharding(mesh, P())
    batch_sharding = sharding.batch_sharding(mesh)  # [grad_accum, batch, seq]
    eval_sharding = sharding.eval_sharding(mesh)  # [batch, seq]
    # With several processes, process 0 alone writes the log and the summary.
    writes_files = jax.process_index() == 0

    # Data.
    corpus = load_corpus(cfg.data, cfg.max_bytes)
    train_data, val_data = split_corpus(corpus, cfg.val_fraction)
    baseline = unigram_cross_entropy(train_data, val_data)
    val_rng = np.random.default_rng(VAL_SAMPLER_SEED)
    val_batches = [
        sample_batch(val_data, val_rng, (cfg.batch_size,), seq_len) for _ in range(cfg.eval_batches)
    ]
    rng = np.random.default_rng(cfg.seed)

    # Model, optimizer, state.
    model = build_model(
        mcfg, policy, cfg.mode, fp8_head=cfg.fp8_head, wide_edge_blocks=cfg.wide_edge_blocks
    )
    tx = make_optimizer(cfg, policy)
    state = init_state(model, tx, cfg.seed, seq_len, mesh)
    state_shardings = jax.tree.map(lambda a: a.sharding, state)
    n_params = sum(p.size for p in jax.tree.leaves(state.params))
    if resume_meta is not None:
        state, resume_meta = restore_newest(manager, state, resume_meta, failed)
        rng.bit_generator.state = json.loads(resume_meta["rng_state"])
        if writes_files:
            _keep_log_until(log_path, int(state.step))
    start_step = int(state.step)

    tokens_per_step = cfg.grad_accum * cfg.batch_size * seq_len
    print(
        f"model: {cfg.preset} ({n_params / 1e6:.2f}M params, {mcfg.n_layer} layers, d_model "
        f"{mcfg.d_model}, {mcfg.n_head} heads, seq {seq_len}, "
        f"{'tied' if mcfg.tie_embeddings else 'untied'} head{_describe_experts(mcfg)})\n"
        f"policy: {cfg.policy} -> {policy!r} (mode: {cfg.mode}){_describe_fp8(state.fp8)}\n"
        f"optimizer: {describe_optimizer(cfg, policy)}; params + optimizer state "
        f"{mpjax.memory_report(state.params, state.opt_state).bytes_per_param:.2f} bytes/param\n"
        f"data: {'stdlib .py sources' if cfg.data is None else cfg.data}: {len(train_data):,} train "
        f"/ {len(val_data):,} val bytes; unigram baseline {baseline:.3f} nats/byte\n"
        f"devices: {len(devices)} x {devices[0].device_kind} ({_layout(mesh)}); "
        f"{tokens_per_step:,} tokens/step "
        f"({cfg.grad_accum} x {cfg.batch_size} x {seq_len}); out: {out_dir}"
        + (f"\nresuming at step {start_step}" if start_step else "")
    )

    # Compile ahead of time, so that the progress bar's tokens/s leaves compilation out.
    x_spec = jax.ShapeDtypeStruct(
        (cfg.grad_accum, cfg.batch_size, seq_len), jnp.int32, sharding=batch_sharding
    )
    t0 = time.perf_counter()
    step_fn = (
        jax.jit(
            make_train_step(model, tx),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        )
        .lower(state, x_spec, x_spec)
        .compile()
    )
    eval_fn = jax.jit(lambda p, fp8, x, y: loss_fn(model, p, x, y, fp8, router_losses=False))
    monitor = measured_fn = None
    if cfg.diagnose_every:
        # The check steps run a second compiled step that measures each module's values; the
        # others run step_fn itself. Compiled at the first check.
        monitor = mpjax.PrecisionMonitor(every=cfg.diagnose_every)
        measured_fn = jax.jit(
            monitor.measuring(make_train_step(model, tx)),
            out_shardings=(state_shardings, replicated),
            donate_argnums=1,
        )
    compile_s = time.perf_counter() - t0
    print(f"compiled the train step in {compile_s:.1f} s")

    def evaluate(state: TrainState) -> float:
        losses = [
            eval_fn(
                state.params,
                state.fp8,
                sharding.global_batch(x, eval_sharding),
                sharding.global_batch(y, eval_sharding),
            )
            for x, y in val_batches
        ]
        return float(np.mean(jax.device_get(losses)))

    schedule = make_schedule(cfg)
    history: list[dict] = []
    val_loss = float("nan")
    pbar = _progress(cfg, start_step)
    t_start = t_last = time.perf_counter()
    last_logged = start_step
    train_time = 0.0
    try:
        for step in range(start_step, cfg.steps):
            x, y = sample_batch(train_data, rng, (cfg.grad_accum, cfg.batch_size), seq_len)
            batch = (
                sharding.global_batch(x, batch_sharding),
                sharding.global_batch(y, batch_sharding),
            )
            if measured_fn is not None and step % cfg.diagnose_every == 0:
                state, metrics = measured_fn(step, state, *batch)
            else:
                state, metrics = step_fn(state, *batch)
            done = step + 1
            if done % cfg.log_interval and done % cfg.eval_interval and done != cfg.steps:
                continue
            m = {k: v.item() for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            train_time += now - t_last
            record = {
                "step": done,
                "loss": m["loss"],
                # Skipped steps do not advance the optimizer's schedule.
                "lr": float(schedule(done - 1 - m["skipped_steps"])),
                "loss_scale": m["loss_scale"],
                "skipped_steps": m["skipped_steps"],
                # Of the param elements, the fraction this (logged) step left unchanged.
                "unmoved": m["unmoved"],
                "tokens_per_s": (done - last_logged) * tokens_per_step / (now - t_last),
                "elapsed_s": now - t_start,
            }
            _check_health(cfg, policy, state, done, m["loss"])
            if done % cfg.eval_interval == 0 or done == cfg.steps:
                val_loss = evaluate(state)
                record["val_loss"] = val_loss
                pbar.write(
                    f"step {done:5d}  train {m['loss']:.4f}  val {val_loss:.4f} nats/byte "
                    f"({val_loss / math.log(2):.3f} bits)"
                )
            history.append(record)
            if writes_files:
                _write_jsonl(log_path, [record])
                if monitor is not None:
                    monitor.write(out_dir / "ranges.jsonl")
            pbar.update(done - last_logged)
            pbar.set_postfix(
                {
                    "loss": f"{m['loss']:.3f}",
                    "tok/s": f"{record['tokens_per_s']:,.0f}",
                    "scale": f"{m['loss_scale']:g}",
                    "skipped": m["skipped_steps"],
                }
            )
            if (
                manager is not None
                and cfg.ckpt_interval > 0
                and (done % cfg.ckpt_interval == 0 or done == cfg.steps)
            ):
                save_checkpoint(manager, state, rng, cfg)
            last_logged = done
            t_last = time.perf_counter()  # leaves evaluation and checkpointing out of tokens/s
    finally:
        if manager is not None:
            manager.wait_until_finished()
    pbar.close()

    final_step = int(state.step)
    trained = final_step - start_step
    if not history:  # resumed a finished run: nothing trained, but report where it stands
        val_loss = evaluate(state)
    summary = {
        "config": dataclasses.asdict(cfg),
        "policy": str(policy),
        "n_params": n_params,
        "steps": final_step,
        "tokens": final_step * tokens_per_step,
        "train_time_s": train_time,
        "compile_time_s": compile_s,
        "tokens_per_s": trained * tokens_per_step / train_time if train_time > 0 else None,
        "final_train_loss": history[-1]["loss"] if history else None,
        "final_val_loss": val_loss,
        "unigram_baseline": baseline,
        "skipped_steps": history[-1]["skipped_steps"] if history else 0,
        "final_loss_scale": history[-1]["loss_scale"] if history else None,
        # What ran, in the banner's words; "config" holds the settings as given, where
        # master_weights asks for an f32 copy of params stored narrower than f32.
        "optimizer": describe_optimizer(cfg, policy),
        "master_weights": uses_master_weights(cfg, policy),
        "devices": len(devices),
        "processes": jax.process_count(),
        "device_kind": devices[0].device_kind,
    }
    if cfg.sample_bytes > 0:
        # Sampling runs on one device: the model without the mesh's placement of activations.
        one_device = dataclasses.replace(mcfg, block_input_sharding=None)
        sampler = build_model(
            one_device,
            policy,
            cfg.mode,
            fp8_head=cfg.fp8_head,
            wide_edge_blocks=cfg.wide_edge_blocks,
        )
        summary["sample"] = sample_text(
            sampler, state.params, cfg, jax.random.key(cfg.seed), state.fp8
        )
    if writes_files:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["state"] = state
    summary["history"] = history
    return summary


def _finished_run(out_dir: pathlib.Path, step: int) -> dict:
    """What resuming a finished run returns: its summary as written, untouched, which
    :func:`main` reports again."""
    print(
        f"--resume: the run in {out_dir} is finished (step {step}); nothing to train. Pass a "
        f"larger --steps to extend it. Its results:"
    )
    path = out_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"steps": step}
    return {**summary, "already_finished": True}


def sample_text(model: GPT, params: Any, cfg: TrainConfig, key: jax.Array, fp8: Any = None) -> str:
    """Samples ``cfg.sample_bytes`` bytes after ``cfg.sample_prompt``; decodes as UTF-8.
    ``fp8``: the delayed-scaling fp8 state, where the policy has one."""
    prompt = np.frombuffer(cfg.sample_prompt.encode(), dtype=np.uint8).astype(np.int32)
    if prompt.size == 0:
        prompt = np.array([ord("\n")], np.int32)
    # Every process gathers the whole params (sliced over fsdp, or over processes) to sample
    # on one of its own devices.
    params, fp8 = jax.device_put(
        multihost_utils.process_allgather((params, fp8), tiled=True), jax.local_devices()[0]
    )
    out = make_generate(model, cfg.sample_bytes)(
        params, jnp.asarray(prompt), key, jnp.asarray(cfg.temperature, jnp.float32), fp8
    )
    return bytes(np.asarray(out, dtype=np.uint8)).decode("utf-8", errors="replace")


def _check_health(
    cfg: TrainConfig, policy: mpjax.Policy, state: TrainState, step: int, loss: float
) -> None:
    """Stops a run that can no longer learn, with a message saying why and what to try."""
    if uses_loss_scaling(cfg, policy):
        # Skipped steps leave the params alone, so a non-finite loss is survivable; a long run
        # of them means nothing is being learned any more.
        try:
            mpjax.check_overflow(state.opt_state, cfg.max_consecutive_skips)
        except mpjax.PersistentOverflowError as e:
            raise TrainingStopped(
                f"Stopped at step {step} (policy {policy}, --loss-scale {cfg.loss_scale}, "
                f"--max-consecutive-skips {cfg.max_consecutive_skips}): {e}"
            ) from e
    elif not math.isfinite(loss):
        raise TrainingStopped(
            f"Stopped at step {step}: the loss is {loss} under policy {policy} without loss "
            "scaling, so the parameters are no longer finite. Try: 1. a lower --lr; "
            "2. --loss-scale dynamic (it skips non-finite steps); 3. --policy float32 to compare."
        )


def _progress(cfg: TrainConfig, start_step: int):
    from tqdm.auto import tqdm  # Deferred: only the script needs tqdm.

    return tqdm(
        total=cfg.steps,
        initial=start_step,
        disable=not cfg.progress,
        unit="step",
        dynamic_ncols=True,
        file=sys.stdout,
    )


# ----------------------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default once: not for on/off flags (their help says what they do)
    nor for flags without a default (their help says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a GPT-style byte-level language model under an mpjax policy.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=list(PRESETS), default=PRESET, help="model size")
    g.add_argument("--n-layer", type=_positive_int, help="override the preset's layers")
    g.add_argument("--n-head", type=_positive_int, help="override the preset's heads")
    g.add_argument("--d-model", type=_positive_int, help="override the preset's width")
    g.add_argument(
        "--untied", action="store_true", help="a separate output head (default: tied to wte)"
    )
    g.add_argument(
        "--attention",
        choices=ATTENTION,
        default=ATTENTION_IMPL,
        help="fused: jax.nn.dot_product_attention (cuDNN flash attention on a GPU); "
        "naive: einsums and an f32 softmax",
    )
    g.add_argument(
        "--scan-layers",
        action="store_true",
        help="run the blocks under nn.scan (compiles one block; params get a layer axis); "
        "default: a Python loop",
    )
    g.add_argument(
        "--remat",
        choices=list(REMAT_POLICIES),
        default=REMAT,
        help="recompute each block in the backward pass to save memory: none, full "
        "(keep only its input) or dots (keep the weight matmuls)",
    )
    g.add_argument(
        "--experts",
        type=int,
        default=EXPERTS,
        help="replace each block's MLP by a mixture of this many experts (a router, top-k "
        "dispatch and grouped GEMMs); 0: the dense MLP",
    )
    g.add_argument("--top-k", type=_positive_int, default=TOP_K, help="experts per token")
    g.add_argument(
        "--expert-ratio",
        type=_positive_int,
        default=EXPERT_RATIO,
        help="each expert's hidden width as a multiple of d_model (default: the MLP's, 4)",
    )
    g.add_argument(
        "--shared-expert",
        action="store_true",
        help="add an MLP every token goes through beside the routed experts",
    )
    g = p.add_argument_group("precision")
    g.add_argument(
        "--policy",
        default=POLICY,
        help="mpjax policy: float32, mixed_bfloat16, mixed_float16, bfloat16, "
        "mixed_bfloat16_fp8 (fp8 matmuls, current scaling; Hopper/Ada GPUs run them as fp8 "
        f"GEMMs), '{FP8_DELAYED}' (fp8, delayed scaling: the train state carries the fp8 "
        "scales and amax histories), mixed_bfloat16_fp8_rowwise (a scale per row), "
        "mixed_bfloat16_mxfp8 and mixed_bfloat16_nvfp4 (Blackwell's block formats; emulated "
        "elsewhere), 'p=f32,c=bf16,o=f32', "
        "'p=f32,c=bf16,o=f32,fp8=current;margin=1', ...",
    )
    g.add_argument(
        "--fp8-head",
        action=argparse.BooleanOptionalAction,
        default=FP8_HEAD,
        help="under an fp8 policy, run the output head's matmul in fp8 too (default: bf16)",
    )
    g.add_argument(
        "--wide-edge-blocks",
        nargs=2,
        type=_non_negative_int,
        metavar=("FIRST", "LAST"),
        default=WIDE_EDGE_BLOCKS,
        help="under an fp8 or block-format policy, keep the first FIRST and the last LAST "
        "blocks in the compute dtype, as NVIDIA's NVFP4 recipe does (mode mpjax; default: 0 0)",
    )
    g.add_argument(
        "--mode",
        choices=MODEL_MODES,
        default=MODE,
        help="how the policy reaches the model: mpjax.linen.apply_policy with rules, "
        "dtypes written by hand, or mpjax.autocast",
    )
    g.add_argument(
        "--loss-scale",
        default=LOSS_SCALE,
        help="auto (dynamic for float16, else none), none, dynamic or static:N",
    )
    g.add_argument(
        "--no-master-weights",
        dest="master_weights",
        action="store_false",
        help="update bf16/f16-stored params directly, without an f32 master copy "
        "(default: keep one)",
    )
    g.add_argument(
        "--param-rounding",
        choices=mpjax.PARAM_ROUNDINGS,
        default=PARAM_ROUNDING,
        help="with --no-master-weights, how f32 updates land on bf16/f16 params: nearest "
        "(optax.apply_updates), stochastic or kahan (mpjax.low_precision_params)",
    )
    g.add_argument(
        "--mu-dtype",
        default=MU_DTYPE,
        help="store Adam's first moment in this dtype (bf16, f16, f32; mpjax.state_precision)",
    )
    g.add_argument("--nu-dtype", default=NU_DTYPE, help="store Adam's second moment in this dtype")
    g.add_argument(
        "--state-rounding",
        choices=("nearest", "stochastic"),
        default=STATE_ROUNDING,
        help="how --mu-dtype/--nu-dtype or --state-format are rounded",
    )
    g.add_argument(
        "--state-format",
        choices=STATE_FORMATS,
        default=STATE_FORMAT,
        help="store Adam's moments blockwise quantized (mpjax.quantized_state): dynamic8 "
        "(bitsandbytes' 8-bit maps), e4m3 (float8 codes) or dynamic4 (torchao's 4-bit maps)",
    )
    g.add_argument(
        "--state-block-size",
        type=_positive_int,
        default=STATE_BLOCK_SIZE,
        help="elements per block of --state-format along a moment's last axis, a power of two "
        "(default: the format's, 256 or 128 for dynamic4)",
    )
    g.add_argument(
        "--max-consecutive-skips",
        type=_positive_int,
        default=MAX_CONSECUTIVE_SKIPS,
        help="stop after this many overflowed steps in a row",
    )
    g = p.add_argument_group("optimization")
    g.add_argument(
        "--steps",
        type=_positive_int,
        default=STEPS,
        help="optimizer steps; with --resume, a larger value extends a run (its LR schedule "
        "keeps its length, the extra steps run at the final LR)",
    )
    g.add_argument(
        "--batch-size", type=_positive_int, default=BATCH_SIZE, help="sequences per micro-batch"
    )
    g.add_argument(
        "--grad-accum",
        type=_positive_int,
        default=GRAD_ACCUM,
        help="micro-batches per optimizer step",
    )
    g.add_argument(
        "--seq-len",
        type=_positive_int,
        default=SEQ_LEN,
        help="bytes per sequence (default: the preset's block size)",
    )
    g.add_argument("--lr", type=float, default=LR, help="peak learning rate")
    g.add_argument(
        "--min-lr-ratio",
        type=float,
        default=MIN_LR_RATIO,
        help="the cosine decay ends at lr x this ratio",
    )
    g.add_argument(
        "--warmup-steps",
        type=int,
        default=WARMUP_STEPS,
        help="linear warmup from 0 (default: min(50, steps / 10))",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=WEIGHT_DECAY,
        help="AdamW decoupled weight decay, on kernels and embeddings",
    )
    g.add_argument("--beta1", type=float, default=BETA1, help="Adam's first-moment decay")
    g.add_argument("--beta2", type=float, default=BETA2, help="Adam's second-moment decay")
    g.add_argument(
        "--grad-clip", type=float, default=GRAD_CLIP, help="global-norm clip; 0 disables it"
    )
    g.add_argument("--seed", type=int, default=SEED, help="model init and batch sampling")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=DATA, help="text file or folder (default: stdlib .py files)")
    g.add_argument(
        "--max-bytes", type=_positive_int, default=MAX_BYTES, help="cap on the corpus size"
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        default=VAL_FRACTION,
        help="the corpus's last part held out for validation",
    )
    g = p.add_argument_group("logging, checkpoints, devices")
    g.add_argument("--out", help="output folder (default: runs/<preset>_<policy>)")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest checkpoint that restores (skipping "
        "corrupt ones), with its own settings, on any number of devices; an error if --out "
        "holds no checkpoint",
    )
    g.add_argument(
        "--diagnose-every",
        type=_positive_int,
        default=0,
        metavar="N",
        help="every N steps, measure each module's largest magnitude and non-finite count, of "
        "its values and of their gradients, in the train step (mpjax.PrecisionMonitor) into "
        "<out>/ranges.jsonl; other steps run the plain step",
    )
    g.add_argument(
        "--diagnose",
        action="store_true",
        help="print mpjax.diagnose's report (ranges, precision lost, non-finite birth, "
        "recommended rules and loss scale) of the model under --policy on --diagnose-batch "
        "sequences; no training",
    )
    g.add_argument(
        "--plan",
        default=TrainConfig.plan,
        metavar="TARGET",
        help="print mpjax.plan's plan of the train step for TARGET (h100, a100, h200, b200, "
        "gb200, b300; v4, v5e, "
        "v5p, v6e; a TPU slice such as v5p:2x2x1), sharded as it would train there, compiled "
        "on this machine without it: matmul dtypes, fused attention, memory per device, and "
        "on a TPU XLA's estimated step time and MFU; no training (needs the cuda12 or tpu "
        "extra)",
    )
    g.add_argument(
        "--diagnose-batch",
        type=_positive_int,
        default=TrainConfig.diagnose_batch,
        metavar="N",
        help="sequences --diagnose runs on (default %(default)s: enough for the ranges; the "
        "doctor holds each value twice, exactly and as it runs, where a train step holds it "
        "once: the small preset's 1,024 bytes take about 12 GB on a CPU)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run in --out (its checkpoints, log.jsonl and summary.json, nothing "
        "else) and start afresh; without it, a fresh run refuses a folder that holds a run",
    )
    g.add_argument(
        "--eval-interval",
        type=_positive_int,
        default=EVAL_INTERVAL,
        help="steps between validation losses",
    )
    g.add_argument(
        "--eval-batches",
        type=_positive_int,
        default=EVAL_BATCHES,
        help="validation batches per evaluation",
    )
    g.add_argument(
        "--log-interval",
        type=_positive_int,
        default=LOG_INTERVAL,
        help="steps between logged lines (metrics leave the device only then)",
    )
    g.add_argument(
        "--ckpt-interval", type=int, default=CKPT_INTERVAL, help="0 disables checkpoints"
    )
    g.add_argument("--num-devices", type=int, default=0, help="devices to use; 0 means all")
    g.add_argument(
        "--fsdp",
        type=_positive_int,
        default=1,
        help="devices that share each param and its optimizer state, sliced (FSDP); the "
        "others are data-parallel replicas",
    )
    g.add_argument(
        "--coordinator",
        help="host:port of process 0, to train as one of --num-processes processes",
    )
    g.add_argument(
        "--num-processes", type=_positive_int, default=1, help="processes running this script"
    )
    g.add_argument("--process-id", type=int, default=0, help="this process's index, from 0")
    g.add_argument(
        "--no-progress", dest="progress", action="store_false", help="hide the progress bar"
    )
    g = p.add_argument_group("sampling")
    g.add_argument("--sample-bytes", type=int, default=SAMPLE_BYTES, help="0 disables sampling")
    g.add_argument("--sample-prompt", default=SAMPLE_PROMPT, help="text the sample starts from")
    g.add_argument("--temperature", type=float, default=TEMPERATURE, help="sampling temperature")
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parses the command line into a :class:`TrainConfig` and validates it."""
    parser = make_parser()
    args = parser.parse_args(argv)
    # The flags given on the command line: parsed again with a marker for every default.
    not_given = object()  # not a string, so argparse never converts it
    quiet = make_parser()
    quiet.set_defaults(**dict.fromkeys(vars(args), not_given))
    given = vars(quiet.parse_args(argv))
    explicit = tuple(sorted(k for k, v in given.items() if v is not not_given))
    args.wide_edge_blocks = tuple(args.wide_edge_blocks)  # argparse gives nargs=2 as a list
    cfg = TrainConfig(**vars(args), explicit=explicit)
    try:
        validate(cfg)
    except ValueError as e:
        parser.error(str(e))
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.coordinator:
        # Before anything touches a device, checking the flags included.
        try:
            sharding.initialize(args.coordinator, args.num_processes, args.process_id)
        except ValueError as e:
            parser.error(str(e))
    cfg = parse_args(argv)
    if cfg.diagnose:
        n = cfg.diagnose_batch
        print(
            f"mpjax.diagnose: the {cfg.preset} model under {cfg.policy} (mode {cfg.mode}), "
            f"the loss around it in {'float32' if cfg.mode == 'mpjax' else cfg.policy}, "
            f"on {n} sequence{'s' if n != 1 else ''} of "
            f"{cfg.model_config().block_size} bytes\n"
        )
        report = diagnose(cfg)
        print(report.table(), report, sep="\n\n")  # every row, then the verdict, last on screen
        return
    if cfg.plan:
        mcfg = cfg.model_config()
        tokens = cfg.grad_accum * cfg.batch_size * mcfg.block_size
        print(
            f"mpjax.plan: the {cfg.preset} train step under {cfg.policy} (mode {cfg.mode}), "
            f"{tokens:,} tokens a step, compiled for {cfg.plan} without one; nothing runs\n"
        )
        try:
            plan = plan_step(cfg)
        except (ValueError, mpjax.PlanUnavailableError) as e:
            sys.exit(f"error: {e}")
        print(plan)
        mfu = plan.mfu(tokens * mcfg.flops_per_token() / plan.devices)
        if mfu is not None:
            print(
                f"estimated MFU of the model FLOPs ({mcfg.flops_per_token():,} a token): {mfu:.1%}"
            )
        if plan.memory is not None and not plan.memory.fits:
            print(largest_batch_that_fits(cfg, plan.devices))
        return
    if jax.process_index() != 0:  # process 0 reports for all
        cfg = dataclasses.replace(cfg, progress=False)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
    try:
        summary = train(cfg)
    except TrainingStopped as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        again = (
            "the same command again"
            if cfg.out is None
            else f"python {sys.argv[0]} --resume --out {cfg.out_dir()}"
        )
        sys.exit(f"\ninterrupted: continue from the last checkpoint with {again}")
    except (ValueError, OSError) as e:  # a user error: the message, not a traceback
        sys.exit(f"error: {e}")
    print_results(summary, cfg.out_dir())


def print_results(summary: dict, out_dir: pathlib.Path) -> None:
    """Prints a run's results from its summary: steps, times, the final validation loss
    against the unigram baseline, skipped steps, where its files are, and its sample. A
    finished run found again (``already_finished``) prints those it wrote then."""
    if "final_val_loss" not in summary:  # a finished run whose summary.json is missing
        return
    val, base = summary["final_val_loss"], summary["unigram_baseline"]
    ln2 = math.log(2)
    print(
        f"\ndone: {summary['steps']} steps, {summary['tokens']:,} tokens, "
        f"{summary['train_time_s']:.1f} s training + {summary['compile_time_s']:.1f} s compile"
        + (f", {summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else "")
        + f"\nfinal val loss {val:.4f} nats/byte ({val / ln2:.3f} bits/byte); unigram baseline "
        f"{base:.4f} nats/byte ({base / ln2:.3f} bits/byte): {abs(base - val):.4f} nats "
        f"{'better' if val <= base else 'worse'}"
        f"\nskipped steps {summary['skipped_steps']}, final loss scale {summary['final_loss_scale']}"
        f"\nlog: {out_dir / 'log.jsonl'}, summary: {out_dir / 'summary.json'}"
    )
    if "sample" in summary:
        temperature = summary["config"]["temperature"]
        print(f"\n--- sample (temperature {temperature}) ---\n{summary['sample']}\n---")


if __name__ == "__main__":
    main()
