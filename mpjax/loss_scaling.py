"""Loss scaling as an optax transformation: never apply an update from non-finite gradients.

The order of one training step is scale -> grad -> unscale -> clip -> update:

1. ``scale_loss(loss, opt_state)`` multiplies the loss by the current scale;
2. ``jax.grad`` gives gradients of the scaled loss;
3. the :func:`loss_scaling` transformation divides them by that same scale in float32, checks
   that every gradient is finite, and only then
4. runs the wrapped transformation (clipping sees the true gradients) and
5. returns its updates; after a non-finite step it returns zeros and leaves the wrapped state
   bit-for-bit unchanged. Either way it adjusts the scale for the next step.

The loss-scale values themselves live in :mod:`mpjax.loss_scale`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from mpjax import jax_compat
from mpjax.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    get_loss_scale,
    loss_scale_for,
)

__all__ = [
    "DynamicLossScale",
    "LossScalingState",
    "NoOpLossScale",
    "PersistentOverflowError",
    "StaticLossScale",
    "check_overflow",
    "find_loss_scaling_state",
    "loss_scale_for",
    "loss_scaling",
    "scale_loss",
]


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


class PersistentOverflowError(RuntimeError):
    """Raised by :func:`check_overflow` when too many optimizer steps in a row were skipped."""


def _check_gradients(grads: Any, params: Any, where: str) -> None:
    """Rejects non-floating gradients and gradients whose tree differs from the params."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{where}: gradients must be floating-point, got {dtype} at "
                f"grads{jax.tree_util.keystr(path)}. Differentiate with respect to the "
                "floating-point params only (integer leaves have no gradient)."
            )
    if params is not None:
        grads_tree, params_tree = jax.tree.structure(grads), jax.tree.structure(params)
        if grads_tree != params_tree:
            raise ValueError(
                f"{where}: the grads tree does not match the params tree.\n"
                f"  grads:  {grads_tree}\n  params: {params_tree}"
            )


def _all_finite(tree: Any) -> jax.Array:
    """One bool for the whole tree; under jit with sharded leaves the reduction is global."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return functools.reduce(jnp.logical_and, checks, jnp.array(True))


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: Union[LossScale, str, int, float] = "dynamic",
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that it sees unscaled gradients and never a non-finite step.

    ``update`` receives gradients of the loss scaled by :func:`scale_loss`. It divides them, in
    float32, by exactly the scale that scaled the loss (the scale in the state it receives,
    before this step adjusts it) and hands them to ``inner`` in their own dtype, so ``inner``
    (clipping, Adam...) sees true gradients. If any gradient is inf or NaN (checked over the
    whole tree; under sharding, over all devices) the step is skipped: the updates are zeros
    and ``inner``'s state is returned bit-for-bit unchanged (Adam's step count does not move).
    Then the loss scale is adjusted.

    Unlike ``optax.apply_if_finite``, a non-finite update is never applied, however many steps
    in a row overflow; ``state.consecutive_skipped`` counts them and :func:`check_overflow`
    raises outside jit when it gets too long.

    Gradient accumulation: wrap ``optax.MultiSteps`` (pass the ``MultiSteps`` object itself or
    its ``gradient_transformation()``), not the other way round:
    ``loss_scaling(optax.MultiSteps(inner, k))``. Each micro-batch is unscaled and checked
    before it reaches the accumulator, so an inf or NaN never enters it (``MultiSteps`` around
    ``loss_scaling`` would accumulate it, and its reset multiplies by 0, which keeps NaN). As in
    PyTorch, a micro-batch with non-finite gradients dooms its whole optimizer step: the rest
    of the window still runs, then the step is skipped (inner state and ``gradient_step`` as if
    the window never happened, accumulator cleared). The scale stays constant within a window
    and is adjusted once per optimizer step, so ``growth_interval`` counts optimizer steps.

    Args:
      inner: the transformation to wrap: any optax ``GradientTransformation`` or chain,
        ``optax.MultiSteps``, or :func:`mpjax.master_weights`.
      loss_scale: a :class:`DynamicLossScale`, :class:`StaticLossScale` or
        :class:`NoOpLossScale`, or ``"dynamic"`` (the default: PyTorch's rule starting at
        ``2**15``), ``"none"``, ``"static:N"`` or a number N for a static scale.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`LossScalingState`.
      ``update`` requires floating-point gradients (``TypeError`` otherwise) and, when
      ``params`` are given, a gradient tree matching them (``ValueError`` otherwise).

    Raises:
      ValueError, TypeError: for a ``loss_scale`` it cannot interpret.

    >>> import optax
    >>> tx = loss_scaling(optax.sgd(1.0), "static:8")
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = jax.grad(lambda p: scale_loss(jnp.sum(p["w"] ** 2), state))(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> updates["w"], state.applied
    (Array([-2., -2.], dtype=float32), Array(True, dtype=bool))
    """
    scale0 = get_loss_scale(loss_scale)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return LossScalingState(
            loss_scale=scale0,
            inner_state=inner.init(params),
            applied=jnp.array(True),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skipped=jnp.zeros((), jnp.int32),
            window_finite=jnp.array(True),
        )

    def update(updates, state, params=None, **extra_args):
        _check_gradients(updates, params, "loss_scaling")
        unscaled = state.loss_scale.unscale(updates)
        # Back to each gradient's own dtype, so inner state dtypes never change; the check comes
        # after the cast because a value finite in float32 can overflow float16.
        grads = jax.tree.map(lambda u, g: u.astype(g.dtype), unscaled, updates)
        finite = _all_finite(grads)
        # Zeros instead of inf/NaN: the inner update runs either way (a select, not a cond,
        # keeps shardings intact) and must not compute with values it would then discard.
        safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        new_updates, new_inner = inner.update(safe_grads, state.inner_state, params, **extra_args)
        window_ok = state.window_finite & finite

        if isinstance(state.inner_state, optax.MultiStepsState):
            old = state.inner_state
            step_done = new_inner.gradient_step != old.gradient_step
            discard = step_done & ~window_ok
            new_inner = new_inner._replace(
                inner_opt_state=_select(discard, old.inner_opt_state, new_inner.inner_opt_state),
                gradient_step=jnp.where(discard, old.gradient_step, new_inner.gradient_step),
            )
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
        new_updates = jax.tree.map(
            lambda u: jnp.where(applied, u, jnp.zeros_like(u)), new_updates
        )
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


