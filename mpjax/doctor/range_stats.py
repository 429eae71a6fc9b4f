"""Range statistics: how the magnitudes of a set of values sit against the range of the
low-precision dtypes, computed inside a jitted function and summed on the host.

Each value is looked at in float32 (the dtype of the reference run they come from; float32
subnormals, below ``2**-126``, count as zeros, as XLA flushes them). What a
low-precision dtype would do to it is what rounding it to that dtype (to nearest, ties to
even) would give: it *overflows* when the rounded value is not finite (float8_e4m3fn has no
infinity: its overflow is NaN), becomes *subnormal* when it rounds to a nonzero value below
the smallest normal, and *flushes to zero* when it is nonzero and rounds to zero. Since
rounding is monotonic in the magnitude, each of these is a comparison of ``|x|`` with a float32
bound found once per dtype (:func:`bounds`). The values are counted by binade, each binade
split at the mantissas of those bounds, so the count at or above each bound is exact, and
stays exact under a power-of-two loss scale ``2**k`` (``|x| * 2**k >= b`` is
``|x| >= b * 2**-k``, the same mantissa a binade lower): the shares a loss scale would
overflow or flush come from the same counts.

:func:`summarize` reduces an array to a :class:`RangeStats`-shaped pair of small arrays inside
the trace; :meth:`RangeStats.from_summary` reads it on the host and :meth:`RangeStats.merge`
adds sets of values together.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
"""The low-precision dtypes whose range the statistics measure, by default all of them."""

# floor(log2|x|) of a normal float32 lies in [-126, 127]: one histogram bin each.
LOG2_MIN, LOG2_MAX = -126, 127
_BINS = LOG2_MAX - LOG2_MIN + 1
_FIELDS = ("nonzero", "normal", "overflow")
_TINY = np.float32(np.finfo(np.float32).smallest_normal)
_MANTISSA = (1 << 23) - 1


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Where rounding float32 magnitudes to ``dtype`` changes what they are: ``|x| >= overflow``
    rounds to a non-finite value, ``|x| >= normal`` to a normal one, ``|x| >= nonzero`` to a
    nonzero one (each the smallest float32 for which it does).

    >>> b = bounds("float16")
    >>> float(b.overflow), float(b.nonzero) > 2.0**-25
    (65520.0, True)
    """

    dtype: str
    nonzero: np.float32
    normal: np.float32
    overflow: np.float32


def check_dtypes(dtypes: Any, caller: str) -> tuple[str, ...]:
    """The names of ``dtypes`` (names or dtype objects), each one of :data:`DTYPES`.

    Raises:
      TypeError: if ``dtypes`` is not a sequence of dtypes.
      ValueError: naming the one that is not a low-precision dtype mpjax measures.
    """
    if isinstance(dtypes, (str, bytes)) or not isinstance(dtypes, Iterable):
        raise TypeError(
            f"{caller}(dtypes=...) takes a list of dtypes among {list(DTYPES)}; got {dtypes!r}."
        )
    names = []
    for dtype in dtypes:
        try:
            name = np.dtype(jnp.dtype(dtype)).name
        except TypeError:
            name = None
        if name not in DTYPES:
            raise ValueError(
                f"{caller}(dtypes=...): {dtype!r} is not a dtype whose range mpjax measures; "
                f"the dtypes are {', '.join(DTYPES)}."
            )
        names.append(name)
    return tuple(dict.fromkeys(names))


def _smallest(predicate) -> np.float32:
    """The smallest positive finite float32 for which ``predicate`` (monotonic in the magnitude,
    on float32 arrays) holds, by bisection over bit patterns (ordered like the magnitudes)."""
    lo, hi = 1, int(np.array(np.finfo(np.float32).max, np.float32).view(np.uint32))
    while lo < hi:
        mid = (lo + hi) // 2
        if predicate(np.array([mid], np.uint32).view(np.float32))[0]:
            hi = mid
        else:
            lo = mid + 1
    return np.array([lo], np.uint32).view(np.float32)[0]


@functools.cache
def bounds(dtype: str) -> Bounds:
    """The :class:`Bounds` of one of :data:`DTYPES`, found by rounding float32 values to it."""
    target = np.dtype(jnp.dtype(dtype))
    tiny = np.float32(jnp.finfo(target).smallest_normal)

    def rounded(x):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.abs(x.astype(target).astype(np.float32))

    return Bounds(
        dtype=target.name,
        nonzero=_smallest(lambda x: rounded(x) > 0),
        normal=_smallest(lambda x: rounded(x) >= tiny),
        overflow=_smallest(lambda x: ~np.isfinite(rounded(x))),
    )


