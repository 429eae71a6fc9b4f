"""The optax transformation :func:`loss_scaling` and its state, :class:`LossScalingState`.

The order of one training step is scale -> grad -> unscale -> clip -> update:

1. :func:`mpjax.scaled_value_and_grad` multiplies the loss by the current scale
   (:func:`mpjax.scale_loss`) and
2. differentiates the scaled loss, returning the loss unscaled and the scaled gradients;
3. the :func:`loss_scaling` transformation, which wraps the whole optimizer, divides them by
   that same scale in float32, checks that every gradient is finite, and only then
4. runs the wrapped transformation (clipping sees the true gradients) and
5. returns its updates; after a non-finite step it returns zeros and leaves the wrapped state
   bit-for-bit unchanged. Either way it adjusts the scale for the next step.

The scales it adjusts are :mod:`mpjax.optim.loss_scale`'s; what reads its state from anywhere in an
optimizer state (steps 1 and 2, the counters, the checks) is :mod:`mpjax.optim.loss_scaling_readers`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpjax import jax_compat
from mpjax.optim.gradient_checks import InitTrees, check_params, check_transformation, check_update
from mpjax.optim.loss_scale import LossScale, NoOpLossScale, StaticLossScale, parse_loss_scale

__all__ = ["LossScalingState", "LossScalingWarning", "loss_scaling"]

# The default dynamic scale backs off from 2**15 to its floor of 1 in 15 overflowed steps in a
# row; 10 more at the floor are overflow that no scale fixes.
DEFAULT_MAX_CONSECUTIVE = 25


class LossScalingWarning(UserWarning):
    """Warned by a :func:`loss_scaling` update that skipped ``DEFAULT_MAX_CONSECUTIVE`` (25)
    optimizer steps in a row for inf or NaN gradients (on the host, from the step), or that
    got gradients of a loss never scaled with its state's scale (at trace time)."""


def _warn_persistent_overflow(count: Any, scale: Any) -> None:
    """The host side of the persistent-overflow warning (a ``jax.debug.callback``)."""
    warnings.warn(
        f"mpjax.loss_scaling: the last {int(count)} optimizer steps were all skipped because "
        f"the gradients had inf or NaN; the loss scale is now {float(scale):g} and nothing has "
        "been applied since. No loss scale fixes this: check the loss and the forward pass for "
        "inf/NaN, keep overflow-prone ops in float32 via the policy, lower the learning rate, "
        "or use bfloat16. mpjax.check_overflow(opt_state) raises PersistentOverflowError "
        "instead.",
        LossScalingWarning,
        stacklevel=2,
    )


# The loss-scale values that scaled a loss (scale_loss, scaled_value_and_grad): concrete arrays,
# or the tracers of a trace in progress, by id. Weak, so nothing is kept alive and an id is only
# found while its value lives.
_scaled_with: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def record_scaled(scale: Any) -> None:
    """Notes that ``scale`` (a :class:`LossScalingState`'s ``loss_scale.loss_scale``, concrete
    or traced) multiplied a loss, for the update's check of a forgotten ``scale_loss``."""
    with contextlib.suppress(TypeError):  # not weak-referenceable: nothing to check against
        _scaled_with[id(scale)] = scale


def _scales(loss_scale: LossScale) -> bool:
    """Whether ``loss_scale`` (a transformation's initial scale) changes the gradients at all:
    not for no scale or a static scale of 1."""
    if isinstance(loss_scale, NoOpLossScale):
        return False
    if isinstance(loss_scale, StaticLossScale):
        return float(loss_scale.loss_scale) != 1.0
    return True


def _warn_if_unscaled(loss_scale: LossScale) -> None:
    """Warns, at trace time (no cost to the step), when the update runs with a scale that
    never scaled a loss in this trace or, outside jit, with this array: gradients from a plain
    ``jax.value_and_grad`` would be divided by a scale they were never multiplied by."""
    scale = loss_scale.loss_scale
    if _scaled_with.get(id(scale)) is scale:
        return
    warnings.warn(
        "mpjax.loss_scaling: update() got gradients of a loss that was not scaled with this "
        "state's loss scale: gradients from a plain jax.value_and_grad are divided by a scale "
        "they were never multiplied by, and the step all but vanishes. Compute them with "
        "mpjax.scaled_value_and_grad(loss_fn)(opt_state, params) or differentiate "
        "mpjax.scale_loss(loss, opt_state). If the loss was scaled in another jitted function "
        "than this update, this warning is a false alarm (see the loss-scaling guide).",
        LossScalingWarning,
        stacklevel=3,
    )


# Whether steps traced now carry the persistent-overflow warning's host callback.
_host_warnings = contextvars.ContextVar("mpjax_loss_scaling_host_warnings", default=True)


@contextlib.contextmanager
def without_host_warnings() -> Any:
    """Traces loss scaling's steps without the host callback of the persistent-overflow
    warning, for a compile for devices this process cannot call back from: the compile-only
    GPUs and TPUs of :func:`mpjax.plan`, where lowering a callback fails."""
    token = _host_warnings.set(False)
    try:
        yield
    finally:
        _host_warnings.reset(token)


