"""f32 master weights as an optax transformation, for params stored in bfloat16 or float16.

``optax.apply_updates`` adds an update in the param's dtype: a bfloat16 param at 1.0 never
moves under updates of -1e-4, because 1.0 - 1e-4 rounds back to 1.0. :func:`master_weights`
keeps a float32 copy of every low-precision param, lets the wrapped optimizer update that copy
(so its state, Adam's moments included, is float32 too) and hands back updates that move the
stored params to the copy rounded to their dtype.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpjax.optim.gradient_checks import check_params, check_transformation, check_update
from mpjax.policy import is_low_precision


class MasterWeightsState(NamedTuple):
    """State of :func:`master_weights`.

    Attributes:
      master: the float32 copy of each param narrower than float32; ``optax.MaskedNode()``
        where the param is float32 or wider (or not floating), which is its own master.
      inner_state: the wrapped transformation's state, built on the float32 params.
    """

    master: Any
    inner_state: optax.OptState


def _master_params(master: Any, params: Any) -> Any:
    """The params as the inner optimizer sees them: the master copy where there is one."""
    return jax.tree.map(lambda p, m: p if isinstance(m, optax.MaskedNode) else m, params, master)


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` on a float32 master copy of low-precision params.

    ``init`` stores a float32 copy of every floating param narrower than float32 and builds
    ``inner``'s state on the float32 params. ``update`` casts those params' gradients to
    float32, runs ``inner`` on the master copy, adds its updates to the copy and returns, per
    param, the difference between the new copy rounded to the param's dtype and the param. So
    ``optax.apply_updates(params, updates)`` is ``new_master.astype(param.dtype)``, bit for bit,
    whenever each param moves by less than its own magnitude in one step (the difference is
    then exact, by Sterbenz's lemma), which covers ordinary optimizer steps; a param that
    crosses zero or more than halves in one step may land an ulp or so off, and the master copy,
    which is what the optimizer reads, stays exact. Keep applying the updates to the params you
    pass in: the master copy is the source of truth.

    float32 (and wider) params and non-floating params are their own master: no copy is stored
    (``optax.MaskedNode()`` in its place) and ``inner``'s updates for them pass through as they
    are, so a float32 model pays nothing.

    With loss scaling, put the master weights outside:
    ``master_weights(loss_scaling(inner))``. The scaled float16 gradients are then cast to
    float32 before they are unscaled, and a gradient below float16's range (tiny gradients are
    what loss scaling exists for) survives. ``loss_scaling(master_weights(inner))`` also works,
    but unscales into float16 first, where such a gradient rounds to zero or loses bits. A
    skipped step gives zero updates either way, so params and master stay unchanged.

    Args:
      inner: the optimizer to run on the float32 params, any optax ``GradientTransformation``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`MasterWeightsState`. Its ``update`` needs ``params`` (``ValueError`` without),
      this transformation's state and floating-point array gradients (``TypeError``) in a tree
      matching the params in structure and shapes (``ValueError``); its updates have each
      param's dtype.

    Raises:
      TypeError: for an ``inner`` that is not an optax transformation (``None``, a name, or a
        factory such as ``optax.adam`` instead of ``optax.adam(learning_rate)``).

    >>> import optax
    >>> params = {"w": jnp.ones(1, jnp.bfloat16)}
    >>> tx = master_weights(optax.sgd(1e-4))
    >>> state = tx.init(params)
    >>> for _ in range(100):
    ...     updates, state = tx.update({"w": jnp.ones(1, jnp.bfloat16)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> state.master["w"], params["w"]
    (Array([0.98999834], dtype=float32), Array([0.988281], dtype=bfloat16))
    """
    check_transformation(inner, "master_weights")
    inner = optax.with_extra_args_support(inner)

    def init(params):
        check_params(params, "master_weights")
        master = jax.tree.map(
            lambda p: jnp.asarray(p, jnp.float32) if is_low_precision(p) else optax.MaskedNode(),
            params,
        )
        return MasterWeightsState(master, inner.init(_master_params(master, params)))

    def update(updates, state, params=None, **extra_args):
        check_update(
            updates, state, params, MasterWeightsState, "master_weights", needs_params=True
        )
        grads = jax.tree.map(
            lambda g, p: g.astype(jnp.float32) if is_low_precision(p) else g, updates, params
        )
        inner_updates, inner_state = inner.update(
            grads, state.inner_state, _master_params(state.master, params), **extra_args
        )

        def new_master(m, u):
            return m if isinstance(m, optax.MaskedNode) else m + u

        def param_update(p, m, u):
            if isinstance(m, optax.MaskedNode):
                return u
            return m.astype(p.dtype) - p

        master = jax.tree.map(
            new_master,
            state.master,
            inner_updates,
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )
        param_updates = jax.tree.map(param_update, params, master, inner_updates)
        return param_updates, MasterWeightsState(master, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)
