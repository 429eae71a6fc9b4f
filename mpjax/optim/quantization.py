"""Blockwise quantization of optimizer-state arrays: 8-bit and 4-bit codes with a float32 absmax
per block, as bitsandbytes' 8-bit optimizers and torchao's low-bit optimizers keep their moments.

An array is cut into blocks of ``block_size`` consecutive elements along its **last axis**
(which must be a multiple of the block). Each block keeps its largest magnitude, ``absmax``, in
float32, and each element a code: the index of the nearest entry of a *map* (a sorted table of
values in [-1, 1]) to the element divided by its block's absmax. Dequantizing is the code's
entry times the absmax. The codes have the array's shape (4-bit codes two to a byte, so the last axis
halves) and the absmaxes its leading shape, ``shape[:-1] + (shape[-1] // block_size,)``: an
array sharded along any axis but the last keeps whole blocks on each device, and its absmax can
be sharded like it.

The formats (:data:`~mpjax.optim.quantization.QUANT_FORMATS`, or a :class:`QuantFormat` of
your own):

* ``"dynamic8"``: bitsandbytes' dynamic map (:func:`create_dynamic_map`): a sign, a run of
  leading zero bits that sets the decade (1e-6 to 1), and a linear fraction in the bits left.
  Signed for first moments, unsigned (twice as fine, no sign bit) for second moments. 256
  entries; a uint8 code and 4 / 256 bytes of absmax per element with the default block of 256.
* ``"e4m3"``: float8_e4m3fn codes (stored as their uint8 bit patterns) of the element divided by
  ``absmax / 448``, so the block's largest magnitude lands on e4m3's largest, 448 (torchao's
  ``AdamWFp8``). Relative precision 2**-4 at every magnitude above e4m3's subnormals.
* ``"dynamic4"``: 4-bit codes, two per byte, the first element of a pair in the high nibble,
  with the maps of torchao's ``AdamW4bit``: the signed dynamic map with 3 exponent bits
  (``create_dynamic_map(True, 3, 4)``: 0, ±0.0055, ±0.0325, ±0.0775, ±0.2125 ... ±0.8875 and 1)
  for first moments, and for second moments the linear map 1/16, 2/16 ... 1, which has no zero,
  so that a small second moment never becomes a zero denominator. Block of 128 by default.

Rounding is to the nearest entry (a tie goes up), or stochastic: to one of the two entries
around the value, the upper one with probability proportional to the distance from the lower,
so the expected stored value is the value itself wherever it lies within the map.

How codes are found and read. The 8-bit formats compute them: an entry of a dynamic map is one
float32 product of an integer and its decade's constant, so a code decodes in a few operations
and a value's code follows from its decade and fraction, checked against the exact midpoints
around it; e4m3 codes are float8 conversions, and its neighbours a step of the bit pattern.
Other maps (the 4-bit ones, a map of one's own) are tables: searched by bisection and read by a
gather, or on a TPU, where a gather per element costs the table's bytes, compared with every
entry and selected among them. The codes and values are the same whichever way, on every
platform.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "QUANT_FORMATS",
    "QuantFormat",
    "QuantizedArray",
    "create_dynamic_map",
    "dequantize_blockwise",
    "quantize_blockwise",
]

_E4M3_MAX = 448.0


def create_dynamic_map(
    signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8
) -> np.ndarray:
    """bitsandbytes' dynamic quantization map: ``2 ** total_bits`` sorted float32 values.

    The construction of bitsandbytes' ``create_dynamic_map``: for each exponent ``i`` below
    ``max_exponent_bits``, the midpoints of an even grid of ``2 ** (i + total_bits - 1 -
    max_exponent_bits) + 1`` points on [0.1, 1] (twice as many points when unsigned: the sign
    bit becomes a fraction bit), scaled by ``10 ** (i - max_exponent_bits + 1)``, and their
    negatives when signed; then 0 and 1. So ``(True, 7, 8)`` spans the decades 1e-6 to 1 with
    1, 2, 4 ... 64 values each, from 5.5e-7 to 0.99296875 and 1 (and down to -0.99296875: the
    signed map has no -1).

    Each value is computed as one float32 product, ``N * C``: the midpoint ``k`` of a decade of
    ``n`` is ``scale * (2n + 18k + 9) / (20n)``, so ``N = 2n + 18k + 9`` is an exact integer and
    ``C = scale / (20n)`` the decade's constant, rounded once to float32. A code's value can
    then be computed rather than looked up, giving the same float32 on every platform (what
    :func:`quantize_blockwise` does for the 8-bit maps). The entries are within one float32 unit
    in the last place (ulp) of the float64 construction rounded once; bitsandbytes evaluates it
    with float32 ``torch.linspace``, whose entries differ from these by at most three ulps,
    depending on PyTorch's kernels.

    Args:
      signed: with negative values (first moments) or without (second moments).
      max_exponent_bits: how many decades below 1 the map reaches.
      total_bits: 8 (a 256-entry map) or 4 (16 entries).

    Returns:
      A float32 array of ``2 ** total_bits`` strictly increasing values, the last one 1.

    Raises:
      ValueError: for ``total_bits`` other than 4 or 8, or ``max_exponent_bits`` outside 1 to
        ``total_bits - 1``.

    >>> m = create_dynamic_map()
    >>> m.size, float(m[0]), float(m[127]), float(m[128]), float(m[-1])
    (256, -0.992968738079071, 0.0, 5.499999815583578e-07, 1.0)
    """
    if total_bits not in (4, 8):
        raise ValueError(f"create_dynamic_map: total_bits must be 4 or 8, got {total_bits!r}.")
    if not isinstance(max_exponent_bits, int) or not 1 <= max_exponent_bits <= total_bits - 1:
        raise ValueError(
            f"create_dynamic_map: max_exponent_bits must be an integer from 1 to "
            f"{total_bits - 1}, got {max_exponent_bits!r}."
        )
    non_sign_bits = total_bits - 1  # bitsandbytes counts one sign bit even when unsigned
    # (count of midpoints, decade's scale): the midpoints of an even grid of count + 1 points
    decades = [
        (2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)), 10.0 ** (i + 1))
        for i in range(max_exponent_bits)
    ]
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1  # fraction bits no exponent needs
    if extra > 0:
        decades.append((extra, decades[-1][1]))
    values = [np.zeros(1, np.float32), np.ones(1, np.float32)]
    for n, scale in decades:
        midpoints = _decade_values(n, scale / 10.0**max_exponent_bits)
        values += [midpoints, -midpoints] if signed else [midpoints]
    return np.sort(np.concatenate(values))


def _decade_values(n: int, scale: float) -> np.ndarray:
    """The midpoints of an even grid of ``n + 1`` points on ``[0.1 scale, scale]``, each the
    float32 product of the exact integer ``2n + 18k + 9`` and the decade's constant
    ``scale / (20n)`` rounded once (:func:`create_dynamic_map`)."""
    numerators = (2 * n + 18 * np.arange(n) + 9).astype(np.float32)
    return numerators * np.float32(scale / (20 * n))


def check_block_size(value: Any, what: str = "block_size") -> int:
    """Returns ``value`` if it is a positive power of two (an int), else raises a ``ValueError``
    (a ``TypeError`` for a non-integer) naming ``what``.

    >>> check_block_size(96)
    Traceback (most recent call last):
    ...
    ValueError: block_size must be a positive power of two (64, 128, 256...), got 96.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{what} must be a positive power of two (an int such as 256), got {value!r} of "
            f"type {type(value).__name__}."
        )
    if value < 1 or value & (value - 1):
        raise ValueError(f"{what} must be a positive power of two (64, 128, 256...), got {value}.")
    return int(value)