def find_loss_scaling_state(opt_state: Any) -> LossScalingState:
    """Returns the one :class:`LossScalingState` inside ``opt_state``, wherever it sits.

    It is found inside ``optax.chain`` tuples, ``optax.MultiSteps`` and master-weights states,
    or any other pytree.

    Raises:
      ValueError: if ``opt_state`` holds none, or more than one.

    >>> import optax
    >>> state = optax.chain(optax.scale(1.0), loss_scaling(optax.sgd(1.0))).init(jnp.ones(1))
    >>> find_loss_scaling_state(state).scale
    Array(32768., dtype=float32)
    """
    is_state = lambda x: isinstance(x, LossScalingState)  # noqa: E731
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
    if len(found) != 1:
        raise ValueError(
            f"opt_state must hold exactly one LossScalingState, found {len(found)}. Build the "
            "optimizer with one mpjax.loss_scaling(...) and pass its full state."
        )
    return found[0]


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Multiplies ``loss`` by the current loss scale found anywhere in ``opt_state``.

    The product is computed in float32 and returned in the loss's dtype. Differentiate the
    result, and pass the gradients to the :func:`loss_scaling` transformation's ``update``.

    Raises:
      ValueError: if ``opt_state`` does not hold exactly one :class:`LossScalingState`.

    >>> state = loss_scaling(optax.sgd(1.0), "static:4").init(jnp.ones(1))
    >>> scale_loss(jnp.array(0.5), state)
    Array(2., dtype=float32)
    """
    return find_loss_scaling_state(opt_state).loss_scale.scale(loss)


def check_overflow(opt_state: Any, max_consecutive: int) -> None:
    """Raises :class:`PersistentOverflowError` after ``max_consecutive`` skipped steps in a row.

    Non-finite steps are expected and harmless in float16 training now and then, but when every
    step overflows, training silently stops. Call this outside ``jax.jit``, for example every
    few steps in the training loop (it reads one scalar from the device).

    Args:
      opt_state: an optimizer state holding one :class:`LossScalingState`.
      max_consecutive: how many consecutive skipped optimizer steps to tolerate, at least 1.

    Raises:
      PersistentOverflowError: if ``max_consecutive`` or more steps in a row were skipped.
      ValueError: for ``max_consecutive < 1`` or an ``opt_state`` without exactly one
        :class:`LossScalingState`.
      TypeError: for a non-integer ``max_consecutive``, or when called inside ``jax.jit``.

    >>> state = loss_scaling(optax.sgd(1.0)).init(jnp.ones(1))
    >>> check_overflow(state, max_consecutive=100)  # nothing skipped: no error
    """
    if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int):
        raise TypeError(f"max_consecutive must be an integer >= 1, got {max_consecutive!r}.")
    if max_consecutive < 1:
        raise ValueError(f"max_consecutive must be an integer >= 1, got {max_consecutive!r}.")
    state = find_loss_scaling_state(opt_state)
    if jax_compat.is_tracer(state.consecutive_skipped):
        raise TypeError(
            "check_overflow reads values from the device: call it outside jax.jit, on the "
            "opt_state a jitted step returns."
        )
    count = int(state.consecutive_skipped)
    if count >= max_consecutive:
        raise PersistentOverflowError(
            f"The last {count} optimizer steps were all skipped because the gradients had inf "
            f"or NaN (limit: {max_consecutive}); the loss scale is now "
            f"{float(state.scale):g}. Nothing has been applied since. Remedies:\n"
            "  1. check the loss and the forward pass for inf/NaN (they overflow at any scale);\n"
            "  2. keep overflow-prone ops (softmax, norms, losses) in float32 via the policy;\n"
            "  3. lower the learning rate if the params themselves diverged;\n"
            "  4. use bfloat16 instead of float16 where the hardware has it."
        )
