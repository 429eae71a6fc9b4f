"""fp8 grouped GEMMs: a mixture of experts' three GEMMs on fp8 operands, scaled per expert or
per row.

:func:`grouped_fp8_dot` is :func:`mpjax.grouped.matmul.grouped_dot` with the operands of each
GEMM quantized to fp8 (:mod:`mpjax.fp8`), the GEMM accumulated in float32 and its scales
applied to the float32 result before it is rounded to the compute dtype (the weight gradient to
the reduce dtype). Two recipes (:class:`mpjax.Fp8Recipe`):

- tensorwise (``"current"``; ``"delayed"`` runs so too, see below): one scale for the tokens,
  one for the incoming gradient and **one per expert** for the weights (each expert's weights
  have their own range, and one outlier expert would cost the others their bits), each from
  its amax at this step. e4m3 forward, e5m2 for the gradient, as :func:`mpjax.fp8.dot_general`;
  the forward's fp8 operands are the residuals the backward GEMMs take.
- ``"rowwise"``: a power-of-two scale per row of each operand of each GEMM, e4m3 throughout,
  as :func:`mpjax.fp8.rowwise_dot_general`: per token and per expert's output column forward,
  per token and per expert's input row for the input gradient, and for the weight gradient,
  whose contraction runs over each expert's tokens, per expert and column of the tokens and of
  the gradient (the amax taken over that expert's tokens only).

Delayed scaling keeps an amax history per matmul of the model; an expert GEMM's scales are per
expert and per step here, so under a ``"delayed"`` recipe the grouped GEMMs scale currently
(their report says ``grouped fp8``), the model's other matmuls as the recipe says.

On an H100 the GEMMs run in mpjax's fp8 kernels (:mod:`mpjax.grouped.kernels`), chosen per
target as :mod:`mpjax.grouped.matmul` chooses JAX's; elsewhere in XLA's ``ragged_dot_general``
on the fp8 values (the same arithmetic: on a CPU in wider types, equal up to the order of the
float32 sums).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import fp8
from mpjax.grouped.matmul import grouped_gemm

__all__ = ["GROUPED_SCALINGS", "grouped_fp8_dot", "row_groups"]

GROUPED_SCALINGS = ("current", "delayed", "rowwise")
"""The :class:`mpjax.Fp8Recipe` scalings :func:`grouped_fp8_dot` takes."""

_F32 = np.dtype(jnp.float32)


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of ``rows`` rows sorted by group: ``G`` (one past the last) for the
    rows past ``sum(group_sizes)``, which belong to none.

    >>> row_groups(jnp.array([2, 0, 1]), 4).tolist()
    [0, 0, 2, 3]
    """
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right")


def _per_row(per_group: jax.Array, groups: jax.Array) -> jax.Array:
    """``per_group[g]`` for each row's group ``g`` (the last group's for rows past the groups,
    whose GEMM results are zero)."""
    return jnp.take(per_group, groups, axis=0, mode="clip")


# --- Tensorwise: a scale per tensor, per expert for the weights ---------------------------


def _expert_scales(w: jax.Array, dtype: np.dtype, margin: int) -> jax.Array:
    return jax.vmap(lambda expert: fp8.current_scale(expert, dtype, margin))(w)


def _tensorwise_forward(x, w, group_sizes, margin):
    sx, sw = fp8.current_scale(x, fp8.E4M3, margin), _expert_scales(w, fp8.E4M3, margin)
    xq, wq = fp8.quantize(x, fp8.E4M3, sx), fp8.quantize(w, fp8.E4M3, sw[:, None, None])
    acc = grouped_gemm("forward", xq, wq, group_sizes, _F32)
    scale = sx * _per_row(sw, row_groups(group_sizes, x.shape[0]))
    return (acc * scale[:, None]).astype(x.dtype), (xq, wq, sx, sw)


def _tensorwise_backward(residuals, g, group_sizes, margin, reduce):
    xq, wq, sx, sw = residuals
    sg = fp8.current_scale(g, fp8.E5M2, margin)
    gq = fp8.quantize(g, fp8.E5M2, sg)
    acc = grouped_gemm("input_gradient", gq, wq, group_sizes, _F32)
    dx = acc * (sg * _per_row(sw, row_groups(group_sizes, g.shape[0])))[:, None]
    dw = grouped_gemm("weight_gradient", xq, gq, group_sizes, _F32) * (sx * sg)
    return dx.astype(g.dtype), dw.astype(reduce)


# --- Rowwise: a power of two per row of each GEMM's operands -------------------------------


def _rowwise_gemm(form, a, b, group_sizes, a_scale, b_scale):
    """``form``'s GEMM on ``a`` and ``b`` quantized to e4m3 by their scales (broadcast against
    them), accumulated in float32, unscaled."""
    qa, qb = fp8.quantize(a, fp8.E4M3, a_scale), fp8.quantize(b, fp8.E4M3, b_scale)
    return grouped_gemm(form, qa, qb, group_sizes, _F32)


def _rowwise_forward(x, w, group_sizes, margin):
    sx = fp8.rowwise_scale(x, (1,), fp8.E4M3, margin)  # [M, 1], per token
    sw = fp8.rowwise_scale(w, (1,), fp8.E4M3, margin)  # [G, 1, N], per expert's output column
    acc = _rowwise_gemm("forward", x, w, group_sizes, sx, sw)
    out = acc * sx * _per_row(sw[:, 0, :], row_groups(group_sizes, x.shape[0]))
    return out.astype(x.dtype), (x, w)


