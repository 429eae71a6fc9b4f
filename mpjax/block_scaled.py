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
quantization of the same operand): all three GEMMs run block-scaled. Under NVFP4 the two
backward GEMMs run in MXFP8: 4-bit gradients need stochastic rounding and random Hadamard
transforms to train (NVIDIA's NVFP4 recipe), which mpjax does not implement. The gradients
reaching the operands are the backward GEMMs' results (a straight-through estimator).

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
    "MXFP8",
    "NVFP4",
    "BlockFormat",
    "BlockQuantized",
    "EmulationWarning",
    "dequantize",
    "dot_general",
    "quantize",
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
# The format of the two backward GEMMs under each forward format.
_GRADIENT_FORMAT = {"mxfp8": MXFP8, "nvfp4": MXFP8}


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


def _mx_quantize(blocks: jax.Array, fmt: BlockFormat) -> tuple[jax.Array, jax.Array]:
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
    return _saturated(values, fmt.data_max, fmt.data), scales[..., 0]


def _nv_quantize(blocks: jax.Array, fmt: BlockFormat) -> tuple[jax.Array, jax.Array, jax.Array]:
    """NVFP4: a float32 tensor scale that maps amax to ``6 * 448``, e4m3 block scales."""
    scale_max = float(jnp.finfo(fmt.scale).max)
    amax = jnp.max(jnp.abs(blocks))
    tensor = jnp.where(
        jnp.isfinite(amax), jnp.where(amax > 0, amax / (fmt.data_max * scale_max), 1.0), jnp.nan
    ).astype(_F32)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scales = jnp.clip(block_amax / fmt.data_max / tensor, 0.0, scale_max).astype(fmt.scale)
    divisor = scales.astype(_F32) * tensor
    values = jnp.where(divisor > 0, blocks / jnp.where(divisor > 0, divisor, 1.0), 0.0)
    values = jnp.where(jnp.isfinite(blocks), values, blocks)
    return _saturated(values, fmt.data_max, fmt.data), scales[..., 0], tensor


def quantize(x: jax.Array, format: BlockFormat | str = "mxfp8") -> BlockQuantized:
    """``x`` in the block ``format``, blocked along its last axis (a multiple of the block size).

    Computed in float32 whatever ``x``'s dtype.

    Raises:
      ValueError: for an unknown format or a last axis that is not a multiple of its block.

    >>> import jax.numpy as jnp
    >>> q = quantize(jnp.arange(32.0).reshape(1, 32))  # amax 31: scale 2**(4 - 8)
    >>> q.scales.astype(jnp.float32).tolist(), q.data[0, -1].astype(jnp.float32).item()
    ([[0.0625]], 448.0)
    """
    fmt = block_format(format)
    x = jnp.asarray(x)
    blocks = _blocks(x.astype(_F32), fmt.block)
    if fmt.tensor_scale:
        data, scales, tensor = _nv_quantize(blocks, fmt)
    else:
        (data, scales), tensor = _mx_quantize(blocks, fmt), jnp.ones((), _F32)
    # Where no block-scaled kernel takes the values, XLA dequantizes them, and its
    # SimplifyFPConversions (on by default) would fold f32 -> e4m3 -> bf16 into one conversion:
    # the GEMM would multiply unrounded values. The barrier keeps the rounding.
    data, scales = lax.optimization_barrier((data.reshape(x.shape), scales))
    return BlockQuantized(data, scales, tensor)


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
    its format's block (the contraction K forward; the rhs's kept size N and the lhs's kept
    size M, for the two backward GEMMs)."""
    fmt = block_format(format)
    gradient = _GRADIENT_FORMAT[fmt.name]
    lhs, rhs = _layouts(lhs_shape, rhs_shape, dimension_numbers)
    sizes = (("K", lhs.sizes[2], fmt), ("N", rhs.sizes[1], gradient), ("M", lhs.sizes[1], gradient))
    wrong = [f"{name}={size}" for name, size, f in sizes if size % f.block]
    if not wrong:
        return None
    return (
        f"{', '.join(wrong)} not a multiple of {fmt.name}'s block of {fmt.block}"
        + ("" if gradient is fmt else f" (its gradients' {gradient.name}: {gradient.block})")
        + f" (lhs {tuple(lhs_shape)}, rhs {tuple(rhs_shape)})"
    )


def _scaled(a: jax.Array, b: jax.Array, fmt: BlockFormat, out: np.dtype) -> jax.Array:
    """``a (B, M, K) x b (B, N, K) -> (B, M, N)`` with both quantized in ``fmt`` along K."""
    qa, qb = quantize(a, fmt), quantize(b, fmt)
    if not fmt.tensor_scale:
        return jax.nn.scaled_matmul(qa.data, qb.data, qa.scales, qb.scales, out)
    product = jax.nn.scaled_matmul(qa.data, qb.data, qa.scales, qb.scales, _F32)
    return (product * (qa.tensor_scale * qb.tensor_scale)).astype(out)


def _forward(lhs, rhs, dimension_numbers, name):
    fmt = FORMATS[name]
    lhs_layout, rhs_layout = _layouts(lhs.shape, rhs.shape, dimension_numbers)
    out = _scaled(lhs_layout.to_bmk(lhs), rhs_layout.to_bmk(rhs), fmt, np.dtype(lhs.dtype))
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    shape = (
        *(lhs.shape[a] for a in lhs_batch),
        *(lhs.shape[a] for a in fp8.kept_axes(lhs.ndim, lhs_batch, lhs_contract)),
        *(rhs.shape[a] for a in fp8.kept_axes(rhs.ndim, rhs_batch, rhs_contract)),
    )
    return out.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dot(lhs, rhs, dimension_numbers, name):
    return _forward(lhs, rhs, dimension_numbers, name)


def _dot_fwd(lhs, rhs, dimension_numbers, name):
    return _forward(lhs, rhs, dimension_numbers, name), (lhs, rhs)


def _dot_bwd(dimension_numbers, name, residuals, g):
    lhs, rhs = residuals
    fmt = _GRADIENT_FORMAT[name]
    lhs_layout, rhs_layout = _layouts(lhs.shape, rhs.shape, dimension_numbers)
    l3, r3 = lhs_layout.to_bmk(lhs), rhs_layout.to_bmk(rhs)
    g3 = g.reshape(l3.shape[0], l3.shape[1], r3.shape[1]).astype(lhs.dtype)
    # dlhs (B, M, K) = g (B, M, N) . rhs (B, N, K): contract N. drhs (B, N, K): contract M.
    dlhs = _scaled(g3, jnp.swapaxes(r3, 1, 2), fmt, np.dtype(lhs.dtype))
    drhs = _scaled(jnp.swapaxes(g3, 1, 2), jnp.swapaxes(l3, 1, 2), fmt, np.dtype(rhs.dtype))
    return lhs_layout.from_bmk(dlhs), rhs_layout.from_bmk(drhs)


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


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    format: BlockFormat | str = "mxfp8",
    *,
    precision: Any = None,
) -> jax.Array:
    """``lax.dot_general`` with block-scaled operands, forward and backward.

    Both operands are cast to the wider of their two dtypes (the compute dtype: bfloat16,
    float16 or float32, which the result has), quantized along the contraction in ``format``
    and multiplied by ``jax.nn.scaled_matmul``. Under ``jax.grad`` the incoming gradient
    and the saved operands are quantized along each backward GEMM's contraction (in MXFP8 for
    both formats) and both backward GEMMs run block-scaled too.

    Args:
      lhs, rhs: the operands.
      dimension_numbers: as for ``lax.dot_general``.
      format: ``"mxfp8"``, ``"nvfp4"`` or a :class:`BlockFormat`.
      precision: must be None or ``DEFAULT``: block-scaled GEMMs have one precision.

    Raises:
      ValueError: for an unknown format, a precision other than the default, a compute dtype
        other than bf16/f16/f32, or shapes whose contractions are not multiples of the block
        (:func:`unaligned` says which).

    >>> import jax.numpy as jnp
    >>> x, w = jnp.full((32, 64), 3.0, jnp.bfloat16), jnp.full((64, 32), 0.5, jnp.bfloat16)
    >>> dot_general(x, w, (((1,), (0,)), ((), ())))[0, :3]
    Array([96, 96, 96], dtype=bfloat16)
    """
    fmt = block_format(format)
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
    _warn_if_emulated(fmt)
    return _dot(lhs.astype(compute), rhs.astype(compute), dimension_numbers, fmt.name)
