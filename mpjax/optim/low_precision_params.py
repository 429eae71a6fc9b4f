"""bfloat16 and float16 params updated without a float32 master copy.

``optax.apply_updates`` rounds ``param + update`` to the param's dtype, to nearest: an update
below half the spacing of bfloat16 around the param (about ``|param| / 512``) is lost. That is
why :func:`mpjax.master_weights` keeps a float32 copy (4 more bytes per param).
:func:`low_precision_params` is the alternative that keeps none. It computes the update in
float32 and lands it on the low-precision param in one of two ways:

* ``"stochastic"`` rounding: ``param + update`` is rounded up or down at random, unbiased, so
  small updates move the param at the right rate on average (no extra memory);
* ``"kahan"`` summation: rounded to nearest, and what the rounding lost is kept in a
  compensation buffer in the param's dtype and added to the next update (2 more bytes per
  bfloat16 param; a param then effectively carries 16 significant bits).

``"nearest"`` is the plain rounding, as ``optax.apply_updates`` does: the baseline.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpjax.optim.gradient_checks import check_params, check_transformation, check_update
from mpjax.optim.loss_scaling_readers import step_applied
from mpjax.optim.rounding import (
    check_rounding,
    next_rounding_keys,
    round_to,
    rounding_key,
    widen,
)
from mpjax.policy import is_low_precision

__all__ = ["PARAM_ROUNDINGS", "LowPrecisionParamsState", "low_precision_params"]

#: The ways :func:`low_precision_params` lands an update on a param.
PARAM_ROUNDINGS = ("stochastic", "kahan", "nearest")


class LowPrecisionParamsState(NamedTuple):
    """State of :func:`low_precision_params`.

    Attributes:
      inner_state: the wrapped transformation's state, built on the params widened to
        float32 (so Adam's moments are float32 unless :func:`mpjax.state_precision` stores
        them narrower).
      compensation: with ``"kahan"``, what rounding has lost so far for each bfloat16/float16
        param, in the param's dtype; ``optax.MaskedNode()`` for the other params and with the
        other roundings.
      key: raw PRNG key data (uint32) with ``"stochastic"``, advanced once per update (not on
        a step that :func:`mpjax.loss_scaling` inside skipped);
        ``optax.EmptyState()`` otherwise.
    """

    inner_state: optax.OptState
    compensation: Any
    key: jax.Array | optax.EmptyState


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def low_precision_params(
    inner: optax.GradientTransformation,
    rounding: str = "stochastic",
    *,
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` in float32 and lands its updates on bfloat16/float16 params directly.

    ``update`` widens the gradients and params narrower than float32 to float32, runs
    ``inner`` on them, and for each such param computes ``param + update`` in float32 and
    rounds it to the param's dtype with ``rounding``. It returns, per param, the difference
    between that rounded value and the param, in the param's dtype, so
    ``optax.apply_updates(params, updates)`` gives the rounded value exactly whenever a param
    moves by less than its own magnitude in one step (as with :func:`mpjax.master_weights`).
    float32 (and wider) params take ``inner``'s updates as they are.

    Roundings:

    * ``"stochastic"`` (the default): :func:`mpjax.stochastic_round`, unbiased. A bfloat16
      param at 1.0 under 100 updates of -1e-4 ends at 0.99 on average (float32 gives
      0.98999834); rounded to nearest it never moves. The key is carried in the state, made
      from ``seed``.
    * ``"kahan"``: round to nearest, keep the rounding error in a compensation buffer of the
      param's dtype and add it to the next update. Deterministic. An element whose update is
      exactly zero keeps its param and its compensation.
    * ``"nearest"``: round to nearest (what ``optax.apply_updates`` does; the baseline).

    A step that :func:`mpjax.loss_scaling` skipped, inside ``inner`` or outside, changes
    nothing: its updates are zeros, which every rounding lands exactly, and the key does not
    advance when the skip happened inside.

    Order: ``low_precision_params(loss_scaling(state_precision(adam, ...)))``. With float16
    and loss scaling, this order unscales in float32, where tiny gradients survive (as
    :func:`mpjax.master_weights` outside ``loss_scaling``). Use it instead of
    ``master_weights``, not with it.

    Args:
      inner: the optimizer to run, any optax ``GradientTransformation``.
      rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``.
      seed: an integer or a PRNG key, for stochastic rounding.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LowPrecisionParamsState`. Its ``update`` needs ``params`` (``ValueError``
      without), this transformation's state and floating-point array gradients (``TypeError``)
      in a tree matching the params (``ValueError``); its updates have each param's dtype.

    Raises:
      TypeError: for an ``inner`` that is not an optax transformation, a non-string
        ``rounding`` or a bad ``seed``.
      ValueError: for an unknown ``rounding``.

    >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
    >>> tx = low_precision_params(optax.sgd(1e-4), "stochastic")
    >>> state = tx.init(params)
    >>> for _ in range(100):
    ...     updates, state = tx.update({"w": jnp.ones(1000, jnp.bfloat16)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> round(float(params["w"].astype(jnp.float32).mean()), 3)  # float32 gives 0.98999834
    0.99
    """
    check_transformation(inner, "low_precision_params")
    rounding = check_rounding(rounding, PARAM_ROUNDINGS, "low_precision_params")
    # Checked whatever the rounding: a bad seed is a mistake even where it goes unused.
    seed_key = rounding_key(seed)
    key0 = seed_key if rounding == "stochastic" else optax.EmptyState()
    inner = optax.with_extra_args_support(inner)

    def init(params):
        check_params(params, "low_precision_params")
        compensation = jax.tree.map(
            lambda p: (
                jnp.zeros_like(p)
                if rounding == "kahan" and is_low_precision(p)
                else optax.MaskedNode()
            ),
            params,
        )
        return LowPrecisionParamsState(inner.init(widen(params)), compensation, key0)

    def update(updates, state, params=None, **extra_args):
        check_update(
            updates,
            state,
            params,
            LowPrecisionParamsState,
            "low_precision_params",
            needs_params=True,
        )
        wide_updates, inner_state = inner.update(
            widen(updates), state.inner_state, widen(params), **extra_args
        )
        p_leaves, treedef = jax.tree.flatten(params)
        u_leaves = jax.tree.leaves(wide_updates)
        c_leaves = jax.tree.leaves(state.compensation, is_leaf=_is_masked)
        key, keys = state.key, list[jax.Array]()
        if rounding == "stochastic":
            applied = step_applied(inner_state)
            key, keys = next_rounding_keys(key, sum(map(is_low_precision, p_leaves)), applied)
        key_iter = iter(keys)

        out_updates, out_comp = [], []
        for p, u, c in zip(p_leaves, u_leaves, c_leaves):
            if not is_low_precision(p):
                out_updates.append(u)
                out_comp.append(c)
                continue
            target = widen(p) + u
            if rounding == "kahan":
                target = target + widen(c)
                new = target.astype(p.dtype)
                lost = (target - widen(new)).astype(c.dtype)
                moved = u != 0
                new = jnp.where(moved, new, p)
                c = jnp.where(moved, lost, c)
            else:
                new = round_to(target, p.dtype, rounding, next(key_iter, None))
            out_updates.append(new - p)
            out_comp.append(c)
        return jax.tree.unflatten(treedef, out_updates), LowPrecisionParamsState(
            inner_state, jax.tree.unflatten(treedef, out_comp), key
        )

    return optax.GradientTransformationExtraArgs(init, update)
