"""mpjax's own grouped-GEMM kernels: fp8 operands, float32 results, on Hopper GPUs.

JAX's Mosaic GPU grouped GEMMs (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`` and
``transposed_ragged_dot_mgpu``) take two operands of one dtype and write that dtype. An fp8
grouped GEMM needs more: an e5m2 gradient against e4m3 weights, and a float32 result that its
scales multiply before it is rounded to the compute dtype (an fp8 result would lose what the
GEMM was for). Hopper's fp8 ``wgmma`` also reads both operands with the contraction contiguous
("K-major"), where JAX's weight-gradient kernel feeds it a transposed tile. The two kernels
here are JAX's, adapted for that (the tiling, the pipeline and the ladder of row stores are
theirs; JAX is Apache-2.0 licensed, as mpjax is):

- :func:`ragged_dot` computes ``out[rows of group g] = lhs[rows] @ rhs[g]^T`` for ``lhs``
  ``[M, K]`` and ``rhs`` ``[G, N, K]``, both K-major: the forward GEMM (on the weights copied
  ``[G, N, K]``) and the input gradient (on the weights as stored, ``[G, K, N]``, whose
  contraction is N).
- :func:`transposed_ragged_dot` computes ``out[g] = lhs_t[:, rows of g] @ rhs_t[:, rows of g]^T``
  for ``lhs_t`` ``[K, M']`` and ``rhs_t`` ``[N, M']``, the weight gradient's contraction over
  each group's tokens, with the tokens contiguous: the token rows transposed, and each group
  starting at a multiple of the block of tokens (:func:`pad_groups`), as torchao pads them for
  its fp8 and MXFP8 grouped GEMMs. So no block mixes two groups and no tile is masked.

Both accumulate in float32 and write float32; the caller applies the scales. Their tiles (128
tokens or features by 128 by 128 bytes of contraction, four stages in flight) fit an H100's
shared memory with room for the float32 result tile. They run only lowered for a compute
capability 9 GPU (:mod:`mpjax.grouped.matmul` chooses them) or in Pallas's GPU interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = [
    "BLOCK",
    "pad_groups",
    "padded_rows",
    "ragged_dot",
    "transposed_ragged_dot",
    "unpad_groups",
]

BLOCK = 128
"""Each side of the kernels' tiles, in rows (tokens, or features of the weight gradient),
columns and fp8 values of contraction (the 128-byte swizzle of Hopper's fp8 ``wgmma``)."""
_STAGES = 4  # tiles in flight: 4 x (2 x 16 KiB) + a 64 KiB float32 result tile
_GRID_BLOCK_N = 8  # JAX's choice: 8 column tiles per stripe of the traversal


def _cores() -> int:
    """The SMs of the GPU the kernel is traced for (a compile-only device's, see
    :func:`mpjax.jax_compat.gpu_chosen_primitive`)."""
    return int(jax.devices()[0].core_count)


def _accumulated(lhs_gmem, rhs_gmem, lhs_block, rhs_block, steps, run=None) -> Any:
    """``sum_j lhs tile(j) @ rhs tile(j)^T`` over ``steps`` pipelined steps, in float32
    registers: tiles of ``BLOCK x BLOCK`` at ``lhs_block(j)`` and ``rhs_block(j)``, both
    contiguous along the contraction, :data:`_STAGES` in flight; zeros where ``run`` (if given)
    is false."""

    def accumulate(acc_ref):
        def pipeline():
            plgpu.emit_pipeline(
                lambda _, a, b: plgpu.wgmma(acc_ref, a, b.transpose((1, 0))),
                grid=(steps,),
                in_specs=[
                    plgpu.BlockSpec((BLOCK, BLOCK), lhs_block, delay_release=1),
                    plgpu.BlockSpec((BLOCK, BLOCK), rhs_block, delay_release=1),
                ],
                max_concurrent_steps=_STAGES,
            )(lhs_gmem, rhs_gmem)

        if run is None:
            pipeline()
        else:
            pl.when(run)(pipeline)
        return acc_ref[...]

    return pl.run_scoped(accumulate, plgpu.ACC((BLOCK, BLOCK)))


def _launch(body: Any, shape: tuple[int, ...], *operands: jax.Array) -> jax.Array:
    """``body`` run as a kernel on every SM (the ``"sm"`` axis), writing float32 ``shape``."""
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(shape, jnp.float32),
        grid=(_cores(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(*operands)


@dataclasses.dataclass(frozen=True)
class _Group:
    """The group of one block of rows of :func:`ragged_dot`'s traversal, which visits a block
    once for each group it holds rows of (``cdiv(M, BLOCK) + G - 1`` blocks in all)."""

    group: Any
    block: Any
    block_start: Any
    start_within_block: Any
    size: Any

    @classmethod
    def of(cls, sizes_ref: Any, groups: int, tile: int, index: Any) -> _Group:
        # Unrolled over the groups (few), as JAX's kernel does: selects, no early exit.
        zero = jnp.array(0, dtype=jnp.int32)
        group = block = group_start = group_end = end = zero
        for i in range(groups):
            start = end
            end = start + sizes_ref[i]
            first_block = lax.div(start, tile)
            past_block = lax.div(end - 1, tile) + 1
            here = (first_block + i <= index) & (index < past_block + i)
            block = lax.select(here, index - i, block)
            group = lax.select(here, jnp.int32(i), group)
            group_start = lax.select(here, start, group_start)
            group_end = lax.select(here, end, group_end)
        block_start = block * tile
        start = jnp.maximum(group_start, block_start)
        size = jnp.minimum(group_end, block_start + tile) - start
        return cls(group, block, block_start, start - block_start, size)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``[M, N]`` float32: each row of ``lhs`` (``[M, K]``, fp8) times its group's matrix of
    ``rhs`` (``[G, N, K]``, fp8, K contiguous), accumulated in float32. Rows past
    ``sum(group_sizes)`` are left unwritten. K and N must be multiples of :data:`BLOCK`."""
    m, k = lhs.shape
    groups, n, k2 = rhs.shape
    if k != k2 or k % BLOCK or n % BLOCK:
        raise ValueError(f"ragged_dot: lhs {lhs.shape} and rhs {rhs.shape} do not tile by {BLOCK}")

    def body(sizes_gmem, lhs_gmem, rhs_gmem, out_gmem):
        grid_m, grid_n = pl.cdiv(m, BLOCK) + groups - 1, n // BLOCK

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def _(loop: Any) -> None:
            mi, ni = plgpu.planar_snake(loop.index[0], (grid_m, grid_n), 1, _GRID_BLOCK_N)
            info = _Group.of(sizes_gmem, groups, BLOCK, mi)

            acc = _accumulated(
                lhs_gmem,
                rhs_gmem.at[info.group],
                lambda j: (info.block, j),
                lambda j: (ni, j),
                k // BLOCK,
            )

            @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((BLOCK, BLOCK), jnp.float32))
            def _(out_smem):
                out_smem[...] = acc
                plgpu.commit_smem()
                # The block's rows of this group, stored by a ladder of power-of-two row
                # counts (a TMA store's shape is static; the count is not).
                start = info.start_within_block
                rows = min(BLOCK, m)
                while rows > 0:
                    step = 1 << int(math.log2(rows))
                    rows //= 2

                    @pl.when(info.size & step != 0)
                    def _(start=start, step=step):  # run here, as the loop unrolls
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[pl.ds(start, step)],
                            out_gmem.at[
                                pl.ds(info.block_start + start, step), pl.ds(ni * BLOCK, BLOCK)
                            ],
                        )

                    start += info.size & step
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _launch(body, (m, n), group_sizes.astype(jnp.int32), lhs, rhs)


def padded_rows(rows: int, groups: int) -> int:
    """The rows of :func:`pad_groups`'s layout: room for each of ``groups`` groups to start at
    a multiple of :data:`BLOCK`, whatever the sizes.

    >>> padded_rows(1000, 8)
    2048
    """
    return -(-(rows + groups * (BLOCK - 1)) // BLOCK) * BLOCK


def pad_groups(x: jax.Array, group_sizes: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x`` (``[M, C]``, rows sorted by group) laid out with each group starting at a multiple
    of :data:`BLOCK` rows, zeros between: ``([padded_rows(M, G), C], starts, blocks)``, the
    first row and the number of blocks of each group there."""
    sizes = group_sizes.astype(jnp.int32)
    blocks = -(-sizes // BLOCK)
    padded_ends = jnp.cumsum(blocks) * BLOCK
    starts = padded_ends - blocks * BLOCK
    ends = jnp.cumsum(sizes)
    rows = padded_rows(x.shape[0], sizes.shape[0])
    position = lax.iota(jnp.int32, rows)
    group = jnp.minimum(jnp.searchsorted(padded_ends, position, side="right"), sizes.shape[0] - 1)
    local = position - starts[group]
    source = ends[group] - sizes[group] + local
    inside = local < sizes[group]
    taken = jnp.take(x, jnp.where(inside, source, 0), axis=0)
    return jnp.where(inside[:, None], taken, jnp.zeros((), x.dtype)), starts, blocks


def unpad_groups(
    padded: jax.Array, group_sizes: jax.Array, starts: jax.Array, rows: int
) -> jax.Array:
    """The rows of ``padded`` (:func:`pad_groups`'s layout of ``rows`` rows, ``starts`` from
    it) back where they were, ``[rows, C]``; the rows past ``sum(group_sizes)`` zero."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    position = lax.iota(jnp.int32, rows)
    group = jnp.minimum(jnp.searchsorted(ends, position, side="right"), sizes.shape[0] - 1)
    inside = position < ends[-1]
    source = starts.astype(jnp.int32)[group] + position - (ends[group] - sizes[group])
    taken = jnp.take(padded, jnp.where(inside, source, 0), axis=0)
    return jnp.where(inside[:, None], taken, jnp.zeros((), padded.dtype))


def transposed_ragged_dot(
    lhs_t: jax.Array, rhs_t: jax.Array, starts: jax.Array, blocks: jax.Array
) -> jax.Array:
    """``[G, K, N]`` float32: for each group, ``lhs_t[:, its rows] @ rhs_t[:, its rows]^T``
    accumulated in float32, for ``lhs_t`` ``[K, M']`` and ``rhs_t`` ``[N, M']`` (fp8, the rows
    contiguous) laid out by :func:`pad_groups` (``starts`` and ``blocks`` from it). A group
    without rows gets zeros. K and N must be multiples of :data:`BLOCK`."""
    k, _ = lhs_t.shape
    n, _ = rhs_t.shape
    groups = starts.shape[0]
    if k % BLOCK or n % BLOCK:
        raise ValueError(
            f"transposed_ragged_dot: lhs_t {lhs_t.shape} and rhs_t {rhs_t.shape} do not tile "
            f"by {BLOCK}"
        )

    def body(starts_gmem, blocks_gmem, lhs_gmem, rhs_gmem, out_gmem):
        grid_m, grid_n = k // BLOCK, n // BLOCK

        @plgpu.nd_loop((groups, grid_m * grid_n), collective_axes="sm")
        def _(loop: Any) -> None:
            g = loop.index[0]
            mi, ni = plgpu.planar_snake(loop.index[1], (grid_m, grid_n), 1, _GRID_BLOCK_N)
            first = lax.div(starts_gmem[g], BLOCK)  # the group's first block of rows

            acc = _accumulated(
                lhs_gmem,
                rhs_gmem,
                lambda j: (mi, first + j),
                lambda j: (ni, first + j),
                blocks_gmem[g],
                run=blocks_gmem[g] > 0,
            )

            @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((BLOCK, BLOCK), jnp.float32))
            def _(out_smem):
                out_smem[...] = acc
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem,
                    out_gmem.at[g, pl.ds(mi * BLOCK, BLOCK), pl.ds(ni * BLOCK, BLOCK)],
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _launch(
        body, (groups, k, n), starts.astype(jnp.int32), blocks.astype(jnp.int32), lhs_t, rhs_t
    )
