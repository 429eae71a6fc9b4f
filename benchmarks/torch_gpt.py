"""The example GPT (``examples/gpt.py``) and its train step, in PyTorch: the benchmark's peer.

Same shape (from the same :class:`gpt.GPTConfig`), same init, same step: pre-norm blocks with a
fused qkv projection, LayerNorm (eps 1e-5), a tanh-GELU MLP, learned position embeddings added
as a slice, an output head tied to the token embedding (or untied), cross-entropy on f32
logits, global-norm clipping at 1.0, then AdamW (betas 0.9/0.95, weight decay 0.1 on matrices
only) under the example's warmup-then-cosine learning rate.

Precisions are PyTorch's idioms: ``float32`` (TF32 matmuls on GPUs, as JAX's default
precision), ``torch.autocast`` to bfloat16, and ``torch.autocast`` to float16 with
``torch.amp.GradScaler`` (unscaled before clipping, as PyTorch's documentation says).
Attention is ``naive`` (two matmuls and an f32 softmax, the example's naive path) or ``sdpa``
(``F.scaled_dot_product_attention(is_causal=True)``: flash attention on a GPU).

``torch.compile`` compiles the model and its loss (forward, and the backward through
AOTAutograd), as nanoGPT does; the optimizer step runs eagerly (``fused=True`` AdamW on CUDA).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from gpt import GPTConfig
from torch import nn

PRECISIONS = {"float32": None, "mixed_bfloat16": torch.bfloat16, "mixed_float16": torch.float16}
ATTENTION = ("naive", "sdpa")


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig, attention: str):
        super().__init__()
        d = cfg.d_model
        self.n_head, self.attention = cfg.n_head, attention
        self.ln1 = nn.LayerNorm(d, eps=1e-5)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=1e-5)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.mlp_proj = nn.Linear(cfg.mlp_ratio * d, d)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_head
        q, k, v = (a.view(b, t, h, d // h).transpose(1, 2) for a in self.qkv(x).split(d, -1))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.float().masked_fill(~causal, float("-inf"))
            y = torch.softmax(scores, dim=-1).to(v.dtype) @ v
        return self.attn_proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.ln1(x))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Tokens ``[batch, time]`` (int64) -> f32 logits ``[batch, time, vocab]``."""

    def __init__(self, cfg: GPTConfig, attention: str = "sdpa"):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}.")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Parameter(torch.empty(cfg.block_size, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.head = None
        if not cfg.tie_embeddings:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init(cfg)

    def _init(self, cfg: GPTConfig) -> None:
        """The example's init: normal(0.02) matrices, residual projections scaled by
        1/sqrt(2 n_layer), position embeddings normal(0.01), zero biases, unit norms."""
        residual = 0.02 / math.sqrt(2 * cfg.n_layer)
        for name, p in self.named_parameters():
            if name == "wpe":
                nn.init.normal_(p, std=0.01)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=residual)
            elif p.ndim == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[-1]
        x = self.wte(tokens) + self.wpe[:t]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = x @ self.wte.weight.T if self.head is None else self.head(x)
        return logits.float()


class LossModel(nn.Module):
    """The model and its cross-entropy, the part ``torch.compile`` compiles."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """Multiplier of the peak LR at each step, as optax's ``warmup_cosine_decay_schedule``:
    linear from 0 over ``warmup_steps``, then cosine down to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class TrainStep:
    """One optimizer step of the example's recipe in PyTorch: ``step(x, y) -> loss``.

    Args:
      cfg: the model's shape.
      policy: ``"float32"``, ``"mixed_bfloat16"`` or ``"mixed_float16"`` (with ``GradScaler``).
      attention: ``"naive"`` or ``"sdpa"``.
      device: where to run (``"cuda"`` or ``"cpu"``).
      train: the example's ``TrainConfig`` (learning rate, schedule, betas, decay, clipping).
      compile: ``torch.compile`` the model and loss.
      seed: ``torch.manual_seed`` for the init.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        policy: str,
        attention: str,
        device: str,
        train: Any,
        compile: bool = True,
        seed: int = 0,
    ):
        if policy not in PRECISIONS:
            raise ValueError(f"policy must be one of {', '.join(PRECISIONS)}, got {policy!r}.")
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = GPT(cfg, attention).to(self.device)
        self.dtype = PRECISIONS[policy]
        loss_model = LossModel(self.model)
        self.loss_model = torch.compile(loss_model) if compile else loss_model
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": train.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=train.lr,
            betas=(train.beta1, train.beta2),
            fused=self.device.type == "cuda",
        )
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(train.warmup_steps, train.steps, train.min_lr_ratio)
        )
        self.grad_clip = train.grad_clip
        self.scaler = torch.amp.GradScaler(
            self.device.type, init_scale=2.0**15, enabled=self.dtype == torch.float16
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None):
            loss = self.loss_model(x, y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()
        return loss.detach()

    def synchronize(self) -> None:
        """Waits for the device, so a step's wall time is its real cost."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
