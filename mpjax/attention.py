"""Fused attention: ``jax.nn.dot_product_attention`` behind Flax's ``attention_fn`` signature.

Attention written as two einsums and a softmax materializes the ``T x T`` scores, in memory and
in time. :func:`dot_product_attention` computes the same function through
``jax.nn.dot_product_attention``, which runs cuDNN's fused flash attention on a GPU when the
dtypes (bf16/f16), head size and masks allow, and XLA's composition otherwise (on CPU, for
example). cuDNN computes the softmax in f32 internally, as mpjax's policies do.

It takes the arguments Flax's attention layers pass to their ``attention_fn`` (linen's
``MultiHeadDotProductAttention``, NNX's ``MultiHeadAttention``), so a rule can route a model's
attention layers to it without touching the model::

    rules = mpjax.Rules(
        [(nn.MultiHeadDotProductAttention, None, {"attention_fn": mpjax.dot_product_attention})],
        default="mixed_bfloat16",
    )

Under a policy it runs in the region's compute dtype like any other code; outside one, the
query, key and value are brought to their common dtype.

Called outside a policy with bf16/f16 inputs, the gradient of JAX's XLA path (the CPU's, or a
GPU's when cuDNN cannot take the shapes) multiplies an f32 cotangent with the bf16/f16 keys.
JAX checks that mix against ``jax_numpy_dtype_promotion`` when it *compiles*, so under
``"strict"`` promotion such a gradient must be compiled under ``"standard"`` promotion (JAX's
default). Under an mpjax policy the casting engine runs those matmuls in the compute dtype,
and strict promotion compiles.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

__all__ = ["dot_product_attention"]


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    *,
    is_causal: bool = False,
    implementation: Literal["xla", "cudnn"] | None = None,
    **flax_options: Any,
) -> jax.Array:
    """Multi-head attention through ``jax.nn.dot_product_attention``, with the signature of
    Flax's ``attention_fn``.

    Args:
      query: ``[batch, q_length, num_heads, head_dim]`` (or without the batch axis).
      key: ``[batch, kv_length, num_kv_heads, head_dim]``; ``num_heads`` must be a multiple of
        ``num_kv_heads`` (grouped-query attention).
      value: shaped like ``key``.
      bias: added to the attention logits, broadcastable to
        ``[batch, num_heads, q_length, kv_length]``.
      mask: boolean, True where a query may attend, broadcastable like ``bias`` (Flax's
        ``make_causal_mask``/``make_attention_mask`` make such masks).
      broadcast_dropout, dropout_rng: accepted for Flax's signature; unused without dropout.
      dropout_rate: must be 0 unless ``deterministic``: fused attention has no dropout.
      deterministic: as in Flax.
      dtype: the dtype to compute in, as Flax's ``dtype``; None for the common dtype of the
        inputs (under an mpjax policy, the region's compute dtype).
      precision: must be None: the fused kernel has its own.
      module: the calling Flax module (unused: fused attention has no weights to sow).
      is_causal: mask out the future, without materializing a mask.
      implementation: ``"xla"``, ``"cudnn"`` or None (cuDNN when supported, else XLA), as for
        ``jax.nn.dot_product_attention``.
      **flax_options: Flax's other ``attention_fn`` keywords. ``force_fp32_for_softmax`` and
        ``promote_dtype`` are accepted (the softmax runs in f32 anyway); custom einsums
        (``einsum_dot_general``, ``qk_attn_weights_einsum``, ``attn_weights_value_einsum``)
        are not, since the fused kernel replaces them.

    Returns:
      ``[batch, q_length, num_heads, head_dim]`` in the compute dtype.

    Raises:
      ValueError: for dropout in training mode, a ``precision``, a custom einsum, an unknown
        keyword, or inputs whose rank is not 3 or 4.

    >>> q = k = v = jnp.ones((2, 5, 4, 8), jnp.bfloat16)
    >>> dot_product_attention(q, k, v, is_causal=True).dtype
    dtype(bfloat16)
    """
    del broadcast_dropout, dropout_rng, module
    for name, given in flax_options.items():
        if name in ("force_fp32_for_softmax", "promote_dtype"):
            continue
        if name in ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"):
            if given is None:
                continue
            raise ValueError(
                f"dot_product_attention got `{name}`: the fused kernel computes both einsums "
                "itself. Use Flax's own attention for custom einsums."
            )
        raise ValueError(f"dot_product_attention got an unknown keyword `{name}`.")
    if dropout_rate and not deterministic:
        raise ValueError(
            f"dot_product_attention has no dropout, got dropout_rate={dropout_rate} with "
            "deterministic=False: set the layer's dropout rate to 0 (or deterministic=True), "
            "or keep Flax's attention for layers that drop attention weights."
        )
    if precision is not None:
        raise ValueError(
            f"dot_product_attention takes no `precision` (got {precision!r}): the fused kernel "
            "sets its own."
        )
    if query.ndim not in (3, 4):
        raise ValueError(
            "dot_product_attention takes query, key and value of rank 4 "
            "([batch, length, heads, head_dim]) or 3 (no batch axis); got a query of shape "
            f"{query.shape}."
        )
    compute = dtype if dtype is not None else _common_dtype(query, key, value)
    query, key, value = (jnp.asarray(x, compute) for x in (query, key, value))
    if bias is not None:
        bias = jnp.asarray(bias, compute)
    if mask is not None:
        mask = jnp.asarray(mask, jnp.bool_)
    # jax.nn's XLA path promotes bf16/f16 logits to f32 implicitly, which strict dtype
    # promotion forbids; the promotion is the intended one, whatever the caller's setting.
    with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, is_causal=is_causal, implementation=implementation
        )


def _common_dtype(*arrays: jax.Array) -> Any:
    """The inputs' dtype when they agree; else the widest, float32 between bf16 and f16."""
    dtypes = {jnp.dtype(x.dtype) for x in arrays}
    if len(dtypes) == 1:
        return dtypes.pop()
    return jnp.dtype(f"float{max(32, *(jnp.finfo(d).bits for d in dtypes))}")
