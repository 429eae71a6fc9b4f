"""Collectives in a policy's dtypes, for the code that writes its own (``jax.shard_map``).

Under ``jax.jit`` with shardings, XLA places the collectives of data parallelism and FSDP
itself, and the casting engine decides their dtypes (``Policy.reduce_dtype``). Code
that writes the collectives by hand, in ``jax.shard_map``, calls these instead of
``lax.all_gather`` and ``lax.psum``, as PyTorch FSDP2 applies its ``MixedPrecisionPolicy``:

- :func:`all_gather_params` casts each param to the compute dtype *before* gathering it (half
  the bytes of float32 in bfloat16); its gradient is reduce-scattered in the reduce dtype and
  arrives in the param's dtype.
- :func:`psum_gradients` sums gradients over devices in the reduce dtype and returns them in
  their own dtypes.

Leaves that are not floating, or narrower than the dtype they would be cast to, are gathered
and summed as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from mpjax.policy import PolicyLike, get_policy, is_floating

__all__ = ["all_gather_params", "psum_gradients"]


def _narrowed(dtype: Any, target: np.dtype) -> np.dtype:
    """``target`` for a floating ``dtype`` wider than it, else ``dtype``."""
    dtype = np.dtype(dtype)
    return target if is_floating(dtype) and dtype.itemsize > target.itemsize else dtype


def all_gather_params(
    params: Any, axis_name: Any, policy: PolicyLike, *, axis: int = 0, tiled: bool = True
) -> Any:
    """``lax.all_gather`` of every leaf of ``params`` inside ``jax.shard_map``, each floating
    leaf cast to ``policy``'s compute dtype first; the gradient of a leaf comes back
    reduce-scattered over ``axis_name`` in the policy's reduce dtype, then in the leaf's
    dtype.

    Args:
      params: a pytree of the local shards of the params.
      axis_name: the mesh axis (or axes) the params are sharded over.
      policy: the policy (anything :func:`mpjax.get_policy` accepts).
      axis: the axis of each leaf that is sharded.
      tiled: as ``lax.all_gather``: concatenate the shards (True) or stack them.

    Returns:
      The gathered params, floating leaves wider than the compute dtype in it.

    Raises:
      ValueError, TypeError: for a policy :func:`mpjax.get_policy` does not accept.
    """
    policy = get_policy(policy)

    def gather(x: Any) -> Any:
        dtype = np.dtype(x.dtype)
        compute = _narrowed(dtype, policy.compute_dtype)
        reduce = _narrowed(dtype, policy.reduce_dtype)

        @jax.custom_vjp
        def cast_and_gather(x):
            return lax.all_gather(x.astype(compute), axis_name, axis=axis, tiled=tiled)

        def fwd(x):
            return cast_and_gather(x), None

        def bwd(_, g):
            shard = lax.psum_scatter(
                g.astype(reduce), axis_name, scatter_dimension=axis, tiled=tiled
            )
            return (shard.astype(dtype),)

        cast_and_gather.defvjp(fwd, bwd)
        return cast_and_gather(x)

    return jax.tree.map(gather, params)


def psum_gradients(grads: Any, axis_name: Any, policy: PolicyLike) -> Any:
    """``lax.psum`` of every leaf of ``grads`` over ``axis_name`` inside ``jax.shard_map``,
    floating leaves wider than the policy's reduce dtype summed in it; each leaf comes back in
    its own dtype.

    With ``reduce_dtype=bfloat16`` a float32 gradient crosses the network in half the bytes,
    and the sum of ``n`` devices' gradients lands within ``(n + 1) * 2**-7`` of the sum of
    their magnitudes (8 bits of mantissa, rounded at each of ``n - 1`` additions and once
    on the way in) instead of float32's ``(n + 1) * 2**-23``.

    Args:
      grads: a pytree of this device's gradients.
      axis_name: the mesh axis (or axes) to sum over.
      policy: the policy (anything :func:`mpjax.get_policy` accepts).

    Raises:
      ValueError, TypeError: for a policy :func:`mpjax.get_policy` does not accept.
    """
    policy = get_policy(policy)

    def psum(g: Any) -> Any:
        reduce = _narrowed(g.dtype, policy.reduce_dtype)
        return lax.psum(g.astype(reduce), axis_name).astype(g.dtype)

    return jax.tree.map(psum, grads)
