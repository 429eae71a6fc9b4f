"""mpjax's grouped-GEMM kernels for Blackwell GPUs: the weight gradient, and fp8.

JAX ships a Blackwell (``tcgen05``) kernel for the forward grouped GEMM of a mixture of experts
(``blackwell_ragged_dot_mgpu``), which also serves its input gradient, in one dtype that it
also writes, and none for the weight gradient, ``out[g] = x[rows of g]^T @ dy[rows of g]``: a
contraction over each expert's tokens. Without one, XLA expands it dense, every expert against
every token in float32. The kernels here work on the tokens laid out by
:func:`mpjax.grouped.kernels.pad_groups` (each group starting at a multiple of 128 rows, zeros
between), as torchao pads them for its grouped GEMMs: no tile of tokens mixes two groups, so no
tile is masked, and the FLOPs are the model's plus at most 127 padded rows per group.

- :func:`transposed_ragged_dot`: the weight gradient, in bf16, f16 or fp8;
- :func:`ragged_dot`: the forward GEMM and the input gradient on fp8 operands (e4m3 by e4m3,
  e5m2 by e4m3), written in float32 for the caller to scale, where JAX's kernel would take one
  dtype and write it.

Their structure is JAX's Blackwell matmul's (a persistent kernel over the SMs, one warp issuing
TMA copies into a ring of shared-memory stages, one issuing ``tcgen05`` MMAs into a
double-buffered tensor-memory accumulator, a second warpgroup storing the last tile while the
next one accumulates; JAX is Apache-2.0 licensed, as mpjax is). What differs:

- the contraction's length depends on the tile: the weight gradient's runs over a group's
  tokens, known only when the kernel runs, and a tile of tokens past the groups has none. The
  steps count on across the tiles an SM visits (the loop's carry), so that every stage of the
  ring is waited on exactly as often as it was filled, whatever the groups' sizes;
- operands are read as they are stored and handed to the MMA transposed where the
  contraction is their leading dimension (``tcgen05`` reads shared memory in either major
  order, fp8 included), so none is copied transposed first;
- the accumulator is written in float32, where the caller scales it and rounds it;
- a tile without steps gets zeros without an MMA.

They run only lowered for a compute capability 10 GPU (:mod:`mpjax.grouped.matmul` chooses
them) or in Pallas's GPU interpreter. One CTA per tile (no 2-SM cluster): the interpreter runs
no collective MMA, and the kernels that ship are the ones their tests run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mpjax.grouped.kernels import BLOCK

__all__ = ["TILE", "ragged_dot", "tile_groups", "transposed_ragged_dot"]

TILE = 128
"""Each side of the kernels' output tiles, in tensor memory. Each step contracts 128 bytes (the
shared-memory swizzle): 64 values in bf16 or f16, 128 in fp8."""
_WIDE = frozenset(np.dtype(d) for d in (jnp.bfloat16, jnp.float16))
_FP8 = frozenset(np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2))
_STAGES = 4  # 4 x (16 + 16) KiB of operands + a 32 KiB float32 store tile
_EPILOGUE_N = 64  # output columns stored per copy out of tensor memory
_GRID_TILE_WIDTH = 8  # output tiles per stripe of the traversal, as JAX's matmul


def _cores() -> int:
    """The SMs of the GPU the kernel is traced for (a compile-only device's, see
    :func:`mpjax.jax_compat.gpu_chosen_primitive`)."""
    return int(jax.devices()[0].core_count)


def _check_dtypes(where: str, lhs: jax.Array, rhs: jax.Array, *, wide: bool = True) -> int:
    """The bytes of a value of the operands, which must be bf16 or f16 of one dtype (if
    ``wide``) or fp8, e4m3 and e5m2 in either order."""
    dtypes = {np.dtype(lhs.dtype), np.dtype(rhs.dtype)}
    if not (wide and len(dtypes) == 1 and dtypes <= _WIDE or dtypes <= _FP8):
        one = "have one dtype, bfloat16 or float16, or " if wide else ""
        raise ValueError(
            f"{where}: the operands ({lhs.dtype} and {rhs.dtype}) must {one}be "
            "float8_e4m3fn or float8_e5m2"
        )
    return int(jnp.dtype(lhs.dtype).itemsize)


def transposed_ragged_dot(
    x: jax.Array, dy: jax.Array, starts: jax.Array, blocks: jax.Array
) -> jax.Array:
    """``[G, K, N]`` float32: for each group ``g``, ``x[its rows]^T @ dy[its rows]``
    accumulated in float32, for ``x`` ``[M', K]`` and ``dy`` ``[M', N]`` (bf16 or f16, one
    dtype, or fp8) laid out by :func:`mpjax.grouped.kernels.pad_groups` (``starts`` and
    ``blocks`` from it: each group's first row, a multiple of 128, and its blocks of 128 rows).
    A group without rows gets zeros. K and N must be multiples of 128.

    Raises:
      ValueError: for operands of other dtypes, or K, N or M' that the tiles do not divide.
    """
    itemsize = _check_dtypes("transposed_ragged_dot", x, dy)
    rows, k = x.shape
    rows_dy, n = dy.shape
    if k % TILE or n % TILE or rows != rows_dy or rows % BLOCK:
        raise ValueError(
            f"transposed_ragged_dot: x {x.shape} and dy {dy.shape} must share their rows, a "
            f"multiple of {BLOCK}, and have K and N multiples of {TILE}"
        )
    groups = starts.shape[0]
    grid_m, grid_n = k // TILE, n // TILE
    tiles = grid_m * grid_n  # output tiles of each group
    step = 128 // itemsize  # tokens a step

    def tile(loop: Any, starts_gmem: Any, blocks_gmem: Any, x_gmem: Any, dy_gmem: Any, out_gmem):
        (index,) = loop.index
        g = lax.div(index, jnp.int32(tiles))
        mi, ni = plgpu.planar_snake(
            lax.rem(index, jnp.int32(tiles)), (grid_m, grid_n), 1, _GRID_TILE_WIDTH
        )
        first = lax.div(starts_gmem[g], jnp.int32(step))  # starts: multiples of 128 rows
        # Token rows as a multiple of the step that Mosaic proves (no multiple_of in a warp).
        tokens = lambda j: pl.ds((first + j) * step, step)  # noqa: E731
        return _Tile(
            lhs=lambda j: x_gmem.at[tokens(j), pl.ds(mi * TILE, TILE)],
            rhs=lambda j: dy_gmem.at[tokens(j), pl.ds(ni * TILE, TILE)],
            out=out_gmem.at[g, pl.ds(mi * TILE, TILE), pl.ds(ni * TILE, TILE)],
            steps=blocks_gmem[g] * (BLOCK // step),
        )

    return _launch(
        tile,
        groups * tiles,
        _Operand((step, TILE), x.dtype, transposed=True),  # [tokens, K]: contracted first
        _Operand((step, TILE), dy.dtype, transposed=False),
        (groups, k, n),
        starts.astype(jnp.int32),
        blocks.astype(jnp.int32),
        x,
        dy,
    )


def tile_groups(starts: jax.Array, blocks: jax.Array, rows: int) -> jax.Array:
    """``[rows // 128]`` int32: the group of each tile of 128 rows of
    :func:`mpjax.grouped.kernels.pad_groups`'s layout (``starts``, ``blocks`` from it), -1
    for a tile that holds no group's rows."""
    tile = lax.iota(jnp.int32, rows // BLOCK)
    first = starts.astype(jnp.int32) // BLOCK
    inside = (tile[:, None] >= first) & (tile[:, None] < first + blocks.astype(jnp.int32))
    return jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1), -1).astype(jnp.int32)


def ragged_dot(
    lhs: jax.Array, rhs: jax.Array, groups_of_tiles: jax.Array, *, transpose_rhs: bool
) -> jax.Array:
    """``[M', N]`` float32: each tile of 128 rows of ``lhs`` ``[M', K]`` times its group's
    matrix of ``rhs`` ``[G, K, N]`` (``transpose_rhs``: ``[G, N, K]``, contracted over its
    last dimension), accumulated in float32, for fp8 operands laid out by
    :func:`mpjax.grouped.kernels.pad_groups`; ``groups_of_tiles`` from :func:`tile_groups`.
    A tile of no group comes out zero. K and N must be multiples of 128.

    Raises:
      ValueError: for operands that are not fp8, or shapes the tiles do not divide.
    """
    _check_dtypes("ragged_dot", lhs, rhs, wide=False)
    rows, k = lhs.shape
    k_rhs, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else rhs.shape[1:]
    if k != k_rhs or k % TILE or n % TILE or rows % BLOCK:
        raise ValueError(
            f"ragged_dot: lhs {lhs.shape} and rhs {rhs.shape} (transpose_rhs={transpose_rhs}) "
            f"must share K, with K, N and the rows multiples of {TILE}"
        )
    grid_m, grid_n = rows // TILE, n // TILE
    step = 128  # fp8 values a step: 128 bytes

    def tile(loop: Any, groups_gmem: Any, lhs_gmem: Any, rhs_gmem: Any, out_gmem: Any):
        (index,) = loop.index
        mi, ni = plgpu.planar_snake(index, (grid_m, grid_n), 1, _GRID_TILE_WIDTH)
        g = groups_gmem[mi]
        w = rhs_gmem.at[lax.max(g, jnp.int32(0))]
        columns = pl.ds(ni * TILE, TILE)
        if transpose_rhs:
            rhs_block = lambda j: w.at[columns, pl.ds(j * step, step)]  # noqa: E731
        else:
            rhs_block = lambda j: w.at[pl.ds(j * step, step), columns]  # noqa: E731
        return _Tile(
            lhs=lambda j: lhs_gmem.at[pl.ds(mi * TILE, TILE), pl.ds(j * step, step)],
            rhs=rhs_block,
            out=out_gmem.at[pl.ds(mi * TILE, TILE), columns],
            steps=jnp.where(g >= 0, jnp.int32(k // step), jnp.int32(0)),
        )

    return _launch(
        tile,
        grid_m * grid_n,
        _Operand((TILE, step), lhs.dtype, transposed=False),
        _Operand((TILE, step) if transpose_rhs else (step, TILE), rhs.dtype, transpose_rhs),
        (rows, n),
        groups_of_tiles.astype(jnp.int32),
        lhs,
        rhs,
    )


# --- The kernel both run -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Operand:
    """One operand's tile of a step in shared memory: its shape and dtype, and whether the MMA
    reads it transposed (its first dimension the contraction for the left, its last for the
    right)."""

    shape: tuple[int, int]
    dtype: Any
    transposed: bool


@dataclasses.dataclass(frozen=True)
class _Tile:
    """One output tile: the operands' tiles of step ``j`` (``lhs(j)``, ``rhs(j)``, views of
    global memory), where it goes, and how many steps it takes."""

    lhs: Callable[[Any], Any]
    rhs: Callable[[Any], Any]
    out: Any
    steps: Any


def _launch(
    tile: Callable[..., _Tile],
    tiles: int,
    lhs: _Operand,
    rhs: _Operand,
    out_shape: tuple[int, ...],
    *operands: jax.Array,
) -> jax.Array:
    """The kernel on every SM: ``tiles`` output tiles, ``tile(loop, *refs)`` saying each one
    (``refs``: the operands' and the output's global memory), written float32 ``out_shape``."""

    def smem(operand: _Operand) -> Any:
        itemsize = jnp.dtype(operand.dtype).itemsize
        # JAX's transforms are dataclasses whose unimplemented method mypy takes for abstract.
        transforms = (
            plgpu.TilingTransform((8, 128 // itemsize)),  # type: ignore[abstract]
            plgpu.SwizzleTransform(128),  # type: ignore[abstract]
        )
        return plgpu.SMEM((_STAGES, *operand.shape), operand.dtype, transforms=transforms)

    def kernel(*refs, **scratch):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((tiles,), collective_axes="sm", init_carry=jnp.int32(0))
        def tile_loop(loop: Any, carry: Any) -> Any:
            said = tile(loop, *refs)
            _run_tile(said, (lhs, rhs), wg=wg, done=carry, local=loop.local_index, **scratch)
            return carry + said.steps

        del tile_loop

    def scoped(*refs):
        pl.run_scoped(
            functools.partial(kernel, *refs),
            lhs_smem=smem(lhs),
            rhs_smem=smem(rhs),
            out_smem=plgpu.SMEM((TILE, _EPILOGUE_N), jnp.float32),
            lhs_loaded=plgpu.Barrier(num_arrivals=1, num_barriers=_STAGES),
            rhs_loaded=plgpu.Barrier(num_arrivals=1, num_barriers=_STAGES),
            consumed=plgpu.Barrier(num_arrivals=1, num_barriers=_STAGES, orders_tensor_core=True),
            accumulated=plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
            stored=plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
            acc_tmem=plgpu.TMEM((TILE, 2 * TILE), jnp.float32),
            collective_axes=("wg",),
        )

    launch = plgpu.kernel(
        scoped,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(_cores(),),
        grid_names=("sm",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return launch(*operands)


def _run_tile(
    tile: _Tile,
    operands: tuple[_Operand, _Operand],
    *,
    wg: Any,
    done: Any,
    local: Any,
    lhs_smem: Any,
    rhs_smem: Any,
    out_smem: Any,
    lhs_loaded: Any,
    rhs_loaded: Any,
    consumed: Any,
    accumulated: Any,
    stored: Any,
    acc_tmem: Any,
) -> None:
    """One output tile: ``sum_j lhs(j) @ rhs(j)`` over its steps, into ``tile.out``. ``done``
    counts the steps this SM ran before (stage ``s`` of the ring holds step ``done + j`` where
    ``(done + j) % _STAGES == s``); ``local`` counts the tiles (the accumulator buffer is
    ``local % 2``)."""
    steps = tile.steps
    slot_of = lambda j: lax.rem(done + j, jnp.int32(_STAGES))  # noqa: E731
    buffer = lax.rem(local, jnp.int32(2))
    acc = acc_tmem.at[:, pl.ds(buffer * TILE, TILE)]
    has_steps, no_steps = steps > 0, steps == 0  # Mosaic lowers no `not` in a warp
    lhs_t, rhs_t = (operand.transposed for operand in operands)

    @pl.when(wg == 0)
    def _issue():
        @plgpu.warp_map
        def _warp(warp):
            @pl.when(warp == 0)
            def _copy():
                def step(j, _):
                    slot = slot_of(j)

                    @pl.when(done + j >= _STAGES)  # the stage's last MMA has read it
                    def _wait_consumed():
                        plgpu.barrier_wait(consumed.at[slot])

                    plgpu.copy_gmem_to_smem(tile.lhs(j), lhs_smem.at[slot], lhs_loaded.at[slot])
                    plgpu.copy_gmem_to_smem(tile.rhs(j), rhs_smem.at[slot], rhs_loaded.at[slot])

                lax.fori_loop(0, steps, step, None)

            @pl.when((warp == 1) & (local > 1))
            def _wait_store():  # the buffer's tile from two tiles ago is out of tensor memory
                plgpu.barrier_wait(stored.at[buffer])

            @pl.when(warp == 1)
            def _multiply():
                def step(j, _):
                    slot = slot_of(j)
                    plgpu.barrier_wait(lhs_loaded.at[slot])
                    plgpu.barrier_wait(rhs_loaded.at[slot])
                    a, b = lhs_smem.at[slot], rhs_smem.at[slot]
                    plgpu.tcgen05_mma(
                        acc,
                        a.T if lhs_t else a,
                        b.T if rhs_t else b,
                        consumed.at[slot],
                        accumulate=j > 0,
                    )

                    @pl.when(j == steps - 1)
                    def _commit():
                        plgpu.tcgen05_commit_arrive(accumulated.at[buffer])

                lax.fori_loop(0, steps, step, None)

                # A tile without steps: nothing to multiply, but the store still waits for the
                # MMA warp, which keeps the two in step on the buffer's barriers.
                @pl.when(no_steps)
                def _commit_none():
                    plgpu.tcgen05_commit_arrive(accumulated.at[buffer])

    @pl.when(wg == 1)
    def _store():
        plgpu.barrier_wait(accumulated.at[buffer])

        for c in range(TILE // _EPILOGUE_N):
            columns = pl.ds(c * _EPILOGUE_N, _EPILOGUE_N)

            @pl.when(has_steps)
            def _load(columns=columns):  # called at once: the loop's columns, bound
                out_smem[...] = plgpu.async_load_tmem(
                    acc.at[:, columns], layout=plgpu.Layout.TCGEN05
                )

            @pl.when(no_steps)
            def _zeros():
                out_smem[...] = jnp.zeros(out_smem.shape, jnp.float32)

            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, tile.out.at[:, columns])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.wait_load_tmem()
        plgpu.barrier_arrive(stored.at[buffer])