def _bits(value: Any) -> int:
    return int(np.array(value, np.float32).view(np.uint32))


@functools.cache
def mantissas() -> tuple[int, ...]:
    """The sorted distinct nonzero mantissa fields (the 23 low bits) of the normal float32
    bounds of :data:`DTYPES`: :func:`summarize` splits each binade at them, so that the count
    of values ``>= b * 2**k`` is exact for every bound ``b`` and power of two ``2**k``."""
    found = {
        _bits(getattr(bounds(d), f)) & _MANTISSA
        for d in DTYPES
        for f in _FIELDS
        if getattr(bounds(d), f) >= _TINY
    }
    return tuple(sorted(found - {0}))


def summary_size() -> int:
    """The length of the counts :func:`summarize` returns."""
    return 4 + _BINS * (len(mantissas()) + 1)


def summarize(x: jax.Array, exclude: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The statistics of the values of ``x`` as two arrays, computed where ``x`` is traced:
    counts (int32: values, non-finite, zeros, values excluded, then the finite nonzero
    magnitudes by binade and, within it, by how many of :func:`mantissas` their mantissa
    reaches) and extremes (float32: the largest finite magnitude, the smallest nonzero one,
    inf when there is none).

    ``exclude`` (booleans, broadcastable to ``x``) marks values that are counted apart and
    left out of everything else: the mask fills of :mod:`mpjax.doctor.side_by_side`.

    One histogram of the magnitudes' bit patterns gives every count: a float32's exponent field
    is its binade (0 for zeros and subnormals, which XLA flushes to zero on CPU and GPU: they
    count as zeros everywhere; all ones for inf and NaN), and comparing its mantissa field with
    each cut splits the binade. The extremes are one reduction of the bit patterns, which are
    ordered like the magnitudes.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).ravel()
    bits = bits & jnp.uint32(0x7FFFFFFF)
    exponent = (bits >> 23).astype(jnp.int32)
    mantissa = (bits & _MANTISSA).astype(jnp.int32)
    cuts = mantissas()
    width = len(cuts) + 1
    part = sum((mantissa >= m).astype(jnp.int32) for m in cuts) if cuts else 0
    index = exponent * width + part
    if exclude is None:
        keep = jnp.ones(bits.shape, bool)
        histogram = jnp.bincount(index, length=256 * width).astype(jnp.int32)
    else:
        keep = ~jnp.broadcast_to(exclude, jnp.shape(x)).ravel()
        weights = keep.astype(jnp.int32)
        histogram = jnp.bincount(index, weights, length=256 * width).astype(jnp.int32)
    excluded = jnp.int32(bits.size) - jnp.sum(keep, dtype=jnp.int32)
    inf = jnp.uint32(0x7F800000)
    largest = jnp.where(keep & (exponent < 255), bits, jnp.uint32(0))
    smallest = jnp.where(keep & (exponent > 0), bits, inf)
    largest, smallest = jax.lax.reduce(
        (largest, smallest),
        (jnp.uint32(0), inf),
        lambda a, b: (jax.lax.max(a[0], b[0]), jax.lax.min(a[1], b[1])),
        (0,),
    )
    # Only inf and NaN above the largest finite value: the smallest nonzero is inf without one.
    smallest = jnp.minimum(smallest, inf)
    extremes = jax.lax.bitcast_convert_type(jnp.stack([largest, smallest]), jnp.float32)
    counts = jnp.concatenate(
        [
            jnp.stack(
                [
                    jnp.int32(bits.size) - excluded,
                    jnp.sum(histogram[255 * width :]),
                    jnp.sum(histogram[:width]),
                    excluded,
                ]
            ),
            histogram[width : 255 * width],
        ]
    )
    return counts, extremes


