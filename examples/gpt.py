"""A decoder-only transformer (GPT-2 shape) written with Flax linen, for byte-level modelling.

Token + learned position embeddings, pre-norm blocks of causal self-attention and a GELU MLP,
a final LayerNorm and an output head tied to the token embedding (or untied, by config).

Two choices change how the model runs, not what it computes:

- ``attention``: ``"fused"`` (default) calls :func:`mpjax.dot_product_attention`, which is
  ``jax.nn.dot_product_attention`` (cuDNN's flash attention on a GPU for bf16/f16, XLA
  otherwise) and never materializes the ``T x T`` scores in memory on a GPU; ``"naive"`` writes
  attention out as two einsums and an f32 softmax.
- ``scan_layers``/``remat``: the blocks run in a Python loop (one copy of the block per layer
  in the compiled program) or under ``nn.scan`` (one copy, params stacked on a leading layer
  axis: ``h/attn/qkv/kernel`` is ``[n_layer, d, 3d]``), which is what keeps the compile time
  of deep models short; each block may be rematerialized (``nn.remat``) in the backward pass
  to save activation memory.

With ``n_experts`` the MLP of every block is a mixture of experts instead (:class:`MoE`): a
router picks ``top_k`` of ``n_experts`` expert MLPs for each token, the tokens are sorted by
expert and each expert's GEMMs run on its own tokens only, as one ``lax.ragged_dot`` (a
grouped GEMM); an optional shared expert sees every token.

The model takes Flax's usual ``dtype`` (compute) and ``param_dtype`` (storage) fields and
passes them to every layer. Left at their defaults (``None`` / float32) the model is plain
f32 Flax: that is what a policy-aware wrapper receives. Setting them by hand
(``GPT(config, dtype=jnp.bfloat16)``) is the honest hand-written mixed-precision baseline.
Whatever the compute dtype, LayerNorm statistics and the attention softmax run in f32, and the model returns f32 logits, so the loss is computed in f32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

import mpjax

ATTENTION = ("fused", "naive")
# What a rematerialized block keeps from its forward pass; the rest is recomputed backward.
REMAT_POLICIES = {
    "none": None,  # no remat: everything the backward pass needs is kept
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only the block's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model, and how it runs.

    Attributes:
      vocab_size: number of token ids; 256 for bytes.
      block_size: maximum sequence length (number of learned positions).
      n_layer: number of transformer blocks.
      n_head: attention heads per block; must divide ``d_model``.
      d_model: width of the residual stream.
      mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
      tie_embeddings: use the token embedding matrix as the output head (GPT-2 does).
      attention: ``"fused"`` (:func:`mpjax.dot_product_attention`) or ``"naive"`` (einsums and
        a softmax); the same function either way.
      scan_layers: run the blocks under ``nn.scan`` (params stacked on a leading layer axis)
        instead of a Python loop.
      remat: rematerialize each block in the backward pass: ``"none"``, ``"full"`` (keep only
        the block's input) or ``"dots"`` (keep the weight matmuls' outputs).
      block_input_sharding: where each block's input ``[batch, time, d_model]`` is placed on
        a mesh (a ``jax.sharding.NamedSharding``; see ``examples/sharding.py``), or None to
        leave it to XLA.
      n_experts: experts in the mixture that replaces each block's MLP; 0 keeps the MLP.
      top_k: experts each token goes to.
      expert_ratio: hidden width of each expert as a multiple of ``d_model`` (``mlp_ratio``
        if None).
      shared_expert: add an MLP that every token goes through (DeepSeek's shared expert).
      balance_weight: weight of the router's load-balancing loss (Switch Transformer's).
      z_weight: weight of the router's z-loss (the squared log-sum-exp of its logits).
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    attention: str = "fused"
    scan_layers: bool = False
    remat: str = "none"
    block_input_sharding: Any = None
    n_experts: int = 0
    top_k: int = 2
    expert_ratio: int | None = None
    shared_expert: bool = False
    balance_weight: float = 0.01
    z_weight: float = 1e-3

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}.")
        if self.attention not in ATTENTION:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}."
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}."
            )
        if self.n_experts < 0:
            raise ValueError(f"n_experts must be 0 (no experts) or more, got {self.n_experts}.")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"top_k must be between 1 and n_experts={self.n_experts}, got {self.top_k}."
            )

    def expert_width(self) -> int:
        """Hidden width of each expert."""
        return (self.expert_ratio or self.mlp_ratio) * self.d_model

    def _block_params(self, experts: int) -> int:
        """The params of one block, with the MLP's or ``experts`` experts' (router included)."""
        d, f = self.d_model, self.mlp_ratio * self.d_model
        mlp = d * f + f + f * d + d
        per_block = (
            2 * 2 * d  # two LayerNorms (scale, bias)
            + d * 3 * d
            + 3 * d  # qkv projection
            + d * d
            + d  # attention output projection
        )
        if not self.n_experts:
            return per_block + mlp
        shared = mlp if self.shared_expert else 0
        return per_block + d * self.n_experts + experts * 2 * d * self.expert_width() + shared

    def num_params(self) -> int:
        """Parameter count, position embeddings included (nanoGPT leaves them out), every
        expert's included."""
        d = self.d_model
        head = 0 if self.tie_embeddings else d * self.vocab_size
        blocks = self.n_layer * self._block_params(self.n_experts)
        return self.vocab_size * d + self.block_size * d + blocks + 2 * d + head

    def active_params(self) -> int:
        """The params a token's computation uses: :meth:`num_params` with ``top_k`` experts
        per block instead of all of them."""
        idle = self.n_layer * (self._block_params(self.n_experts) - self._block_params(self.top_k))
        return self.num_params() - (idle if self.n_experts else 0)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token, the PaLM/nanoGPT estimate.

        ``6 * N`` for the weight matmuls (2 forward, 4 backward, per parameter) plus
        ``12 * n_layer * d_model * T`` for the attention score and value matmuls, where ``N``
        leaves out the position embedding (a lookup, not a matmul) and ``T`` is the sequence
        length. A tied token embedding counts once: its lookup is free and its use as the
        output head is a matmul. With experts, ``N`` counts those a token goes to
        (:meth:`active_params`).
        """
        t = self.block_size if seq_len is None else seq_len
        n = self.active_params() - self.block_size * self.d_model
        return 6 * n + 12 * self.n_layer * self.d_model * t

    def expert_flops_per_token(self) -> int:
        """Training FLOPs per token of the experts' GEMMs (the grouped GEMMs): each token's
        ``top_k`` experts, two GEMMs each, forward and backward (``6`` per weight); 0 without
        experts."""
        if not self.n_experts:
            return 0
        return self.n_layer * 6 * self.top_k * 2 * self.d_model * self.expert_width()


# Presets. `tiny` trains on two CPU cores in a few minutes. `small` and `medium` have GPT-2
# small/medium widths and head counts, made deeper (18 and 28 layers instead of 12 and 24) so
# that, with a 256-byte vocabulary instead of GPT-2's 50257 tokens, they keep GPT-2's sizes:
# about 125M and 350M parameters.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=128, n_layer=4, n_head=4, d_model=128),
    "small": GPTConfig(block_size=1024, n_layer=18, n_head=12, d_model=768),
    "medium": GPTConfig(block_size=1024, n_layer=28, n_head=16, d_model=1024),
    # About a billion parameters (1.21B): for planning a run on a pod (docs/pods.md), run
    # with --scan-layers to keep its compile short.
    "1b": GPTConfig(block_size=1024, n_layer=24, n_head=16, d_model=2048),
    # A mixture of experts at `small`'s width: 12 blocks of 8 experts, 2 per token (482M params,
    # 143M active per token), for plans of MoE steps (docs/moe.md).
    "small-moe": GPTConfig(
        block_size=1024, n_layer=12, n_head=12, d_model=768, n_experts=8, top_k=2
    ),
}


def _normal(std: float) -> nn.initializers.Initializer:
    return nn.initializers.normal(stddev=std)


class LayerNorm(nn.Module):
    """LayerNorm whose statistics and affine transform run in f32; returns the compute dtype.

    Flax's ``nn.LayerNorm`` also computes statistics in f32, but it calls
    ``jnp.promote_types(bfloat16, float32)``, which ``jax_numpy_dtype_promotion="strict"``
    rejects; this one casts explicitly and so runs under strict promotion.
    """

    dtype: Any = None
    param_dtype: Any = jnp.float32
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        # dtype=None follows the input, like Flax layers do.
        return y.astype(x.dtype if self.dtype is None else self.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the softmax runs in f32 whatever the compute dtype
    (cuDNN's fused kernel computes it in f32 too)."""

    config: GPTConfig
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        b, t, d = x.shape
        h = cfg.n_head
        qkv = nn.Dense(
            3 * d,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_normal(0.02),
            name="qkv",
        )(x)
        q, k, v = (a.reshape(b, t, h, d // h) for a in jnp.split(qkv, 3, axis=-1))
        if cfg.attention == "fused":
            y = mpjax.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
        else:
            # Scores in the compute dtype (the matmul), softmax in f32: exp of bf16/f16 scores
            # loses the small probabilities and f16 overflows on large logits (PyTorch autocast
            # does the same).
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
            causal = jnp.tril(jnp.ones((t, t), dtype=bool))
            scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
            y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        # GPT-2 scales the init of projections into the residual stream by 1/sqrt(2 * n_layer).
        return nn.Dense(
            d,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_normal(0.02 / math.sqrt(2 * cfg.n_layer)),
            name="proj",
        )(y)


class MLP(nn.Module):
    """Position-wise feed-forward network with a GELU (tanh approximation, as GPT-2)."""

    config: GPTConfig
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = nn.Dense(
            cfg.mlp_ratio * cfg.d_model,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_normal(0.02),
            name="fc",
        )(x)
        x = nn.gelu(x)
        return nn.Dense(
            cfg.d_model,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_normal(0.02 / math.sqrt(2 * cfg.n_layer)),
            name="proj",
        )(x)


class MoE(nn.Module):
    """A top-k mixture of experts in place of the MLP, dropless: every token goes to its
    ``top_k`` experts.

    The router (``router``, a Dense without bias) scores the experts; each token goes to the
    ``top_k`` most probable, weighted by their probabilities renormalized over those chosen.
    The token-expert pairs are sorted by expert (``argsort``), so each expert's tokens are
    consecutive rows, and the experts' two GEMMs (``w_in [E, d, f]``, ``w_out [E, f, d]``) are
    one ``lax.ragged_dot`` each: a grouped GEMM over the groups of rows. The results go back
    to token order (a scatter) and are summed with the router's weights. The router's
    load-balancing and z-losses are sown in the ``"losses"`` collection, weighted.

    The router computes in float32 whatever the model's ``dtype``, as MoE models do (a policy
    does the same by its built-in router rule).
    """

    config: GPTConfig
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        b, t, d = x.shape
        e, k, f = cfg.n_experts, cfg.top_k, cfg.expert_width()
        tokens = x.reshape(b * t, d)
        logits = nn.Dense(
            e,
            use_bias=False,
            dtype=None if self.dtype is None else jnp.float32,
            param_dtype=self.param_dtype,
            kernel_init=_normal(0.02),
            name="router",
        )(tokens.astype(jnp.float32) if self.dtype is not None else tokens)
        logits = logits.astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, chosen = lax.top_k(probs, k)  # [tokens, k]
        weights = weights / weights.sum(-1, keepdims=True)
        flat = chosen.reshape(-1)
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        # Switch Transformer's balance: E * sum over experts of (share of the assignments) x
        # (mean probability); 1 when both are uniform. The z-loss keeps the logits small.
        balance = e * jnp.sum(sizes.astype(jnp.float32) / flat.size * probs.mean(0))
        z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        self.sow("losses", "routing", cfg.balance_weight * balance + cfg.z_weight * z)
        # Dispatch: each expert's tokens consecutive, in one grouped GEMM per expert matrix.
        order = jnp.argsort(flat, stable=True)
        rows = tokens[order // k]
        w_in = self.param("w_in", _normal(0.02), (e, d, f), self.param_dtype)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        w_out = self.param("w_out", _normal(out_std), (e, f, d), self.param_dtype)
        dtype = rows.dtype if self.dtype is None else self.dtype
        h = nn.gelu(lax.ragged_dot(rows.astype(dtype), w_in.astype(dtype), sizes))
        out = lax.ragged_dot(h, w_out.astype(dtype), sizes)
        # Combine: back to token order, each token's experts weighted by the router.
        unsorted = jnp.zeros_like(out).at[order].set(out).reshape(b * t, k, d)
        y = jnp.sum(unsorted * weights.astype(out.dtype)[..., None], axis=1)
        if cfg.shared_expert:
            y = y + MLP(cfg, dtype=self.dtype, param_dtype=self.param_dtype, name="shared")(tokens)
        return y.reshape(b, t, d)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (or the experts')."""

    config: GPTConfig
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        if self.config.block_input_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, self.config.block_input_sharding)
        x = x + CausalSelfAttention(self.config, name="attn", **kw)(LayerNorm(name="ln1", **kw)(x))
        mlp = MoE(self.config, name="moe", **kw) if self.config.n_experts else None
        mlp = mlp or MLP(self.config, name="mlp", **kw)
        return x + mlp(LayerNorm(name="ln2", **kw)(x))


class Embed(nn.Module):
    """A lookup table (``embedding``, ``[num_embeddings, features]``) that casts only the rows
    it reads.

    Flax's ``nn.Embed(dtype=bf16)`` casts the whole table before its gather, so the gradient
    of the table is a scatter-add in bf16: slow (it was the most expensive kernel of a bf16
    GPT-2 step on a GPU) and lossy. Reading the rows from the table in its param dtype and
    casting them makes the backward scatter-add accumulate in f32, as mpjax's policies do.
    """

    num_embeddings: int
    features: int
    embedding_init: nn.initializers.Initializer
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding", self.embedding_init, (self.num_embeddings, self.features), self.param_dtype
        )

    def _cast(self, rows: jax.Array) -> jax.Array:
        return rows if self.dtype is None else rows.astype(self.dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Rows ``ids`` of the table: ``[..., features]``."""
        return self._cast(jnp.take(self.embedding, ids, axis=0))

    def first(self, n: int) -> jax.Array:
        """The first ``n`` rows, as a slice (its gradient is a pad, not a scatter-add)."""
        return self._cast(self.embedding[:n])

    def attend(self, x: jax.Array) -> jax.Array:
        """``x @ embedding.T``: the tied output head, a matmul in the compute dtype."""
        dtype = x.dtype if self.dtype is None else self.dtype
        return jnp.einsum("...d,vd->...v", x.astype(dtype), self.embedding.astype(dtype))


class GPT(nn.Module):
    """Decoder-only transformer: int tokens ``[batch, time]`` -> f32 logits ``[batch, time, vocab]``.

    >>> import jax, jax.numpy as jnp
    >>> model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, d_model=16))
    >>> tokens = jnp.zeros((2, 8), jnp.int32)
    >>> params = model.init(jax.random.key(0), tokens)["params"]
    >>> model.apply({"params": params}, tokens).shape
    (2, 8, 256)
    """

    config: GPTConfig
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        t = tokens.shape[-1]
        if t > cfg.block_size:
            raise ValueError(f"Sequence length {t} exceeds block_size={cfg.block_size}.")
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        wte = Embed(cfg.vocab_size, cfg.d_model, _normal(0.02), name="wte", **kw)
        wpe = Embed(cfg.block_size, cfg.d_model, _normal(0.01), name="wpe", **kw)
        x = wte(tokens) + wpe.first(t)
        x = self._blocks(x)
        x = LayerNorm(name="ln_f", **kw)(x)
        if cfg.tie_embeddings:
            logits = wte.attend(x)
        else:
            logits = nn.Dense(
                cfg.vocab_size, use_bias=False, kernel_init=_normal(0.02), name="head", **kw
            )(x)
        # The cross-entropy's log-sum-exp over the vocabulary needs f32.
        return logits.astype(jnp.float32)

    def _blocks(self, x: jax.Array) -> jax.Array:
        """The ``n_layer`` blocks: ``h0`` ... in a loop, or one ``h`` scanned over layers."""
        cfg = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        block: Any = Block
        if cfg.remat != "none":
            # Under scan, the loop already keeps XLA from merging the recomputation into the
            # forward pass, so prevent_cse (extra barriers) is only needed in the Python loop.
            block = nn.remat(
                Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers
            )
        if not cfg.scan_layers:
            for i in range(cfg.n_layer):
                x = block(cfg, name=f"h{i}", **kw)(x)
            return x
        stack = nn.scan(
            lambda module, carry, _: (module(carry), None),
            variable_axes={"params": 0, "losses": 0},
            split_rngs={"params": True},
            length=cfg.n_layer,
        )
        x, _ = stack(block(cfg, name="h", **kw), x, None)
        return x