def _check_map(values: Any, what: str) -> tuple[float, ...]:
    """A user map as a tuple of float32 values: 16 or 256 of them, finite, in [-1, 1] and
    strictly increasing, else a ValueError naming ``what``."""
    try:
        arr = np.asarray(values, np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"QuantFormat: {what} must be a sequence of numbers: {error}") from None
    if arr.ndim != 1 or arr.size not in (16, 256):
        raise ValueError(
            f"QuantFormat: {what} must hold 256 values (8-bit codes) or 16 (4-bit codes), got "
            f"shape {arr.shape}."
        )
    arr = arr.astype(np.float32)
    if not np.all(np.isfinite(arr)) or np.max(np.abs(arr)) > 1.0:
        raise ValueError(
            f"QuantFormat: {what} must lie in [-1, 1], got {arr.min()} to {arr.max()}."
        )
    steps = np.diff(arr)
    if np.any(steps <= 0):
        i = int(np.argmax(steps <= 0))
        raise ValueError(
            f"QuantFormat: {what} must be strictly increasing (a code is the index of the "
            f"nearest entry), but entry {i + 1} ({arr[i + 1]}) is not above entry {i} ({arr[i]})."
        )
    return tuple(float(v) for v in arr)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A blockwise quantized storage format: a map for signed and one for unsigned values.

    Build one for a map of your own (``QuantFormat("mine", signed_map=..., unsigned_map=...)``)
    or take a named one from :data:`~mpjax.optim.quantization.QUANT_FORMATS`. The maps are
    checked when the format is made: 256 values (8-bit codes) or 16 (4-bit), in [-1, 1],
    strictly increasing, both of the same size.

    Attributes:
      name: what reports call the format (``"dynamic8"``).
      signed_map: the values a code stands for, relative to its block's absmax, for leaves that
        take both signs (first moments).
      unsigned_map: the same for leaves that are never negative (second moments); the signed
        map when not given. A negative value stored with it rounds to its first entry.
      block_size: the block size when the caller gives none: a positive power of two.
      float8: codes are the float8_e4m3fn bit patterns of ``value / (absmax / 448)`` rather
        than indices into a map (the ``"e4m3"`` format); the maps then list e4m3's values
        divided by 448.
    """

    name: str
    signed_map: tuple[float, ...]
    unsigned_map: tuple[float, ...] | None = None
    block_size: int = 256
    float8: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"QuantFormat: name must be a non-empty string, got {self.name!r}.")
        if self.float8:
            # The grid of e4m3 values, relative to 448: what its codes can stand for.
            grid = tuple(float(v) for v in _e4m3_values() / _E4M3_MAX)
            signed, unsigned = grid, grid
        else:
            signed = _check_map(self.signed_map, "signed_map")
            unsigned = (
                signed
                if self.unsigned_map is None
                else _check_map(self.unsigned_map, "unsigned_map")
            )
            if len(unsigned) != len(signed):
                raise ValueError(
                    f"QuantFormat: signed_map has {len(signed)} values and unsigned_map "
                    f"{len(unsigned)}; both maps of a format have the same number of codes."
                )
        object.__setattr__(self, "signed_map", signed)
        object.__setattr__(self, "unsigned_map", unsigned)
        object.__setattr__(
            self, "block_size", check_block_size(self.block_size, "QuantFormat block_size")
        )

    @property
    def bits(self) -> int:
        """The bits of a code, 8 or 4."""
        return 8 if self.float8 or len(self.signed_map) == 256 else 4

    def map(self, signed: bool) -> np.ndarray:
        """The signed or unsigned map, as float32."""
        return np.asarray(self.signed_map if signed else self.unsigned_map, np.float32)

    def __repr__(self) -> str:
        return f"QuantFormat({self.name!r}, {self.bits}-bit, block_size={self.block_size})"


def _e4m3_values() -> np.ndarray:
    """Every finite float8_e4m3fn value once (a single zero), sorted, as float32."""
    values = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    return np.unique(values[np.isfinite(values)])


#: The named formats, ``"dynamic8"``, ``"e4m3"`` and ``"dynamic4"`` (the module's text says
#: what each is).
QUANT_FORMATS: dict[str, QuantFormat] = {
    "dynamic8": QuantFormat(
        "dynamic8",
        tuple(create_dynamic_map(True)),
        tuple(create_dynamic_map(False)),
        block_size=256,
    ),
    "e4m3": QuantFormat("e4m3", (), block_size=256, float8=True),
    "dynamic4": QuantFormat(
        "dynamic4",
        tuple(create_dynamic_map(True, 3, 4)),
        tuple(np.arange(1, 17, dtype=np.float64) / 16),
        block_size=128,
    ),
}


def quant_format(value: Any, what: str = "format") -> QuantFormat:
    """The :class:`QuantFormat` ``value`` names (a key of
    :data:`~mpjax.optim.quantization.QUANT_FORMATS`) or is.

    Raises:
      ValueError: for an unknown name, listing the valid ones.
      TypeError: for anything else.

    >>> quant_format("dynamic8").bits, quant_format("dynamic4").block_size
    (8, 128)
    """
    if isinstance(value, QuantFormat):
        return value
    if isinstance(value, str):
        if value in QUANT_FORMATS:
            return QUANT_FORMATS[value]
        raise ValueError(
            f"{what} must be one of {tuple(QUANT_FORMATS)} or a QuantFormat, got {value!r}."
        )
    raise TypeError(
        f"{what} must be a format name {tuple(QUANT_FORMATS)} or a QuantFormat, got {value!r} of "
        f"type {type(value).__name__}."
    )


def unquantizable_reason(shape: Sequence[int], fmt: QuantFormat, block_size: int) -> str | None:
    """Why an array of ``shape`` cannot be stored blockwise in ``fmt`` with ``block_size``, or
    None if it can: blocks run along the last axis, which must be a multiple of the block (and
    of two, for 4-bit codes, which share a byte)."""
    if len(shape) == 0:
        return "a scalar has no axis to cut into blocks"
    if shape[-1] % block_size:
        return f"its last axis, {shape[-1]}, is not a multiple of block_size {block_size}"
    if fmt.bits == 4 and shape[-1] % 2:
        return f"its last axis, {shape[-1]}, is odd, and 4-bit codes are stored two to a byte"
    return None


@jax.tree_util.register_pytree_with_keys_class
class QuantizedArray:
    """A float32 array stored blockwise quantized: what :func:`quantize_blockwise` returns and
    :func:`mpjax.quantized_state` keeps in place of a moment.

    A pytree whose children are the two arrays; the format, the map's sign and the block size
    are static (part of the tree structure, as a dtype is part of an array's type).

    Attributes:
      codes: uint8, the array's shape (4-bit codes: the last axis halved, two codes a byte, the
        first in the high nibble; e4m3: the float8_e4m3fn bit patterns).
      absmax: float32, the largest magnitude of each block: ``shape[:-1] + (shape[-1] //
        block_size,)``.
      format: the :class:`QuantFormat`.
      signed: whether the codes index the signed map or the unsigned one.
      block_size: the elements in a block, along the last axis.
    """

    __slots__ = ("absmax", "block_size", "codes", "format", "signed")

    def __init__(
        self, codes: Any, absmax: Any, format: QuantFormat, signed: bool, block_size: int
    ) -> None:
        self.codes = codes
        self.absmax = absmax
        self.format = format
        self.signed = signed
        self.block_size = block_size

    def tree_flatten(self) -> tuple[tuple[Any, Any], tuple[QuantFormat, bool, int]]:
        return (self.codes, self.absmax), (self.format, self.signed, self.block_size)

    def tree_flatten_with_keys(self) -> tuple[tuple[Any, ...], tuple[QuantFormat, bool, int]]:
        keys = (jax.tree_util.GetAttrKey("codes"), jax.tree_util.GetAttrKey("absmax"))
        return tuple(zip(keys, (self.codes, self.absmax))), (
            self.format,
            self.signed,
            self.block_size,
        )

    @classmethod
    def tree_unflatten(cls, aux: tuple[QuantFormat, bool, int], children: Any) -> QuantizedArray:
        codes, absmax = children
        fmt, signed, block_size = aux
        return cls(codes, absmax, fmt, signed, block_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array the codes stand for."""
        shape = tuple(np.shape(self.codes))
        return shape[:-1] + (shape[-1] * 2,) if self.format.bits == 4 else shape

    @property
    def nbytes(self) -> int:
        """The bytes of codes and absmaxes together."""
        return sum(
            int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
            for x in (self.codes, self.absmax)
        )

    def dequantize(self) -> jax.Array:
        """The float32 array the codes stand for (:func:`dequantize_blockwise`)."""
        return dequantize_blockwise(self)

    def __repr__(self) -> str:
        sign = "signed" if self.signed else "unsigned"
        return (
            f"QuantizedArray({self.format.name}, {sign}, shape={self.shape}, "
            f"block_size={self.block_size})"
        )


