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
- :func:`dispatch_tokens` sends a mixture of experts' tokens to the devices of their experts
  (``lax.all_to_all``) in the policy's dispatch dtype: in float8, each token's values with a
  float32 scale of its own, as DeepSeek-V3 sends them (half the bytes of bfloat16); they arrive
  in the compute dtype. :func:`combine_tokens` sends the experts' results back in the compute
  dtype. The gradients of both travel in the compute dtype.

Leaves that are not floating, or narrower than the dtype they would be cast to, are gathered
and summed as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax.policy import PolicyLike, get_policy, is_floating

__all__ = ["all_gather_params", "combine_tokens", "dispatch_tokens", "psum_gradients"]


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


def _check_axes(x: Any, split_axis: int, concat_axis: int, caller: str) -> None:
    """Refuses an all-to-all that would split or join the tokens' features (their last axis):
    each token travels whole, with its scale."""
    ndim = jnp.ndim(x)
    for name, axis in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if not -ndim <= axis < ndim or axis % ndim == ndim - 1:
            raise ValueError(
                f"{caller}: {name}={axis} must name an axis of the tokens other than their "
                f"last (the features; the tokens have {ndim} axes): each token travels whole, "
                "with its scale."
            )


def _all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, tiled: bool) -> Any:
    return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)


def dispatch_tokens(
    tokens: Any,
    axis_name: Any,
    policy: PolicyLike,
    *,
    split_axis: int = 0,
    concat_axis: int = 0,
    tiled: bool = False,
) -> Any:
    """``lax.all_to_all`` of a mixture of experts' tokens to their experts' devices, inside
    ``jax.shard_map``, in ``policy``'s dispatch dtype (``Policy.dispatch_dtype``).

    In a float8 dispatch dtype each token (a row along the last axis) is sent as its values
    divided by a float32 scale of its own, ``amax / finfo.max`` (rounded to nearest, saturated),
    and the scale beside it: ``d`` bytes and 4 where bfloat16 sends ``2 d``. The tokens arrive
    multiplied back, in the compute dtype. Otherwise they travel in the dispatch dtype (the
    compute dtype by default) and arrive in the compute dtype. The gradient travels back in the
    compute dtype, and comes out in the tokens' dtype.

    Args:
      tokens: this device's tokens, grouped along ``split_axis`` by the device they go to; the
        last axis is the features.
      axis_name: the mesh axis (or axes) the experts are sharded over.
      policy: the policy (anything :func:`mpjax.get_policy` accepts).
      split_axis, concat_axis, tiled: as ``lax.all_to_all``'s; neither axis may be the last.

    Returns:
      The tokens this device's experts receive, in the compute dtype.

    Raises:
      ValueError, TypeError: for a policy :func:`mpjax.get_policy` does not accept, or an axis
        that is the features'.
    """
    policy = get_policy(policy)
    _check_axes(tokens, split_axis, concat_axis, "dispatch_tokens")
    compute, dispatch = policy.compute_dtype, policy.dispatch_dtype
    dtype = np.dtype(tokens.dtype)

    def send(x: Any) -> Any:
        if jnp.finfo(dispatch).bits > 8:
            moved = _all_to_all(x.astype(dispatch), axis_name, split_axis, concat_axis, tiled)
            return moved.astype(compute)
        largest = float(jnp.finfo(dispatch).max)
        wide = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(wide), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / largest, 1.0)
        values = jnp.clip(wide / scale, -largest, largest).astype(dispatch)
        values = _all_to_all(values, axis_name, split_axis, concat_axis, tiled)
        scale = _all_to_all(scale, axis_name, split_axis, concat_axis, tiled)
        return (values.astype(jnp.float32) * scale).astype(compute)

    @jax.custom_vjp
    def dispatched(x):
        return send(x)

    def fwd(x):
        return send(x), None

    def bwd(_, g):  # back to where each token came from, in the compute dtype
        back = _all_to_all(g.astype(compute), axis_name, concat_axis, split_axis, tiled)
        return (back.astype(dtype),)

    dispatched.defvjp(fwd, bwd)
    return dispatched(tokens)


def combine_tokens(
    tokens: Any,
    axis_name: Any,
    policy: PolicyLike,
    *,
    split_axis: int = 0,
    concat_axis: int = 0,
    tiled: bool = False,
) -> Any:
    """``lax.all_to_all`` of the experts' results back to their tokens' devices, inside
    ``jax.shard_map``, in ``policy``'s compute dtype (and their gradient too): the return trip
    of :func:`dispatch_tokens`.

    Args:
      tokens: the results, grouped along ``split_axis`` by the device they go back to.
      axis_name: the mesh axis (or axes) the experts are sharded over.
      policy: the policy (anything :func:`mpjax.get_policy` accepts).
      split_axis, concat_axis, tiled: as ``lax.all_to_all``'s.

    Returns:
      The results of this device's tokens, in the compute dtype.
    """
    compute = get_policy(policy).compute_dtype
    moved = _all_to_all(tokens.astype(compute), axis_name, split_axis, concat_axis, tiled)
    return moved