# lax.platform_dependent's names of the accelerator platforms; each gets the warning's callback
# only where this process has devices of it. JAX's names in a traced value's sharding differ.
_ACCELERATORS = {"cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
_said_left_out: set[str] = set()


@functools.cache
def _has_devices(platform: str) -> bool:
    """Whether this process has devices of ``platform`` (a compile for any other platform is
    ahead of time, on compile-only devices)."""
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # no such backend here, or it did not start
        return False


def _say_left_out(consecutive: jax.Array) -> None:
    """Says once per platform, at trace time, that a step traced for devices this process
    lacks leaves the persistent-overflow warning out (unless :func:`without_host_warnings`,
    the user's ``mpjax.compile_only()``, asked for that already)."""
    platform = jax_compat.traced_platform(consecutive)
    local = {name for name, traced in _ACCELERATORS.items() if traced == platform}
    if platform in (None, "cpu") or any(_has_devices(name) for name in local):
        return
    if platform not in _said_left_out:
        _said_left_out.add(platform)
        warnings.warn(
            f"mpjax.loss_scaling: this step is traced for {platform} devices this process does "
            "not have (an ahead-of-time compile), where its host callback cannot run: the "
            "warning after 25 skipped steps in a row is left out of that compile. The step "
            "still skips non-finite updates and keeps its loss scale; mpjax.check_overflow("
            "opt_state) reads the skipped steps on the host. Trace inside "
            "mpjax.compile_only() to leave it out without this note.",
            LossScalingWarning,
            stacklevel=4,
        )


def _warn_if_persistent(skipped: jax.Array, consecutive: jax.Array, scale: jax.Array) -> None:
    """Warns once per run of skipped steps, when it reaches ``DEFAULT_MAX_CONSECUTIVE``. The
    callback sits in the branch of a ``cond`` that only such a step takes, so a step that went
    well sends nothing to the host and waits for nothing.

    A host callback lowers only for a platform this process has devices of: for the others
    (the compile-only GPUs or TPUs of an ahead-of-time ``jax.jit(step).lower(...).compile()``)
    the branch is empty, chosen when the step is lowered (``lax.platform_dependent``), so such
    a compile works however the step was traced."""
    if not _host_warnings.get():
        return
    _say_left_out(consecutive)

    def warn(count, scale):
        jax.debug.callback(_warn_persistent_overflow, count, scale)

    def left_out(count, scale):
        del count, scale

    branches = {name: warn if _has_devices(name) else left_out for name in _ACCELERATORS}

    def on_this_platform(count, scale):
        jax.lax.platform_dependent(count, scale, default=warn, **branches)

    jax.lax.cond(
        skipped & (consecutive == DEFAULT_MAX_CONSECUTIVE),
        on_this_platform,
        lambda count, scale: None,
        consecutive,
        scale,
    )


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
        step). :func:`mpjax.check_overflow` turns a long run of them into an error.
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
    :func:`mpjax.scaled_value_and_grad`. ``update`` receives gradients of the loss scaled by
    :func:`mpjax.scale_loss`. It divides them, in float32, by exactly the scale that scaled the loss
    (the scale in the state it receives, before this step adjusts it) and hands them to
    ``inner`` in their own dtype, so ``inner`` (clipping, Adam...) sees true gradients. If any gradient is inf or NaN (checked over the
    whole tree; under sharding, over all devices) the step is skipped: the updates are zeros
    and ``inner``'s state is returned bit-for-bit unchanged (Adam's step count does not move).
    Then the loss scale is adjusted.

    Unlike ``optax.apply_if_finite``, a non-finite update is never applied, however many steps
    in a row overflow; ``state.consecutive_skipped`` counts them and :func:`mpjax.check_overflow`
    raises outside jit when it gets too long. Without it, the update itself warns on the host
    (:class:`mpjax.LossScalingWarning`, through ``jax.debug.callback``) when the 25th step in a
    row is skipped; the callback runs only on that step, so steps that go well do not sync.

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
      loss_scale: a :class:`mpjax.DynamicLossScale`, :class:`mpjax.StaticLossScale` or
        :class:`mpjax.NoOpLossScale`, or ``"dynamic"`` (the default: PyTorch's rule starting at
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
    >>> from mpjax.optim.loss_scaling_readers import scaled_value_and_grad
    >>> tx = loss_scaling(optax.sgd(1.0), "static:8")
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss, grads = scaled_value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(state, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> updates["w"], state.applied
    (Array([-2., -2.], dtype=float32), Array(True, dtype=bool))
    """
    check_transformation(inner, "loss_scaling")
    scale0 = parse_loss_scale(loss_scale)
    axis_name = _check_axis_name(axis_name)
    checks_scaled = _scales(scale0)
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
        if checks_scaled:
            _warn_if_unscaled(state.loss_scale)
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
        _warn_if_persistent(skipped, consecutive, new_scale.loss_scale)
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init, update)