def _typed_key(key: Any) -> jax.Array:
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.ndim == 1:
        return jax.random.wrap_key_data(jnp.asarray(key))
    raise TypeError(
        "quantize_blockwise: stochastic rounding needs key, a PRNG key (jax.random.key(0)) or "
        f"raw key data (jax.random.PRNGKey(0)), got {key!r}."
    )


def quantize_blockwise(
    x: Any,
    format: str | QuantFormat = "dynamic8",
    *,
    signed: bool = True,
    block_size: int | None = None,
    rounding: str = "nearest",
    key: Any = None,
) -> QuantizedArray:
    """Quantizes ``x`` blockwise along its last axis (bitsandbytes' ``quantize_blockwise``).

    Each block of ``block_size`` consecutive elements along the last axis is divided by its
    largest magnitude (its absmax; e4m3: by ``absmax / 448``) and each element stored as the
    code of the nearest map entry (a tie goes to the upper one), or with ``rounding=
    "stochastic"`` of one of the two entries around it, the upper one with probability
    ``(v - lower) / (upper - lower)``. A block of zeros keeps absmax 0 and decodes to zeros.
    Values beyond the map's ends (``-1`` with bitsandbytes' signed map, whose lowest entry is
    -0.99296875; a negative value with an unsigned map) go to the end entry. With the unsigned
    map a positive value never becomes 0, however small: it takes the smallest positive entry
    instead (a second moment of 0 under a first moment that is not would turn Adam's update
    into the first moment over epsilon; torchao's 4-bit unsigned map has no 0 for the same
    reason). Non-finite values have no code.

    Args:
      x: a floating-point array, its last axis a multiple of ``block_size``; computed in
        float32.
      format: a name in :data:`~mpjax.optim.quantization.QUANT_FORMATS` or a :class:`QuantFormat`.
      signed: the signed map (first moments) or the unsigned one (second moments).
      block_size: elements per block, a positive power of two; the format's own by default.
      rounding: ``"nearest"`` or ``"stochastic"``.
      key: a PRNG key (typed or raw key data), for stochastic rounding.

    Returns:
      A :class:`QuantizedArray`.

    Raises:
      ValueError: for an unknown format or rounding, a block size that is not a power of two,
        an array whose last axis is not a multiple of it, or stochastic rounding without a key.
      TypeError: for a non-floating ``x``.

    >>> x = jnp.linspace(-1.0, 1.0, 256)
    >>> q = quantize_blockwise(x, "dynamic8")
    >>> q.codes.dtype, q.absmax
    (dtype('uint8'), Array([1.], dtype=float32))
    >>> float(jnp.max(jnp.abs(q.dequantize() - x)))  # doctest: +ELLIPSIS
    0.00703...
    """
    fmt = quant_format(format)
    block = fmt.block_size if block_size is None else check_block_size(block_size)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(
            f"quantize_blockwise: rounding must be one of ('nearest', 'stochastic'), got "
            f"{rounding!r}."
        )
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(
            f"quantize_blockwise: x must be a floating-point array, got {jnp.result_type(x)}."
        )
    x = jnp.asarray(x, jnp.float32)
    reason = unquantizable_reason(x.shape, fmt, block)
    if reason is not None:
        raise ValueError(f"quantize_blockwise: x of shape {x.shape} cannot be quantized: {reason}.")
    if rounding == "stochastic" and key is None:
        raise ValueError("quantize_blockwise: stochastic rounding needs a PRNG key, got key=None.")
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, n // block, block)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = absmax / _E4M3_MAX if fmt.float8 else absmax
    y = blocks / jnp.where(scale > 0, scale, 1.0)[..., None]
    grid = _e4m3_values() if fmt.float8 else fmt.map(signed)
    if fmt.float8:
        y = jnp.clip(y, -_E4M3_MAX, _E4M3_MAX)
    # With the unsigned map a positive value never becomes 0: a second moment of 0 under a
    # first moment that is not would make the update its first moment over epsilon.
    smallest = int(np.argmax(grid > 0))
    u = None
    if rounding == "stochastic":
        u = jax.random.uniform(_typed_key(key), y.shape, jnp.float32)
    if fmt.float8:
        values = _round_e4m3(y, u)
        if not signed:
            values = jnp.where((y > 0) & (values <= 0), grid[smallest], values)
        codes = jax.lax.bitcast_convert_type(values.astype(jnp.float8_e4m3fn), jnp.uint8)
    else:
        index = _round_to_map(grid, y, u)
        if not signed:
            index = jnp.where((y > 0) & (index < smallest), smallest, index)
        codes = index.astype(jnp.uint8)
    codes = codes.reshape(*lead, n)
    if fmt.bits == 4:
        codes = (codes[..., 0::2] << 4) | codes[..., 1::2]
    return QuantizedArray(codes, absmax, fmt, bool(signed), block)


