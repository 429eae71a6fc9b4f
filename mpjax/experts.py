"""Mixture-of-experts operations for code that calls them directly.

A mixture-of-experts layer sends each token to a few of its experts: sorted by expert, the
tokens meet their experts' weights in one grouped GEMM, ``lax.ragged_dot``. Under a policy (a
wrapped Flax or Equinox model, :func:`mpjax.autocast`), every ``lax.ragged_dot`` of the model
already runs grouped: the casting engine binds it as :func:`mpjax.grouped.matmul.grouped_dot`,
in the region's compute dtype, its gradients grouped too, with JAX's GPU kernels where a GPU
has them. :func:`ragged_dot` is the same for code outside any policy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax.casting.trace_context import tracing
from mpjax.grouped.matmul import check_operands, grouped_dot

__all__ = ["ragged_dot"]


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``lax.ragged_dot`` that stays grouped: the forward GEMM and both gradients' are grouped
    GEMMs (on an H100 and a B200, JAX's Mosaic GPU kernels; on a TPU, XLA's own), where XLA
    turns ``lax.ragged_dot`` into dense GEMMs over every expert on GPUs (G times the FLOPs),
    its gradients in float32 when ``preferred_element_type`` is.

    Inside a policy (a wrapped model, :func:`mpjax.autocast`) it is ``lax.ragged_dot``, which
    the policy runs grouped in its region's compute dtype, the weights' gradient in the reduce
    dtype. Outside one, it multiplies in the operands' common dtype and accumulates in float32.

    Args:
      lhs: ``[M, K]``, the tokens sorted by expert (M token-expert pairs).
      rhs: ``[G, K, N]``, the weights of the G experts.
      group_sizes: ``[G]`` integers, how many consecutive rows of ``lhs`` each expert takes.
        Rows past their sum come out zero.
      precision: how float32 operands are multiplied, as ``lax.ragged_dot``'s (inside a
        policy, the policy's ``f32_matmul_precision`` where this is None).
      preferred_element_type: the result's dtype, by default the operands' common dtype. On a
        GPU the kernels write their operands' dtype: a wider result is theirs widened (one
        rounding to the operands' dtype), not a wider accumulator's.

    Returns:
      ``[M, N]``.

    Raises:
      TypeError: ``group_sizes`` are not integers.
      ValueError: the shapes do not fit (``lhs`` not ``[M, K]``, ``rhs`` not ``[G, K, N]``, one
        group size per expert), or group sizes known when called are negative or sum past M.

    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((4, 2), jnp.bfloat16), jnp.ones((2, 2, 3), jnp.bfloat16)
    >>> y = ragged_dot(x, w, jnp.array([1, 3]))
    >>> y.shape, y.dtype
    ((4, 3), dtype(bfloat16))
    """
    check_operands(lhs, rhs, group_sizes, "mpjax.ragged_dot()")
    if tracing():  # the engine binds it grouped, in its region's dtypes
        return lax.ragged_dot(
            lhs,
            rhs,
            group_sizes,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
    compute = np.dtype(jnp.result_type(lhs, rhs))
    out = grouped_dot(lhs, rhs, group_sizes, compute=compute, precision=precision)
    return out if preferred_element_type is None else out.astype(preferred_element_type)
