"""Loss scaling: the scale values, the optax transformation, and readers of its state.

float16's narrow exponent range lets small gradients underflow to zero. Loss scaling multiplies
the loss by a large factor before differentiation, so the backward pass stays in range, and
divides the gradients by it again before the optimizer sees them. The order of one training
step is scale -> grad -> unscale -> clip -> update:

1. :func:`scaled_value_and_grad` multiplies the loss by the current scale (``scale_loss``)
   and
2. differentiates the scaled loss, returning the loss unscaled and the scaled gradients;
3. the :func:`loss_scaling` transformation, which wraps the whole optimizer, divides them by
   that same scale in float32, checks that every gradient is finite, and only then
4. runs the wrapped transformation (clipping sees the true gradients) and
5. returns its updates; after a non-finite step it returns zeros and leaves the wrapped state
   bit-for-bit unchanged. Either way it adjusts the scale for the next step.

The vocabulary:

* the scale values :class:`DynamicLossScale` (PyTorch's ``GradScaler`` rule),
  :class:`StaticLossScale` and :class:`NoOpLossScale` (``LossScale`` is any of them);
* the transformation :func:`loss_scaling`, whose state is a :class:`LossScalingState`;
* :func:`scaled_value_and_grad`, ``jax.value_and_grad`` of the scaled loss;
* readers that take any optimizer state, the loss-scaling state nested anywhere in it
  (:func:`mpjax.master_weights`, ``nnx.Optimizer.opt_state``, a train state):
  :func:`scale_loss`, :func:`loss_scaling_info`, :func:`check_overflow` and
  :func:`check_loss_scaling`. Without a loss-scaling state they pass through, so one training
  step serves every policy. They refuse a loss scaling that does not wrap the rest of the
  optimizer, where the state shows it (in an ``optax.chain`` after or before other
  transformations, or inside ``optax.MultiSteps``).

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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax import jax_compat
from mpjax.deprecation import warn_deprecated
from mpjax.gradient_checks import InitTrees, check_params, check_transformation, check_update
from mpjax.policy import PolicyLike, get_policy, is_floating

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "LossScalingInfo",
    "LossScalingState",
    "NoOpLossScale",
    "PersistentOverflowError",
    "StaticLossScale",
    "check_loss_scaling",
    "check_overflow",
    "loss_scaling",
    "loss_scaling_info",
    "scale_loss",
    "scaled_value_and_grad",
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
        """The scale, a float32 scalar array: always 1."""
        return jnp.ones((), jnp.float32)

    @property
    def counter(self) -> jax.Array:
        """The growth counter, an int32 scalar array: always 0."""
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
        """The growth counter, an int32 scalar array: always 0."""
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
    :func:`check_overflow` stops a run that cannot recover. ``min_scale=None`` removes the
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


def _parse_loss_scale(spec: LossScale | str | int | float) -> LossScale:
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


# ---------------------------------------------------------------------------------------------
# The transformation


class LossScalingState(NamedTuple):
    """State of :func:`loss_scaling`: the loss scale, the wrapped state and skip bookkeeping.

    Attributes:
      loss_scale: the loss-scale pytree used to scale the next loss.
      inner_state: the wrapped transformation's state.
      applied: bool scalar; whether the last optimizer step was applied (False after a
        skipped step, and after a micro-batch that did not complete an ``optax.MultiSteps``
        step).
      skipped_steps: int32 scalar; optimizer steps skipped so far for non-finite gradients.
      consecutive_skipped: int32 scalar; optimizer steps skipped in a row (0 after an applied
        step). :func:`check_overflow` turns a long run of them into an error.
      window_finite: bool scalar; False once a micro-batch of the current ``optax.MultiSteps``
        accumulation window had non-finite gradients (that optimizer step will be skipped).
        Always True without ``MultiSteps``.
    """

    loss_scale: LossScale
    inner_state: optax.OptState
    applied: jax.Array
    skipped_steps: jax.Array
    consecutive_skipped: jax.Array
    window_finite: jax.Array

    @property
    def scale(self) -> jax.Array:
        """The current loss scale, a float32 scalar array."""
        return self.loss_scale.loss_scale

    @property
    def counter(self) -> jax.Array:
        """The growth counter, an int32 scalar array (0 for static and no-op scales)."""
        return self.loss_scale.counter


AxisName = str | tuple[str, ...]
"""A mapped axis name (``shard_map``, ``pmap``) or a tuple of them."""


def _all_finite(tree: Any, axis_name: AxisName | None = None) -> jax.Array:
    """One bool for the whole tree; under jit with sharded leaves the reduction is global, and
    with ``axis_name`` it is also taken over the devices of those mapped axes."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    finite = functools.reduce(jnp.logical_and, checks, jnp.array(True))
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


def _check_axis_name(axis_name: Any) -> AxisName | None:
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if (
        isinstance(axis_name, (tuple, list))
        and axis_name
        and all(isinstance(a, str) for a in axis_name)
    ):
        return tuple(axis_name)
    raise TypeError(
        "axis_name must be None, a mapped axis name (str) or a non-empty tuple of them, got "
        f"{axis_name!r}."
    )


def _is_multi_steps(x: Any) -> bool:
    return isinstance(x, optax.MultiStepsState)


