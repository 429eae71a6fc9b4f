"""Fused attention: ``jax.nn.dot_product_attention`` behind Flax's ``attention_fn`` signature.

Attention written as two einsums and a softmax materializes the ``T x T`` scores, in memory and
in time. :func:`dot_product_attention` computes the same function with cuDNN's fused flash
attention on CUDA GPUs and Pallas's flash attention on TPUs where they can, and with XLA's
composition elsewhere:

- **Chosen per platform when the function is lowered**, not when it is traced: the function
  holds all three (``lax.platform_dependent``), and compiling it for a CUDA GPU keeps cuDNN's
  kernels, forward and backward, compiling it for a TPU keeps Pallas's (Mosaic
  ``tpu_custom_call``s), and compiling it for a CPU keeps XLA's. So the same jitted step gets
  the right path on a GPU, on a TPU, on a CPU, and in a compile for a GPU or a TPU done on a
  machine without one (see :func:`mpjax.plan`). ``jax.nn.dot_product_attention``'s own
  default (``implementation=None``) is XLA's path everywhere.
- **cuDNN where it applies**: bfloat16 or float16 inputs, a head size of at most 128 and a
  multiple of 8, a bias only with even sequence lengths, and whatever else cuDNN's own checks
  refuse when the call is traced (without the CUDA plugin, ``pip install "mpjax[cuda12]"``,
  cuDNN is never chosen). Otherwise XLA's path runs on every platform. ``implementation``
  forces either.
- **Pallas where it applies** (``jax.experimental.pallas.ops.tpu.flash_attention``): bfloat16
  or float32 inputs (the default takes bfloat16 ones: float32 attention stays on XLA's path,
  whose matmuls run at the policy's float32 precision), as many key/value heads as query heads,
  sequence lengths that are multiples of 128 (its block size), a head size below 128 or a
  multiple of it, causal or no mask, and no bias (:func:`pallas_refusal`).
  ``implementation="pallas"`` forces it. XLA cannot partition its Mosaic kernels: in a step
  whose input shardings span several devices, they run under a ``jax.shard_map`` on each
  device's share, the batch split over the mesh axes that divide it and the heads over the
  rest, in the mesh's order (a data-parallel or FSDP step splits the batch only, as its
  activations are split already); a mesh axis that divides neither keeps XLA's path. Splash
  attention, which also takes grouped-query heads and arbitrary mask patterns, is built from
  NumPy masks for fixed lengths when it is traced; the flash kernel takes the shapes it is
  traced with, as this function does.
- **In the compute dtype**: under an mpjax policy (a wrapped Flax model, :func:`mpjax.autocast`)
  the query, key and value are cast to the compute dtype of the region the attention is called
  in *when it is traced*, so a model whose Dense layers return float32 still reaches cuDNN in
  bfloat16. Outside a policy they are brought to ``dtype``, else to their common dtype.

cuDNN computes the logits and the softmax in f32 internally, as XLA's path does for bfloat16
(f32 logits, f32 softmax). For float16, XLA's path computes the logits in float16 (the query
scaled first) and the softmax in f32, since XLA's CPU backend has no float16 x float16 ->
float32 matmul.

It takes the arguments Flax's attention layers pass to their ``attention_fn`` (linen's
``MultiHeadDotProductAttention``, NNX's ``MultiHeadAttention``), so a rule can route a model's
attention layers to it without touching the model::

    rules = mpjax.Rules(
        [(nn.MultiHeadDotProductAttention, None, {"attention_fn": mpjax.dot_product_attention})],
        default="mixed_bfloat16",
    )

Called outside a policy with bf16 inputs, the gradient of JAX's XLA path multiplies an f32
cotangent with the bf16 keys. JAX checks that mix against ``jax_numpy_dtype_promotion`` when it
*compiles*, so under ``"strict"`` promotion such a gradient must be compiled under
``"standard"`` promotion (JAX's default). Under an mpjax policy the casting engine runs those
matmuls in the compute dtype, and strict promotion compiles.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from mpjax import jax_compat as compat
from mpjax.casting.trace_context import traced_compute_dtype

__all__ = ["IMPLEMENTATIONS", "cudnn_refusal", "dot_product_attention", "pallas_refusal"]

IMPLEMENTATIONS = ("xla", "cudnn", "pallas", None)
"""The values of ``implementation``: XLA's composition, cuDNN's fused kernel, Pallas's TPU
flash attention, or cuDNN on CUDA GPUs and Pallas on TPUs where they apply and XLA elsewhere
(the default)."""

_CUDNN_DTYPES = frozenset(np.dtype(d) for d in (jnp.bfloat16, jnp.float16))
_CUDNN_MAX_HEAD = 128  # Hopper takes 256, but the target is not known when tracing
_PALLAS_DTYPES = frozenset(np.dtype(d) for d in (jnp.bfloat16, jnp.float32))
_F16 = np.dtype(jnp.float16)
_F32 = np.dtype(jnp.float32)
# cuDNN's own checks when it is traced: bad layouts, no cuDNN (no CUDA plugin), shapes its
# kernels do not cover.
_REFUSALS = (ValueError, NotImplementedError, RuntimeError, TypeError)


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
    implementation: Literal["xla", "cudnn", "pallas"] | None = None,
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
        inputs. Under an mpjax policy the region's compute dtype wins, as it does for every
        operation of a wrapped model.
      precision: must be None: the fused kernel has its own.
      module: the calling Flax module (unused: fused attention has no weights to sow).
      is_causal: mask out the future, without materializing a mask.
      implementation: None (the default): cuDNN's fused kernel when the function is
        compiled for a CUDA GPU and cuDNN takes these inputs (:func:`cudnn_refusal`), Pallas's
        flash attention when it is compiled for a TPU, the inputs are bfloat16 and Pallas takes
        them (:func:`pallas_refusal`), XLA's composition otherwise. ``"cudnn"`` forces cuDNN
        (which then fails to compile for a platform other than CUDA, or raises for inputs it
        refuses); ``"pallas"`` forces Pallas (which fails to compile for other platforms,
        unless traced under ``jax.experimental.pallas.tpu.force_tpu_interpret_mode()``, or
        raises for inputs it refuses); ``"xla"`` forces XLA.
      **flax_options: Flax's other ``attention_fn`` keywords. ``force_fp32_for_softmax`` and
        ``promote_dtype`` are accepted (the softmax runs in f32 anyway); custom einsums
        (``einsum_dot_general``, ``qk_attn_weights_einsum``, ``attn_weights_value_einsum``)
        are not, since the fused kernel replaces them.

    Returns:
      ``[batch, q_length, num_heads, head_dim]`` in ``dtype`` if given, else the inputs'
      common dtype. (Under a policy the attention runs in the compute dtype, and the engine
      casts its output as it does any operation's.)

    Raises:
      ValueError: for dropout in training mode, a ``precision``, a custom einsum, an unknown
        keyword or ``implementation``, or inputs whose rank is not 3 or 4.
      TypeError: for a query, key or value that is not an array.

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
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(
                f"dot_product_attention takes arrays for query, key and value; got {name}="
                f"{x!r} of type {type(x).__name__}."
            )
    if query.ndim not in (3, 4):
        raise ValueError(
            "dot_product_attention takes query, key and value of rank 4 "
            "([batch, length, heads, head_dim]) or 3 (no batch axis); got a query of shape "
            f"{query.shape}."
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            "dot_product_attention(implementation=...) must be None (cuDNN on CUDA GPUs and "
            "Pallas on TPUs where they apply, XLA elsewhere), 'cudnn', 'pallas' or 'xla'; got "
            f"{implementation!r}."
        )
    given = dtype if dtype is not None else _common_dtype(query, key, value)
    # Under a policy the engine casts every operation's inputs when it evaluates the traced
    # function; this one is traced in its compute dtype already, and hands back the dtype the
    # model's code expects while it is traced (a convert pair XLA folds away).
    compute = traced_compute_dtype()
    if compute is None:
        compute = given
    query, key, value = (jnp.asarray(x, compute) for x in (query, key, value))
    if bias is not None:
        bias = jnp.asarray(bias, compute)
    if mask is not None:
        mask = jnp.asarray(mask, jnp.bool_)
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = (x[None] for x in (query, key, value))
    # jax.nn's XLA path promotes bf16/f16 logits to f32 implicitly, which strict dtype
    # promotion forbids; the promotion is the intended one, whatever the caller's setting.
    with jax.numpy_dtype_promotion("standard"):
        cudnn = functools.partial(_cudnn, is_causal=is_causal)
        shares = _pallas_shares(query, key)
        pallas = functools.partial(
            _pallas,
            is_causal=is_causal,
            shares=None if isinstance(shares, str) else shares,
        )
        xla = functools.partial(_xla, is_causal=is_causal)
        operands = (query, key, value, bias, mask)
        if implementation == "cudnn":
            out = cudnn(*operands)
        elif implementation == "pallas":
            refusal = pallas_refusal(*operands, is_causal)
            if refusal is not None:
                raise ValueError(
                    f"dot_product_attention(implementation='pallas') cannot run: {refusal}. "
                    "Leave implementation=None for XLA's path where Pallas does not apply."
                )
            out = pallas(*operands)
        elif implementation == "xla":
            out = xla(*operands)
        else:
            fused = {}
            if cudnn_refusal(*operands, is_causal) is None:
                fused["cuda"] = cudnn
            # float32 attention keeps XLA's path, whose matmuls run at the policy's float32
            # precision (true float32 by default); Pallas's kernel multiplies as it chooses.
            if query.dtype == jnp.bfloat16 and pallas_refusal(*operands, is_causal) is None:
                fused["tpu"] = pallas
            if fused:
                out = lax.platform_dependent(*operands, default=xla, **fused)
            else:
                out = xla(*operands)
    out = out.astype(given)
    return out[0] if unbatched else out


def cudnn_refusal(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    is_causal: bool = False,
) -> str | None:
    """Why cuDNN's fused attention would not take these inputs, or None if it would.

    Takes arrays or ``jax.ShapeDtypeStruct`` values of rank 4, already in the dtype to compute
    in. Checks the dtype (bfloat16 or float16), the head size (at most 128, a multiple of 8),
    a bias's sequence lengths (even, for its gradient), then traces cuDNN's own call, whose
    checks cover the rest (layouts, masks, and whether cuDNN is installed at all).

    >>> import jax, jax.numpy as jnp
    >>> cudnn_refusal(*[jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.float32)] * 3)
    'cuDNN runs attention in bfloat16 or float16, not float32'
    """
    dtype = np.dtype(query.dtype)
    if dtype not in _CUDNN_DTYPES:
        return f"cuDNN runs attention in bfloat16 or float16, not {dtype.name}"
    head = query.shape[-1]
    if head > _CUDNN_MAX_HEAD or head % 8:
        return f"cuDNN takes head sizes of at most {_CUDNN_MAX_HEAD}, multiples of 8; got {head}"
    if bias is not None and (query.shape[1] % 2 or key.shape[1] % 2):
        return "cuDNN's bias gradient needs even sequence lengths"
    try:
        with jax.numpy_dtype_promotion("standard"):
            jax.eval_shape(
                functools.partial(_cudnn, is_causal=is_causal), query, key, value, bias, mask
            )
    except _REFUSALS as error:
        return f"cuDNN refused: {error}"
    return None


def pallas_refusal(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    is_causal: bool = False,
) -> str | None:
    """Why Pallas's TPU flash attention would not take these inputs, or None if it would.

    Takes arrays or ``jax.ShapeDtypeStruct`` values of rank 4, already in the dtype to compute
    in. Checks the dtype (bfloat16 or float32), the heads (as many for the key and value as for
    the query), the sequence lengths (multiples of the kernel's block size, 128), the head
    size (below 128 or a multiple of it), that there is no mask (causal attention is
    ``is_causal``) and no bias, and, for a query traced over several devices, that each mesh
    axis the step is partitioned over splits the batch or the heads (the kernels then run on
    each device's share, under a ``shard_map``); then traces the kernels on one device's share,
    forward and backward, whose own checks cover the rest.

    >>> import jax, jax.numpy as jnp
    >>> pallas_refusal(*[jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)] * 3)
    'Pallas takes sequence lengths that are multiples of 128; got 200 and 200'
    """
    dtype = np.dtype(query.dtype)
    if dtype not in _PALLAS_DTYPES:
        return f"Pallas runs attention in bfloat16 or float32, not {dtype.name}"
    if mask is not None:
        return "Pallas takes no boolean mask (only is_causal)"
    if bias is not None:
        return "Pallas takes no bias"
    if key.shape[2] != query.shape[2]:
        return (
            "Pallas takes as many key/value heads as query heads; got "
            f"{key.shape[2]} and {query.shape[2]}"
        )
    t, s, head = query.shape[1], key.shape[1], query.shape[-1]
    block = compat.PALLAS_BLOCK
    if t % block or s % block:
        return f"Pallas takes sequence lengths that are multiples of {block}; got {t} and {s}"
    if head > block and head % block:
        return f"Pallas takes head sizes below {block} or multiples of it; got {head}"
    shares = _pallas_shares(query, key)
    if isinstance(shares, str):
        return shares
    local = [jax.ShapeDtypeStruct(shares.local(x.shape), x.dtype) for x in (query, key, value)]
    kernel = functools.partial(_pallas, bias=None, mask=None, is_causal=is_causal, shares=None)
    try:
        jax.eval_shape(lambda q, k, v: jax.vjp(kernel, q, k, v), *local)
    except _REFUSALS as error:
        return f"Pallas refused: {error}"
    return None


class _Shares(NamedTuple):
    """How a sharded step's attention is split for Pallas's kernels: the mesh axes (of the
    traced mesh) the batch is split over, and those the heads are split over; each device runs
    the kernels on its share."""

    mesh: Any
    batch: tuple[str, ...]
    heads: tuple[str, ...]

    def spec(self) -> P:
        """The ``shard_map`` spec of a ``[batch, length, heads, head_dim]`` operand."""
        return P(self.batch or None, None, self.heads or None, None)

    def local(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """One device's share of a ``[batch, length, heads, head_dim]`` shape."""
        sizes = dict(self.mesh.shape) if self.mesh is not None else {}
        b = int(np.prod([sizes[a] for a in self.batch], dtype=int))
        h = int(np.prod([sizes[a] for a in self.heads], dtype=int))
        return (shape[0] // b, shape[1], shape[2] // h, *shape[3:])


def _pallas_shares(query: Any, key: Any) -> _Shares | str:
    """How Pallas's kernels split attention traced over several devices, or why they cannot.

    XLA cannot partition a Mosaic kernel: in a sharded step, the kernels run under a
    ``shard_map`` on each device's share of the batch and of the heads, as MaxText runs them.
    Each mesh axis XLA partitions the step over (:func:`mpjax.jax_compat.partitioned_axes`), in
    the mesh's order, splits the batch if it divides what is left of it, else the heads if it
    divides what is left of them; an axis that divides neither would have each of its devices
    compute the same attention, and is a refusal. A query traced on one device needs no split.
    """
    axes = compat.partitioned_axes(query)
    batch, heads = [], []
    left_batch, left_heads = query.shape[0], query.shape[2]
    for name, size in axes.items():
        if left_batch % size == 0:
            batch.append(name)
            left_batch //= size
        elif left_heads % size == 0 and key.shape[2] == query.shape[2]:
            heads.append(name)
            left_heads //= size
        else:
            return (
                "Pallas's kernels run on each device's share of the batch and heads (XLA cannot "
                f"partition them), and mesh axis {name!r} of {size} devices divides neither the "
                f"batch's {left_batch} sequences nor the {left_heads} heads left to split"
            )
    return _Shares(compat.traced_mesh(query) if axes else None, tuple(batch), tuple(heads))


def _cudnn(query, key, value, bias, mask, *, is_causal):
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, is_causal=is_causal, implementation="cudnn"
    )


def _pallas(query, key, value, bias, mask, *, is_causal, shares):
    """Pallas's flash attention on ``[batch, length, heads, head_dim]`` operands; under a
    ``shard_map`` on each device's share where ``shares`` splits them (:func:`_pallas_shares`).
    """
    del bias, mask  # None: pallas_refusal refuses them
    scale = 1.0 / float(np.sqrt(query.shape[-1]))

    def kernel(query, key, value):
        heads_first = [jnp.swapaxes(x, 1, 2) for x in (query, key, value)]
        out = compat.pallas_flash_attention(*heads_first, is_causal=is_causal, scale=scale)
        return jnp.swapaxes(out, 1, 2)

    if shares is None or shares.mesh is None:
        return kernel(query, key, value)
    spec = shares.spec()
    # Inside a shard_map already, the axes it made manual stay so: this one takes the rest.
    manual = {"axis_names": {*shares.batch, *shares.heads}} if compat.manual_axes(query) else {}
    # The kernels declare no varying mesh axes, so the per-device check is off.
    return jax.shard_map(
        kernel, mesh=shares.mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False, **manual
    )(query, key, value)


def _xla(query, key, value, bias, mask, *, is_causal):
    """XLA's composition, rematerialized in the backward pass.

    Differentiated as written, the composition keeps its ``T x T`` intermediates for the
    backward pass: the masked f32 logits, the f32 softmax and, for bfloat16, the bfloat16
    probabilities as well, about 10 bytes per score, more than float32's 8. Recomputing them
    from the query and key (which the backward pass keeps anyway) keeps none: one more logits
    matmul backward, and the step's memory no longer grows with ``layers x T x T``.
    """
    return jax.checkpoint(
        functools.partial(_xla_composition, is_causal=is_causal),
        policy=jax.checkpoint_policies.nothing_saveable,
    )(query, key, value, bias, mask)


def _xla_composition(query, key, value, bias, mask, *, is_causal):
    if np.dtype(query.dtype) == _F16:
        return _xla_float16(query, key, value, bias, mask, is_causal)
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, is_causal=is_causal, implementation="xla"
    )


