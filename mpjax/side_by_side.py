"""The precision doctor's side-by-side evaluation: a jaxpr evaluated twice in one traced
function, *as it runs* (the policy's casts and dtypes) and *exactly* (the same equations with
every value in float32: casts to a lower precision become identities and matmuls accumulate in
float32; this is the float32 reference run of the same function), measuring each equation on
the way. Each equation is attributed to the module whose precision region it runs in (or its
named scopes), and to the forward or backward pass.

- Ranges come from the exact values: per equation, the summary
  (:func:`mpjax.range_stats.summarize`) of the values it computes (copies such as reshapes and
  casts, ``STRUCTURAL``, left out).
- A non-finite birth is an equation whose inputs are all finite and whose output is not, as
  it runs: the counts of both are measured.
- The precision lost *in* an equation is measured by running it as the policy runs it on the
  exact inputs cast to the dtypes it takes, against the exact equation on those same inputs:
  that relative error is what enters there, whatever came before (the rounding of the inputs
  counts at the cast that rounds them). The relative error of the value as it ran, against
  the exact one, is what has accumulated.
- Matmuls have the amax of their two operands (exact) measured, for fp8 fitness.

Higher-order primitives that are calls (``jit``, ``remat``, custom derivatives) are looked
into; loops and conditionals (``scan``, ``while``, ``cond``) count as one equation whose
outputs are measured.

``__all__`` is what :mod:`mpjax.diagnosis` uses: :class:`Evaluation` (with :class:`Site`, what
it measured where) and :func:`to_exact`, the exact counterpart of an input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import jax_compat as compat
from mpjax import range_stats
from mpjax.policy import is_floating
from mpjax.regions import innermost

__all__ = ["STRUCTURAL", "Evaluation", "Site", "to_exact"]

# Equations whose outputs copy, move or cast their inputs' values: their ranges are those of
# their inputs. (A cast still can overflow, and loses precision: births and errors see it.)
STRUCTURAL = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "copy",
        "copy_p",
        "slice",
        "dynamic_slice",
        "rev",
        "concatenate",
        "pad",
        "name",
        "reduce_precision",
    }
)
_CAST = frozenset({"convert_element_type", "reduce_precision"})
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
_F32 = np.dtype(np.float32)


def _is_low(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return is_floating(dtype) and dtype.itemsize < 4


def to_exact(x: Any) -> Any:
    """``x`` as the exact evaluation takes it: in float32 if it is a lower-precision float,
    else as it is."""
    dtype = jax.typeof(x).dtype if not isinstance(x, np.ndarray | np.generic) else x.dtype
    return x.astype(jnp.float32) if _is_low(dtype) else x


def _cast(x: Any, dtype: Any) -> Any:
    if is_floating(jax.typeof(x).dtype) and jax.typeof(x).dtype != np.dtype(dtype):
        return lax.convert_element_type(x, dtype)
    return x


def _relative_error(value: Any, exact: Any) -> jax.Array:
    """``||value - exact|| / ||exact||`` over the entries where ``exact`` is finite; inf when
    ``value`` is not finite there."""
    value, exact = value.astype(jnp.float32), exact.astype(jnp.float32)
    ok = jnp.isfinite(exact)
    bad = jnp.any(ok & ~jnp.isfinite(value))
    diff = jnp.where(ok, value - exact, 0.0)
    norm = jnp.sqrt(jnp.sum(jnp.where(ok, exact, 0.0) ** 2))
    error = jnp.sqrt(jnp.sum(diff**2)) / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)
    return jnp.where(bad, jnp.inf, error)


def _largest_error(values: list, references: list) -> jax.Array:
    return jnp.max(jnp.stack([_relative_error(a, b) for a, b in zip(values, references)]))


def _nonfinite(x: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(x)).astype(jnp.int32)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


# What the evaluation measures of its values, one kind at a time: the values of a kind and
# shape are stacked and measured by one vmapped call (a few large operations, quick to
# compile, rather than thousands of small ones).
_MEASURES: dict[str, Callable[..., Any]] = {
    "nonfinite": _nonfinite,
    "summary": range_stats.summarize,
    "amax": _amax,
    "error": _relative_error,
}


@dataclasses.dataclass(frozen=True)
class Site:
    """An equation the evaluation measured: what, where, in which pass and dtype."""

    primitive: str
    module: str
    backward: bool
    dtype: str
    location: str


class Evaluation:
    """Evaluates a jaxpr exactly and as it runs, side by side, collecting per equation the
    measures of :mod:`mpjax.side_by_side`: call :meth:`run` inside a traced function and
    return :meth:`outputs` from it, then :meth:`assemble` the host values and read them by
    :meth:`indices` into :attr:`sites`."""

    def __init__(self, compare: bool):
        self.compare = compare
        self.sites: list[Site] = []
        # Per measured site, the slots of its measures: (group, rank in the group).
        self.births: list[tuple[int, list, list]] = []
        self.ranges: list[tuple[int, list]] = []
        self.dots: list[tuple[int, list]] = []
        self.errors: list[tuple[int, list, list]] = []
        self.groups: dict[tuple, list[tuple]] = {}

    def _measure(self, kind: str, *arrays: Any) -> tuple[tuple, int]:
        key = (kind, tuple((jax.typeof(a).shape, str(jax.typeof(a).dtype)) for a in arrays))
        group = self.groups.setdefault(key, [])
        group.append(arrays)
        return key, len(group) - 1

    def run(self, closed: Any, exact: Sequence[Any], actual: Sequence[Any], path, backward):
        jaxpr = closed.jaxpr
        ex_env: dict[Any, Any] = {}
        ac_env: dict[Any, Any] = {}

        def read(env, atom, exact_value):
            if compat.is_literal(atom):
                return to_exact(atom.val) if exact_value else atom.val
            return env[atom]

        for var, const in zip(jaxpr.constvars, closed.consts):
            ex_env[var], ac_env[var] = to_exact(const), const
        for var, ex, ac in zip(jaxpr.invars, exact, actual):
            ex_env[var], ac_env[var] = ex, ac
        for eqn in jaxpr.eqns:
            where = path + compat.scope_names(eqn)
            backward_eqn = backward or compat.is_backward(eqn)
            ex_in = [read(ex_env, a, True) for a in eqn.invars]
            ac_in = [read(ac_env, a, False) for a in eqn.invars]
            sub = _inner_jaxpr(eqn)
            if sub is not None:
                ex_out, ac_out = self.run(sub, ex_in, ac_in, where, backward_eqn)
            else:
                ex_out, ac_out = self.equation(eqn, ex_in, ac_in, where, backward_eqn)
            for var, ex, ac in zip(eqn.outvars, ex_out, ac_out):
                if not compat.is_dropvar(var):
                    ex_env[var], ac_env[var] = ex, ac
        return (
            [read(ex_env, a, True) for a in jaxpr.outvars],
            [read(ac_env, a, False) for a in jaxpr.outvars],
        )

    def equation(self, eqn, ex_in, ac_in, path, backward):
        ac_out = compat.bind_equation(eqn, ac_in)
        floats_in = [i for i, v in enumerate(eqn.invars) if is_floating(v.aval.dtype)]
        floats_out = [i for i, v in enumerate(eqn.outvars) if is_floating(v.aval.dtype)]
        if not floats_in and not floats_out:
            return ac_out, ac_out
        ex_out = _exact_equation(eqn, ex_in)
        if not floats_out:
            return ex_out, ac_out
        name = eqn.primitive.name
        region = innermost(path)
        site = Site(
            primitive=name,
            module=region.path if region is not None else "/".join(path),
            backward=backward,
            dtype=np.dtype(eqn.outvars[floats_out[0]].aval.dtype).name,
            location=compat.source_location(eqn),
        )
        index = len(self.sites)
        self.sites.append(site)
        ranges = name not in STRUCTURAL
        errors = self.compare and not backward and (ranges or name in _CAST)
        local, reference = [], []
        if errors and any(_is_low(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)):
            # The equation as the policy runs it, on the exact inputs in the dtypes it takes,
            # against the exact equation on those same inputs: what rounding the inputs loses
            # is counted at the cast that rounds them, not again at each use. (An equation
            # with no lower-precision value runs exactly: nothing enters there.)
            local_in = [_cast(x, v.aval.dtype) for x, v in zip(ex_in, eqn.invars)]
            local = compat.bind_equation(eqn, local_in)
            rounded = any(_is_low(v.aval.dtype) for v in eqn.invars)
            reference = _exact_equation(eqn, [to_exact(x) for x in local_in]) if rounded else ex_out
            local, reference = [local[i] for i in floats_out], [reference[i] for i in floats_out]
        self.births.append(
            (
                index,
                [self._measure("nonfinite", ac_out[i]) for i in floats_out],
                [self._measure("nonfinite", ac_in[i]) for i in floats_in],
            )
        )
        if ranges:
            self.ranges.append((index, [self._measure("summary", ex_out[i]) for i in floats_out]))
        if name in _MATMULS:
            self.dots.append((index, [self._measure("amax", ex_in[i]) for i in floats_in[:2]]))
        if errors:
            entering = [self._measure("error", a, b) for a, b in zip(local, reference)]
            accumulated = [self._measure("error", ac_out[i], ex_out[i]) for i in floats_out]
            self.errors.append((index, entering, accumulated))
        return ex_out, ac_out

    def outputs(self) -> list[Any]:
        """The measures, one vmapped call per group (in the order of :attr:`groups`)."""
        found = []
        for (kind, _), members in self.groups.items():
            stacked = [jnp.stack(column) for column in zip(*members)]
            found.append(jax.vmap(_MEASURES[kind])(*stacked))
        return found

    def assemble(self, measured: list[Any]) -> dict[str, np.ndarray]:
        """Per site, from the measures (host values): non-finite counts of outputs and inputs,
        range summaries (counts, extremes), matmul operand amaxes, errors (entering,
        accumulated), each stacked in the order of :meth:`indices`."""
        results = dict(zip(self.groups, measured))

        def get(slot, part=None):
            key, rank = slot
            value = results[key] if part is None else results[key][part]
            return value[rank]

        def total(slots):
            return int(sum(int(get(s)) for s in slots))

        def largest(slots):
            return max((float(get(s)) for s in slots), default=0.0)

        width = range_stats.summary_size()
        counts = [np.sum([get(s, 0) for s in slots], axis=0) for _, slots in self.ranges]
        extremes = [
            [max(float(get(s, 1)[0]) for s in slots), min(float(get(s, 1)[1]) for s in slots)]
            for _, slots in self.ranges
        ]
        return {
            "range_counts": np.array(counts, np.int64).reshape(-1, width),
            "range_extremes": np.array(extremes, np.float32).reshape(-1, 2),
            "births": np.array([[total(o), total(i)] for _, o, i in self.births]).reshape(-1, 2),
            "errors": np.array(
                [[largest(e), largest(a)] for _, e, a in self.errors], np.float32
            ).reshape(-1, 2),
            "dots": np.array(
                [[float(get(s)) for s in slots] for _, slots in self.dots], np.float32
            ),
        }

    def indices(self) -> dict[str, list[int]]:
        return {
            "ranges": [i for i, _ in self.ranges],
            "births": [i for i, _, _ in self.births],
            "errors": [i for i, _, _ in self.errors],
            "dots": [i for i, _ in self.dots],
        }


def _inner_jaxpr(eqn: Any) -> Any | None:
    """The jaxpr a call-like equation evaluates (looked into), or None."""
    name = eqn.primitive.name
    if name in ("jit", "pjit"):
        return compat.jit_params(eqn).jaxpr
    if name in ("remat2", "checkpoint"):
        return compat.remat_params(eqn).jaxpr
    if name in compat.CALL_PRIMITIVES or name in ("custom_jvp_call", "custom_vjp_call"):
        return compat.call_jaxpr(eqn)
    return None


def _exact_equation(eqn: Any, ex_in: list) -> list:
    """``eqn`` on float32 values: a cast to a lower precision keeps the value, a matmul
    accumulates in float32; an equation that takes no float32 operands runs as written on
    its inputs cast back, its outputs widened."""
    name = eqn.primitive.name
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    if not any(_is_low(a.dtype) for a in avals):
        return compat.bind_equation(eqn, ex_in)
    if name in _CAST:
        target = np.dtype(eqn.outvars[0].aval.dtype)
        return [lax.convert_element_type(ex_in[0], _F32 if _is_low(target) else target)]
    cast_back = [_cast(x, v.aval.dtype) for x, v in zip(ex_in, eqn.invars)]
    if compat.sub_jaxprs(eqn):  # a loop or conditional: its bodies are typed as written
        return [to_exact(x) for x in compat.bind_equation(eqn, cast_back)]
    params = None
    preferred = compat.preferred_element_type(eqn)
    if preferred is not None and _is_low(preferred):
        params = {**eqn.params, "preferred_element_type": _F32}
    try:
        outs = compat.bind_equation(eqn, ex_in, params)
    except (TypeError, ValueError):
        outs = compat.bind_equation(eqn, cast_back)
    return [to_exact(x) for x in outs]