def _multi_steps_states(state: Any) -> list[optax.MultiStepsState]:
    leaves = jax.tree.leaves(state, is_leaf=_is_multi_steps)
    return [x for x in leaves if _is_multi_steps(x)]


def _keep_inner_of_multi_steps(old: Any, new: Any) -> Any:
    """``new`` with the optimizer state and step count of its ``MultiSteps`` taken from
    ``old``, and everything else (the cleared accumulator, the reset micro-step) from ``new``."""

    def merge(o, n):
        if not _is_multi_steps(o):
            return n
        return n._replace(inner_opt_state=o.inner_opt_state, gradient_step=o.gradient_step)

    return jax.tree.map(merge, old, new, is_leaf=_is_multi_steps)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | str | int | float = "dynamic",
    *,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that it sees unscaled gradients and never a non-finite step.

    Wrap the whole optimizer (``loss_scaling(optax.chain(clip, adam))``, never a chain holding
    ``loss_scaling`` next to other transformations), and compute the gradients with
    :func:`scaled_value_and_grad`. ``update`` receives gradients of the loss scaled by
    :func:`scale_loss`. It divides them, in float32, by exactly the scale that scaled the loss
    (the scale in the state it receives, before this step adjusts it) and hands them to
    ``inner`` in their own dtype, so ``inner`` (clipping, Adam...) sees true gradients. If any gradient is inf or NaN (checked over the
    whole tree; under sharding, over all devices) the step is skipped: the updates are zeros
    and ``inner``'s state is returned bit-for-bit unchanged (Adam's step count does not move).
    Then the loss scale is adjusted.

    Unlike ``optax.apply_if_finite``, a non-finite update is never applied, however many steps
    in a row overflow; ``state.consecutive_skipped`` counts them and :func:`check_overflow`
    raises outside jit when it gets too long.

    Gradient accumulation: wrap ``optax.MultiSteps`` (the ``MultiSteps`` object itself or its
    ``gradient_transformation()``, alone or anywhere inside ``inner``: in a chain, inside
    :func:`mpjax.master_weights`), not the other way round:
    ``loss_scaling(optax.MultiSteps(inner, k))``. Each micro-batch is unscaled and checked
    before it reaches the accumulator, so an inf or NaN never enters it (``MultiSteps`` around
    ``loss_scaling`` would accumulate it, and its reset multiplies by 0, which keeps NaN). As in
    PyTorch, a micro-batch with non-finite gradients dooms its whole optimizer step: the rest
    of the window still runs, then the step is skipped (inner state and ``gradient_step`` as if
    the window never happened, accumulator cleared). The scale stays constant within a window
    and is adjusted once per optimizer step, so ``growth_interval`` counts optimizer steps;
    ``applied`` is True only after a micro-batch that completed an optimizer step.

    Many devices: inside ``shard_map`` or ``pmap``, where each device holds its own gradients,
    pass the mapped axes as ``axis_name``. The finite check is then taken over all their
    devices, so every device skips the same steps and keeps the same scale, and replicated
    params stay identical (as Flax's ``DynamicScale(axis_name=...)``). Under ``jax.jit`` with
    sharded arrays no ``axis_name`` is needed: the check is global already.

    To choose the scale from a policy: ``loss_scaling(inner, "dynamic" if
    policy.needs_loss_scaling else "none")`` (see :attr:`mpjax.Policy.needs_loss_scaling`).

    Args:
      inner: the transformation to wrap: any optax ``GradientTransformation`` or chain,
        ``optax.MultiSteps``, or :func:`mpjax.master_weights`.
      loss_scale: a :class:`DynamicLossScale`, :class:`StaticLossScale` or
        :class:`NoOpLossScale`, or ``"dynamic"`` (the default: PyTorch's rule starting at
        ``2**15``), ``"none"``, ``"static:N"`` or a number N for a static scale.
      axis_name: the mapped axis name, or a tuple of names, over which devices must agree on
        whether a step was finite; None (the default) outside ``shard_map``/``pmap``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`LossScalingState`.
      ``update`` requires this transformation's state and floating-point array gradients
      (``TypeError`` otherwise) and, when ``params`` are given, a gradient tree matching them
      in structure and shapes (``ValueError``) for floating-point params (``TypeError``).

    Raises:
      ValueError: for an unknown string, a malformed ``"static:N"`` or a non-positive scale,
        and (from ``init``) for an ``inner`` holding more than one ``optax.MultiSteps``.
      TypeError: for a ``loss_scale`` or ``axis_name`` of any other type, or an ``inner``
        that is not an optax transformation (``optax.adam`` instead of ``optax.adam(lr)``).

    >>> import optax
    >>> tx = loss_scaling(optax.sgd(1.0), "static:8")
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss, grads = scaled_value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(state, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> updates["w"], state.applied
    (Array([-2., -2.], dtype=float32), Array(True, dtype=bool))
    """
    check_transformation(inner, "loss_scaling")
    scale0 = _parse_loss_scale(loss_scale)
    axis_name = _check_axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)
    init_trees = InitTrees()

    def init(params):
        check_params(params, "loss_scaling")
        init_trees.add(params)
        inner_state = inner.init(params)
        if len(_multi_steps_states(inner_state)) > 1:
            raise ValueError(
                "loss_scaling: inner holds more than one optax.MultiSteps; accumulate "
                "gradients with one MultiSteps."
            )
        return LossScalingState(
            loss_scale=scale0,
            inner_state=inner_state,
            applied=jnp.array(True),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skipped=jnp.zeros((), jnp.int32),
            window_finite=jnp.array(True),
        )

    def update(updates, state, params=None, **extra_args):
        check_update(
            updates,
            state,
            params,
            LossScalingState,
            "loss_scaling",
            needs_params=False,
            init_trees=init_trees,
        )
        unscaled = state.loss_scale.unscale(updates)
        # Back to each gradient's own dtype, so inner state dtypes never change; the check comes
        # after the cast because a value finite in float32 can overflow float16.
        grads = jax.tree.map(lambda u, g: u.astype(g.dtype), unscaled, updates)
        finite = _all_finite(grads, axis_name)
        # Zeros instead of inf/NaN: the inner update runs either way (a select, not a cond,
        # keeps shardings intact) and must not compute with values it would then discard.
        safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        new_updates, new_inner = inner.update(safe_grads, state.inner_state, params, **extra_args)
        window_ok = state.window_finite & finite

        multi_steps = _multi_steps_states(state.inner_state)
        if multi_steps:
            (old,) = multi_steps
            (new,) = _multi_steps_states(new_inner)
            step_done = new.gradient_step != old.gradient_step
            discard = step_done & ~window_ok
            kept = _keep_inner_of_multi_steps(state.inner_state, new_inner)
            new_inner = _select(discard, kept, new_inner)
            applied = step_done & window_ok
            new_scale = _select(step_done, state.loss_scale.adjust(window_ok), state.loss_scale)
            next_window_finite = window_ok | step_done
        else:
            step_done = jnp.array(True)
            applied = finite
            new_inner = _select(finite, new_inner, state.inner_state)
            new_scale = state.loss_scale.adjust(finite)
            next_window_finite = jnp.array(True)

        skipped = step_done & ~applied
        new_updates = jax.tree.map(lambda u: jnp.where(applied, u, jnp.zeros_like(u)), new_updates)
        consecutive = jnp.where(
            skipped,
            optax.safe_increment(state.consecutive_skipped),
            jnp.where(step_done, 0, state.consecutive_skipped),
        )
        new_state = LossScalingState(
            loss_scale=new_scale,
            inner_state=new_inner,
            applied=applied,
            skipped_steps=jnp.where(
                skipped, optax.safe_increment(state.skipped_steps), state.skipped_steps
            ),
            consecutive_skipped=consecutive,
            window_finite=next_window_finite,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init, update)


# ---------------------------------------------------------------------------------------------
# Readers of any optimizer state


class LossScalingInfo(NamedTuple):
    """What a training loop reads from the loss scaling: see :func:`loss_scaling_info`.

    Attributes:
      loss_scale: float32 scalar; the scale the next loss will be multiplied by.
      applied: bool scalar; whether the last optimizer step was applied.
      skipped_steps: int32 scalar; optimizer steps skipped so far for non-finite gradients.
      consecutive_skipped: int32 scalar; optimizer steps skipped in a row.
    """

    loss_scale: jax.Array
    applied: jax.Array
    skipped_steps: jax.Array
    consecutive_skipped: jax.Array


def _is_loss_scaling_state(x: Any) -> bool:
    return isinstance(x, LossScalingState)


def _loss_scaling_states(opt_state: Any) -> list[tuple[tuple, LossScalingState]]:
    """Every :class:`LossScalingState` inside ``opt_state``, wherever it sits, with its path."""
    found = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_loss_scaling_state)[0]
    return [(path, x) for path, x in found if _is_loss_scaling_state(x)]


def _describe(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} of type {type(value).__name__}"


def _type_name(x: Any) -> str:
    return type(x).__name__


def _child(node: Any, key: Any) -> Any:
    """The child of ``node`` at one key of a pytree path."""
    children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    return next(child for path, child in children if path == (key,))


_WRONG_AND_RIGHT = {
    "after": (
        "optax.chain(optax.clip_by_global_norm(1.0), mpjax.loss_scaling(optax.adam(lr)))",
        "mpjax.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)))",
    ),
    "before": (
        "optax.chain(mpjax.loss_scaling(optax.clip_by_global_norm(1.0)), optax.adam(lr))",
        "mpjax.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)))",
    ),
    "multi_steps": (
        "optax.MultiSteps(mpjax.loss_scaling(inner), k)",
        "mpjax.loss_scaling(optax.MultiSteps(inner, k))",
    ),
}


def _misplacement(node: Any, key: Any, at: str) -> tuple[str, str] | None:
    """What is wrong with a loss-scaling state below ``node`` (at ``at``) on the path through
    ``key``: ``(kind, why)`` with a kind of :data:`_WRONG_AND_RIGHT`, or None."""
    if isinstance(node, optax.MultiStepsState):
        return "multi_steps", (
            f"inside optax.MultiSteps (its state is {at}), which accumulates the gradients before "
            "loss_scaling unscales and checks them: one inf or NaN stays in its accumulator"
        )
    if type(node) is not tuple or not isinstance(key, jax.tree_util.SequenceKey):
        return None
    # An optax.chain's state: one state (a NamedTuple, or a tuple for a nested chain) per
    # transformation, in the order they run.
    before = [i for i in range(key.idx) if isinstance(node[i], tuple)]
    after = [
        i
        for i in range(key.idx + 1, len(node))
        if isinstance(node[i], tuple) and jax.tree.leaves(node[i])
    ]
    if before:
        other = f"{at}[{before[-1]}] is {_type_name(node[before[-1]])}"
        return "after", (
            f"inside an optax.chain, after another transformation ({other}): that "
            "transformation sees the scaled gradients (clipping, for one, clips at a threshold "
            "thousands of times too small) and its state moves on steps loss_scaling skips"
        )
    if after:
        other = f"{at}[{after[0]}] is {_type_name(node[after[0]])}"
        return "before", (
            f"inside an optax.chain, before a transformation that keeps state ({other}): it "
            "receives the zero updates of skipped steps, so its state (Adam's step count and "
            "moments, a schedule's count) moves on every skipped step"
        )
    return None


def _check_placement(opt_state: Any, path: tuple, where: str) -> None:
    """Refuses a :func:`loss_scaling` that does not wrap the rest of the optimizer, where the
    state shows it: in an ``optax.chain`` (a plain tuple of states) after another
    transformation or before a stateful one, or inside ``optax.MultiSteps``.

    ``optax.named_chain``, ``optax.partition`` and custom wrappers keep no order that the state
    shows; the docs warn about them.
    """
    node = opt_state
    for depth, key in enumerate(path):
        found = _misplacement(node, key, f"opt_state{jax.tree_util.keystr(path[:depth])}")
        if found is not None:
            wrong, right = _WRONG_AND_RIGHT[found[0]]
            raise ValueError(
                f"{where}: mpjax.loss_scaling must wrap the whole optimizer, but its state "
                f"(opt_state{jax.tree_util.keystr(path)}) sits {found[1]}. Put loss_scaling "
                "outermost (inside only mpjax.master_weights or mpjax.low_precision_params):\n"
                f"  wrong: {wrong}\n  right: {right}"
            )
        node = _child(node, key)


# The fields that identify a loss-scaling state that lost its type.
_STATE_FIELDS = frozenset({"loss_scale", "inner_state", "skipped_steps", "consecutive_skipped"})


def _is_untyped_state(x: Any) -> bool:
    return isinstance(x, Mapping) and _STATE_FIELDS <= {k for k in x if isinstance(k, str)}


def _check_opt_state(opt_state: Any, where: str) -> None:
    """Refuses an ``opt_state`` that cannot be an optimizer state holding the loss scaling,
    where passing it on would silently leave the loss unscaled."""
    leaves = jax.tree.leaves(opt_state)
    if opt_state is None or (len(leaves) == 1 and leaves[0] is opt_state):
        raise TypeError(
            f"{where}: opt_state must be the optimizer state (what tx.init(params) returns, "
            f"or a pytree holding it), got {_describe(opt_state)}."
        )
    nodes = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda x: _is_untyped_state(x) or isinstance(x, tuple)
    )[0]
    untyped = [path for path, x in nodes if _is_untyped_state(x)]
    if untyped:
        raise TypeError(
            f"{where}: opt_state{jax.tree_util.keystr(untyped[0])} holds the fields of a "
            "LossScalingState in a mapping, not the LossScalingState itself (nnx.state(...) of "
            "an optimizer, or a checkpoint restored without a target, turns it into one), so "
            "its loss scale cannot be used. Pass the optimizer state itself (for an "
            "nnx.Optimizer, optimizer.opt_state), or restore the checkpoint into the state "
            "tx.init(params) builds."
        )
    if nodes and not any(isinstance(x, tuple) for _, x in nodes):
        # Every optax state is a NamedTuple (or a tuple of them): a tree of arrays without
        # one is params or gradients, passed where the optimizer state goes.
        raise TypeError(
            f"{where}: opt_state holds no optax state (optax states are NamedTuples, chains "
            f"tuples of them), only {len(nodes)} arrays or values: params, gradients or "
            "nnx.state(optimizer) passed where the optimizer state goes? Pass what tx.init(params) returns, or the pytree "
            "holding it."
        )


def _unbox(x: Any) -> Any:
    """An array as it is; the one array inside a box: ``nnx.Optimizer`` keeps each array of
    its state in a Variable (``OptArray``), a pytree node whose one leaf is the array."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return x
    leaves = jax.tree.leaves(x)
    return leaves[0] if len(leaves) == 1 else x


def _unboxed(state: LossScalingState) -> LossScalingState:
    """``state`` with plain arrays for the fields the readers use (the inner state as it is)."""
    scale = state.loss_scale
    return state._replace(
        loss_scale=jax.tree.map(_unbox, scale, is_leaf=lambda x: x is not scale),
        applied=_unbox(state.applied),
        skipped_steps=_unbox(state.skipped_steps),
        consecutive_skipped=_unbox(state.consecutive_skipped),
        window_finite=_unbox(state.window_finite),
    )


def _find_state(opt_state: Any, where: str) -> LossScalingState | None:
    """The one :class:`LossScalingState` inside ``opt_state`` (its arrays unboxed), or None
    when it holds none; refuses an ``opt_state`` that cannot be an optimizer state, more than
    one loss-scaling state, and one that does not wrap the rest of the optimizer."""
    _check_opt_state(opt_state, where)
    found = _loss_scaling_states(opt_state)
    if len(found) > 1:
        raise ValueError(
            f"{where}: opt_state must hold at most one LossScalingState, found {len(found)} "
            f"(at {', '.join('opt_state' + jax.tree_util.keystr(p) for p, _ in found)}). "
            "Build the optimizer with one mpjax.loss_scaling(...) and pass its full state."
        )
    if not found:
        return None
    path, state = found[0]
    _check_placement(opt_state, path, where)
    return _unboxed(state)


def step_applied(opt_state: Any) -> jax.Array:
    """Whether the loss scaling inside ``opt_state`` applied its last step (True without one).

    For transformations that wrap :func:`loss_scaling` and must not move their own state on a
    skipped step (:func:`mpjax.state_precision`, :func:`mpjax.low_precision_params`); it reads
    the wrapped state as it is, without the checks of the public readers.
    """
    found = _loss_scaling_states(opt_state)
    if len(found) > 1:
        raise ValueError(
            f"opt_state must hold at most one LossScalingState, found {len(found)}. Build the "
            "optimizer with one mpjax.loss_scaling(...)."
        )
    return _unbox(found[0][1].applied) if found else jnp.array(True)


def _check_loss(loss: Any, where: str, what: str) -> None:
    """Refuses a loss that cannot be scaled and differentiated: not floating, or 8-bit."""
    if not is_floating(loss):
        raise TypeError(
            f"{where}: {what} must be a floating-point array (the value to differentiate), got "
            f"{_describe(loss)}."
        )
    if jnp.finfo(loss.dtype).bits < 16:
        raise TypeError(
            f"{where}: {what} is {loss.dtype}, which cannot hold a scaled loss; compute the loss "
            "in float32 (a policy's output dtype) or at least float16."
        )


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Multiplies ``loss`` by the current loss scale found anywhere in ``opt_state``.

    :func:`scaled_value_and_grad` calls it for you, so it cannot be forgotten; use this to
    write the step by hand. The state of :func:`loss_scaling` is found wherever it sits:
    inside :func:`mpjax.master_weights` states, ``nnx.Optimizer.opt_state`` or any other
    pytree holding the optimizer state. The product is computed in float32 and returned in
    the loss's dtype. Differentiate the result, and pass the gradients to the optimizer's
    ``update``.

    Without loss scaling in ``opt_state`` the loss is returned unchanged, as PyTorch's
    ``GradScaler(enabled=False).scale`` does: one training step serves every policy, whether or
    not its optimizer scales the loss.

    Args:
      loss: the loss, a floating-point array of at least 16 bits (usually a scalar) or a
        Python float.
      opt_state: the full optimizer state.

    Raises:
      TypeError: if ``loss`` is not floating point (a string, an integer, a bool array...) or
        is an 8-bit float, and for an ``opt_state`` that is not an optimizer state (None, an
        array, a tree of params) or holds a loss-scaling state turned into a dict.
      ValueError: if ``opt_state`` holds more than one :class:`LossScalingState`, or one that
        does not wrap the rest of the optimizer (inside an ``optax.chain`` after or before
        other transformations, or inside ``optax.MultiSteps``).

    >>> state = loss_scaling(optax.sgd(1.0), "static:4").init(jnp.ones(1))
    >>> scale_loss(jnp.float32(0.5), state)
    Array(2., dtype=float32)
    >>> scale_loss(jnp.float32(0.5), optax.sgd(1.0).init(jnp.ones(1)))  # no loss scaling
    Array(0.5, dtype=float32)
    """
    if isinstance(loss, float):
        loss = jnp.asarray(loss, jnp.float32)
    _check_loss(loss, "scale_loss", "loss")
    state = _find_state(opt_state, "scale_loss")
    return loss if state is None else state.loss_scale.scale(loss)


def check_argnums(argnums: Any, where: str, also: tuple[type, ...] = (), what: str = "") -> None:
    """Refuses an ``argnums`` that is neither an int nor a non-empty tuple of ints (nor, for a
    ``value_and_grad`` that takes more, an instance of ``also``, described by ``what``)."""

    def ok(i):
        return isinstance(i, (int, np.integer, *also)) and not isinstance(i, (bool, np.bool_))

    if ok(argnums) or (isinstance(argnums, (tuple, list)) and argnums and all(map(ok, argnums))):
        return
    raise TypeError(
        f"{where}: argnums must be an int{what} or a non-empty tuple of them (which of fun's "
        f"arguments to differentiate, counted after opt_state), got {_describe(argnums)}."
    )


def make_scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: Any,
    has_aux: bool,
    value_and_grad: Callable[..., Callable[..., Any]],
    where: str,
) -> Callable[..., tuple[Any, Any]]:
    """:func:`scaled_value_and_grad` over any ``value_and_grad`` transformation
    (``jax.value_and_grad``; ``flax.nnx.value_and_grad`` for :mod:`mpjax.nnx`), whose
    ``argnums`` the caller has checked.

    Raises:
      TypeError: for a ``fun`` that is not callable or a ``has_aux`` that is not a bool.
    """
    if not callable(fun):
        raise TypeError(
            f"{where}(fun): fun must be the loss function (a callable), got {_describe(fun)}. "
            f"Pass the function itself: {where}(loss_fn), not {where}(loss_fn(params))."
        )
    if not isinstance(has_aux, (bool, np.bool_)):
        raise TypeError(f"{where}: has_aux must be a bool, got {_describe(has_aux)}.")

    def value_and_scaled_grad(opt_state: Any, /, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not _loss_scaling_states(opt_state) and any(
            _loss_scaling_states(a) for a in (*args, *kwargs.values())
        ):
            raise TypeError(
                f"{where}: the loss-scaling state is among fun's arguments, not in opt_state: "
                f"the optimizer state goes first, {where}(loss_fn)(opt_state, *loss_fn_args)."
            )
        state = _find_state(opt_state, where)

        def scaled(*fun_args: Any, **fun_kwargs: Any) -> tuple[jax.Array, Any]:
            out = fun(*fun_args, **fun_kwargs)
            if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    f"{where}: with has_aux=True fun must return a pair (loss, aux), got "
                    f"{_describe(out)}."
                )
            loss, aux = out if has_aux else (out, None)
            _check_loss(loss, where, "the loss fun returns")
            if np.ndim(loss) != 0:
                raise TypeError(
                    f"{where}: fun must return a scalar loss, got shape {np.shape(loss)}; "
                    "reduce it (jnp.mean) first."
                )
            # In at least float32: a float16 loss times the scale would overflow to an inf
            # (discarded, but jax_debug_infs stops at it); the gradients are scale_loss's.
            wide = loss if jnp.finfo(loss.dtype).bits >= 32 else loss.astype(jnp.float32)
            return (wide if state is None else state.loss_scale.scale(wide)), (loss, aux)

        (_, (loss, aux)), grads = value_and_grad(scaled, argnums=argnums, has_aux=True)(
            *args, **kwargs
        )
        return ((loss, aux) if has_aux else loss), grads

    return value_and_scaled_grad


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad(fun)``, but the gradients are of the loss times the current
    loss scale: what :func:`loss_scaling`'s ``update`` expects.

    The returned function takes the optimizer state first, then ``fun``'s arguments exactly:
    ``loss, grads = scaled_value_and_grad(loss_fn)(opt_state, params, batch)``. It finds the
    loss scale in ``opt_state`` (anywhere in it, as :func:`scale_loss` does), differentiates
    ``fun``'s loss times that scale, and returns the loss as ``fun`` computed it (unscaled)
    with the scaled gradients. Pass those to ``tx.update(grads, opt_state, params)``
    unchanged: it unscales them, skips the step if any is inf or NaN, then clips and updates.
    (Read gradient norms from the updates, or after unscaling; these gradients are scaled.)

    Without loss scaling in ``opt_state`` it is ``jax.value_and_grad``: one train step serves
    every policy. It works under ``jax.jit`` and with any params pytree (Flax linen's
    included); for NNX modules use :func:`mpjax.nnx.scaled_value_and_grad`.

    Args:
      fun: the loss function; it returns a floating-point scalar of at least 16 bits, or
        ``(loss, aux)`` with ``has_aux``.
      argnums: which of ``fun``'s positional arguments to differentiate (not counting
        ``opt_state``), an int or a tuple of ints, as for ``jax.value_and_grad``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function ``(opt_state, *args, **kwargs) -> (loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux``; ``grads`` is shaped as for
      ``jax.value_and_grad``, in the dtypes of the arguments.

    Raises:
      TypeError: for a ``fun`` that is not callable, a bad ``argnums`` or ``has_aux``; when
        called, for a ``fun`` that returns no floating scalar (or no pair with ``has_aux``),
        the optimizer state passed after ``fun``'s arguments, and what :func:`scale_loss`
        raises about ``opt_state``.
      ValueError: when called, what :func:`scale_loss` raises about ``opt_state``: more
        than one loss-scaling state, or one that does not wrap the rest of the optimizer.

    >>> tx = loss_scaling(optax.sgd(0.5), "static:1024")
    >>> params = {"w": jnp.ones(2)}
    >>> opt_state = tx.init(params)
    >>> loss_fn = lambda p, x: jnp.sum((p["w"] * x) ** 2)
    >>> loss, grads = jax.jit(scaled_value_and_grad(loss_fn))(opt_state, params, 3.0)
    >>> loss, grads["w"]  # the loss unscaled, the gradients scaled by 1024
    (Array(18., dtype=float32), Array([18432., 18432.], dtype=float32))
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> updates["w"]  # -0.5 times the true gradient, 18
    Array([-9., -9.], dtype=float32)
    """
    check_argnums(argnums, "scaled_value_and_grad")
    return make_scaled_value_and_grad(
        fun, argnums, has_aux, jax.value_and_grad, "scaled_value_and_grad"
    )


def loss_scaling_info(opt_state: Any) -> LossScalingInfo:
    """The current loss scale and skip counters, read from anywhere in ``opt_state``.

    The state of :func:`loss_scaling` is found as by :func:`scale_loss`. Works inside and
    outside ``jax.jit``: the fields are arrays, ready to log as metrics.

    Without loss scaling in ``opt_state`` the neutral values come back: a scale of 1, every
    step applied, nothing skipped. So a training step can log the same metrics for every
    policy, as PyTorch's ``GradScaler(enabled=False).get_scale()`` gives 1.

    Args:
      opt_state: the full optimizer state.

    Returns:
      A :class:`LossScalingInfo`: ``loss_scale`` (float32), ``applied`` (bool),
      ``skipped_steps`` and ``consecutive_skipped`` (int32), all scalar arrays (plain arrays
      for an ``nnx.Optimizer``'s ``opt_state`` too).

    Raises:
      TypeError, ValueError: what :func:`scale_loss` raises about ``opt_state``.

    >>> tx = loss_scaling(optax.chain(optax.clip(1.0), optax.sgd(1.0)))
    >>> loss_scaling_info({"opt": tx.init(jnp.ones(1))}).loss_scale
    Array(32768., dtype=float32)
    >>> loss_scaling_info(optax.sgd(1.0).init(jnp.ones(1))).loss_scale  # no loss scaling
    Array(1., dtype=float32)
    """
    return _info(_find_state(opt_state, "loss_scaling_info"))


def _info(state: LossScalingState | None) -> LossScalingInfo:
    if state is None:
        return LossScalingInfo(
            loss_scale=jnp.ones((), jnp.float32),
            applied=jnp.array(True),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skipped=jnp.zeros((), jnp.int32),
        )
    return LossScalingInfo(
        loss_scale=state.scale,
        applied=state.applied,
        skipped_steps=state.skipped_steps,
        consecutive_skipped=state.consecutive_skipped,
    )


class PersistentOverflowError(RuntimeError):
    """Raised by :func:`check_overflow` when too many optimizer steps in a row were skipped."""


# The default dynamic scale backs off from 2**15 to its floor of 1 in 15 overflowed steps in a
# row; 10 more at the floor are overflow that no scale fixes.
DEFAULT_MAX_CONSECUTIVE = 25


def check_overflow(opt_state: Any, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE) -> None:
    """Raises :class:`PersistentOverflowError` after ``max_consecutive`` skipped steps in a row.

    Non-finite steps are expected and harmless in float16 training now and then, but when every
    step overflows, training silently stops. Call this outside ``jax.jit``, for example every
    few steps in the training loop (it reads one scalar from the device). The state of
    :func:`loss_scaling` is found as by :func:`scale_loss`; without one nothing is ever
    skipped, and this never raises. A state with one copy per device (what ``pmap`` returns,
    or ``shard_map`` with per-device state) must agree across devices, which
    ``loss_scaling(..., axis_name=...)`` guarantees; disagreeing copies raise ``ValueError``.

    Args:
      opt_state: the full optimizer state.
      max_consecutive: how many consecutive skipped optimizer steps to tolerate, an integer
        (Python or NumPy) of at least 1; 25 by default (the default dynamic scale reaches its
        floor after 15).

    Raises:
      PersistentOverflowError: if ``max_consecutive`` or more steps in a row were skipped.
      ValueError: for ``max_consecutive < 1``, per-device copies that disagree, and what
        :func:`scale_loss` raises about ``opt_state``.
      TypeError: for a non-integer ``max_consecutive``, when called inside ``jax.jit``, and
        what :func:`scale_loss` raises about ``opt_state``.

    >>> state = loss_scaling(optax.sgd(1.0)).init(jnp.ones(1))
    >>> check_overflow(state)  # nothing skipped: no error
    """
    if isinstance(max_consecutive, (bool, np.bool_)) or not isinstance(
        max_consecutive, (int, np.integer)
    ):
        raise TypeError(
            f"check_overflow: max_consecutive must be an integer >= 1, got "
            f"{_describe(max_consecutive)}."
        )
    if max_consecutive < 1:
        raise ValueError(
            f"check_overflow: max_consecutive must be an integer >= 1, got {max_consecutive!r}."
        )
    state = _find_state(opt_state, "check_overflow")
    info = _info(state)
    if jax_compat.is_tracer(info.consecutive_skipped):
        raise TypeError(
            "check_overflow reads values from the device: call it outside jax.jit, on the "
            "opt_state a jitted step returns."
        )
    per_device = np.asarray(info.consecutive_skipped).reshape(-1)
    scales = np.asarray(info.loss_scale).reshape(-1)
    if len(set(per_device.tolist())) > 1 or len(set(scales.tolist())) > 1:
        raise ValueError(
            "check_overflow: the devices disagree on the loss scaling (consecutive skipped "
            f"steps {sorted(set(per_device.tolist()))}, scales {sorted(set(scales.tolist()))}): "
            "their params have diverged. Inside shard_map or pmap, pass the mapped axes to "
            "mpjax.loss_scaling(..., axis_name=...) so that every device skips the same steps."
        )
    count = int(per_device[0])
    if count >= max_consecutive:
        raise PersistentOverflowError(
            f"The last {count} optimizer steps were all skipped because the gradients had inf "
            f"or NaN (limit: {max_consecutive}); the loss scale is now "
            f"{float(scales[0]):g}. Nothing has been applied since. Remedies:\n"
            "  1. check the loss and the forward pass for inf/NaN (they overflow at any scale);\n"
            "  2. keep overflow-prone ops (softmax, norms, losses) in float32 via the policy;\n"
            "  3. lower the learning rate if the params themselves diverged;\n"
            "  4. use bfloat16 instead of float16 where the hardware has it."
        )


def check_loss_scaling(opt_state: Any) -> None:
    """Checks that the loss-scaling state in ``opt_state`` is one :func:`loss_scaling` could
    have produced; call it, outside ``jax.jit``, on a state restored from a checkpoint.

    A checkpoint holds the scale and the counters; the bounds (``min_scale``, ``max_scale``)
    come from the optimizer the code builds. A scale outside them (a checkpoint of a run with
    other bounds, or from before the default floor), a scale that is not positive and finite,
    or negative counters would otherwise be used as they are. Without loss scaling in
    ``opt_state`` there is nothing to check.

    It also refuses a loss scaling that does not wrap the rest of the optimizer (see
    :func:`scale_loss`): a checkpoint restored into the state of such an optimizer resumes a
    run whose steps were wrong.

    Raises:
      ValueError: naming what is wrong and the values, and what :func:`scale_loss` raises
        about ``opt_state``.
      TypeError: when called inside ``jax.jit``, and what :func:`scale_loss` raises about
        ``opt_state``.

    >>> state = loss_scaling(optax.sgd(1.0)).init(jnp.ones(1))
    >>> check_loss_scaling(state)  # a fresh state is fine
    """
    state = _find_state(opt_state, "check_loss_scaling")
    if state is None:
        return
    if jax_compat.is_tracer(state.scale):
        raise TypeError("check_loss_scaling reads values from the device: call it outside jit.")
    scale = np.asarray(state.scale, np.float64).reshape(-1)
    problems = []
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        problems.append(f"the scale {scale.tolist()} is not positive and finite")
    ls = state.loss_scale
    if isinstance(ls, DynamicLossScale):
        low = -np.inf if ls.min_scale is None else np.float32(ls.min_scale)
        high = np.inf if ls.max_scale is None else np.float32(ls.max_scale)
        if ((scale < low) | (scale > high)).any():
            problems.append(
                f"the scale {scale.tolist()} is outside [min_scale, max_scale] = "
                f"[{ls.min_scale}, {ls.max_scale}] of this optimizer"
            )
    for name in ("counter", "skipped_steps", "consecutive_skipped"):
        value = np.asarray(getattr(state, name)).reshape(-1)
        if (value < 0).any():
            problems.append(f"{name} {value.tolist()} is negative")
    if problems:
        raise ValueError(
            "check_loss_scaling: the loss-scaling state is not one this optimizer can continue "
            f"from: {'; '.join(problems)}. Restore a checkpoint of this same setup, or start "
            "the loss scale afresh (replace the state's loss_scale with the optimizer's own)."
        )


# ---------------------------------------------------------------------------------------------
# Deprecated aliases: kept for one release, each warns and names its replacement.


def get_loss_scale(spec: LossScale | str | int | float) -> LossScale:
    """Deprecated: pass ``spec`` to :func:`loss_scaling` directly, or build the loss scale
    with :class:`DynamicLossScale`, :class:`StaticLossScale` or :class:`NoOpLossScale`.

    Returns the loss scale that ``spec`` names (same specs and errors as :func:`loss_scaling`).
    """
    warn_deprecated(
        "mpjax.get_loss_scale(spec)",
        "mpjax.loss_scaling(inner, loss_scale=spec) with the spec directly, or build "
        "mpjax.DynamicLossScale(), mpjax.StaticLossScale(N) or mpjax.NoOpLossScale()",
    )
    return _parse_loss_scale(spec)


def loss_scale_for(policy: PolicyLike) -> LossScale:
    """Deprecated: use :attr:`mpjax.Policy.needs_loss_scaling`.

    Returns a :class:`DynamicLossScale` when the policy computes or stores params in float16,
    a :class:`NoOpLossScale` otherwise.
    """
    warn_deprecated(
        "mpjax.loss_scale_for(policy)",
        'mpjax.loss_scaling(tx, "dynamic" if policy.needs_loss_scaling else "none")',
    )
    return DynamicLossScale() if get_policy(policy).needs_loss_scaling else NoOpLossScale()


def find_loss_scaling_state(opt_state: Any) -> LossScalingState:
    """Deprecated: use :func:`loss_scaling_info` (or :func:`scale_loss`).

    Returns the one :class:`LossScalingState` inside ``opt_state``; ``ValueError`` if it holds
    none or more than one.
    """
    warn_deprecated(
        "mpjax.find_loss_scaling_state(opt_state)",
        "mpjax.loss_scaling_info(opt_state) to read the scale and the skip counters",
    )
    found = _loss_scaling_states(opt_state)
    if len(found) != 1:
        raise ValueError(
            f"opt_state must hold exactly one LossScalingState, found {len(found)}. Build the "
            "optimizer with one mpjax.loss_scaling(...) and pass its full state."
        )
    return found[0][1]
