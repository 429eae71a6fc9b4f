"""Checks of what mpjax's optax wrappers receive: the wrapped transformation, the state handed
back to ``update``, and the gradients.

:func:`mpjax.loss_scaling`, :func:`mpjax.master_weights`, :func:`mpjax.state_precision` and
:func:`mpjax.low_precision_params` reject what they cannot handle, with the same messages, at
the call that is wrong and before tracing any arithmetic.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax.policy import is_floating

# Params and gradients narrower than this (8-bit floats) cannot be trained directly.
MIN_TRAINED_BITS = 16


def check_transformation(inner: Any, where: str) -> None:
    """Rejects an ``inner`` that is not an optax ``GradientTransformation``.

    Args:
      inner: what the wrapper was given to wrap.
      where: the wrapper's name, prefixed to the message.

    Raises:
      TypeError: unless ``inner`` has callable ``init`` and ``update``; the message says how to
        fix the usual mistakes (``None``, a name such as ``'adam'``, an optax factory such as
        ``optax.adam`` instead of ``optax.adam(learning_rate)``).

    >>> check_transformation("adam", "my_wrapper")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: my_wrapper: inner must be an optax GradientTransformation ..., got the string 'adam'...
    """
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return
    expected = f"{where}: inner must be an optax GradientTransformation (with init and update)"
    if isinstance(inner, str):
        hint = f"got the string {inner!r}: build the optimizer, e.g. optax.{inner}(learning_rate)."
    elif callable(inner):
        name = getattr(inner, "__qualname__", getattr(inner, "__name__", repr(inner)))
        try:
            params = ", ".join(inspect.signature(inner).parameters)
        except (TypeError, ValueError):
            params = "..."
        hint = (
            f"got the function {name}: call it to build the transformation, "
            f"{name}({params}), e.g. optax.adam(1e-3)."
        )
    else:
        hint = f"got {inner!r} of type {type(inner).__name__}."
    raise TypeError(f"{expected}, {hint}")


def check_state(state: Any, expected: type, where: str) -> None:
    """Rejects a state that ``update`` cannot have made: not an ``expected`` instance.

    Raises:
      TypeError: naming the type received and how to get the right state.
    """
    if isinstance(state, expected):
        return
    raise TypeError(
        f"{where}: update got a state of type {type(state).__name__}, not the "
        f"{expected.__name__} this transformation's init returns. Pass the state from "
        "tx.init(params) (or the last update) of this same transformation, not the state of "
        "another optimizer or of a part of the chain."
    )


def is_box(x: Any) -> bool:
    """Whether ``x`` is a box: a pytree node holding one value under ``.value``, as Flax NNX's
    Variables do (``nnx.Param``, and the ``OptArray`` in which ``nnx.Optimizer`` keeps each
    array of its state). The value is what counts; the box is bookkeeping.

    >>> is_box(jnp.ones(2)), is_box({"value": jnp.ones(2)})
    (False, False)
    """
    if x is None or isinstance(x, (jax.Array, np.ndarray, np.generic, dict, list, tuple)):
        return False
    children = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
    return len(children) == 1 and children[0][0] == (jax.tree_util.GetAttrKey("value"),)


def _structure(tree: Any) -> Any:
    """The tree structure of ``tree`` with boxes (:func:`is_box`) as leaves, so that params in
    ``nnx.Param`` boxes and the plain arrays of their gradients compare equal."""
    return jax.tree.structure(tree, is_leaf=is_box)


def _check_param_leaf(leaf: Any, at: str, where: str) -> None:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
        raise TypeError(
            f"{where}: params must be arrays, got {leaf!r} of type {type(leaf).__name__} at "
            f"{at}. Keep strings and other values out of the tree the optimizer sees (next to "
            "the params, or outside the optimizer with optax.masked)."
        )
    dtype = np.dtype(jnp.result_type(leaf))
    if is_floating(leaf) and jnp.finfo(dtype).bits < MIN_TRAINED_BITS:
        raise TypeError(
            f"{where}: {at} is {dtype}, which cannot be trained as a param: an update "
            "rounds away in its few mantissa bits, and 8-bit floats need per-tensor scales. "
            "Store params in float32, bfloat16 or float16, and run matmuls in fp8 through a "
            "policy (mpjax.Fp8Recipe)."
        )


def check_params(params: Any, where: str) -> None:
    """Rejects params that a transformation's ``init`` cannot build a state for.

    Args:
      params: the params tree ``init`` received.
      where: the transformation's name, prefixed to every message.

    Raises:
      TypeError: for ``params=None``, a leaf that is not an array or a number (a string), or
        an 8-bit float leaf; naming the path.

    >>> check_params({"name": "mlp"}, "my_transform")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: my_transform: params must be arrays, got 'mlp' of type str at params['name']. ...
    """
    if params is None:
        raise TypeError(f"{where}: init got params=None; pass the params tree to optimize.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        _check_param_leaf(leaf, f"params{jax.tree_util.keystr(path)}", where)


class InitTrees:
    """The params trees (structure and shapes) a transformation's ``init`` was given, to check
    the gradients of an ``update`` that gets no params against: a mismatch would otherwise fail
    deep inside the wrapped optimizer's ``tree_map``, or broadcast silently.

    A transformation built once and initialized for several models accepts the gradients of
    any of them; one never initialized in this process (a state restored without ``init``)
    checks nothing.
    """

    def __init__(self) -> None:
        self._seen: list[tuple[Any, tuple[tuple[int, ...], ...]]] = []

    @staticmethod
    def _signature(tree: Any) -> tuple[Any, tuple[tuple[int, ...], ...]]:
        return _structure(tree), tuple(np.shape(leaf) for leaf in jax.tree.leaves(tree))

    def add(self, params: Any) -> None:
        """Records the structure and shapes of ``params``, as ``init`` received them."""
        signature = self._signature(params)
        if signature not in self._seen:
            self._seen.append(signature)

    def check(self, grads: Any, where: str) -> None:
        """Raises ``ValueError`` unless ``grads`` has the structure and shapes of params
        ``init`` saw."""
        if not self._seen:
            return
        treedef, shapes = self._signature(grads)
        same_tree = [seen_shapes for seen_tree, seen_shapes in self._seen if seen_tree == treedef]
        if not same_tree:
            raise ValueError(
                f"{where}: the grads tree does not match the params tree init was given.\n"
                f"  grads:  {treedef}\n  params: {self._seen[-1][0]}"
            )
        if shapes in same_tree:
            return
        expected = same_tree[-1]
        paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(grads)]
        for path, got, want in zip(paths, shapes, expected):
            if got != want:
                at = jax.tree_util.keystr(path)
                raise ValueError(
                    f"{where}: grads{at} has shape {got} but the param init was given there "
                    f"has shape {want}; each gradient must have its param's shape."
                )


def check_gradients(grads: Any, params: Any, where: str) -> None:
    """Rejects gradients the wrapper cannot handle.

    Args:
      grads: the gradient tree an ``update`` received.
      params: the params tree, or None when the caller passed none (then only the gradients
        themselves are checked).
      where: the name of the transformation, prefixed to every message.

    Raises:
      TypeError: for ``grads`` of None, a gradient leaf that is not an array (a Python float),
        a leaf that is not floating-point, or a floating gradient for an integer param (which
        ``optax.apply_updates`` would truncate); each naming the path.
      ValueError: when ``params`` is given and its tree structure, or a leaf's shape, differs
        from ``grads``'.

    >>> check_gradients({"n": jnp.ones(1, jnp.int32)}, None, "my_transform")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: my_transform: gradients must be floating-point, got int32 at grads['n']. ...
    """
    if grads is None:
        raise TypeError(f"{where}: update got grads=None; pass the gradient tree.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        at = f"grads{jax.tree_util.keystr(path)}"
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(
                f"{where}: gradients must be arrays, got {leaf!r} of type "
                f"{type(leaf).__name__} at {at}. Pass what jax.grad returns."
            )
        dtype = jnp.result_type(leaf)
        if not is_floating(dtype):
            raise TypeError(
                f"{where}: gradients must be floating-point, got {dtype} at {at}. Differentiate "
                "with respect to the floating-point params only (integer leaves have no "
                "gradient)."
            )
        if jnp.finfo(dtype).bits < MIN_TRAINED_BITS:
            raise TypeError(
                f"{where}: gradients must be float16 or wider, got {dtype} at {at}: 8-bit "
                "gradients come from 8-bit params, which cannot be trained. Store params in "
                "float32, bfloat16 or float16."
            )
    if params is None:
        return
    grads_tree, params_tree = jax.tree.structure(grads), jax.tree.structure(params)
    if grads_tree != params_tree:  # type: ignore[operator]
        raise ValueError(
            f"{where}: the grads tree does not match the params tree.\n"
            f"  grads:  {grads_tree}\n  params: {params_tree}"
        )
    for (path, g), p in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params), strict=True
    ):
        at = jax.tree_util.keystr(path)
        _check_param_leaf(p, f"params{at}", where)
        if np.shape(g) != np.shape(p):
            raise ValueError(
                f"{where}: grads{at} has shape {np.shape(g)} but params{at} has shape "
                f"{np.shape(p)}; each gradient must have its param's shape."
            )
        if not is_floating(jnp.result_type(p)):
            raise TypeError(
                f"{where}: params{at} is {jnp.result_type(p)}, and a floating-point update "
                "would be truncated on it. Keep integer leaves out of the optimizer (e.g. "
                "optax.masked or optax.partition), or store them outside the params."
            )


def check_update(
    grads: Any,
    state: Any,
    params: Any,
    state_type: type,
    where: str,
    *,
    needs_params: bool,
    init_trees: InitTrees | None = None,
) -> None:
    """Every check of an ``update(grads, state, params)`` call, in order: the params when the
    transformation needs them, then :func:`check_state` and :func:`check_gradients`, and
    without params the gradients' structure against ``init_trees``.

    Raises:
      ValueError: for ``params=None`` where ``needs_params``, gradients shaped unlike the
        params ``init`` was given, and what :func:`check_gradients` raises.
      TypeError: what :func:`check_state` and :func:`check_gradients` raise.
    """
    if needs_params and params is None:
        raise ValueError(f"{where} needs the params: call update(grads, opt_state, params).")
    check_state(state, state_type, where)
    check_gradients(grads, params, where)
    if params is None and init_trees is not None:
        init_trees.check(grads, where)
