"""The user's custom derivative rules, traced as their code traced them: what the casting engine
runs under its policies in place of a ``custom_jvp``'s rule or a ``custom_vjp``'s fwd and bwd.

Each is traced at the dtypes the user's code gave the custom function (``jax.jvp`` or
``jax.vjp`` of the original equation, which calls the user's rule), so that the engine can then
run the rule's jaxpr with each operation cast, as it runs the primal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mpjax import jax_compat as compat

__all__ = ["float0_zeros", "trace_jvp_rule", "trace_vjp_bwd", "trace_vjp_fwd"]


def float0_zeros(aval: Any) -> np.ndarray:
    """Zeros of ``aval``'s shape in ``float0``: the tangent of a value that has none."""
    return np.zeros(aval.shape, dtype=jax.dtypes.float0)


def _original(eqn: Any, args: Sequence[Any], fidx: Sequence[int], fargs: Sequence[Any]) -> list:
    """Evaluates ``eqn`` unchanged with the floating inputs at ``fidx`` replaced by ``fargs``."""
    args = list(args)
    for i, x in zip(fidx, fargs):
        args[i] = x
    return compat.bind_equation(eqn, args)


def trace_jvp_rule(eqn, avals, fidx, oidx):
    """Jaxpr of ``(primals, float tangents) -> (primals out, float tangents out)`` at the traced
    dtypes, built by ``jax.jvp`` of the equation, which calls its custom rule."""
    n_in = len(eqn.invars)

    def rule(*xs):
        primals, tangents = xs[:n_in], xs[n_in:]
        outs, touts = jax.jvp(
            lambda *f: _original(eqn, primals, fidx, f), [primals[i] for i in fidx], list(tangents)
        )
        return [*outs, *(touts[i] for i in oidx)]

    return compat.trace_at(rule, avals)


def trace_vjp_fwd(eqn, avals, fidx):
    """Jaxpr of the custom fwd, ``primals -> (outs, residuals)``, and the residuals' treedef."""
    tree = []

    def fwd(*primals):
        outs, vjp_fn = jax.vjp(
            lambda *f: _original(eqn, primals, fidx, f), *(primals[i] for i in fidx)
        )
        residuals, treedef = jax.tree.flatten(vjp_fn)
        tree.append(treedef)
        return [*outs, *residuals]

    fwd_jaxpr = compat.trace_at(fwd, avals)
    return fwd_jaxpr, tree[0]


def trace_vjp_bwd(tree, avals, out_avals, oidx):
    """Jaxpr of the custom bwd, ``(residuals, float cts) -> float input cts``."""
    n_res = len(avals) - len(oidx)

    def bwd(*xs):
        vjp_fn = jax.tree.unflatten(tree, xs[:n_res])
        cts = iter(xs[n_res:])
        full = [next(cts) if i in oidx else float0_zeros(a) for i, a in enumerate(out_avals)]
        return list(vjp_fn(full))

    return compat.trace_at(bwd, avals)
