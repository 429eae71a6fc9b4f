"""Block-scaled matmuls: MXFP8 and NVFP4, one scale per small block of values along the
contraction, the formats Blackwell GPUs' Tensor Cores multiply natively.

A per-tensor fp8 scale (:mod:`mpjax.fp8`) must fit a tensor's largest value, so its small
values lose bits; a block format gives every ``block`` consecutive values along the
contraction their own scale, stored beside the values, and the GEMM applies the scales as it
accumulates:

- **MXFP8** (the OCP Microscaling format): e4m3 values, one e8m0 scale (a power of two) per 32.
  The scale of a block is ``2**(floor(log2(amax)) - 8)``, 8 being e4m3's largest exponent, so
  the block's largest value lands in [256, 512); values past 448 saturate to ±448. A block of
  zeros gets the smallest scale, 2**-127; a block holding inf or NaN gets the NaN scale, so its
  products are NaN.
- **NVFP4** (NVIDIA's): e2m1 values (±0, 0.5, 1, 1.5, 2, 3, 4, 6), one e4m3 scale per 16, and one
  float32 scale per tensor, ``amax / (6 * 448)``, which brings the block scales into e4m3's
  range. A block's scale is its amax over 6, divided by the tensor's, rounded to e4m3; values
  are divided by both scales and rounded to e2m1, saturating at ±6.

:func:`dot_general` quantizes both operands of a matmul along its contraction, forward, and in
the backward pass quantizes the incoming gradient and the saved operands again along the
backward GEMMs' contractions (a block runs along the contraction, so each GEMM needs its own
quantization of the same operand): all three GEMMs run block-scaled, in the same format. The
gradients reaching the operands are the backward GEMMs' results (a straight-through estimator).

4-bit values do not train by the format's definition alone. NVFP4 takes NVIDIA's training
recipe (arXiv 2509.25149, Transformer Engine's ``NVFP4BlockScaling``) by default, each
ingredient switchable for ablations:

- **a random Hadamard transform** (:func:`hadamard_transform`, 16 x 16) on both inputs of the
  weight-gradient GEMM, along its contraction (the tokens), with one fixed random sign vector:
  it spreads an outlier over its 16 neighbours, so the block's scale fits the others better.
  The transform is orthogonal and both operands take it, so the product is unchanged before
  rounding. The tensor's amax is taken after it.
- **stochastic rounding** (``quantize(..., key=...)``) of the output gradient, in both gradient
  GEMMs: each value rounds up or down with the probabilities that make its expectation exact,
  so small gradients are not lost to rounding to nearest. Weights and activations round to
  nearest (stochastic rounding of forward tensors diverged in NVIDIA's runs).
- **2D weight blocks** (:func:`quantize_tiles`): the weight, the ``rhs``, quantized in 16 x 16
  tiles, so the forward GEMM (blocked along its rows' contraction) and the input-gradient GEMM
  (along its columns') multiply the same quantized weight.

The GEMMs are ``jax.nn.scaled_matmul``, which XLA compiles to cuDNN's block-scaled GEMM
(``__cudnn$blockScaledDot``) on Blackwell GPUs. Elsewhere (a Hopper GPU, a TPU, the CPU) it
runs as an emulation: the values are dequantized and multiplied in the compute dtype, with the
same numbers and no speed-up, and :func:`dot_general` warns once (:class:`EmulationWarning`).
:func:`mpjax.plan` shows which GEMMs a target runs block-scaled.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import fp8, jax_compat

__all__ = [
    "FORMATS",
    "HADAMARD_SIZES",
    "MXFP8",
    "NVFP4",
    "BlockFormat",
    "BlockQuantized",
    "EmulationWarning",
    "dequantize",
    "dot_general",
    "hadamard_matrix",
    "hadamard_transform",
    "quantize",
    "quantize_tiles",
    "transpose_tiles",
    "unaligned",
]

_F32 = np.dtype(jnp.float32)
E4M3 = np.dtype(jnp.float8_e4m3fn)
E2M1 = np.dtype(jnp.float4_e2m1fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)
_E8M0_BIAS = 127
jax_compat.emulate_block_scaled_matmuls_on_cpu()  # the emulation this module's docstring names


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled number format.

    Attributes:
      name: ``"mxfp8"`` or ``"nvfp4"``.
      data: the values' dtype (e4m3, e2m1).
      scale: the block scales' dtype (e8m0, e4m3).
      block: how many consecutive values along the contraction share a scale.
      emax: the largest exponent of ``data`` (8 for e4m3, 2 for e2m1).
      tensor_scale: whether a float32 scale per tensor sits above the block scales (NVFP4).
    """

    name: str
    data: np.dtype
    scale: np.dtype
    block: int
    emax: int
    tensor_scale: bool

    @property
    def data_max(self) -> float:
        """The largest finite value of ``data``: 448 for e4m3, 6 for e2m1."""
        return float(jnp.finfo(self.data).max)


