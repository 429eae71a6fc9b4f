"""Optimizer state in the precision you choose, for any optax transformation.

Adam keeps two float32 moments per parameter: 8 of the 12 to 16 bytes a parameter costs in
training. :func:`state_precision` stores the floating leaves of any wrapped transformation's
state (Adam's ``mu`` and ``nu``, momentum ``trace``, accumulators) in a dtype you choose, per
leaf kind (``{"mu": "bfloat16", "nu": "float32"}``: the ``nu_dtype`` optax lacks), while the
update itself is computed in float32: the stored state is widened, the wrapped transformation
runs, and its new state is rounded back to nearest or stochastically (unbiased, so small
changes to a moment survive on average).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from mpjax.optim.gradient_checks import InitTrees, check_params, check_transformation, check_update
from mpjax.optim.loss_scaling_readers import step_applied
from mpjax.optim.rounding import (
    ROUNDINGS,
    check_rounding,
    next_rounding_keys,
    round_to,
    rounding_key,
    widen,
)
from mpjax.policy import is_floating, storage_dtype

__all__ = ["StatePrecisionState", "state_precision"]


class StatePrecisionState(NamedTuple):
    """State of :func:`state_precision`.

    Attributes:
      inner_state: the wrapped transformation's state, its chosen leaves stored in their
        chosen dtypes.
      key: raw PRNG key data (uint32), advanced once per update (not on a step that
        :func:`mpjax.loss_scaling` inside skipped), with stochastic
        rounding; ``optax.EmptyState()`` with rounding to nearest.
    """

    inner_state: optax.OptState
    key: jax.Array | optax.EmptyState


def _attribute_names(path: tuple) -> list[str]:
    """The attribute names along a pytree path: the fields of optax's and mpjax's state
    classes (``mu``, ``nu``, ``master``...), without the keys of the params' dicts."""
    return [e.name for e in path if isinstance(e, jax.tree_util.GetAttrKey)]


def _dtypes(tree: Any) -> list[Any]:
    """The dtype of each leaf of ``tree`` (None for a leaf without one), in leaf order."""
    return [getattr(x, "dtype", None) for x in jax.tree.leaves(tree)]


