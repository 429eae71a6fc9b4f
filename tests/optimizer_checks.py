"""Helpers shared by the tests of mpjax's optax transformations (loss scaling, master weights,
state precision, low-precision params)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tolerances import tolerance

from mpjax import scale_loss


def standard_promotion():
    """optax's Adam (``b1 ** count``) and MultiSteps (``acc / (n_acc + 1)``) mix floats with
    int32 counters, which strict promotion rejects; mpjax's own code runs strict elsewhere."""
    return jax.numpy_dtype_promotion("standard")


def assert_trees_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert jnp.result_type(x) == jnp.result_type(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trees_equal_up_to_fma(a, b, steps):
    """``a`` and ``b``, the results of ``steps`` updates computed two ways (sharded and not),
    alike: keys and counters bit for bit; floating leaves within ``steps`` bfloat16 units in
    the last place, at their largest element.

    XLA compiles an update for each array size it runs on, and may contract a multiply-add
    into a fused one in one size's code and not in another's (jax 0.12 does in a 16-element
    shard of Adam's update): the float32 arithmetic moves by an ulp. Rounded to bfloat16,
    to nearest or stochastically, that lands on the other neighbour only rarely, one bfloat16
    ulp away, and Adam carries such a step's difference into the next steps scaled down.
    """
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert jnp.result_type(x) == jnp.result_type(y)
        x, y = np.asarray(x), np.asarray(y)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_array_equal(x, y)
            continue
        x, y = x.astype(np.float64), y.astype(np.float64)
        atol = steps * tolerance(jnp.bfloat16, 0) * float(np.abs(y).max())
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def quadratic_loss(p):
    """A loss of params ``{"w", "b"}`` of any floating dtype, in float32."""
    return jnp.sum((p["w"].astype(jnp.float32) - 0.5) ** 2) + jnp.sum(
        p["b"].astype(jnp.float32) ** 2
    )


def make_poisoned_step(tx):
    """A jitted train step on :func:`quadratic_loss` that adds ``poison`` (0 or inf) to every
    gradient, so a test chooses which steps overflow."""

    @jax.jit
    def step(params, state, poison):
        grads = jax.grad(lambda p: scale_loss(quadratic_loss(p), state))(params)
        grads = jax.tree.map(lambda g: g + poison.astype(g.dtype), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def counting_step(tx):
    """A jitted ``step(params, state, grads) -> (params, state)`` of ``tx``, and the list it
    appends to at each trace: one entry after many steps means no retrace."""
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step, traces


def small_grads_at(i, params):
    """Step ``i``'s gradients: small and of mixed size, in each param's dtype."""
    key = jax.random.fold_in(jax.random.key(1), i)
    return {
        name: (1e-2 * jax.random.normal(jax.random.fold_in(key, j), p.shape)).astype(p.dtype)
        for j, (name, p) in enumerate(sorted(params.items()))
    }


def run_steps(tx, params, steps, start=0, state=None, *, grads_at):
    """``steps`` jitted updates from step ``start`` (from ``tx.init`` without a ``state``),
    step ``i`` taking ``grads_at(i, params)``; returns ``(params, state)``."""
    step = jax.jit(tx.update)
    with standard_promotion():
        if state is None:
            state = tx.init(params)
        for i in range(start, start + steps):
            updates, state = step(grads_at(i, params), state, params)
            params = optax.apply_updates(params, updates)
    return params, state


def run_sharded_steps(tx, params, steps, sharding, *, grads_at):
    """:func:`run_steps` with params and gradients placed by ``sharding``, checking that every
    update keeps it; returns ``(params, initial_state, state)``."""
    step = jax.jit(tx.update)
    with standard_promotion():
        params = jax.device_put(params, sharding)
        state0 = state = tx.init(params)
        for i in range(steps):
            grads = jax.device_put(grads_at(i, params), sharding)
            updates, state = step(grads, state, params)
            for u in jax.tree.leaves(updates):
                assert u.sharding.is_equivalent_to(sharding, u.ndim)
            params = optax.apply_updates(params, updates)
    return params, state0, state