def _between(y: jax.Array, low: jax.Array, high: jax.Array, u: jax.Array) -> jax.Array:
    """Whether stochastic rounding takes ``high``: with probability ``(y - low) / (high -
    low)``, from the uniform draw ``u``."""
    return u < jnp.clip((y - low) / (high - low), 0.0, 1.0)


def _round_to_map(grid: np.ndarray, y: jax.Array, u: jax.Array | None) -> jax.Array:
    """The int32 codes of ``y`` in the map ``grid``: the nearest entry's (``u`` None; a tie
    goes up) or, stochastically, the entry below or above (``u`` the uniform draws). The 8-bit
    dynamic maps compute them (:class:`_DynamicMap`), other maps search the table."""
    computed = _computed_map(grid)
    if u is None:
        if computed is not None:
            return computed.nearest(y)
        return _search((grid[:-1] + grid[1:]) / np.float32(2), y)
    if computed is not None:
        nearest = computed.nearest(y)
        below = nearest - (y < computed.decode(nearest)).astype(jnp.int32)
        lower = jnp.clip(below, 0, grid.size - 2)
        low, high = computed.decode(lower), computed.decode(lower + 1)
    else:
        lower = jnp.clip(_search(grid, y) - 1, 0, grid.size - 2)
        low, high = _lookup(grid, lower), _lookup(grid, lower + 1)
    return lower + _between(y, low, high, u).astype(jnp.int32)