def state_precision(
    inner: optax.GradientTransformation,
    dtype: Any,
    *,
    rounding: str = "nearest",
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s optimizer state in ``dtype``, computing every update in float32.

    ``update`` widens the stored state, the gradients and the params to (at least) float32,
    runs ``inner``, and rounds its new state back: the chosen leaves to their chosen dtype with
    ``rounding``, the other floating leaves to the dtype ``inner`` gave them, to nearest. The
    updates come back in the gradients' dtypes. Compared with running ``inner`` on its own,
    only the storage of the chosen leaves changes (and, for bfloat16 or float16 params, the
    arithmetic is float32 rather than the params' dtype).

    Which leaves: a single ``dtype`` applies to every floating leaf of ``inner``'s state that
    is not a scalar (Adam's ``mu`` and ``nu``, momentum, accumulators; scalars are
    hyperparameters and counters, such as ``optax.inject_hyperparams``'s learning rate). A
    mapping names the state fields to store, by the attribute names on the leaf's path
    (``ScaleByAdamState.mu`` is ``"mu"``; the params' own dict keys never count); every other leaf keeps its dtype. A name that
    matches no leaf is an error (``init`` lists the names there are).

    Rounding: ``"nearest"`` is a cast, as optax's ``mu_dtype`` does (optax then computes the
    next step's ``b1 * mu`` in ``mu_dtype``; here it is float32). ``"stochastic"`` is :func:`mpjax.stochastic_round`:
    unbiased, so a moment that changes by less than half a bfloat16 spacing per step still
    drifts at the right rate on average. Its key is carried in the state (made from ``seed``)
    and advanced once per step, except on a step :func:`mpjax.loss_scaling` inside ``inner``
    skipped, so such a step leaves the state bit for bit as it was.

    Order: put this inside :func:`mpjax.master_weights` and :func:`mpjax.loss_scaling`, around
    the optimizer whose state it stores: ``master_weights(loss_scaling(state_precision(adam,
    "bfloat16")))``. Wrapping a ``master_weights`` state would store its float32 master copy in
    ``dtype`` too, which defeats it: ``init`` refuses that.

    Args:
      inner: the optax transformation whose state to store (``optax.adamw(lr)``, a chain...).
      dtype: one dtype for every non-scalar floating leaf (``jnp.bfloat16``, ``"bf16"``), or a
        mapping from state field names to dtypes (``{"mu": "bf16", "nu": "f32"}``). Dtypes are
        floating and at least 16 bits wide.
      rounding: ``"nearest"`` (the default) or ``"stochastic"``.
      seed: an integer or a PRNG key, for stochastic rounding.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`StatePrecisionState`.

    Raises:
      TypeError: for an ``inner`` that is not an optax transformation, a ``dtype`` that is not
        a dtype or mapping, a ``rounding`` that is not a string or a bad ``seed``.
      ValueError: for an unknown ``rounding``, an 8-bit or non-floating dtype, and (from
        ``init``) a field name that matches no floating leaf, or a master-weights copy in
        ``inner``'s state.

    >>> import jax.numpy as jnp
    >>> tx = state_precision(optax.adam(1e-3), {"mu": "bfloat16", "nu": "float32"})
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> adam = state.inner_state[0]
    >>> adam.mu["w"].dtype, adam.nu["w"].dtype
    (dtype(bfloat16), dtype('float32'))
    """
    check_transformation(inner, "state_precision")
    rounding = check_rounding(rounding, ROUNDINGS, "state_precision")
    if isinstance(dtype, Mapping):
        if not dtype:
            raise ValueError("state_precision: dtype is an empty mapping; name a state field.")
        for name in dtype:
            if not isinstance(name, str):
                raise TypeError(
                    "state_precision: the keys of a dtype mapping are state field names "
                    f"(strings such as 'mu'), got {name!r}."
                )
        targets: dict[str, np.dtype] | np.dtype = {
            name: storage_dtype(d, f"state_precision dtype for {name!r}")
            for name, d in dtype.items()
        }
    else:
        targets = storage_dtype(dtype, "state_precision dtype")
    # Checked whatever the rounding: a bad seed is a mistake even where it goes unused.
    seed_key = rounding_key(seed)
    key0 = seed_key if rounding == "stochastic" else optax.EmptyState()
    inner = optax.with_extra_args_support(inner)
    init_trees = InitTrees()

    def target_of(path: tuple, leaf: Any) -> np.dtype | None:
        """The dtype to store ``leaf`` in, or None to keep the dtype ``inner`` gives it."""
        if not is_floating(leaf):
            return None
        if isinstance(targets, np.dtype):
            return targets if np.ndim(leaf) > 0 else None
        # State fields only, innermost first: the params' own dict keys (a param named "mu")
        # must not decide how Adam's nu for it is stored.
        for name in _attribute_names(path)[::-1]:
            if name in targets:
                return targets[name]
        return None

    def store(new_state: Any, keep: list[Any], how: str, keys: list[jax.Array]) -> Any:
        """``new_state`` with its chosen leaves rounded to their dtypes with ``how`` (a key
        each from ``keys`` when stochastic), its other floating leaves cast back to the dtypes
        in ``keep`` (one per leaf of the stored state)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(new_state)
        key_iter = iter(keys)
        out = []
        for (path, leaf), kept in zip(leaves, keep):
            target = target_of(path, leaf)
            if target is not None:
                out.append(round_to(leaf, target, how, next(key_iter, None)))
            elif is_floating(leaf):
                out.append(leaf.astype(kept))
            else:
                out.append(leaf)
        return jax.tree.unflatten(treedef, out)

    def chosen_count(state: Any) -> int:
        return sum(
            target_of(path, leaf) is not None
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)
        )

    def init(params):
        check_params(params, "state_precision")
        init_trees.add(params)
        inner_state = inner.init(params)
        paths = jax.tree_util.tree_leaves_with_path(inner_state)
        floating_names = sorted(
            {n for path, leaf in paths if is_floating(leaf) for n in _attribute_names(path)}
        )
        if isinstance(targets, dict):
            missing = [n for n in targets if n not in floating_names]
            if missing:
                raise ValueError(
                    f"state_precision: {missing} name no floating leaf of the wrapped "
                    f"optimizer's state. Field names with floating leaves: {floating_names}."
                )
        for path, leaf in paths:
            if "master" in _attribute_names(path) and target_of(path, leaf) is not None:
                raise ValueError(
                    "state_precision: the wrapped state holds a master-weights copy "
                    f"(at {jax.tree_util.keystr(path)}), which would be stored in "
                    f"{target_of(path, leaf)}. Put master_weights outside: "
                    "master_weights(state_precision(inner, dtype))."
                )
        # Rounded to nearest: the initial state holds no small changes to lose.
        initial = store(inner_state, _dtypes(inner_state), "nearest", [])
        return StatePrecisionState(initial, key0)

    def update(updates, state, params=None, **extra_args):
        check_update(
            updates,
            state,
            params,
            StatePrecisionState,
            "state_precision",
            needs_params=False,
            init_trees=init_trees,
        )
        new_updates, new_inner = inner.update(
            widen(updates), widen(state.inner_state), widen(params), **extra_args
        )
        new_updates = jax.tree.map(lambda u, g: u.astype(g.dtype), new_updates, updates)
        if rounding == "stochastic":
            applied = step_applied(new_inner)
            key, keys = next_rounding_keys(state.key, chosen_count(new_inner), applied)
        else:
            key, keys = state.key, []
        stored = store(new_inner, _dtypes(state.inner_state), rounding, keys)
        return new_updates, StatePrecisionState(stored, key)

    return optax.GradientTransformationExtraArgs(init, update)
