"""Loss-scale values: dynamic (PyTorch's GradScaler rule), static and no-op.

A loss scale multiplies the loss before differentiation so that small float16 gradients do not
underflow, and divides the gradients afterwards. The three classes here are frozen dataclass
pytrees registered from their fields (``flax.struct.dataclass``), so they pass through
``jax.jit``, ``jax.tree.map``, orbax and ``flax.serialization`` without losing a field.

Values that change during training are leaves and always have one dtype: the scale is a float32
scalar array and the growth counter an int32 scalar array, whatever number type was passed in,
so a jitted step compiles once and a new static scale value does not retrace. The dynamic
scale's hyperparameters (``growth_factor``, ``backoff_factor``, ``growth_interval``,
``min_scale``, ``max_scale``) are static fields: they are configuration, fixed for a run, like an
optax learning rate held in a closure. They survive every tree operation (they are part of the
tree structure), and a checkpoint restored into an optimizer state built by the same code gets
them back from that code, while the scale and counter come from the checkpoint.

Constructor arguments given as Python or NumPy numbers are validated. jax arrays are only cast
to float32/int32: tree operations rebuild these objects from tracers and device arrays through
the constructor, and checking a device value would wait for it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, TypeVar, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mpjax.policy import PolicyLike, get_policy

T = TypeVar("T")

# PyTorch's GradScaler starts at 2**16, which float16 cannot represent (its largest finite
# value is 65504): a float16 loss scaled by it is inf on the first step. 2**15 (jmp, Keras) is
# the largest power of two float16 holds.
DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
DEFAULT_GROWTH_INTERVAL = 2000


def _is_user_number(value: Any) -> bool:
    """True for numbers a user passes in; False for what tree operations put in a field.

    Unflattening a pytree calls the constructor with tracers, abstract values, ``None`` or
    arbitrary placeholders, and jax arrays there may be device values not yet computed: only
    Python and NumPy numbers are checked, so unflattening never blocks or raises.
    """
    if isinstance(value, (bool, np.bool_)):
        return False
    return isinstance(value, (int, float, np.ndarray, np.generic))


def _scale_leaf(value: Any, name: str) -> Any:
    """Normalizes a scale to a strongly typed float32 scalar array, checking user numbers."""
    if _is_user_number(value):
        host = np.asarray(value)
        if host.shape != () or not np.issubdtype(host.dtype, np.number):
            raise ValueError(f"{name} must be a positive number, got {value!r}.")
        with np.errstate(over="ignore"):  # too large for float32 is reported just below
            as_f32 = np.float32(host)
        if not (np.isfinite(as_f32) and as_f32 > 0):
            raise ValueError(
                f"{name} must be positive and finite in float32, got {value!r}."
            )
        return jnp.asarray(as_f32, jnp.float32)
    if isinstance(value, jax.Array) and (
        value.dtype != jnp.float32 or jax.typeof(value).weak_type
    ):
        return jnp.asarray(value, jnp.float32)
    return value


def _counter_leaf(value: Any) -> Any:
    """Normalizes a growth counter to an int32 scalar array, checking user numbers."""
    if _is_user_number(value):
        host = np.asarray(value)
        if host.shape != () or not np.issubdtype(host.dtype, np.integer) or host < 0:
            raise ValueError(f"counter must be a non-negative integer, got {value!r}.")
        return jnp.asarray(host, jnp.int32)
    if isinstance(value, jax.Array) and (
        value.dtype != jnp.int32 or jax.typeof(value).weak_type
    ):
        return jnp.asarray(value, jnp.int32)
    return value


def _optional_bound(value: Any, name: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a positive number or None, got {value!r}.")
    value = float(value)
    with np.errstate(over="ignore"):  # too large for float32 is reported just below
        in_range = math.isfinite(np.float32(value))
    if not (value > 0 and in_range):
        raise ValueError(f"{name} must be positive and finite in float32 or None, got {value!r}.")
    return value


def _multiply_floating(tree: T, factor: jax.Array, divide: bool, keep_dtype: bool) -> T:
    """Multiplies (or divides) floating leaves by ``factor``, computing in at least float32."""

    def apply(x):
        if isinstance(x, (float, np.ndarray, np.generic)):
            x = jnp.asarray(x)
        if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        # Explicit: strict dtype promotion has no bfloat16 -> float32 path.
        wide = x.dtype if jnp.finfo(x.dtype).bits > 32 else np.dtype(jnp.float32)
        x_wide, f_wide = x.astype(wide), factor.astype(wide)
        out = x_wide / f_wide if divide else x_wide * f_wide
        return out.astype(x.dtype) if keep_dtype else out

    return jax.tree.map(apply, tree)


class _LossScaleMethods:
    """``scale``/``unscale`` shared by the three loss scales; each provides ``loss_scale``."""

    loss_scale: jax.Array

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


@flax.struct.dataclass
class NoOpLossScale(_LossScaleMethods):
    """A loss scale of exactly 1: for bfloat16 and float32 training, which need none.

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
        """Returns ``self``: a no-op scale never changes."""
        del grads_finite
        return self


