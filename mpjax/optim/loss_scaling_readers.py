"""Readers of the loss-scaling state inside any optimizer state, for the training step.

The state of :func:`mpjax.loss_scaling` may sit anywhere in an optimizer state
(:func:`mpjax.master_weights`, ``nnx.Optimizer.opt_state``, a train state). The readers find
it there: :func:`scale_loss` and :func:`scaled_value_and_grad` (``jax.value_and_grad`` of the
scaled loss) for the gradients, :func:`loss_scaling_info` for the scale and skip counters,
:func:`check_overflow` and :func:`check_loss_scaling` for a run that cannot recover or a
checkpoint that does not fit. Without a loss-scaling state they pass through, so one training
step serves every policy. They refuse a loss scaling that does not wrap the rest of the
optimizer, where the state shows it (in an ``optax.chain`` after or before other
transformations, or inside ``optax.MultiSteps``).

For mpjax's own modules: ``step_applied``, for the transformations that wrap the loss scaling,
and ``make_scaled_value_and_grad``, for the integrations' own ``value_and_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax import jax_compat
from mpjax.optim.loss_scale import DynamicLossScale
from mpjax.optim.loss_scaling import (
    DEFAULT_MAX_CONSECUTIVE,
    LossScalingState,
    loss_scaling,  # noqa: F401  (the docstrings' examples use it)
    record_scaled,
)
from mpjax.policy import is_floating

__all__ = [
    "LossScalingInfo",
    "PersistentOverflowError",
    "check_loss_scaling",
    "check_overflow",
    "loss_scaling_info",
    "scale_loss",
    "scaled_value_and_grad",
]


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
    """Every :class:`mpjax.LossScalingState` inside ``opt_state``, wherever it sits, with its path."""
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
    """Refuses a :func:`mpjax.loss_scaling` that does not wrap the rest of the optimizer, where the
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
    """The one :class:`mpjax.LossScalingState` inside ``opt_state`` (its arrays unboxed), or None
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

    For transformations that wrap :func:`mpjax.loss_scaling` and must not move their own state on a
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
    write the step by hand. The state of :func:`mpjax.loss_scaling` is found wherever it sits:
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
      ValueError: if ``opt_state`` holds more than one :class:`mpjax.LossScalingState`, or one that
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
    if state is None:
        return loss
    record_scaled(state.loss_scale.loss_scale)
    return state.loss_scale.scale(loss)


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
            if state is None:
                return wide, (loss, aux)
            record_scaled(state.loss_scale.loss_scale)
            return state.loss_scale.scale(wide), (loss, aux)

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
    loss scale: what :func:`mpjax.loss_scaling`'s ``update`` expects.

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

    The state of :func:`mpjax.loss_scaling` is found as by :func:`scale_loss`. Works inside and
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


def check_overflow(opt_state: Any, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE) -> None:
    """Raises :class:`PersistentOverflowError` after ``max_consecutive`` skipped steps in a row.

    Non-finite steps are expected and harmless in float16 training now and then, but when every
    step overflows, training silently stops. Call this outside ``jax.jit``, for example every
    few steps in the training loop (it reads one scalar from the device). The state of
    :func:`mpjax.loss_scaling` is found as by :func:`scale_loss`; without one nothing is ever
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
    """Checks that the loss-scaling state in ``opt_state`` is one :func:`mpjax.loss_scaling` could
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