def _group_scales(a, groups, count, margin):
    """Per group and column of ``a`` (rows sorted by group): the power-of-two scale of the
    column's amax over the group's rows, ``[count, columns]``."""
    amax = jax.ops.segment_max(jnp.abs(a), groups, num_segments=count + 1)[:count]
    return fp8.power_of_two_scale(amax, fp8.E4M3, margin)


def _rowwise_backward(residuals, g, group_sizes, margin, reduce):
    x, w = residuals
    groups, count = row_groups(group_sizes, g.shape[0]), w.shape[0]
    sg = fp8.rowwise_scale(g, (1,), fp8.E4M3, margin)  # [M, 1]
    sw = fp8.rowwise_scale(w, (2,), fp8.E4M3, margin)  # [G, K, 1], per expert's input row
    acc = _rowwise_gemm("input_gradient", g, w, group_sizes, sg, sw)
    dx = acc * sg * _per_row(sw[:, :, 0], groups)
    # The weight gradient contracts each expert's tokens: scales per expert and column.
    sx_g, sg_g = _group_scales(x, groups, count, margin), _group_scales(g, groups, count, margin)
    acc = _rowwise_gemm(
        "weight_gradient", x, g, group_sizes, _per_row(sx_g, groups), _per_row(sg_g, groups)
    )
    dw = acc * sx_g[:, :, None] * sg_g[:, None, :]
    return dx.astype(g.dtype), dw.astype(reduce)


_RECIPES = {
    "current": (_tensorwise_forward, _tensorwise_backward),
    "rowwise": (_rowwise_forward, _rowwise_backward),
}


# --- The grouped GEMM with its backward pass ---------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _grouped(lhs, rhs, group_sizes, compute, reduce, scaling, margin, lhs_dtype, rhs_dtype):
    return _grouped_fwd(
        lhs, rhs, group_sizes, compute, reduce, scaling, margin, lhs_dtype, rhs_dtype
    )[0]


def _grouped_fwd(lhs, rhs, group_sizes, compute, reduce, scaling, margin, lhs_dtype, rhs_dtype):
    del reduce, lhs_dtype, rhs_dtype
    forward, _ = _RECIPES[scaling]
    out, residuals = forward(lhs.astype(compute), rhs.astype(compute), group_sizes, margin)
    return out, (residuals, group_sizes)


def _grouped_bwd(compute, reduce, scaling, margin, lhs_dtype, rhs_dtype, saved, g):
    residuals, group_sizes = saved
    _, backward = _RECIPES[scaling]
    dx, dw = backward(residuals, g.astype(compute), group_sizes, margin, reduce)
    return dx.astype(lhs_dtype), dw.astype(rhs_dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_fp8_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    compute: Any,
    reduce: Any = None,
    transposed: bool = False,
    recipe: fp8.Fp8Recipe | str = "current",
) -> jax.Array:
    """``lax.ragged_dot(lhs, rhs, group_sizes)`` with its three GEMMs in fp8 (see the module
    docstring): the result in ``compute``, the input gradient in ``compute`` and the weight
    gradient written in ``reduce`` (``compute`` if None).

    Args:
      lhs: ``[M, K]``, the token rows, sorted by group.
      rhs: ``[G, K, N]``, one matrix per group (expert); ``[G, N, K]`` with ``transposed``.
      group_sizes: ``[G]`` integers, the rows of each group in order; rows past their sum come
        out zero.
      compute: the dtype the fp8 values are dequantized into (bf16, f16 or f32).
      reduce: the dtype the weight gradient is written in (f32 under a mixed policy).
      transposed: ``rhs`` is stored ``[G, N, K]``.
      recipe: an :class:`mpjax.Fp8Recipe` or its string form, scaling one of
        :data:`GROUPED_SCALINGS` (``"current"``, ``"delayed"``, ``"rowwise"``).

    Raises:
      ValueError: for a block-scaled recipe, or a compute dtype fp8 cannot dequantize into.

    >>> x, w = jnp.full((4, 4), 7.0), jnp.full((2, 4, 3), 3.5)
    >>> grouped_fp8_dot(x, w, jnp.array([1, 2]), compute=jnp.bfloat16)[:, 0].tolist()
    [98.0, 98.0, 98.0, 0.0]
    """
    recipe = fp8.fp8_recipe(recipe)
    if recipe.scaling not in GROUPED_SCALINGS:
        raise ValueError(
            f"grouped_fp8_dot(recipe=...) takes the scalings {', '.join(GROUPED_SCALINGS)}; "
            f"got {recipe.scaling!r}, a block format."
        )
    compute = fp8.check_compute_dtype(compute)
    reduce = compute if reduce is None else np.dtype(reduce)
    if transposed:
        rhs = jnp.swapaxes(rhs, 1, 2)
    scaling = "rowwise" if recipe.scaling == "rowwise" else "current"
    lhs_dtype, rhs_dtype = np.dtype(jnp.result_type(lhs)), np.dtype(jnp.result_type(rhs))
    return _grouped(
        lhs, rhs, group_sizes, compute, reduce, scaling, recipe.margin, lhs_dtype, rhs_dtype
    )
