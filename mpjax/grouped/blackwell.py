"""mpjax's grouped-GEMM kernel for the weight gradient on Blackwell GPUs.

JAX ships Blackwell (``tcgen05``) kernels for the forward grouped GEMM of a mixture of experts
(``blackwell_ragged_dot_mgpu``), which also serves its input gradient, but none for the weight
gradient, ``out[g] = x[rows of g]^T @ dy[rows of g]``: a contraction over each expert's tokens.
Without one, XLA expands it dense, every expert against every token in float32. The kernel here
computes it on the tokens laid out by :func:`mpjax.grouped.kernels.pad_groups` (each group
starting at a multiple of 128 rows, zeros between), as torchao pads them for its grouped GEMMs:
no tile of tokens mixes two groups, so no tile is masked, and the FLOPs are the model's plus at
most 127 padded rows per group.

Its structure is JAX's Blackwell matmul's (a persistent kernel over the SMs, one warp issuing
TMA copies into a ring of shared-memory stages, one issuing ``tcgen05`` MMAs into a
double-buffered tensor-memory accumulator, a second warpgroup storing the last tile while the
next one accumulates; JAX is Apache-2.0 licensed, as mpjax is). What differs:

- the contraction runs over the tokens, whose number per group is known only when the kernel
  runs: each output tile of group ``g`` takes ``blocks[g]`` x 2 steps, and the steps count on
  across the tiles an SM visits (the loop's carry), so that every stage of the ring is waited
  on exactly as often as it was filled, whatever the groups' sizes;
- the token rows are read as they are stored, ``[tokens, features]``, and handed to the MMA
  transposed (``tcgen05`` reads shared memory in either major order), so neither operand is
  copied transposed first;
- the accumulator is written in float32, where the caller rounds it to the reduce dtype;
- a group without tokens gets zeros without an MMA.

It runs only lowered for a compute capability 10 GPU (:mod:`mpjax.grouped.matmul` chooses it)
or in Pallas's GPU interpreter. One CTA per tile (no 2-SM cluster): the interpreter runs no
collective MMA, and the kernel that ships is the one its tests run.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mpjax.grouped.kernels import BLOCK

__all__ = ["TILE", "transposed_ragged_dot"]

TILE = (128, 128)
"""The kernel's output tile, 128 features of ``x`` by 128 of ``dy``, in tensor memory. Each step
contracts 128 bytes of tokens (the shared-memory swizzle): 64 in bf16 or f16, 128 in fp8."""
_WIDE = frozenset(np.dtype(d) for d in (jnp.bfloat16, jnp.float16))
_FP8 = frozenset(np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2))
_STAGES = 4  # 4 x (16 + 16) KiB of operands + a 32 KiB float32 store tile
_EPILOGUE_N = 64  # output columns stored per copy out of tensor memory
_GRID_TILE_WIDTH = 8  # output tiles per stripe of the traversal, as JAX's matmul


def _cores() -> int:
    """The SMs of the GPU the kernel is traced for (a compile-only device's, see
    :func:`mpjax.jax_compat.gpu_chosen_primitive`)."""
    return int(jax.devices()[0].core_count)


def transposed_ragged_dot(
    x: jax.Array, dy: jax.Array, starts: jax.Array, blocks: jax.Array
) -> jax.Array:
    """``[G, K, N]`` float32: for each group ``g``, ``x[its rows]^T @ dy[its rows]``
    accumulated in float32, for ``x`` ``[M', K]`` and ``dy`` ``[M', N]`` (bf16 or f16, one
    dtype, or fp8: e4m3 and e5m2 in either order, as ``tcgen05`` multiplies them) laid out by :func:`mpjax.grouped.kernels.pad_groups` (``starts`` and ``blocks``
    from it: each group's first row, a multiple of 128, and its blocks of 128 rows). A group
    without rows gets zeros. K and N must be multiples of 128.

    Raises:
      ValueError: for operands of other dtypes, or K, N or M' that the tiles do not divide.
    """
    tile_m, tile_n = TILE
    rows, k = x.shape
    rows_dy, n = dy.shape
    dtypes = {np.dtype(x.dtype), np.dtype(dy.dtype)}
    if not (len(dtypes) == 1 and dtypes <= _WIDE or dtypes <= _FP8):
        raise ValueError(
            f"transposed_ragged_dot: x ({x.dtype}) and dy ({dy.dtype}) must have one dtype, "
            "bfloat16 or float16, or be float8_e4m3fn or float8_e5m2"
        )
    if k % tile_m or n % tile_n or rows != rows_dy or rows % BLOCK:
        raise ValueError(
            f"transposed_ragged_dot: x {x.shape} and dy {dy.shape} must share their rows, a "
            f"multiple of {BLOCK}, and have K and N multiples of {tile_m} and {tile_n}"
        )
    groups = starts.shape[0]
    grid_m, grid_n = k // tile_m, n // tile_n
    tiles = grid_m * grid_n  # output tiles of each group
    itemsize = jnp.dtype(x.dtype).itemsize
    tile_k = 128 // itemsize  # tokens a step
    steps_per_block = BLOCK // tile_k
    # JAX's transforms are dataclasses whose unimplemented method mypy takes for abstract.
    transforms = (
        plgpu.TilingTransform((8, 128 // itemsize)),  # type: ignore[abstract]
        plgpu.SwizzleTransform(128),  # type: ignore[abstract]
    )

    def kernel(starts_gmem, blocks_gmem, x_gmem, dy_gmem, out_gmem, **refs):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((groups * tiles,), collective_axes="sm", init_carry=jnp.int32(0))
        def tile_loop(loop: Any, carry: Any) -> Any:
            (index,) = loop.index
            local = loop.local_index
            g = lax.div(index, jnp.int32(tiles))
            mi, ni = plgpu.planar_snake(
                lax.rem(index, jnp.int32(tiles)), (grid_m, grid_n), 1, _GRID_TILE_WIDTH
            )
            first_row = starts_gmem[g]
            steps = blocks_gmem[g] * steps_per_block
            _tile(
                x_gmem.at[:, pl.ds(mi * tile_m, tile_m)],
                dy_gmem.at[:, pl.ds(ni * tile_n, tile_n)],
                out_gmem.at[g, pl.ds(mi * tile_m, tile_m), pl.ds(ni * tile_n, tile_n)],
                wg=wg,
                first_row=first_row,
                steps=steps,
                done=carry,
                local=local,
                **refs,
            )
            return carry + steps

        del tile_loop

    def scoped(*gmem):
        pl.run_scoped(
            functools.partial(kernel, *gmem),
            x_smem=plgpu.SMEM((_STAGES, tile_k, tile_m), x.dtype, transforms=transforms),
            dy_smem=plgpu.SMEM((_STAGES, tile_k, tile_n), dy.dtype, transforms=transforms),
            out_smem=plgpu.SMEM((tile_m, _EPILOGUE_N), jnp.float32),
            x_loaded=plgpu.Barrier(num_arrivals=1, num_barriers=_STAGES),
            dy_loaded=plgpu.Barrier(num_arrivals=1, num_barriers=_STAGES),
            consumed=plgpu.Barrier(num_arrivals=1, num_barriers=_STAGES, orders_tensor_core=True),
            accumulated=plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
            stored=plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
            acc_tmem=plgpu.TMEM((tile_m, 2 * tile_n), jnp.float32),
            collective_axes=("wg",),
        )

    launch = plgpu.kernel(
        scoped,
        out_type=jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        grid=(_cores(),),
        grid_names=("sm",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return launch(starts.astype(jnp.int32), blocks.astype(jnp.int32), x, dy)


def _tile(
    x_cols: Any,
    dy_cols: Any,
    out_tile: Any,
    *,
    wg: Any,
    first_row: Any,
    steps: Any,
    done: Any,
    local: Any,
    x_smem: Any,
    dy_smem: Any,
    out_smem: Any,
    x_loaded: Any,
    dy_loaded: Any,
    consumed: Any,
    accumulated: Any,
    stored: Any,
    acc_tmem: Any,
) -> None:
    """One output tile: ``x_cols[rows]^T @ dy_cols[rows]`` over the ``steps`` steps of 64 token
    rows from ``first_row``, into ``out_tile``. ``done`` counts the steps this SM ran before
    (stage ``s`` of the ring holds step ``done + j`` where ``(done + j) % _STAGES == s``);
    ``local`` counts the tiles (the accumulator buffer is ``local % 2``)."""
    _, tile_n = TILE
    tile_k = x_smem.shape[1]  # tokens a step
    first_step = lax.div(first_row, jnp.int32(tile_k))  # first_row: a multiple of 128
    slot_of = lambda j: lax.rem(done + j, jnp.int32(_STAGES))  # noqa: E731
    buffer = lax.rem(local, jnp.int32(2))
    acc = acc_tmem.at[:, pl.ds(buffer * tile_n, tile_n)]
    has_steps, no_steps = steps > 0, steps == 0  # Mosaic lowers no `not` in a warp

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

                    # A multiple of tile_k that Mosaic can prove (it takes no multiple_of
                    # in a warp).
                    rows = pl.ds((first_step + j) * tile_k, tile_k)
                    plgpu.copy_gmem_to_smem(x_cols.at[rows], x_smem.at[slot], x_loaded.at[slot])
                    plgpu.copy_gmem_to_smem(dy_cols.at[rows], dy_smem.at[slot], dy_loaded.at[slot])

                lax.fori_loop(0, steps, step, None)

            @pl.when((warp == 1) & (local > 1))
            def _wait_store():  # the buffer's tile from two tiles ago is out of tensor memory
                plgpu.barrier_wait(stored.at[buffer])

            @pl.when(warp == 1)
            def _multiply():
                def step(j, _):
                    slot = slot_of(j)
                    plgpu.barrier_wait(x_loaded.at[slot])
                    plgpu.barrier_wait(dy_loaded.at[slot])
                    plgpu.tcgen05_mma(
                        acc,
                        x_smem.at[slot].T,  # [features, tokens]: the tokens contracted
                        dy_smem.at[slot],
                        consumed.at[slot],
                        accumulate=j > 0,
                    )

                    @pl.when(j == steps - 1)
                    def _commit():
                        plgpu.tcgen05_commit_arrive(accumulated.at[buffer])

                lax.fori_loop(0, steps, step, None)

                # A group without tokens: nothing to multiply, but the store still waits for
                # the MMA warp, which keeps the two in step on the buffer's barriers.
                @pl.when(no_steps)
                def _commit_none():
                    plgpu.tcgen05_commit_arrive(accumulated.at[buffer])

    @pl.when(wg == 1)
    def _store():
        plgpu.barrier_wait(accumulated.at[buffer])

        for c in range(tile_n // _EPILOGUE_N):
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
            plgpu.copy_smem_to_gmem(out_smem, out_tile.at[:, columns])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.wait_load_tmem()
        plgpu.barrier_arrive(stored.at[buffer])