@dataclasses.dataclass(frozen=True)
class Shares:
    """What share of a set of finite values one dtype would overflow, make subnormal, or flush
    to zero (fractions of the finite values)."""

    overflow: float
    subnormal: float
    flush: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RangeStats:
    """The magnitudes of a set of values: counts, extremes, and a log2 histogram whose binades
    are split at the mantissas of the dtypes' bounds (see :func:`mantissas`).

    Attributes:
      count: how many values.
      nonfinite: how many are inf or NaN (left out of everything below).
      zeros: how many are zero (float32 subnormals included).
      amax: the largest finite magnitude (0.0 when there is none).
      min_nonzero: the smallest nonzero finite magnitude (inf when there is none).
      bins: ``bins[i, j]`` values have ``floor(log2|x|) == LOG2_MIN + i`` and a mantissa that
        reaches ``j`` of :func:`mantissas`.
      masked: how many more values are mask fills (a large constant such as
        ``finfo(dtype).min`` written where a mask excludes a position, and what elementwise
        operations compute from it), not numbers the model computes: left out of everything
        above.
    """

    count: int
    nonfinite: int
    zeros: int
    amax: float
    min_nonzero: float
    bins: np.ndarray
    masked: int = 0

    @classmethod
    def from_summary(cls, counts: np.ndarray, extremes: np.ndarray) -> RangeStats:
        """The statistics :func:`summarize` computed, as host values."""
        counts = np.asarray(counts, np.int64)
        return cls(
            count=int(counts[0]),
            nonfinite=int(counts[1]),
            zeros=int(counts[2]),
            amax=float(extremes[0]),
            min_nonzero=float(extremes[1]),
            bins=counts[4:].reshape(_BINS, len(mantissas()) + 1),
            masked=int(counts[3]),
        )

    @classmethod
    def merge(cls, parts: Sequence[RangeStats]) -> RangeStats:
        """The statistics of the union of the sets of values of ``parts`` (at least one)."""
        return cls(
            count=sum(p.count for p in parts),
            nonfinite=sum(p.nonfinite for p in parts),
            zeros=sum(p.zeros for p in parts),
            amax=max(p.amax for p in parts),
            min_nonzero=min(p.min_nonzero for p in parts),
            bins=np.sum([p.bins for p in parts], axis=0),
            masked=sum(p.masked for p in parts),
        )

    @property
    def finite(self) -> int:
        return self.count - self.nonfinite

    @property
    def histogram(self) -> np.ndarray:
        """``histogram[i]`` values have ``floor(log2|x|) == LOG2_MIN + i``."""
        return self.bins.sum(axis=1)

    def count_at_least(self, bound: Any, scale_log2: int = 0) -> int:
        """How many finite nonzero values have ``|x| * 2**scale_log2 >= bound``, for a bound
        of :func:`bounds` (or any float32 whose mantissa is 0 or one of :func:`mantissas`)."""
        if np.float32(bound) < _TINY:  # below the normal range: every nonzero value
            return self.finite - self.zeros
        bits = _bits(bound)
        binade = (bits >> 23) - 127 - scale_log2 - LOG2_MIN
        mantissa = bits & _MANTISSA
        cuts = mantissas()
        if mantissa and mantissa not in cuts:
            raise ValueError(f"{bound!r} is not a bound these statistics split the binades at.")
        if binade < 0:
            return self.finite - self.zeros
        if binade >= _BINS:
            return 0
        part = cuts.index(mantissa) + 1 if mantissa else 0
        return int(self.bins[binade + 1 :].sum() + self.bins[binade, part:].sum())

    def shares(self, dtype: str, scale_log2: int = 0) -> Shares:
        """The shares of the finite values that rounding ``x * 2**scale_log2`` to ``dtype``
        would overflow, make subnormal or flush to zero."""
        b = bounds(dtype)
        nonzero_count = self.finite - self.zeros
        keep = self.count_at_least(b.nonzero, scale_log2)
        normal = self.count_at_least(b.normal, scale_log2)
        over = self.count_at_least(b.overflow, scale_log2)
        total = max(self.finite, 1)
        return Shares(over / total, (keep - normal) / total, (nonzero_count - keep) / total)

    def log2_range(self) -> tuple[int, int] | None:
        """``(floor(log2 min_nonzero), floor(log2 amax))``, or None without nonzero values."""
        bins = np.flatnonzero(self.histogram)
        if bins.size == 0:
            return None
        return int(bins[0] + LOG2_MIN), int(bins[-1] + LOG2_MIN)

    def to_dict(self, dtypes: Sequence[str]) -> dict[str, Any]:
        """JSON-serialisable: counts, extremes, the histogram as ``{log2: count}`` for its
        nonzero bins, and the shares of each of ``dtypes``."""
        histogram = self.histogram
        return {
            "count": self.count,
            "nonfinite": self.nonfinite,
            "zeros": self.zeros,
            "masked": self.masked,
            "amax": self.amax,
            "min_nonzero": None if np.isinf(self.min_nonzero) else self.min_nonzero,
            "log2_histogram": {
                str(int(i) + LOG2_MIN): int(histogram[i]) for i in np.flatnonzero(histogram)
            },
            "shares": {d: self.shares(d).to_dict() for d in dtypes},
        }
