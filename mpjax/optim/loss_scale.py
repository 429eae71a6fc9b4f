"""The loss scales: the values that multiply the loss before differentiation.

float16's narrow exponent range lets small gradients underflow to zero. Loss scaling multiplies
the loss by a large factor before differentiation, so the backward pass stays in range, and
divides the gradients by it again before the optimizer sees them. This module holds the factor
itself, in three kinds: :class:`DynamicLossScale` (PyTorch's ``GradScaler`` rule),
:class:`StaticLossScale` and :class:`NoOpLossScale` (``LossScale`` is any of them), and
``parse_loss_scale``, which reads the specs :func:`mpjax.loss_scaling` takes
(``"dynamic"``, ``"none"``, ``"static:N"``, a number). The transformation that uses them is
:mod:`mpjax.optim.loss_scaling`; the readers of its state in a training step are
:mod:`mpjax.optim.loss_scaling_readers`.

The scale values are plain JAX pytrees (frozen dataclasses registered with
``jax.tree_util``): values that change during training are leaves of one dtype each (the scale
a float32 scalar array, the growth counter an int32 scalar array), so a jitted step compiles
once and a new static scale does not retrace. The dynamic scale's hyperparameters are part of
the tree structure: configuration fixed for a run, like an optax learning rate held in a
closure. They survive every tree operation, and a checkpoint restored into an optimizer state
built by the same code gets them back from that code, while the scale and counter come from the
checkpoint. The constructors validate what the user passes; rebuilding from leaves (``jit``,
``tree.map``, checkpoint restore) does not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import jax_compat
from mpjax.policy import is_floating

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
]

T = TypeVar("T")
_ScaleType = TypeVar("_ScaleType", bound="type[_LossScaleBase]")

# PyTorch's GradScaler starts at 2**16, which float16 cannot represent (its largest finite
# value is 65504): a float16 loss scaled by it is inf on the first step. 2**15 (jmp, Keras) is
# the largest power of two float16 holds.
DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
DEFAULT_GROWTH_INTERVAL = 2000
# The default dynamic scale's floor (jmp's too). Without one, a burst of overflows halves the
# scale to exactly 0 after about 140 steps in a row and it never recovers (growth doubles it
# once per 2000 finite steps); long before, every float16 gradient underflows to 0 and the
# steps count as finite. A scale below 1 multiplies the loss by less than 1, which only helps
# a loss whose gradients overflow float16 unscaled: a bug to fix in the model, not a scale.
DEFAULT_MIN_SCALE = 1.0

_F32 = np.finfo(np.float32)
_INT32_MAX = int(np.iinfo(np.int32).max)


# ---------------------------------------------------------------------------------------------
# Loss-scale values


def _host_scalar(value: Any, name: str, what: str) -> np.ndarray | None:
    """The host value of a scalar the user passed, or None for a tracer (checked later)."""
    if jax_compat.is_tracer(value):
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.ndarray, np.generic, jax.Array)
    ):
        raise TypeError(f"{name} must be {what}, got {value!r} of type {type(value).__name__}.")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        # Beyond int64 NumPy makes an object array; the value's sign and size are what count.
        return np.asarray(math.copysign(math.inf, value) if abs(value) > 2**1000 else float(value))
    host = np.asarray(value)
    if host.shape != () or not jnp.issubdtype(host.dtype, jnp.number):
        raise ValueError(f"{name} must be {what}, got {value!r}.")
    return host


def _scale_leaf(value: Any, name: str = "loss_scale") -> jax.Array:
    """Checks a scale the user passed; returns it as a strongly typed float32 scalar array.

    A tracer is only cast: its value is not known yet.
    """
    host = _host_scalar(value, name, "a positive number")
    if host is not None:
        with np.errstate(over="ignore", invalid="ignore"):  # reported just below
            as_f32 = np.float32(host)
        if not (np.isfinite(as_f32) and as_f32 > 0):
            raise ValueError(f"{name} must be positive and finite in float32, got {value!r}.")
        if as_f32 < _F32.tiny:
            raise ValueError(
                f"{name} must be at least float32's smallest normal number ({_F32.tiny:g}), "
                f"got {value!r}: a subnormal scale loses precision and backs off to 0."
            )
    if isinstance(value, jax.Array):
        if value.dtype == jnp.float32 and not jax.typeof(value).weak_type:
            return value  # keeps its device and sharding
        return jnp.asarray(value, jnp.float32)
    return jnp.asarray(as_f32, jnp.float32)


def _counter_leaf(value: Any) -> jax.Array:
    """Checks a growth counter the user passed; returns it as an int32 scalar array."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= _INT32_MAX:
        raise ValueError(
            f"counter must be below 2**31 - 1 (it is an int32 that counts up), got {value!r}."
        )
    host = _host_scalar(value, "counter", "a non-negative integer")
    if host is not None and (not jnp.issubdtype(host.dtype, jnp.integer) or host < 0):
        raise ValueError(f"counter must be a non-negative integer, got {value!r}.")
    if host is not None and host >= _INT32_MAX:
        raise ValueError(
            f"counter must be below 2**31 - 1 (it is an int32 that counts up), got {value!r}."
        )
    if isinstance(value, jax.Array):
        if value.dtype == jnp.int32 and not jax.typeof(value).weak_type:
            return value
        return jnp.asarray(value, jnp.int32)
    return jnp.asarray(host, jnp.int32)


