"""Every use of JAX internals that :mod:`mpjax.autocast` needs, in one place.

Autocast reads jaxprs: equation params, name stacks, and the binding convention of primitives.
These are not covered by JAX's compatibility promise (the peer project ``jaxamp`` broke when
``Primitive.get_bind_params`` changed from returning ``(subfuns, params)`` to returning params
only). Everything version dependent is here, behind small functions with stable signatures, so a
JAX upgrade touches this file only; :mod:`mpjax.autocast` re-expresses higher-order primitives
with public APIs (``jax.jit``, ``lax.scan``, ``lax.while_loop``, ``lax.switch``,
``jax.checkpoint``, ``jax.custom_jvp``, ``jax.custom_vjp``, ``jax.shard_map``) from the values
these functions return. Written against jax 0.10.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Sequence

import jax
from jax.extend import core as jex_core


def closed(jaxpr: Any) -> jex_core.ClosedJaxpr:
    """``jaxpr`` as a ClosedJaxpr (remat and shard_map carry open jaxprs, with no consts)."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        return jaxpr
    return jex_core.ClosedJaxpr(jaxpr, ())


def bind_equation(eqn: Any, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Binds ``eqn``'s primitive to ``invals``, as ``jax.core.eval_jaxpr`` does.

    ``params`` replaces the equation's params (for example a new ``preferred_element_type``).
    Returns the outputs as a list. ``get_bind_params`` returned ``(subfuns, params)`` before
    jax 0.9.2 and returns params (subfuns inside) since; both are handled.
    """
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns: tuple[Any, ...] = ()
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
    # The equation's context carries its abstract mesh, compute_on and threefry settings.
    manager = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
    with manager:
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


_TRANSFORM = re.compile(r"^[a-z_]+\((.*)\)$")


def scope_names(eqn: Any) -> tuple[str, ...]:
    """The ``jax.named_scope`` names around ``eqn``, outermost first, transforms left out.

    JAX's name stack mixes scopes (``named_scope``, Flax module names) with transformation
    markers (``jvp(...)``, ``transpose(...)``); only scopes name a region of user code.
    """
    stack = getattr(eqn.source_info, "name_stack", None)
    entries = getattr(stack, "stack", None)
    if entries is not None:
        return tuple(e.name for e in entries if type(e).__name__ == "Scope")
    names = []
    for part in str(stack or "").split("/"):
        while (match := _TRANSFORM.match(part)) is not None:
            part = match.group(1)
        if part:
            names.append(part)
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class JitParams:
    jaxpr: jex_core.ClosedJaxpr
    name: str
    donate_argnums: tuple[int, ...]
    keep_unused: bool
    inline: bool


def jit_params(eqn: Any) -> JitParams:
    p = eqn.params
    donated = p.get("donated_invars", ())
    return JitParams(
        jaxpr=closed(p["jaxpr"]),
        name=p.get("name", "jit"),
        donate_argnums=tuple(i for i, d in enumerate(donated) if d),
        keep_unused=bool(p.get("keep_unused", False)),
        inline=bool(p.get("inline", False)),
    )


@dataclasses.dataclass(frozen=True)
class ScanParams:
    jaxpr: jex_core.ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool


def scan_params(eqn: Any) -> ScanParams:
    p = eqn.params
    return ScanParams(closed(p["jaxpr"]), p["num_consts"], p["num_carry"], p["length"],
                      bool(p["reverse"]), p.get("unroll", 1))


@dataclasses.dataclass(frozen=True)
class WhileParams:
    cond_jaxpr: jex_core.ClosedJaxpr
    cond_nconsts: int
    body_jaxpr: jex_core.ClosedJaxpr
    body_nconsts: int


def while_params(eqn: Any) -> WhileParams:
    p = eqn.params
    return WhileParams(closed(p["cond_jaxpr"]), p["cond_nconsts"], closed(p["body_jaxpr"]),
                       p["body_nconsts"])


def cond_branches(eqn: Any) -> tuple[jex_core.ClosedJaxpr, ...]:
    """The branches of a ``cond`` equation; its first input is the branch index."""
    return tuple(closed(b) for b in eqn.params["branches"])


@dataclasses.dataclass(frozen=True)
class RematParams:
    jaxpr: jex_core.ClosedJaxpr
    prevent_cse: bool
    policy: Any


def remat_params(eqn: Any) -> RematParams:
    p = eqn.params
    return RematParams(closed(p["jaxpr"]), bool(p.get("prevent_cse", True)), p.get("policy"))


def custom_call_jaxpr(eqn: Any) -> jex_core.ClosedJaxpr:
    """The primal jaxpr of a ``custom_jvp_call`` or ``custom_vjp_call`` equation."""
    return closed(eqn.params["call_jaxpr"])


@dataclasses.dataclass(frozen=True)
class ShardMapParams:
    jaxpr: jex_core.ClosedJaxpr
    kwargs: dict  # keyword arguments of jax.shard_map other than the function


def shard_map_params(eqn: Any) -> ShardMapParams:
    p = eqn.params
    kwargs = dict(mesh=p["mesh"], in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]))
    # ``check_rep`` became ``check_vma`` and ``auto`` became ``axis_names`` (its complement).
    if "check_vma" in p:
        kwargs["check_vma"] = p["check_vma"]
    if "newly_manual_axes" in p:
        kwargs["axis_names"] = set(p["newly_manual_axes"])
    elif "manual_axes" in p:
        kwargs["axis_names"] = set(p["manual_axes"])
    return ShardMapParams(closed(p["jaxpr"]), kwargs)


def is_literal(atom: Any) -> bool:
    return isinstance(atom, jex_core.Literal)


def is_dropvar(atom: Any) -> bool:
    return isinstance(atom, jex_core.DropVar)


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs in ``eqn``'s params (non-empty for higher-order primitives)."""
    return list(jex_core.jaxprs_in_params(eqn.params))


def retyped(x: Any, like: Any) -> Any:
    """The abstract value of ``x`` with the dtype and weak type of the aval ``like``.

    Unlike a ``jax.ShapeDtypeStruct``, it keeps what else the type of ``x`` carries (sharding,
    the varying manual axes inside ``shard_map``), so a function traced at it (see
    :func:`trace_at`) sees the same types as where ``x`` lives.
    """
    return jax.typeof(x).update(dtype=like.dtype, weak_type=getattr(like, "weak_type", False))


def weakly_typed(aval: Any) -> Any:
    """``aval`` marked weakly typed."""
    return aval.update(weak_type=True)


def trace_at(fn: Any, avals: Sequence[Any]) -> jex_core.ClosedJaxpr:
    """``jax.make_jaxpr(fn)`` at abstract values (``make_jaxpr`` accepts avals as arguments)."""
    return jax.make_jaxpr(fn)(*avals)