MXFP8 = BlockFormat("mxfp8", E4M3, E8M0, 32, 8, False)
"""The OCP MXFP8 format with e4m3 values, a power-of-two e8m0 scale per 32 values."""
NVFP4 = BlockFormat("nvfp4", E2M1, E4M3, 16, 2, True)
"""The NVFP4 format, e2m1 values with an e4m3 scale per 16 values and a float32 scale per
tensor."""
FORMATS = {f.name: f for f in (MXFP8, NVFP4)}
"""The block formats by name."""


class EmulationWarning(UserWarning):
    """Block-scaled matmuls were traced for a backend without block-scaled GEMM kernels: they
    run dequantized, with the block formats' numbers and none of their speed."""


def block_format(format: BlockFormat | str) -> BlockFormat:
    """The :class:`BlockFormat` ``format`` names (a format is returned as it is).

    Raises:
      ValueError: for an unknown name, listing the valid ones.
      TypeError: for anything but a name or a format.
    """
    if isinstance(format, BlockFormat):
        return format
    if not isinstance(format, str):
        raise TypeError(
            f"format must be a block format's name ({', '.join(map(repr, FORMATS))}) or an "
            f"mpjax.block_scaled.BlockFormat; got {format!r} of type {type(format).__name__}."
        )
    if format not in FORMATS:
        raise ValueError(
            f"Unknown block format {format!r}; valid formats: {', '.join(map(repr, FORMATS))}."
        )
    return FORMATS[format]


class BlockQuantized(NamedTuple):
    """A tensor in a block format, blocked along its last axis.

    Attributes:
      data: the values, in ``format.data``, of the tensor's shape.
      scales: one per block, in ``format.scale``: the shape with the last axis divided by the
        block size.
      tensor_scale: the float32 scale of the whole tensor (NVFP4); 1 for MXFP8.
    """

    data: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array