def _optional_bound(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a positive number or None, got {value!r}.")
    value = float(value)
    with np.errstate(over="ignore"):  # too large for float32 is reported just below
        in_range = math.isfinite(np.float32(value))
    if not (value > 0 and in_range):
        raise ValueError(f"{name} must be positive and finite in float32 or None, got {value!r}.")
    if value < _F32.tiny:
        raise ValueError(
            f"{name} must be at least float32's smallest normal number ({_F32.tiny:g}) or "
            f"None, got {value!r}."
        )
    return value


def _multiply_floating(tree: T, factor: jax.Array, divide: bool, keep_dtype: bool) -> T:
    """Multiplies (or divides) floating leaves by ``factor``, computing in at least float32."""

    def apply(x):
        if isinstance(x, (float, np.ndarray, np.generic)):
            x = jnp.asarray(x)
        if not isinstance(x, jax.Array) or not is_floating(x):
            return x
        # Explicit: strict dtype promotion has no bfloat16 -> float32 path.
        wide = x.dtype if jnp.finfo(x.dtype).bits > 32 else np.dtype(jnp.float32)
        x_wide, f_wide = x.astype(wide), factor.astype(wide)
        out = x_wide / f_wide if divide else x_wide * f_wide
        return out.astype(x.dtype) if keep_dtype else out

    return jax.tree.map(apply, tree)


def _register(cls: _ScaleType, data_fields: tuple[str, ...]) -> _ScaleType:
    """Registers a loss-scale dataclass as a pytree: ``data_fields`` are leaves, every other
    field is static (part of the tree structure). Unflattening rebuilds the object without
    calling the constructor, so tracers, abstract values and placeholders are never validated
    and never block."""
    meta_fields = tuple(
        f.name for f in dataclasses.fields(cast(Any, cls)) if f.name not in data_fields
    )
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data_fields)

    def flatten_with_keys(obj):
        children = tuple((key, getattr(obj, key.name)) for key in keys)
        return children, tuple(getattr(obj, name) for name in meta_fields)

    def flatten(obj):
        return tuple(getattr(obj, name) for name in data_fields), tuple(
            getattr(obj, name) for name in meta_fields
        )

    def unflatten(meta, children):
        return cls._from_fields(**dict(zip(data_fields, children)), **dict(zip(meta_fields, meta)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


class _LossScaleBase:
    """``scale``/``unscale``/``replace`` shared by the three loss scales."""

    if TYPE_CHECKING:  # a field of two of the scales, a property of the no-op one

        @property
        def loss_scale(self) -> jax.Array: ...

    @classmethod
    def _from_fields(cls, **fields: Any):
        """Builds an instance from field values as they are, without validation or casts."""
        obj = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(obj, name, value)
        return obj

    def scale(self, tree: T) -> T:
        """Multiplies the floating-point leaves of ``tree`` by the scale, keeping their dtypes.

        The product is computed in at least float32 and rounded once to each leaf's dtype.
        Non-floating leaves pass through.
        """
        return _multiply_floating(tree, self.loss_scale, divide=False, keep_dtype=True)

    def unscale(self, tree: T) -> T:
        """Divides the floating-point leaves of ``tree`` by the scale, in float32.

        Leaves come back as float32 (float64 stays float64); non-floating leaves pass through.
        """
        return _multiply_floating(tree, self.loss_scale, divide=True, keep_dtype=False)

    def replace(self, **changes: Any):
        """Returns a copy with the given fields changed, validated like the constructor."""
        return dataclasses.replace(cast(Any, self), **changes)


def _finite_flag(grads_finite: Any) -> jax.Array:
    """Checks the ``grads_finite`` an ``adjust`` received: one boolean, a Python or NumPy bool
    or a bool scalar array (traced or not). Returns it as a bool array."""
    if isinstance(grads_finite, (bool, np.bool_)):
        return jnp.asarray(grads_finite)
    if isinstance(grads_finite, (jax.Array, np.ndarray)) and grads_finite.dtype == np.bool_:
        if grads_finite.shape != ():
            raise ValueError(
                "adjust(grads_finite): grads_finite must be one bool for the whole step (reduce "
                f"with jnp.all), got a bool array of shape {grads_finite.shape}."
            )
        return jnp.asarray(grads_finite)
    raise TypeError(
        "adjust(grads_finite): grads_finite must be a bool or a bool scalar array (whether "
        f"every gradient was finite), got {grads_finite!r} of type "
        f"{type(grads_finite).__name__}."
    )


@functools.partial(_register, data_fields=())
@dataclasses.dataclass(frozen=True, init=False)
class NoOpLossScale(_LossScaleBase):
    """A loss scale of exactly 1: for bfloat16 and float32 training, which need none.

    Members as jmp's ``NoOpLossScale``: ``loss_scale``, ``counter``, ``scale``, ``unscale``,
    ``adjust``.

    >>> NoOpLossScale().loss_scale
    Array(1., dtype=float32)
    """

    @property
    def loss_scale(self) -> jax.Array:
        """The scale, a float32 scalar array, always 1."""
        return jnp.ones((), jnp.float32)

    @property
    def counter(self) -> jax.Array:
        """The growth counter, an int32 scalar array, always 0."""
        return jnp.zeros((), jnp.int32)

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        """Returns ``self``: a no-op scale never changes (``grads_finite`` is checked as by
        :meth:`DynamicLossScale.adjust`)."""
        _finite_flag(grads_finite)
        return self


@functools.partial(_register, data_fields=("loss_scale",))
@dataclasses.dataclass(frozen=True, init=False)
class StaticLossScale(_LossScaleBase):
    """A fixed loss scale.

    The value is a float32 array leaf, so a jitted step given a new static value does not
    retrace. Members as jmp's ``StaticLossScale``: ``loss_scale``, ``counter``, ``scale``,
    ``unscale``, ``adjust``.

    Args:
      loss_scale: the scale, a positive number (Python, NumPy or a jax scalar array; stored as
        a float32 scalar array). Inside ``jax.jit`` a traced scale is cast, not checked.

    Raises:
      ValueError: if ``loss_scale`` is not positive and finite in float32, or not a scalar.
      TypeError: if ``loss_scale`` is not a number.

    >>> StaticLossScale(128).scale(jnp.array(0.5, jnp.bfloat16))
    Array(64, dtype=bfloat16)
    """

    loss_scale: jax.Array

    def __init__(self, loss_scale: jax.Array | float):
        object.__setattr__(self, "loss_scale", _scale_leaf(loss_scale))

    @property
    def counter(self) -> jax.Array:
        """The growth counter, an int32 scalar array, always 0."""
        return jnp.zeros((), jnp.int32)

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        """Returns ``self``: a static scale never changes (``grads_finite`` is checked as by
        :meth:`DynamicLossScale.adjust`)."""
        _finite_flag(grads_finite)
        return self


@functools.partial(_register, data_fields=("loss_scale", "counter"))
@dataclasses.dataclass(frozen=True, init=False)
class DynamicLossScale(_LossScaleBase):
    """A loss scale that follows PyTorch's ``GradScaler`` rule.

    After a step with non-finite gradients the scale is multiplied by ``backoff_factor`` and the
    counter resets. After a finite step the counter grows by one; on the
    ``growth_interval``-th consecutive finite step the scale is multiplied by ``growth_factor``
    (only if the result stays finite) and the counter resets. ``min_scale`` and ``max_scale``
    clamp the result (PyTorch has neither).

    The scale has a floor by default, ``min_scale=1.0`` (jmp's): without one, a burst of about
    140 overflows in a row halves it to exactly 0, from which it never recovers, and long
    before that every float16 gradient underflows to 0 while the steps count as finite. At the
    floor, a step that still overflows is skipped and counted like any other, so
    :func:`mpjax.check_overflow` stops a run that cannot recover. ``min_scale=None`` removes the
    floor, for PyTorch's exact trajectory.

    An all-zero gradient is not taken for underflow: gradients can be legitimately zero (a
    fully masked batch, a frozen branch), and with the floor the scale never sinks to where
    every gradient underflows.

    The default initial scale is ``2**15`` (jmp and Keras), not PyTorch's ``2**16``: float16's
    largest finite value is 65504, so a float16 loss scaled by ``2**16`` overflows on the first
    step. Growth factor, backoff factor and interval default to PyTorch's 2, 0.5 and 2000.

    The members are jmp's, so code written against ``jmp.DynamicLossScale`` reads the same:
    ``loss_scale`` (a float32 scalar array) and ``counter`` (an int32 scalar array) are the
    pytree leaves, ``scale(tree)``, ``unscale(tree)`` and ``adjust(grads_finite)`` the methods.
    The hyperparameters take PyTorch's names and are static: configuration that never changes
    during a run, kept in the tree structure (never lost by ``jit``, ``tree.map`` or
    checkpoints) and, on restore, taken from the optimizer the code builds.

    Args:
      loss_scale: initial scale, a positive number (Python, NumPy or a jax scalar array),
        normal in float32.
      counter: consecutive finite steps since the last change, a non-negative integer below
        ``2**31 - 1``.
      growth_factor: factor applied on growth, greater than 1 and finite in float32.
      backoff_factor: factor applied on overflow, in (0, 1) and normal in float32.
      growth_interval: consecutive finite steps before growth, from 1 to ``2**31 - 1``.
      min_scale: floor for the scale after backoff (default 1.0), or None for no floor.
      max_scale: cap for the scale after growth, or None for no cap.

    Inside ``jax.jit`` a traced ``loss_scale`` or ``counter`` is cast, not checked.

    Raises:
      ValueError: for a scale that is not positive, finite and normal in float32, a counter
        outside ``[0, 2**31 - 1)``, a ``growth_factor`` that is not above 1 or overflows
        float32 (or, without ``max_scale``, overflows it once multiplied by the initial scale,
        which could then never grow), a ``backoff_factor`` outside (0, 1) or subnormal in
        float32, a ``growth_interval`` outside ``[1, 2**31 - 1]``, ``min_scale > max_scale``
        or an initial scale outside ``[min_scale, max_scale]``.
      TypeError: for an argument that is not a number of the right kind.

    >>> ls = DynamicLossScale(16.0, growth_interval=1)
    >>> ls.adjust(jnp.array(True)).loss_scale, ls.adjust(jnp.array(False)).loss_scale
    (Array(32., dtype=float32), Array(8., dtype=float32))
    """

    loss_scale: jax.Array
    counter: jax.Array
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float | None
    max_scale: float | None

    def __init__(
        self,
        loss_scale: jax.Array | float = DEFAULT_INITIAL_SCALE,
        counter: jax.Array | int = 0,
        *,
        growth_factor: float = DEFAULT_GROWTH_FACTOR,
        backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
        growth_interval: int = DEFAULT_GROWTH_INTERVAL,
        min_scale: float | None = DEFAULT_MIN_SCALE,
        max_scale: float | None = None,
    ):
        growth, backoff, interval = growth_factor, backoff_factor, growth_interval
        if isinstance(growth, bool) or not isinstance(growth, (int, float, np.number)):
            raise TypeError(f"growth_factor must be a number greater than 1, got {growth!r}.")
        with np.errstate(over="ignore", under="ignore"):  # reported just below
            growth32, backoff32 = np.float32(growth), np.float32(backoff)
        if not (growth32 > 1 and np.isfinite(growth32)):
            raise ValueError(
                "growth_factor must be greater than 1 and finite in float32 (the scale's "
                f"dtype), got {growth!r}."
            )
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float, np.number)):
            raise TypeError(f"backoff_factor must be a number in (0, 1), got {backoff!r}.")
        if not (0 < backoff < 1 and backoff32 < 1):
            raise ValueError(
                f"backoff_factor must be in the open interval (0, 1), got {backoff!r}."
            )
        if backoff32 < _F32.tiny:
            raise ValueError(
                "backoff_factor must be at least float32's smallest normal number "
                f"({_F32.tiny:g}): one backoff by {backoff!r} would leave a scale of 0."
            )
        if isinstance(interval, bool) or not isinstance(interval, (int, np.integer)):
            raise TypeError(f"growth_interval must be an integer >= 1, got {interval!r}.")
        if not 1 <= interval <= _INT32_MAX:
            raise ValueError(
                "growth_interval must be an integer from 1 to 2**31 - 1 (the counter is an "
                f"int32), got {interval!r}."
            )
        low = _optional_bound(min_scale, "min_scale")
        high = _optional_bound(max_scale, "max_scale")
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"min_scale must not exceed max_scale, got min_scale={low!r} > max_scale={high!r}."
            )
        scale = _scale_leaf(loss_scale)
        if not jax_compat.is_tracer(scale):
            initial = float(scale)
            if (low is not None and initial < low) or (high is not None and initial > high):
                raise ValueError(
                    f"loss_scale {loss_scale!r} is outside [min_scale, max_scale] = "
                    f"[{low}, {high}]; pass a lower min_scale (or min_scale=None for no floor) "
                    "or a higher max_scale."
                )
            with np.errstate(over="ignore"):  # reported just below
                grown = np.float32(initial) * growth32
            # adjust refuses a growth that overflows float32; without max_scale to clamp it,
            # the scale would stay where it starts for good.
            if high is None and not np.isfinite(grown):
                raise ValueError(
                    f"growth_factor {growth!r} times the initial loss_scale {initial:g} "
                    f"overflows float32 (largest {_F32.max:g}), so the scale could never grow: "
                    f"use a growth_factor of at most {_F32.max / initial:g} (PyTorch's is 2), "
                    "or set max_scale to cap the growth."
                )
        fields = {
            "loss_scale": scale,
            "counter": _counter_leaf(counter),
            "growth_factor": float(growth),
            "backoff_factor": float(backoff),
            "growth_interval": int(interval),
            "min_scale": low,
            "max_scale": high,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """Returns the loss scale for the next step, given whether this step's grads were finite.

        Args:
          grads_finite: a boolean scalar (array or Python bool).

        Returns:
          A new :class:`DynamicLossScale`; ``loss_scale`` stays float32, ``counter`` int32.

        Raises:
          TypeError: for a ``grads_finite`` that is not a bool (a float, None, a string).
          ValueError: for a bool array that is not a scalar.
        """
        finite = _finite_flag(grads_finite)
        scale, counter = self.loss_scale, self.counter + 1
        grow = finite & (counter >= self.growth_interval)
        grown = scale * self.growth_factor
        if self.max_scale is not None:
            grown = jnp.minimum(grown, self.max_scale)
        # PyTorch's rule: growth that would overflow float32 is refused, the counter still resets.
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        backed_off = scale * self.backoff_factor
        if self.min_scale is not None:
            backed_off = jnp.maximum(backed_off, self.min_scale)
        new_scale = jnp.where(finite, jnp.where(grow, grown, scale), backed_off)
        new_counter = jnp.where(finite & ~grow, counter, 0)
        # Built from the computed values as they are (they are tracers under jit).
        return self._from_fields(
            **{
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "loss_scale": new_scale.astype(jnp.float32),
                "counter": new_counter.astype(jnp.int32),
            }
        )


LossScale = DynamicLossScale | StaticLossScale | NoOpLossScale
"""Any of the three loss-scale pytrees."""

_LOSS_SCALE_CHOICES = ("'dynamic'", "'none'", "'static:N'", "a positive number", "a loss scale")


def parse_loss_scale(spec: LossScale | str | int | float) -> LossScale:
    """The loss scale that ``spec`` names: a loss scale (as is), ``"dynamic"``, ``"none"``,
    ``"static:N"`` or a positive number N."""
    if isinstance(spec, (DynamicLossScale, StaticLossScale, NoOpLossScale)):
        return spec
    if isinstance(spec, str):
        text = spec.strip()
        if text == "dynamic":
            return DynamicLossScale()
        if text == "none":
            return NoOpLossScale()
        head, sep, value = text.partition(":")
        if head.strip() == "static" and sep:
            try:
                number = float(value)
            except ValueError:
                raise ValueError(
                    f"Malformed static loss scale {spec!r}: expected 'static:N' with N a "
                    "positive number, for example 'static:1024'."
                ) from None
            return StaticLossScale(number)
        raise ValueError(
            f"Unknown loss_scale {spec!r}. Valid choices: {', '.join(_LOSS_SCALE_CHOICES)}."
        )
    if isinstance(spec, (int, float, np.number)) and not isinstance(spec, bool):
        return StaticLossScale(spec)
    raise TypeError(
        f"loss_scale must be one of {', '.join(_LOSS_SCALE_CHOICES)}; got {spec!r} of type "
        f"{type(spec).__name__}."
    )