@flax.struct.dataclass
class StaticLossScale(_LossScaleMethods):
    """A fixed loss scale.

    The value is a float32 array leaf, so a jitted step given a new static value does not
    retrace.

    Args:
      loss_scale: the scale, a positive number (stored as a float32 scalar array).

    Raises:
      ValueError: if ``loss_scale`` is not positive and finite in float32.

    >>> StaticLossScale(128).scale(jnp.array(0.5, jnp.bfloat16))
    Array(64, dtype=bfloat16)
    """

    loss_scale: jax.Array

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _scale_leaf(self.loss_scale, "loss_scale"))

    @property
    def counter(self) -> jax.Array:
        """The growth counter, an int32 scalar array: always 0."""
        return jnp.zeros((), jnp.int32)

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        """Returns ``self``: a static scale never changes."""
        del grads_finite
        return self


@flax.struct.dataclass
class DynamicLossScale(_LossScaleMethods):
    """A loss scale that follows PyTorch's ``GradScaler`` rule.

    After a step with non-finite gradients the scale is multiplied by ``backoff_factor`` and the
    counter resets. After a finite step the counter grows by one; on the
    ``growth_interval``-th consecutive finite step the scale is multiplied by ``growth_factor``
    (only if the result stays finite) and the counter resets. ``min_scale`` and ``max_scale``,
    when given, clamp the result (PyTorch has neither).

    The default initial scale is ``2**15`` (jmp and Keras), not PyTorch's ``2**16``: float16's
    largest finite value is 65504, so a float16 loss scaled by ``2**16`` overflows on the first
    step. Growth factor, backoff factor and interval default to PyTorch's 2, 0.5 and 2000.

    ``loss_scale`` (float32) and ``counter`` (int32) are array leaves. The hyperparameters are
    static pytree fields: configuration that never changes during a run, kept in the tree
    structure (never lost by ``jit``, ``tree.map`` or checkpoints) and, on restore, taken from
    the optimizer the code builds.

    Args:
      loss_scale: initial scale, a positive number.
      counter: consecutive finite steps since the last change, a non-negative integer.
      growth_factor: factor applied on growth, greater than 1.
      backoff_factor: factor applied on overflow, in (0, 1).
      growth_interval: consecutive finite steps before growth, at least 1.
      min_scale: floor for the scale after backoff, or None for no floor.
      max_scale: cap for the scale after growth, or None for no cap.

    Raises:
      ValueError: for a non-positive scale, ``growth_factor <= 1``, ``backoff_factor`` outside
        (0, 1), ``growth_interval < 1``, ``min_scale > max_scale`` or an initial scale outside
        ``[min_scale, max_scale]``.

    >>> ls = DynamicLossScale(16.0, growth_interval=1)
    >>> ls.adjust(jnp.array(True)).loss_scale, ls.adjust(jnp.array(False)).loss_scale
    (Array(32., dtype=float32), Array(8., dtype=float32))
    """

    loss_scale: jax.Array = DEFAULT_INITIAL_SCALE
    counter: jax.Array = 0
    growth_factor: float = flax.struct.field(
        pytree_node=False, kw_only=True, default=DEFAULT_GROWTH_FACTOR
    )
    backoff_factor: float = flax.struct.field(
        pytree_node=False, kw_only=True, default=DEFAULT_BACKOFF_FACTOR
    )
    growth_interval: int = flax.struct.field(
        pytree_node=False, kw_only=True, default=DEFAULT_GROWTH_INTERVAL
    )
    min_scale: Optional[float] = flax.struct.field(pytree_node=False, kw_only=True, default=None)
    max_scale: Optional[float] = flax.struct.field(pytree_node=False, kw_only=True, default=None)

    def __post_init__(self):
        growth, backoff, interval = self.growth_factor, self.backoff_factor, self.growth_interval
        if isinstance(growth, bool) or not isinstance(growth, (int, float, np.number)):
            raise TypeError(f"growth_factor must be a number greater than 1, got {growth!r}.")
        if not (growth > 1 and math.isfinite(growth)):
            raise ValueError(f"growth_factor must be finite and greater than 1, got {growth!r}.")
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float, np.number)):
            raise TypeError(f"backoff_factor must be a number in (0, 1), got {backoff!r}.")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {backoff!r}.")
        if isinstance(interval, bool) or not isinstance(interval, (int, np.integer)):
            raise TypeError(f"growth_interval must be an integer >= 1, got {interval!r}.")
        if interval < 1:
            raise ValueError(f"growth_interval must be an integer >= 1, got {interval!r}.")
        low = _optional_bound(self.min_scale, "min_scale")
        high = _optional_bound(self.max_scale, "max_scale")
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"min_scale must not exceed max_scale, got min_scale={low!r} > max_scale={high!r}."
            )
        scale = _scale_leaf(self.loss_scale, "loss_scale")
        if _is_user_number(self.loss_scale):
            initial = float(scale)
            if (low is not None and initial < low) or (high is not None and initial > high):
                raise ValueError(
                    f"loss_scale {self.loss_scale!r} is outside [min_scale, max_scale] = "
                    f"[{low}, {high}]."
                )
        fields = {
            "loss_scale": scale,
            "counter": _counter_leaf(self.counter),
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
        """
        finite = jnp.asarray(grads_finite, jnp.bool_)
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
        return self.replace(loss_scale=new_scale, counter=new_counter)


LossScale = Union[DynamicLossScale, StaticLossScale, NoOpLossScale]
"""Any of the three loss-scale pytrees."""

_LOSS_SCALE_CHOICES = ("'dynamic'", "'none'", "'static:N'", "a positive number", "a loss scale")


def get_loss_scale(spec: Union[LossScale, str, int, float]) -> LossScale:
    """Returns the loss scale that ``spec`` names.

    Args:
      spec: a :class:`DynamicLossScale`, :class:`StaticLossScale` or :class:`NoOpLossScale`
        (returned as is); ``"dynamic"`` (a :class:`DynamicLossScale` with the defaults);
        ``"none"`` (a :class:`NoOpLossScale`); ``"static:N"`` or a positive number N (a
        :class:`StaticLossScale` of N).

    Raises:
      ValueError: for an unknown string or a malformed or non-positive static value.
      TypeError: for a value of any other type.

    >>> get_loss_scale("static:1024").loss_scale
    Array(1024., dtype=float32)
    """
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


def loss_scale_for(policy: PolicyLike) -> LossScale:
    """Returns the loss scale a policy needs: dynamic for float16, none otherwise.

    float16's narrow exponent range lets small gradients underflow, so a policy whose compute or
    param dtype is float16 gets a :class:`DynamicLossScale` with the defaults. bfloat16 and
    float32 have float32's exponent range and get a :class:`NoOpLossScale`.

    Args:
      policy: anything :func:`mpjax.get_policy` accepts.

    >>> type(loss_scale_for("mixed_float16")).__name__, type(loss_scale_for("bf16")).__name__
    ('DynamicLossScale', 'NoOpLossScale')
    """
    policy = get_policy(policy)
    if np.dtype(jnp.float16) in (policy.compute_dtype, policy.param_dtype):
        return DynamicLossScale()
    return NoOpLossScale()
