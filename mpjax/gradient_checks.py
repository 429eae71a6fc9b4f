"""Validation of the gradients an optimizer wrapper receives.

:func:`mpjax.loss_scaling` and :func:`mpjax.master_weights` both reject gradients they cannot
handle, with the same messages, before tracing any arithmetic on them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mpjax.policy import is_floating


def check_gradients(grads: Any, params: Any, where: str) -> None:
    """Rejects non-floating gradients and gradients whose tree differs from the params.

    Args:
      grads: the gradient tree an ``update`` received.
      params: the params tree, or None when the caller passed none (then only the dtypes are
        checked).
      where: the name of the transformation, prefixed to every message.

    Raises:
      TypeError: for a gradient leaf that is not floating-point, naming its path.
      ValueError: when ``params`` is given and its tree structure differs from ``grads``'.

    >>> check_gradients({"n": jnp.ones(1, jnp.int32)}, None, "my_transform")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: my_transform: gradients must be floating-point, got int32 at grads['n']. ...
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        dtype = jnp.result_type(leaf)
        if not is_floating(dtype):
            raise TypeError(
                f"{where}: gradients must be floating-point, got {dtype} at "
                f"grads{jax.tree_util.keystr(path)}. Differentiate with respect to the "
                "floating-point params only (integer leaves have no gradient)."
            )
    if params is not None:
        grads_tree, params_tree = jax.tree.structure(grads), jax.tree.structure(params)
        if grads_tree != params_tree:  # type: ignore[operator]
            raise ValueError(
                f"{where}: the grads tree does not match the params tree.\n"
                f"  grads:  {grads_tree}\n  params: {params_tree}"
            )