def _xla_float16(query, key, value, bias, mask, is_causal):
    """XLA's composition for float16: float16 logits of the scaled query, an f32 softmax.

    ``jax.nn``'s asks for float16 x float16 -> float32 logits, which XLA's CPU backend cannot
    compile; scaling the query first keeps the float16 logits in range.
    """
    b, t, n, h = query.shape
    s, kv_heads = key.shape[1], key.shape[2]
    groups = n // kv_heads
    query = query * jnp.asarray(1.0 / np.sqrt(h), query.dtype)
    grouped = query.reshape(b, t, kv_heads, groups, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", grouped, key).astype(_F32).reshape(b, n, t, s)
    if bias is not None:
        logits = logits + bias.astype(_F32)
    if is_causal:
        causal = jnp.tril(jnp.ones((t, s), jnp.bool_))  # top-left aligned, as jax.nn's
        mask = causal if mask is None else mask & causal
    if mask is not None:
        # Large and finite, as jax.nn's: a fully masked row averages the values, never NaN.
        logits = jnp.where(mask, logits, -0.7 * float(np.finfo(np.float32).max))
    probs = jax.nn.softmax(logits, axis=-1).astype(query.dtype)
    grouped_probs = probs.reshape(b, kv_heads, groups, t, s)
    return jnp.einsum("bkgts,bskh->btkgh", grouped_probs, value).reshape(b, t, n, h)


def _common_dtype(*arrays: jax.Array) -> Any:
    """The inputs' dtype when they agree; else the widest, float32 between bf16 and f16."""
    dtypes = {jnp.dtype(x.dtype) for x in arrays}
    if len(dtypes) == 1:
        return dtypes.pop()
    return jnp.dtype(f"float{max(32, *(jnp.finfo(d).bits for d in dtypes))}")