# The sign bit of float8_e4m3fn's bit patterns.
_E4M3_SIGN = 0x80


def _e4m3_neighbour(values: jax.Array, up: bool) -> jax.Array:
    """The e4m3 value next to each e4m3 ``values`` (float32), above (``up``) or below, by a
    step of its bit pattern: away from zero adds one to the magnitude's bits, toward it takes
    one away, and from zero it goes to the smallest subnormal of the direction's sign. The
    neighbours of the extremes (448 up, -448 down) are not asked for."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float8_e4m3fn), jnp.uint8)
    bits = bits.astype(jnp.int32)
    magnitude, negative = bits & ~_E4M3_SIGN, bits >= _E4M3_SIGN
    away = negative != up
    magnitude, negative = (
        jnp.where(magnitude == 0, 1, jnp.where(away, magnitude + 1, magnitude - 1)),
        jnp.where(magnitude == 0, not up, negative),
    )
    bits = (magnitude | jnp.where(negative, _E4M3_SIGN, 0)).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)


def _round_e4m3(y: jax.Array, u: jax.Array | None) -> jax.Array:
    """``y`` (within +-448) rounded to an e4m3 value, as float32: to nearest (e4m3's own
    conversion, ties to even; ``u`` None), or stochastically to the e4m3 value below or above
    ``y``, found from the nearest one by a step of its bit pattern: the same values a search of
    every e4m3 value gives (the one below 448 and 448 itself, for ``y`` = 448)."""
    nearest = y.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    if u is None:
        return nearest
    low = jnp.where(nearest > y, _e4m3_neighbour(nearest, up=False), nearest)
    low = jnp.minimum(low, np.float32(_e4m3_values()[-2]))  # 448 rounds from the one below
    high = _e4m3_neighbour(low, up=True)
    return jnp.where(_between(y, low, high, u), high, low)


def _search_by_comparison(entries: np.ndarray, y: jax.Array) -> jax.Array:
    return jnp.sum(y[..., None] >= jnp.asarray(entries), axis=-1, dtype=jnp.int32)


def _search_by_bisection(entries: np.ndarray, y: jax.Array) -> jax.Array:
    index = jnp.searchsorted(jnp.asarray(entries), y, side="right", method="scan_unrolled")
    return index.astype(jnp.int32)


def _search(entries: np.ndarray, y: jax.Array) -> jax.Array:
    """How many of the sorted ``entries`` are at most ``y`` (``searchsorted``, side right),
    as int32. On a TPU by comparing ``y`` with every entry: a bisection reads the table once
    a step per element, a gather each, which the TPU runs (and XLA's cost model prices) at the
    whole table's bytes, some 800 times a comparison with all 256 entries of an 8-bit map
    (the 8-bit formats need neither: their codes are computed). Elsewhere by an unrolled
    bisection. The same integers either way."""
    return jax.lax.platform_dependent(
        y,
        tpu=functools.partial(_search_by_comparison, entries),
        default=functools.partial(_search_by_bisection, entries),
    )


def _lookup_by_selection(entries: np.ndarray, index: jax.Array) -> jax.Array:
    table = jnp.asarray(entries)
    chosen = index[..., None] == jnp.arange(table.size, dtype=index.dtype)
    return jnp.sum(jnp.where(chosen, table, np.float32(0)), axis=-1)


def _lookup_by_gather(entries: np.ndarray, index: jax.Array) -> jax.Array:
    return jnp.asarray(entries)[index]


def _lookup(entries: np.ndarray, index: jax.Array) -> jax.Array:
    """``entries[index]`` in float32: on a TPU by selecting among all the entries (a gather per
    element costs a TPU the table's bytes, see :func:`_search`), elsewhere by a gather. The
    same values either way: one entry is selected, the others add zeros."""
    return jax.lax.platform_dependent(
        index,
        tpu=functools.partial(_lookup_by_selection, entries),
        default=functools.partial(_lookup_by_gather, entries),
    )


def _select(index: jax.Array, constants: Sequence[float]) -> jax.Array:
    """``constants[index]`` in float32 for a small table, by a chain of selects (no gather)."""
    out = jnp.full(index.shape, constants[0], jnp.float32)
    for j, value in enumerate(constants[1:], start=1):
        out = jnp.where(index == j, np.float32(value), out)
    return out


def _count_reached(x: jax.Array, thresholds: Sequence[Any]) -> jax.Array:
    """How many of the ``thresholds`` each element of ``x`` reaches (is at least), as int32:
    ``floor(log2(q))`` of a positive integer ``q`` for the powers of two from 2, the decade of
    a value for the powers of ten."""
    count = jnp.zeros(x.shape, jnp.int32)
    for threshold in thresholds:
        count = count + (x >= threshold).astype(jnp.int32)
    return count


@dataclasses.dataclass(frozen=True)
class _DynamicMap:
    """The 8-bit dynamic map (``create_dynamic_map(signed)``) computed instead of looked up.

    Its positive entries below 1 run through 7 decades, decade ``i`` (``10 ** (i - 7)`` to
    ``10 ** (i - 6)``) holding ``n = 2 ** (i + f)`` of them, ``f`` 0 for the signed map and 1
    for the unsigned one; the ``k``-th is ``(2n + 18k + 9) * C_i`` in float32, with ``C_i =
    10 ** (i - 6) / (20n)`` rounded once, as :func:`create_dynamic_map` builds them. So a code
    decodes in some twenty operations, the same float32 on every platform, where a lookup is a
    gather, which a TPU prices at the table's bytes per element (or a select among all 256
    entries); and a value finds its nearest code from its decade and fraction, checked against
    the exact midpoints of its neighbours, where a search compares with up to 255 midpoints.
    """

    signed: bool

    @property
    def _f(self) -> int:
        return 0 if self.signed else 1

    @functools.cached_property
    def _constants(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        c = [np.float32(10.0 ** (i - 6) / (20 * 2 ** (i + self._f))) for i in range(7)]
        return tuple(float(x) for x in c), tuple(float(np.float32(1) / x) for x in c)

    def decode(self, index: jax.Array) -> jax.Array:
        """The entries at int32 ``index`` (0 to 255), as float32: those of the table."""
        if self.signed:  # 0..126 negative, 127 zero, 128..254 positive, 255 one
            negative = index < 127
            p = jnp.where(negative, 126 - index, index - 128)
        else:  # 0 zero, 1..254 positive, 255 one
            negative, p = None, index - 1
        q = p + 2**self._f  # decade i's entries hold q from 2 ** (i + f) to 2 ** (i + f + 1) - 1
        e = _count_reached(q, [2**t for t in range(1, 9)])
        decade = jnp.clip(e - self._f, 0, 6)
        n = jnp.left_shift(jnp.int32(1), decade + self._f)
        numerator = 2 * n + 18 * (q - n) + 9
        value = numerator.astype(jnp.float32) * _select(decade, self._constants[0])
        value = jnp.where(p < 0, np.float32(0), jnp.where(index == 255, np.float32(1), value))
        return value if negative is None else jnp.where(negative, -value, value)

    def _midpoint(self, index: jax.Array) -> jax.Array:
        """The midpoint between entries ``index`` and ``index + 1`` as the table's search takes
        it (their float32 sum halved), -inf below the first and +inf above the last."""
        safe = jnp.clip(index, 0, 254)
        mid = (self.decode(safe) + self.decode(safe + 1)) / np.float32(2)
        return jnp.where(index < 0, -np.inf, jnp.where(index > 254, np.inf, mid))

    def nearest(self, y: jax.Array) -> jax.Array:
        """The code of the entry nearest ``y`` (a tie goes up), as int32: the search of the
        table's midpoints, ``searchsorted(midpoints, y, side="right")``."""
        a = jnp.abs(y) if self.signed else jnp.maximum(y, 0)
        decade = _count_reached(a, [np.float32(10.0 ** (j - 6)) for j in range(6)])
        n = jnp.left_shift(jnp.int32(1), decade + self._f)
        fraction = (a * _select(decade, self._constants[1]) - (2 * n + 9).astype(jnp.float32)) / 18
        k = jnp.clip(jnp.round(fraction), 0, (n - 1).astype(jnp.float32)).astype(jnp.int32)
        p = n - 2**self._f + k
        guess = (jnp.where(y < 0, 126 - p, 128 + p) if self.signed else 1 + p).astype(jnp.int32)
        # The guess is the nearest entry or one of its neighbours (at a decade's edge, or by
        # float32 rounding): one step against the exact midpoints around it settles it.
        up = (y >= self._midpoint(guess)).astype(jnp.int32)
        down = (y < self._midpoint(guess - 1)).astype(jnp.int32)
        return guess + up - down


@functools.cache
def _dynamic_maps() -> tuple[np.ndarray, np.ndarray]:
    return create_dynamic_map(True), create_dynamic_map(False)


def _computed_map(entries: np.ndarray) -> _DynamicMap | None:
    """The :class:`_DynamicMap` whose table ``entries`` is, or None for other maps."""
    for signed, table in zip((True, False), _dynamic_maps()):
        if entries.shape == table.shape and np.array_equal(entries, table):
            return _DynamicMap(signed)
    return None


def dequantize_blockwise(q: QuantizedArray) -> jax.Array:
    """The float32 array ``q``'s codes stand for: each code's map entry (e4m3: its value) times
    its block's absmax (e4m3: ``absmax / 448``).

    Raises:
      TypeError: if ``q`` is not a :class:`QuantizedArray`.

    >>> q = quantize_blockwise(jnp.array([[0.5, -2.0] * 64]), "dynamic4")
    >>> dequantize_blockwise(q)[0, :2]
    Array([ 0.425, -1.775], dtype=float32)
    """
    if not isinstance(q, QuantizedArray):
        raise TypeError(
            f"dequantize_blockwise: q must be a QuantizedArray, got {type(q).__name__}."
        )
    codes = q.codes
    if q.format.bits == 4:
        codes = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*codes.shape[:-1], -1)
    if q.format.float8:
        values = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
        scale = q.absmax / _E4M3_MAX
    else:
        table = q.format.map(q.signed)
        computed = _computed_map(table)
        index = codes.astype(jnp.int32)
        values = _lookup(table, index) if computed is None else computed.decode(index)
        scale = q.absmax
    lead, n = codes.shape[:-1], codes.shape[-1]
    blocks = values.reshape(*lead, n // q.block_size, q.block_size) * scale[..., None]
    return blocks.reshape(*lead, n)