def _blocks(x: jax.Array, block: int) -> jax.Array:
    *lead, k = x.shape
    if k % block:
        raise ValueError(
            f"A block-scaled operand's last axis must be a multiple of the block size {block}; "
            f"got shape {tuple(x.shape)}."
        )
    return x.reshape(*lead, k // block, block)


def _saturated(y: jax.Array, bound: float, dtype: np.dtype) -> jax.Array:
    """``y`` rounded to ``dtype`` (to nearest, ties to even), finite values saturating at
    ±``bound``; inf and NaN stay non-finite (both NaN in formats without inf)."""
    return jnp.where(jnp.isfinite(y), jnp.clip(y, -bound, bound), y).astype(dtype)


def _stochastic(y: jax.Array, fmt: BlockFormat, key: jax.Array) -> jax.Array:
    """``y`` (float32) rounded to ``fmt.data`` stochastically, saturating at ±``data_max``.

    Between the two values of the format around ``|y|``, ``lower`` and ``lower + spacing``
    (the spacing a power of two: the format's step in ``|y|``'s binade, or its subnormal step),
    the upper is taken with probability ``(|y| - lower) / spacing``, so the expected result is
    ``y``. Both the division by the spacing and ``lower`` are exact in float32; the
    probability is compared with a uniform draw of 23 bits."""
    info = jnp.finfo(fmt.data)
    magnitude = jnp.clip(jnp.abs(y), 0.0, fmt.data_max)
    _, exponent = jnp.frexp(magnitude)  # floor(log2 |y|) + 1
    spacing = jnp.ldexp(
        jnp.ones_like(magnitude), jnp.maximum(exponent - 1, info.minexp) - info.nmant
    )
    steps = magnitude / spacing
    lower = jnp.floor(steps)
    up = jax.random.uniform(_typed_key(key), y.shape, _F32) < steps - lower
    rounded = jnp.minimum((lower + up.astype(_F32)) * spacing, fmt.data_max)
    return jnp.where(jnp.isfinite(y), jnp.copysign(rounded, y), y).astype(fmt.data)


def _typed_key(key: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


def _rounded(y: jax.Array, fmt: BlockFormat, key: jax.Array | None) -> jax.Array:
    """``y`` in ``fmt.data``: to nearest without a key, stochastically with one."""
    if key is None:
        return _saturated(y, fmt.data_max, fmt.data)
    return _stochastic(y, fmt, key)


def _mx_quantize(
    blocks: jax.Array, fmt: BlockFormat, key: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """OCP MX: the scale exponent ``floor(log2(amax)) - emax``, written as e8m0 bits."""
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    _, exponent = jnp.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2) + 1
    shared = jnp.clip(exponent - 1 - fmt.emax, -_E8M0_BIAS, _E8M0_BIAS)
    shared = jnp.where(amax > 0, shared, -_E8M0_BIAS)
    finite = jnp.isfinite(amax)
    bits = jnp.where(finite, shared + _E8M0_BIAS, 0xFF).astype(jnp.uint8)
    scales = lax.bitcast_convert_type(bits, fmt.scale)
    # Dividing by 2**shared is exact: scaling by a power of two, one step, no subnormal scale.
    values = jnp.ldexp(blocks, (-jnp.where(finite, shared, 0)).astype(jnp.int32))
    return _rounded(values, fmt, key), scales[..., 0]


def _nv_quantize(
    blocks: jax.Array, fmt: BlockFormat, key: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """NVFP4: a float32 tensor scale that maps amax to ``6 * 448``, e4m3 block scales. Under a
    ``shard_map`` the amax is the whole tensor's, taken over the axes it is sharded over (the
    rule of Transformer Engine), so each shard quantizes as its part of the whole tensor does;
    under ``jit`` the reduction is the whole tensor's already."""
    scale_max = float(jnp.finfo(fmt.scale).max)
    amax = jnp.max(jnp.abs(blocks))
    if sharded := jax_compat.varying_axes(blocks):
        amax = lax.pmax(amax, sharded)
    tensor = jnp.where(
        jnp.isfinite(amax), jnp.where(amax > 0, amax / (fmt.data_max * scale_max), 1.0), jnp.nan
    ).astype(_F32)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scales = jnp.clip(block_amax / fmt.data_max / tensor, 0.0, scale_max).astype(fmt.scale)
    divisor = scales.astype(_F32) * tensor
    values = jnp.where(divisor > 0, blocks / jnp.where(divisor > 0, divisor, 1.0), 0.0)
    values = jnp.where(jnp.isfinite(blocks), values, blocks)
    return _rounded(values, fmt, key), scales[..., 0], tensor


def _quantized_blocks(
    blocks: jax.Array, fmt: BlockFormat, key: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    if fmt.tensor_scale:
        return _nv_quantize(blocks, fmt, key)
    data, scales = _mx_quantize(blocks, fmt, key)
    return data, scales, jnp.ones((), _F32)


def _barrier(data: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Where no block-scaled kernel takes the values, XLA dequantizes them, and its
    # SimplifyFPConversions (on by default) would fold f32 -> e4m3 -> bf16 into one conversion:
    # the GEMM would multiply unrounded values. The barrier keeps the rounding.
    return lax.optimization_barrier((data, scales))


def quantize(
    x: jax.Array, format: BlockFormat | str = "mxfp8", *, key: jax.Array | None = None
) -> BlockQuantized:
    """``x`` in the block ``format``, blocked along its last axis (a multiple of the block size).

    Computed in float32 whatever ``x``'s dtype. The values round to nearest (ties to even);
    with a ``key``, stochastically (unbiased: the expected dequantized value of each element is
    the element divided by its scales and multiplied back, saturation aside), the draws a
    function of the key alone, so one key gives one result.

    Args:
      x: the tensor.
      format: ``"mxfp8"``, ``"nvfp4"`` or a :class:`BlockFormat`.
      key: a PRNG key (typed, or raw key data) for stochastic rounding; None rounds to nearest.

    Raises:
      ValueError: for an unknown format or a last axis that is not a multiple of its block.

    >>> import jax.numpy as jnp
    >>> q = quantize(jnp.arange(32.0).reshape(1, 32))  # amax 31: scale 2**(4 - 8)
    >>> q.scales.astype(jnp.float32).tolist(), q.data[0, -1].astype(jnp.float32).item()
    ([[0.0625]], 448.0)
    """
    fmt = block_format(format)
    x = jnp.asarray(x)
    data, scales, tensor = _quantized_blocks(_blocks(x.astype(_F32), fmt.block), fmt, key)
    data, scales = _barrier(data.reshape(x.shape), scales)
    return BlockQuantized(data, scales, tensor)


def _tiles_of(x: jax.Array, tile: int) -> jax.Array:
    """``x (..., R, C)`` as ``(..., R / tile, C / tile, tile * tile)``: each tile's values."""
    *lead, rows, cols = x.shape
    if rows % tile or cols % tile:
        raise ValueError(
            f"A tile-quantized operand's last two axes must be multiples of the tile size {tile}; "
            f"got shape {tuple(x.shape)}."
        )
    tiles = x.reshape(*lead, rows // tile, tile, cols // tile, tile)
    return jnp.swapaxes(tiles, -3, -2).reshape(*lead, rows // tile, cols // tile, tile * tile)


def _untiled(tiles: jax.Array, tile: int) -> jax.Array:
    *lead, row_tiles, col_tiles, _ = tiles.shape
    x = tiles.reshape(*lead, row_tiles, col_tiles, tile, tile)
    return jnp.swapaxes(x, -3, -2).reshape(*lead, row_tiles * tile, col_tiles * tile)


def quantize_tiles(x: jax.Array, format: BlockFormat | str = "nvfp4") -> BlockQuantized:
    """``x (..., R, C)`` in the block ``format`` with one scale per ``block x block`` tile of
    its last two axes (2D blocks: NVFP4's recipe quantizes weights so), rounded to nearest.

    The result is blocked along the last axis like :func:`quantize`'s (its ``scales`` hold each
    tile's scale once per row of the tile), so it feeds a GEMM that contracts ``C``;
    :func:`transpose_tiles` gives the same values blocked along ``R``, for the GEMM that
    contracts ``R``: both GEMMs multiply one quantized tensor.

    Raises:
      ValueError: for an unknown format, or last two axes that are not multiples of its block.

    >>> import jax.numpy as jnp
    >>> w = jnp.ones((32, 32)).at[:16, :16].set(4.0)
    >>> q = quantize_tiles(w)  # a tile of 4s, three of 1s: each its scale, values all 6
    >>> q.scales.shape, sorted(set(q.scales.astype(jnp.float32).ravel().tolist()))
    ((32, 2), [112.0, 448.0])
    """
    fmt = block_format(format)
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(
            f"quantize_tiles takes a tensor of at least two axes; got shape {tuple(x.shape)}."
        )
    tiles = _tiles_of(x.astype(_F32), fmt.block)
    data, scales, tensor = _quantized_blocks(tiles, fmt, None)
    data = _untiled(data, fmt.block)
    data, scales = _barrier(data, jnp.repeat(scales, fmt.block, axis=-2))
    return BlockQuantized(data, scales, tensor)


def transpose_tiles(q: BlockQuantized) -> BlockQuantized:
    """A :func:`quantize_tiles` result for the transposed tensor (its last two axes swapped),
    blocked along the new last axis: the same quantized values and tile scales."""
    rows, cols = q.data.shape[-2:]
    block = cols // q.scales.shape[-1]
    tile_scales = q.scales[..., ::block, :]  # (..., R / block, C / block)
    scales = jnp.repeat(jnp.swapaxes(tile_scales, -1, -2), block, axis=-2)
    return BlockQuantized(jnp.swapaxes(q.data, -1, -2), scales, q.tensor_scale)


# --- The random Hadamard transform --------------------------------------------------------------

HADAMARD_SIZES = (16,)
"""The sizes :func:`hadamard_transform` takes: NVIDIA's recipe transforms in blocks of 16, the
NVFP4 block."""
# One fixed random sign vector (drawn once, by a fair coin), shared by every transform, as in
# NVIDIA's recipe. Any fixed signs keep the transform orthogonal.
_HADAMARD_SIGNS = np.array(
    [1, -1, -1, 1, 1, 1, -1, 1, -1, -1, 1, -1, 1, 1, -1, -1], dtype=np.float32
)


def hadamard_matrix(size: int = 16) -> np.ndarray:
    """The random Hadamard matrix of :func:`hadamard_transform`: ``H diag(s) / sqrt(size)``,
    ``H`` Sylvester's ``size x size`` Hadamard matrix (``H[i, j] = (-1)**popcount(i & j)``)
    and ``s`` the fixed sign vector; orthogonal, its entries ``±1 / sqrt(size)``."""
    _check_hadamard_size(size)
    i = np.arange(size)
    parity = np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :])
    sylvester = np.where(parity, -1.0, 1.0).astype(np.float32)
    return sylvester * _HADAMARD_SIGNS[None, :size] / np.float32(np.sqrt(size))


def _check_hadamard_size(size: Any) -> None:
    if isinstance(size, bool) or size not in HADAMARD_SIZES:
        raise ValueError(
            f"hadamard_transform(size=...) must be one of {', '.join(map(str, HADAMARD_SIZES))}; "
            f"got {size!r}."
        )


def hadamard_transform(x: jax.Array, size: int = 16) -> jax.Array:
    """``x`` with each run of ``size`` consecutive values along its last axis multiplied by
    :func:`hadamard_matrix`: ``v -> H diag(s) v / sqrt(size)``, in float32.

    The matrix is orthogonal, so the transform keeps dot products along the last axis: two
    operands that contract that axis, both transformed, multiply to the same result (up to
    float32 rounding). It runs as a fast Walsh-Hadamard transform (``log2(size)`` stages of
    sums and differences, no matmul).

    Raises:
      ValueError: for a ``size`` not in :data:`HADAMARD_SIZES`, or a last axis that is not a
        multiple of it.

    >>> import jax.numpy as jnp
    >>> y = hadamard_transform(jnp.zeros(16).at[0].set(4.0))  # a spike spreads evenly
    >>> sorted(set(jnp.abs(y).tolist()))
    [1.0]
    """
    _check_hadamard_size(size)
    x = jnp.asarray(x).astype(_F32)
    *lead, k = x.shape
    if k % size:
        raise ValueError(
            f"hadamard_transform: the last axis must be a multiple of size={size}; got shape "
            f"{tuple(x.shape)}."
        )
    v = x.reshape(-1, size) * _HADAMARD_SIGNS[:size]
    half = size // 2
    while half:  # Sylvester's recursion, H_2n = [[H_n, H_n], [H_n, -H_n]]: one stage per level
        pairs = v.reshape(-1, size // (2 * half), 2, half)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = jnp.stack([a + b, a - b], axis=2).reshape(-1, size)
        half //= 2
    return (v * np.float32(1 / np.sqrt(size))).reshape(x.shape)


def dequantize(q: BlockQuantized, dtype: Any = jnp.float32) -> jax.Array:
    """The values ``q`` stands for, ``data * block scale * tensor scale``, in ``dtype``."""
    data = q.data.astype(_F32)
    block = data.shape[-1] // q.scales.shape[-1]
    blocks = data.reshape(*data.shape[:-1], q.scales.shape[-1], block)
    values = blocks * q.scales.astype(_F32)[..., None] * q.tensor_scale
    return values.reshape(data.shape).astype(dtype)


# --- The matmul -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How an operand of a ``dot_general`` becomes the ``(B, M, K)`` of a scaled matmul:
    batch axes, then kept axes, then contracted ones (in the order the dimension numbers pair
    them), flattened into three."""

    permutation: tuple[int, ...]
    shape: tuple[int, ...]  # the operand's shape after the permutation
    sizes: tuple[int, int, int]  # (B, M, K)

    @classmethod
    def of(cls, shape: tuple[int, ...], batch: Sequence[int], contract: Sequence[int]):
        kept = fp8.kept_axes(len(shape), batch, contract)
        permutation = (*batch, *kept, *contract)
        b, m, k = (math.prod(shape[a] for a in axes) for axes in (batch, kept, contract))
        return cls(tuple(permutation), tuple(shape[a] for a in permutation), (b, m, k))

    def to_bmk(self, x: jax.Array) -> jax.Array:
        return jnp.transpose(x, self.permutation).reshape(self.sizes)

    def from_bmk(self, x: jax.Array) -> jax.Array:
        inverse = tuple(int(i) for i in np.argsort(self.permutation))
        return jnp.transpose(x.reshape(self.shape), inverse)


def _canonical(dimension_numbers: Any) -> tuple:
    """``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` as tuples of ints, hashable
    (the custom VJP takes them as a static argument)."""
    (lc, rc), (lb, rb) = dimension_numbers
    return tuple(
        tuple(tuple(int(a) for a in axes) for axes in pair) for pair in ((lc, rc), (lb, rb))
    )


def _layouts(lhs_shape, rhs_shape, dimension_numbers) -> tuple[_Layout, _Layout]:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    return (
        _Layout.of(tuple(lhs_shape), lhs_batch, lhs_contract),
        _Layout.of(tuple(rhs_shape), rhs_batch, rhs_contract),
    )


def unaligned(
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    dimension_numbers: Any,
    format: BlockFormat | str = "mxfp8",
) -> str | None:
    """Why a ``dot_general`` of these shapes cannot run block-scaled in ``format``, or None
    when it can: each of its three GEMMs contracts an axis whose size must be a multiple of
    the format's block (the contraction K forward; the rhs's kept size N and the lhs's kept
    size M, for the two backward GEMMs). The same sizes make NVFP4's 16 x 16 weight tiles and
    16-value Hadamard transforms fit."""
    fmt = block_format(format)
    lhs, rhs = _layouts(lhs_shape, rhs_shape, dimension_numbers)
    sizes = (("K", lhs.sizes[2]), ("N", rhs.sizes[1]), ("M", lhs.sizes[1]))
    wrong = [f"{name}={size}" for name, size in sizes if size % fmt.block]
    if not wrong:
        return None
    return (
        f"{', '.join(wrong)} not a multiple of {fmt.name}'s block of {fmt.block}"
        f" (lhs {tuple(lhs_shape)}, rhs {tuple(rhs_shape)})"
    )


class _Recipe(NamedTuple):
    """The NVFP4 recipe's ingredients a ``dot_general`` runs with (all off for MXFP8), and
    whether the caller gave the stochastic rounding's key."""

    hadamard: bool
    stochastic_rounding: bool
    weight_blocks_2d: bool
    explicit_key: bool


def _product(qa: BlockQuantized, qb: BlockQuantized, out: np.dtype) -> jax.Array:
    """``a (B, M, K) x b (B, N, K) -> (B, M, N)`` of two operands quantized along K."""
    if qa.data.dtype != E2M1:
        return jax.nn.scaled_matmul(qa.data, qb.data, qa.scales, qb.scales, out)
    product = jax.nn.scaled_matmul(qa.data, qb.data, qa.scales, qb.scales, _F32)
    return (product * (qa.tensor_scale * qb.tensor_scale)).astype(out)


def _weight(r3: jax.Array, fmt: BlockFormat, recipe: _Recipe) -> BlockQuantized:
    """The weight ``(B, N, K)`` quantized for the forward GEMM, along K."""
    return quantize_tiles(r3, fmt) if recipe.weight_blocks_2d else quantize(r3, fmt)


# The seed of the stochastic rounding's key when the caller gives none: the key is then made
# from it and the bits of the gradient being rounded.
_GRADIENT_SEED = 0x4E564634


def _gradient_key(g: jax.Array) -> jax.Array:
    """A key from the bits of ``g``: two wrapping sums (of the bits, and of the bits times an
    odd constant xor their high half), folded into a fixed seed. The same gradient gives the
    same key (a step is reproducible and a resumed run repeats it), another step's or another
    device's gradient another key."""
    bits = lax.bitcast_convert_type(g.astype(_F32), jnp.uint32)
    total = jnp.sum(bits, dtype=jnp.uint32)
    mixed = jnp.sum((bits * np.uint32(0x9E3779B1)) ^ (bits >> 16), dtype=jnp.uint32)
    key = jax.random.fold_in(jax.random.key(_GRADIENT_SEED), total)
    return jax.random.key_data(jax.random.fold_in(key, mixed))


def _forward(lhs, rhs, key, dimension_numbers, name, recipe):
    fmt = FORMATS[name]
    lhs_layout, rhs_layout = _layouts(lhs.shape, rhs.shape, dimension_numbers)
    l3, r3 = lhs_layout.to_bmk(lhs), rhs_layout.to_bmk(rhs)
    out = _product(quantize(l3, fmt), _weight(r3, fmt, recipe), np.dtype(lhs.dtype))
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    shape = (
        *(lhs.shape[a] for a in lhs_batch),
        *(lhs.shape[a] for a in fp8.kept_axes(lhs.ndim, lhs_batch, lhs_contract)),
        *(rhs.shape[a] for a in fp8.kept_axes(rhs.ndim, rhs_batch, rhs_contract)),
    )
    return out.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dot(lhs, rhs, key, dimension_numbers, name, recipe):
    return _forward(lhs, rhs, key, dimension_numbers, name, recipe)


def _dot_fwd(lhs, rhs, key, dimension_numbers, name, recipe):
    return _forward(lhs, rhs, key, dimension_numbers, name, recipe), (lhs, rhs, key)


def _dot_bwd(dimension_numbers, name, recipe, residuals, g):
    lhs, rhs, key = residuals
    fmt = FORMATS[name]
    lhs_layout, rhs_layout = _layouts(lhs.shape, rhs.shape, dimension_numbers)
    l3, r3 = lhs_layout.to_bmk(lhs), rhs_layout.to_bmk(rhs)
    g3 = g.reshape(l3.shape[0], l3.shape[1], r3.shape[1]).astype(lhs.dtype)
    input_key = weight_key = None
    if recipe.stochastic_rounding:
        base = key if recipe.explicit_key else _gradient_key(g3)
        input_key, weight_key = (jax.random.fold_in(_typed_key(base), i) for i in (1, 2))
    # dlhs (B, M, K) = g (B, M, N) . rhs (B, N, K): contract N, the weight as the forward saw it.
    if recipe.weight_blocks_2d:
        weight_t = transpose_tiles(quantize_tiles(r3, fmt))
    else:
        weight_t = quantize(jnp.swapaxes(r3, 1, 2), fmt)
    dlhs = _product(quantize(g3, fmt, key=input_key), weight_t, np.dtype(lhs.dtype))
    # drhs (B, N, K) = g^T (B, N, M) . lhs^T (B, K, M): contract M, the tokens.
    g_t, lhs_t = jnp.swapaxes(g3, 1, 2), jnp.swapaxes(l3, 1, 2)
    if recipe.hadamard:
        g_t, lhs_t = hadamard_transform(g_t), hadamard_transform(lhs_t)
    drhs = _product(quantize(g_t, fmt, key=weight_key), quantize(lhs_t, fmt), np.dtype(rhs.dtype))
    key_cotangent = np.zeros(key.shape, jax.dtypes.float0)
    return lhs_layout.from_bmk(dlhs), rhs_layout.from_bmk(drhs), key_cotangent


_dot.defvjp(_dot_fwd, _dot_bwd)


_warn_emulation = contextvars.ContextVar("mpjax_block_scaled_warn_emulation", default=True)
_warned: set[tuple[str, str]] = set()


@contextlib.contextmanager
def compiling_for_target() -> Any:
    """Traces block-scaled matmuls without the emulation warning: for a compile whose target
    is not this process's backend (:func:`mpjax.plan`, which says itself whether its target
    has the kernels)."""
    token = _warn_emulation.set(False)
    try:
        yield
    finally:
        _warn_emulation.reset(token)


def native_backend() -> tuple[str, bool]:
    """The default backend's name, and whether XLA compiles ``jax.nn.scaled_matmul`` to
    block-scaled GEMM kernels there: cuDNN's need an NVIDIA GPU of compute capability 10 or
    more (Blackwell); elsewhere XLA expands it into a dequantization and an ordinary dot."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend, False
    device = jax.devices()[0]
    capability = str(getattr(device, "compute_capability", ""))
    major = capability.split(".")[0]
    native = major.isdigit() and int(major) >= 10
    return f"{device.device_kind}, compute capability {capability or 'unknown'}", native


def _warn_if_emulated(fmt: BlockFormat) -> None:
    if not _warn_emulation.get():
        return
    backend, native = native_backend()
    if native or (fmt.name, backend) in _warned:
        return
    _warned.add((fmt.name, backend))
    warnings.warn(
        f"{fmt.name} matmuls run emulated on this backend ({backend}): it has no "
        "block-scaled GEMM kernels (Blackwell GPUs, compute capability 10 and up, have them), "
        "so they are dequantized and multiplied in the compute dtype: the numbers of the "
        "format, none of its speed. mpjax.plan(fn, 'b200') shows what a B200 runs.",
        EmulationWarning,
        stacklevel=3,
    )


def _recipe_ingredients(format: BlockFormat | str, **flags: bool | None) -> dict[str, bool]:
    """Each of NVFP4's recipe ingredients (:data:`mpjax.fp8.NVFP4_INGREDIENTS`) on or off for
    ``format``: a flag left None takes the format's default (on for NVFP4; MXFP8 has none).

    Raises:
      ValueError: for an ingredient set on MXFP8, naming it and the format that takes it.
      TypeError: for a flag that is not a bool or None.
    """
    fmt = block_format(format)
    resolved = {}
    for name in fp8.NVFP4_INGREDIENTS:
        flag = flags.get(name)
        if flag is not None and not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True, False or None; got {flag!r}.")
        if flag is not None and fmt is not NVFP4 and flag:
            raise ValueError(
                f"{name}=True is an ingredient of NVFP4's training recipe; format "
                f"{fmt.name!r} takes none (format='nvfp4' does)."
            )
        resolved[name] = bool(fmt is NVFP4 if flag is None else flag)
    return resolved


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    format: BlockFormat | str = "mxfp8",
    *,
    hadamard: bool | None = None,
    stochastic_rounding: bool | None = None,
    weight_blocks_2d: bool | None = None,
    key: jax.Array | None = None,
    precision: Any = None,
) -> jax.Array:
    """``lax.dot_general`` with block-scaled operands, forward and backward.

    Both operands are cast to the wider of their two dtypes (the compute dtype: bfloat16,
    float16 or float32, which the result has), quantized along the contraction in ``format``
    and multiplied by ``jax.nn.scaled_matmul``. Under ``jax.grad`` the incoming gradient
    and the saved operands are quantized along each backward GEMM's contraction, in the same
    format: all three GEMMs run block-scaled.

    NVFP4 runs NVIDIA's training recipe (this module's docstring), each ingredient on unless
    turned off: the ``rhs`` is taken as the weight for the 2D blocks (``x @ w``, as Flax's and
    most JAX layers multiply).

    Args:
      lhs, rhs: the operands.
      dimension_numbers: as for ``lax.dot_general``.
      format: ``"mxfp8"``, ``"nvfp4"`` or a :class:`BlockFormat`.
      hadamard: NVFP4: a random Hadamard transform on both inputs of the weight-gradient GEMM
        (default on).
      stochastic_rounding: NVFP4: the output gradient rounded stochastically in both gradient
        GEMMs (default on).
      weight_blocks_2d: NVFP4: the ``rhs`` quantized in 16 x 16 tiles (default on).
      key: the stochastic rounding's PRNG key (typed or raw key data). None makes one from the
        bits of the gradient being rounded: reproducible (the same step rounds the same way,
        and a resumed run repeats it), different at each step and on each device, nothing to
        carry or checkpoint.
      precision: must be None or ``DEFAULT``: block-scaled GEMMs have one precision.

    Raises:
      ValueError: for an unknown format, a recipe ingredient turned on for MXFP8, a precision
        other than the default, a compute dtype other than bf16/f16/f32, or shapes whose
        contractions are not multiples of the block (:func:`unaligned` says which).

    >>> import jax.numpy as jnp
    >>> x, w = jnp.full((32, 64), 3.0, jnp.bfloat16), jnp.full((64, 32), 0.5, jnp.bfloat16)
    >>> dot_general(x, w, (((1,), (0,)), ((), ())))[0, :3]
    Array([96, 96, 96], dtype=bfloat16)
    """
    fmt = block_format(format)
    ingredients = _recipe_ingredients(
        fmt,
        hadamard=hadamard,
        stochastic_rounding=stochastic_rounding,
        weight_blocks_2d=weight_blocks_2d,
    )
    if precision not in (None, lax.Precision.DEFAULT) and precision != (
        lax.Precision.DEFAULT,
        lax.Precision.DEFAULT,
    ):
        raise ValueError(
            f"block_scaled.dot_general(precision=...) must be None (DEFAULT); got {precision!r}."
        )
    with jax.numpy_dtype_promotion("standard"):
        compute = fp8.check_compute_dtype(jnp.promote_types(lhs.dtype, rhs.dtype))
    dimension_numbers = _canonical(dimension_numbers)
    reason = unaligned(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers, fmt)
    if reason is not None:
        raise ValueError(f"block_scaled.dot_general: cannot run in {fmt.name}: {reason}.")
    recipe = _Recipe(**ingredients, explicit_key=key is not None)
    key_data = _key_data(key)
    _warn_if_emulated(fmt)
    return _dot(
        lhs.astype(compute), rhs.astype(compute), key_data, dimension_numbers, fmt.name, recipe
    )


def _key_data(key: Any) -> jax.Array:
    """Raw key data for the custom VJP (a placeholder when there is no key)."""
    if key is None:
        return jnp.zeros((2,), jnp.uint32)
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"dot_general(key=...) must be one PRNG key; got shape {key.shape}.")
        return jax.random.key_data(key)
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.ndim == 1:
        return jnp.asarray(key)
    raise TypeError(
        "dot_general(key=...) must be a PRNG key (jax.random.key(0)) or raw key data "
        f"(jax.random.PRNGKey(0)); got {key!r} of type {type(key).__name__}."
    )
