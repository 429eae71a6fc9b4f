"""Block-scaled expert GEMMs at a capacity: a mixture of experts' three grouped GEMMs as batched
MXFP8 or NVFP4 GEMMs, which a Blackwell GPU runs natively (cuDNN's block-scaled GEMM takes a
batch axis), where no grouped block-scaled GEMM exists.

Each expert takes at most ``capacity`` of its rows, its first ones in the order the tokens were
sorted in, into slots ``[G, capacity, K]`` (zeros after its last row). The ragged dot's three
GEMMs run as batched block-scaled GEMMs over the slots (:func:`mpjax.block_scaled.dot_general`
with the expert as the batch axis): the forward contracting K, the input gradient N, and the
weight gradient the slots, where each expert's rows start on a block of their own, so that no
block of 32 (16) mixes two experts' tokens, as torchao pads them for its MXFP8 grouped GEMMs.
The results go back to the rows.

**A row past its expert's capacity is dropped**: its output is zero and no gradient reaches it
or the weights from it, as with Switch Transformer's and GShard's capacity factor (in a residual
block, the token passes through unchanged). The capacity is a setting of the recipe,
``mixed_bfloat16_mxfp8`` with ``fp8=mxfp8;capacity=1.25`` (:class:`mpjax.Fp8Recipe`): each
expert's slots are ``capacity_factor * rows / experts``, rounded up to a multiple of 128.
:func:`dropped_rows` counts what a step drops, for a user to log. Without a capacity, a block
format's grouped GEMMs run in the compute dtype, grouped (:mod:`mpjax.grouped.matmul`), with the
reason in the reports.

The padding is work: a batched GEMM multiplies every slot, ``capacity_factor`` times the rows'
FLOPs or more, and :func:`mpjax.plan` counts the FLOPs the GEMMs execute.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from mpjax import block_scaled, fp8
from mpjax.grouped.fp8 import row_groups

__all__ = [
    "SCOPE",
    "capacity_dot",
    "capacity_rows",
    "dropped_rows",
    "refusal",
    "scope_name",
    "slots",
]

_ROW_TILE = 128
# ``[G, C, K] x [G, K, N]`` (or ``[G, N, K]`` transposed): the expert is the batch axis.
_DIMS = ((((2,), (1,)), ((0,), (0,))), (((2,), (2,)), ((0,), (0,))))


def capacity_rows(rows: int, experts: int, capacity_factor: float) -> int:
    """The slots of each expert: ``capacity_factor * rows / experts`` rounded up to a multiple
    of 128, the row tile of Blackwell's block-scaled GEMMs (XLA pads their operands to it, so
    fewer slots would multiply as many), which both formats' blocks divide, so that the weight
    gradient's contraction over the slots fits.

    >>> capacity_rows(1000, 8, 1.25)
    256
    """
    return max(1, math.ceil(capacity_factor * rows / experts / _ROW_TILE)) * _ROW_TILE


def slots(group_sizes: jax.Array, rows: int, capacity: int) -> jax.Array:
    """The slot of each of ``rows`` rows sorted by expert, ``expert * capacity + i`` for its
    expert's ``i``-th row, or ``G * capacity`` (one past the last slot) for a row past its
    expert's capacity or past ``sum(group_sizes)``.

    >>> slots(jnp.array([3, 1]), 5, 2).tolist()
    [0, 1, 4, 2, 4]
    """
    experts = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    groups = row_groups(sizes, rows)
    starts = jnp.cumsum(sizes) - sizes
    index = jnp.arange(rows, dtype=jnp.int32) - jnp.take(starts, groups, mode="clip")
    kept = (groups < experts) & (index < capacity)
    return jnp.where(kept, groups * capacity + index, experts * capacity)


def dropped_rows(group_sizes: jax.Array, capacity: int) -> jax.Array:
    """How many rows the experts drop at ``capacity`` slots each: the rows past each expert's
    capacity, summed.

    >>> int(dropped_rows(jnp.array([3, 1, 6]), 4))
    2
    """
    return jnp.sum(jnp.maximum(group_sizes.astype(jnp.int32) - capacity, 0))


def scope_name(rows: int, k: int, n: int, capacity: int) -> str:
    """The named scope around :func:`capacity_dot`: the ragged dot's sizes and each expert's
    slots, which the compiled program's op names carry, so that a plan tells the experts'
    batched GEMMs and the work they stand for (the parenthesis keeps it out of module paths).

    >>> scope_name(4096, 256, 1024, 640)
    'experts_at_capacity(4096x256x1024, 640)'
    """
    return f"experts_at_capacity({rows}x{k}x{n}, {capacity})"


SCOPE = re.compile(r"experts_at_capacity\((?P<rows>\d+)x(?P<k>\d+)x(?P<n>\d+), (?P<capacity>\d+)\)")
"""What :func:`scope_name` writes, as a regular expression."""


def refusal(
    lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], transposed: bool, format: str
) -> str | None:
    """Why the ragged dot of these shapes cannot run as batched block-scaled GEMMs in
    ``format`` (its K or N not a multiple of the block), or None when it can."""
    fmt = block_scaled.block_format(format)
    k, n = (rhs_shape[2], rhs_shape[1]) if transposed else (rhs_shape[1], rhs_shape[2])
    wrong = [f"{name}={size}" for name, size in (("K", k), ("N", n)) if size % fmt.block]
    if not wrong:
        return None
    return f"{', '.join(wrong)} not a multiple of {fmt.name}'s block of {fmt.block}"


def capacity_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: fp8.Fp8Recipe | str,
    compute: Any,
    transposed: bool = False,
) -> jax.Array:
    """``lax.ragged_dot(lhs, rhs, group_sizes)`` as batched block-scaled GEMMs over each
    expert's first ``capacity`` rows (the module docstring): the result in ``compute``, rows
    past their expert's capacity zero. The gradients are the block-scaled GEMMs' results in
    ``compute``, each widened to its operand's dtype (f32 weights get the weight gradient's
    ``compute`` values in f32).

    Args:
      lhs: ``[M, K]``, the token rows, sorted by expert.
      rhs: ``[G, K, N]``, one matrix per expert; ``[G, N, K]`` with ``transposed``.
      group_sizes: ``[G]`` integers, the rows of each expert in order.
      recipe: an :class:`mpjax.Fp8Recipe` (or its string form) with a block scaling and a
        ``capacity``; NVFP4's recipe ingredients apply as to any of its GEMMs (the weight
        tiles per expert, the Hadamard transforms along each expert's slots).
      compute: the compute dtype (bf16, f16 or f32).
      transposed: ``rhs`` is stored ``[G, N, K]``.

    Raises:
      ValueError: for a recipe without a block scaling or a capacity, or K or N not a
        multiple of the format's block (:func:`refusal`).

    >>> x, w = jnp.ones((256, 32)), jnp.ones((2, 32, 32))
    >>> sizes = jnp.array([140, 116])  # 128 slots each: expert 0 drops 12 rows
    >>> y = capacity_dot(x, w, sizes, recipe="mxfp8;capacity=1", compute=jnp.bfloat16)
    >>> y[:, 0].tolist() == [32.0] * 128 + [0.0] * 12 + [32.0] * 116
    True
    """
    recipe = fp8.fp8_recipe(recipe)
    if not recipe.block_scaled or recipe.capacity is None:
        raise ValueError(
            "capacity_dot(recipe=...) takes a block format with a capacity, such as "
            f"'mxfp8;capacity=1.25'; got {str(recipe)!r}."
        )
    why = refusal(tuple(lhs.shape), tuple(rhs.shape), transposed, recipe.scaling)
    if why is not None:
        raise ValueError(f"capacity_dot: {why}.")
    compute = fp8.check_compute_dtype(compute)
    rows, k = lhs.shape
    experts = rhs.shape[0]
    capacity = capacity_rows(rows, experts, recipe.capacity)
    with jax.named_scope(scope_name(rows, k, rhs.shape[1 if transposed else 2], capacity)):
        return _at_capacity(lhs, rhs, group_sizes, recipe, compute, transposed, capacity)


def _at_capacity(lhs, rhs, group_sizes, recipe, compute, transposed, capacity):
    rows, k = lhs.shape
    experts = rhs.shape[0]
    slot = slots(group_sizes, rows, capacity)
    # One slot past the last takes the dropped rows (written and read, never used).
    x = jnp.zeros((experts * capacity + 1, k), compute).at[slot].set(lhs.astype(compute))
    x = x[:-1].reshape(experts, capacity, k)
    w = rhs.astype(compute)
    flags = {name: getattr(recipe, name) for name in fp8.NVFP4_INGREDIENTS}
    y = block_scaled.dot_general(x, w, _DIMS[transposed], recipe.scaling, **flags)
    n = y.shape[-1]
    y = jnp.concatenate([y.reshape(experts * capacity, n), jnp.zeros((1, n), y.dtype)])
    return jnp.take(y, slot, axis=0)
