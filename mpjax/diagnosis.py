"""``mpjax.diagnose``: where a model's numbers leave a dtype's range under a policy, where
precision is lost, where a non-finite value is born, and what to do about it.

The target runs under the policy as one jaxpr (forward and, for a loss, backward), and that
jaxpr is evaluated twice side by side in one jitted function: *as it runs* (the policy's
casts and dtypes) and *exactly* (the same equations with every value in float32: casts to a
lower precision become identities and matmuls accumulate in float32; this is the float32
reference run of the same function). Each equation is attributed to the module whose
precision region it runs in (or its named scopes), and to the forward or backward pass.

- Ranges come from the exact values: per module and per primitive, the
  :class:`mpjax.range_stats.RangeStats` of the values each computes (copies such as reshapes
  and casts left out).
- The non-finite birth is the first equation, in the order they run, whose inputs are all
  finite and whose output is not, as it runs.
- The precision lost *in* an equation is measured by running it as the policy runs it on the
  exact inputs cast to the dtypes it takes, against the exact equation on those same inputs:
  that relative error is what enters there, whatever came before (the rounding of the inputs
  counts at the cast that rounds them). The relative error of the value as it ran, against
  the exact one, is what has accumulated.

Higher-order primitives that are calls (``jit``, ``remat``, custom derivatives) are looked
into; loops and conditionals (``scan``, ``while``, ``cond``) count as one equation whose
outputs are measured.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import jax_compat as compat
from mpjax import range_stats
from mpjax.describe import Runner, runner_of
from mpjax.policy import is_floating
from mpjax.range_stats import DTYPES, RangeStats, Shares, bounds, check_dtypes
from mpjax.regions import innermost
from mpjax.rules import Rules, RulesLike, as_rules
from mpjax.table import format_table

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
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
# A matmul is fit for fp8 with delayed scaling when its operands' amax moves by at most this
# factor between batches: a scale set from earlier batches then neither overflows nor wastes
# more than one binade of the format's range.
FP8_STABLE_RATIO = 2.0
# The loss scales whose effect on float16 gradients is measured: 2**0 ... 2**LOSS_SCALE_MAX_LOG2.
LOSS_SCALE_MAX_LOG2 = 32
# Below this share of flushed gradient values, a loss scale is in the recommended range.
FLUSH_TOLERANCE = 1e-3


def _is_low(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return is_floating(dtype) and dtype.itemsize < 4


def _exact(x: Any) -> Any:
    """``x`` in float32 if it is a lower-precision float, else as it is."""
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
class _Site:
    """An equation the evaluation measured: what, where, in which pass and dtype."""

    primitive: str
    module: str
    backward: bool
    dtype: str
    location: str


class _Evaluation:
    """Evaluates a jaxpr exactly and as it runs, side by side, collecting per equation the
    statistics of the module docstring."""

    def __init__(self, compare: bool):
        self.compare = compare
        self.sites: list[_Site] = []
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
                return _exact(atom.val) if exact_value else atom.val
            return env[atom]

        for var, const in zip(jaxpr.constvars, closed.consts):
            ex_env[var], ac_env[var] = _exact(const), const
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
        site = _Site(
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
            reference = _exact_equation(eqn, [_exact(x) for x in local_in]) if rounded else ex_out
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
        return [_exact(x) for x in compat.bind_equation(eqn, cast_back)]
    params = None
    preferred = compat.preferred_element_type(eqn)
    if preferred is not None and _is_low(preferred):
        params = {**eqn.params, "preferred_element_type": _F32}
    try:
        outs = compat.bind_equation(eqn, ex_in, params)
    except (TypeError, ValueError):
        outs = compat.bind_equation(eqn, cast_back)
    return [_exact(x) for x in outs]


# --- The report -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RangeRow:
    """The ranges of the values computed in one module or by one primitive, in one pass.

    Attributes:
      where: the module path (``""`` for the root) or the primitive name.
      backward: True for the gradient pass.
      stats: their :class:`mpjax.range_stats.RangeStats`.
    """

    where: str
    backward: bool
    stats: RangeStats

    def to_dict(self, dtypes: Sequence[str]) -> dict[str, Any]:
        return {
            "where": self.where,
            "pass": "backward" if self.backward else "forward",
            **self.stats.to_dict(dtypes),
        }


@dataclasses.dataclass(frozen=True)
class ErrorRow:
    """The precision lost in one module's forward equations under the policy.

    Attributes:
      module: its path.
      local: the largest relative error an equation of the module makes on exact inputs (the
        error that enters there).
      primitive: the equation that makes it; ``location`` where it was written.
      accumulated: the largest relative error of the module's values as they ran (including
        what came in).
    """

    module: str
    local: float
    primitive: str
    location: str
    accumulated: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Birth:
    """The first equation whose inputs are finite and whose output is not, as it ran.

    Attributes:
      module: the module path it runs in.
      primitive: its primitive.
      location: the source line it was written at.
      backward: True when it is in the gradient pass.
      dtype: the dtype its output has under the policy.
      nonfinite: how many of its output values are inf or NaN.
      batch: the batch (0 for the first) it was seen in.
    """

    module: str
    primitive: str
    location: str
    backward: bool
    dtype: str
    nonfinite: int
    batch: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        where = "backward" if self.backward else "forward"
        return (
            f"{self.module or '<root>'}: {self.primitive} ({where}, {self.dtype}) at "
            f"{self.location}: {self.nonfinite} non-finite values from finite inputs"
        )


@dataclasses.dataclass(frozen=True)
class LossScaleCandidate:
    """What a loss scale ``2**log2_scale`` would do to the gradient values in float16."""

    log2_scale: int
    shares: Shares

    def to_dict(self) -> dict[str, Any]:
        return {"log2_scale": self.log2_scale, **self.shares.to_dict()}


@dataclasses.dataclass(frozen=True)
class LossScaleAdvice:
    """The loss scales that keep the gradient values in float16's range.

    Attributes:
      candidates: each scale ``2**0 ... 2**32`` with the shares of the gradient values (every
        value of the backward pass of the float32 run, times the scale) it would overflow,
        make subnormal or flush to zero in float16.
      low, high: the recommended range ``2**low ... 2**high``: no value overflows and at most
        ``FLUSH_TOLERANCE`` of them flush (or, if no scale flushes that little, the largest
        scale that overflows nothing); None when every scale overflows.
      why: the recommendation with its figures.
    """

    candidates: tuple[LossScaleCandidate, ...]
    low: int | None
    high: int | None
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidates": [c.to_dict() for c in self.candidates],
            "low": self.low,
            "high": self.high,
            "why": self.why,
        }


@dataclasses.dataclass(frozen=True)
class Fp8Matmul:
    """How fit one matmul is for fp8 with delayed scaling: its operands' amax across batches.

    Attributes:
      module: the module path it runs in; ``index`` its rank among the module's matmuls of
        the same pass.
      backward: True for a matmul of the gradient pass (its gradient operand would be e5m2).
      amax: per batch, the amax of its two operands (float32 run).
      ratio: the largest over the smallest amax across batches, the worse operand.
      fit: whether ``ratio <= FP8_STABLE_RATIO`` with at least two batches seen.
      why: the verdict with its figure.
    """

    module: str
    index: int
    backward: bool
    amax: tuple[tuple[float, ...], ...]
    ratio: float
    fit: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "amax": [list(a) for a in self.amax]}


@dataclasses.dataclass(frozen=True)
class DiagnosisReport:
    """What :func:`mpjax.diagnose` found; ``str`` gives :meth:`table`.

    Attributes:
      policy: the rules the target ran under.
      dtypes: the dtypes whose range is measured.
      batches: how many batches were run.
      modules: the ranges per module and pass, in the order the modules first ran.
      ops: the ranges per primitive and pass.
      errors: the precision lost per module (forward), in the order the modules first ran.
      birth: where the first non-finite value is born, or None.
      rules: the recommended rules (the policy, with the modules that overflow, make a
        non-finite value or lose more than ``max_error`` in float32), or None when none does.
      reasons: why each module is in ``rules``, with the figures.
      loss_scale: the loss scales that keep gradients in float16's range (None without a
        backward pass).
      fp8: per matmul, its fitness for fp8.
    """

    policy: Rules
    dtypes: tuple[str, ...]
    batches: int
    modules: tuple[RangeRow, ...]
    ops: tuple[RangeRow, ...]
    errors: tuple[ErrorRow, ...]
    birth: Birth | None
    rules: Rules | None
    reasons: tuple[str, ...]
    loss_scale: LossScaleAdvice | None
    fp8: tuple[Fp8Matmul, ...]

    def module(self, path: str, backward: bool = False) -> RangeRow:
        """The ranges of the module at ``path`` in one pass."""
        for row in self.modules:
            if row.where == path and row.backward == backward:
                return row
        raise KeyError(
            f"No {'backward' if backward else 'forward'} values in module {path!r}; modules: "
            f"{sorted({r.where for r in self.modules})}."
        )

    def op(self, primitive: str, backward: bool = False) -> RangeRow:
        """The ranges of the values computed by ``primitive`` in one pass."""
        for row in self.ops:
            if row.where == primitive and row.backward == backward:
                return row
        raise KeyError(f"No {primitive!r} in the {'backward' if backward else 'forward'} pass.")

    def error(self, path: str) -> ErrorRow:
        """The precision lost in the module at ``path``."""
        for row in self.errors:
            if row.module == path:
                return row
        raise KeyError(f"No forward equations measured in module {path!r}.")

    def __str__(self) -> str:
        return self.table()

    def _range_table(self, rows: Sequence[RangeRow], title: str) -> str:
        short = {d: _SHORT[d] for d in self.dtypes}
        header = (
            title,
            "pass",
            "values",
            "amax",
            "min nonzero",
            "log2 range",
            *(f"{short[d]} over/sub/ftz" for d in self.dtypes),
        )
        body = []
        for r in rows:
            s = r.stats
            log2 = s.log2_range()
            body.append(
                (
                    r.where or "<root>",
                    "bwd" if r.backward else "fwd",
                    f"{s.count:,}" + (f" ({s.nonfinite} non-finite)" if s.nonfinite else ""),
                    f"{s.amax:.3g}",
                    "-" if math.isinf(s.min_nonzero) else f"{s.min_nonzero:.3g}",
                    "-" if log2 is None else f"[{log2[0]}, {log2[1]}]",
                    *(_shares_text(s.shares(d)) for d in self.dtypes),
                )
            )
        return format_table(header, body, right=frozenset({2, 3, 4}))

    def table(self) -> str:
        """The report as text: ranges by module and by primitive, the precision lost by
        module, the non-finite birth, and the recommendations."""
        lines = [
            f"precision diagnosis under {self.policy.default} (ranges from the float32 run, "
            f"{self.batches} batch{'es' if self.batches != 1 else ''})",
            "",
            self._range_table(self.modules, "module"),
            "",
            self._range_table(self.ops, "operation"),
        ]
        if self.errors:
            lines += [
                "",
                format_table(
                    ("module", "error entering (max)", "at", "accumulated"),
                    [
                        (
                            r.module or "<root>",
                            f"{r.local:.2e}",
                            f"{r.primitive} {r.location}",
                            f"{r.accumulated:.2e}",
                        )
                        for r in self.errors
                    ],
                ),
            ]
        lines += ["", f"non-finite born at: {self.birth if self.birth else 'nowhere'}", ""]
        lines += ["recommendations:"]
        lines += [f"- {why}" for why in self.reasons] or ["- the policy keeps every module"]
        if self.loss_scale is not None:
            lines.append(f"- {self.loss_scale.why}")
        if self.batches > 1:
            lines += [f"- {m.why}" for m in self.fp8]
        elif self.fp8:
            lines.append(
                f"- fp8: {len(self.fp8)} matmuls; their fitness needs the amax of several "
                "batches (diagnose(...).over(batches))"
            )
        return "\n".join(lines)

    def histogram(self, where: str, backward: bool = False, width: int = 40) -> str:
        """The log2-magnitude histogram of a module's (or else a primitive's) values as a text
        plot, one line per power of two, with the float16, bfloat16 and fp8 limits marked."""
        rows = [r for r in (*self.modules, *self.ops) if r.where == where]
        row = next((r for r in rows if r.backward == backward), None)
        if row is None:
            raise KeyError(f"No values for {where!r} in that pass.")
        s = row.stats
        log2 = s.log2_range()
        if log2 is None:
            return "no nonzero values"
        marks: dict[int, list[str]] = collections.defaultdict(list)
        for d in self.dtypes:
            b = bounds(d)
            marks[int(np.floor(np.log2(b.overflow)))].append(f"{_SHORT[d]} max")
            marks[int(np.floor(np.log2(b.normal)))].append(f"{_SHORT[d]} normal")
        top = max(int(s.histogram.max()), 1)
        lines = []
        for e in range(log2[1], log2[0] - 1, -1):
            n = int(s.histogram[e - range_stats.LOG2_MIN])
            bar = "#" * math.ceil(width * n / top) if n else ""
            note = f"  <- {', '.join(marks[e])}" if e in marks else ""
            lines.append(f"2^{e:>4}  {bar:<{width}}  {n}{note}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data."""
        return {
            "policy": str(self.policy.default),
            "dtypes": list(self.dtypes),
            "batches": self.batches,
            "modules": [r.to_dict(self.dtypes) for r in self.modules],
            "ops": [r.to_dict(self.dtypes) for r in self.ops],
            "errors": [r.to_dict() for r in self.errors],
            "birth": None if self.birth is None else self.birth.to_dict(),
            "rules": None
            if self.rules is None
            else {str(r.key): str(r.policy) for r in self.rules.rules if not r.builtin},
            "reasons": list(self.reasons),
            "loss_scale": None if self.loss_scale is None else self.loss_scale.to_dict(),
            "fp8": [m.to_dict() for m in self.fp8],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=1)


def _shares_text(shares: Shares) -> str:
    def pct(x):
        return "0" if x == 0 else f"{100 * x:.3g}%"

    return "/".join(pct(x) for x in (shares.overflow, shares.subnormal, shares.flush))


# --- Running ----------------------------------------------------------------------------------


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


@dataclasses.dataclass
class _Trace:
    """The jaxpr of the target under the policy for one input structure, and its evaluation."""

    closed: Any
    backward: bool
    evaluate: Callable[[list], dict] = dataclasses.field(init=False)
    evaluation: _Evaluation = dataclasses.field(init=False)  # set when evaluate is traced


class Doctor:
    """What :func:`diagnose` returns: call it with the target's inputs for the report of one
    batch, or use :meth:`over` for several batches (needed to judge fp8 fitness)."""

    def __init__(self, runner, rules, loss, dtypes, max_error, compare):
        self._runner = runner
        self._rules = rules
        self._loss = loss
        self._dtypes = dtypes
        self._max_error = max_error
        self._compare = compare
        self._traces: dict[Any, _Trace] = {}

    def __call__(self, *inputs, **kwargs) -> DiagnosisReport:
        return self.over([(inputs, kwargs)])

    def over(self, batches: Iterable[Any]) -> DiagnosisReport:
        """The report over several batches: ranges of all of them, the first birth, the
        largest errors, and the fp8 fitness from how each matmul's amax moves between them.

        Args:
          batches: each a tuple of the target's positional inputs, or an ``(args, kwargs)``
            pair of a tuple and a dict.
        """
        results = []
        prefix: tuple | None = None
        for batch in batches:
            if (
                isinstance(batch, tuple)
                and len(batch) == 2
                and isinstance(batch[0], tuple)
                and isinstance(batch[1], Mapping)
            ):
                inputs, kwargs = batch
            else:
                inputs, kwargs = (batch if isinstance(batch, tuple) else (batch,)), {}
            if prefix is None:
                args, kwargs = self._runner.arguments(tuple(inputs), dict(kwargs))
                prefix = args[: len(args) - len(inputs)]
            else:
                args = (*prefix, *inputs)
            results.append(self._run(args, kwargs))
        if not results:
            raise ValueError("diagnose(...).over(batches): batches is empty; give at least one.")
        return _report(results, self._rules, self._dtypes, self._max_error)

    def _run(self, args: tuple, kwargs: dict) -> tuple[_Trace, dict[str, np.ndarray]]:
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        static = tuple((i, leaf) for i, leaf in enumerate(leaves) if not _is_array(leaf))
        key: Any = (tree, static, tuple(jax.typeof(leaves[i]) for i in dynamic))
        try:
            hash(key)
        except TypeError:
            key = None
        trace = self._traces.get(key) if key is not None else None
        if trace is None:
            trace = self._trace(leaves, tree, dynamic)
            if key is not None:
                self._traces[key] = trace
        measured = jax.tree.map(np.asarray, trace.evaluate([leaves[i] for i in dynamic]))
        return trace, trace.evaluation.assemble(measured)

    def _trace(self, leaves, tree, dynamic) -> _Trace:
        fn = self._runner.under(self._rules)
        floating = [i for i in dynamic if is_floating(leaves[i])]
        loss = self._loss

        def value(float_leaves, array_leaves):
            merged = list(leaves)
            for i, leaf in zip(dynamic, array_leaves):
                merged[i] = leaf
            for i, leaf in zip(floating, float_leaves):
                merged[i] = leaf
            call_args, call_kwargs = jax.tree.unflatten(tree, merged)
            out = fn(*call_args, **call_kwargs)
            return out if loss is None else loss(out)

        float_leaves = [leaves[i] for i in floating]
        array_leaves = [leaves[i] for i in dynamic]
        try:
            shape = jax.eval_shape(value, float_leaves, array_leaves)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"diagnose(...)(*inputs): the target cannot run on these inputs: {error}"
            ) from error
        backward = (
            isinstance(shape, jax.ShapeDtypeStruct) and shape.shape == () and is_floating(shape)
        )
        if loss is not None and not backward:
            raise ValueError(
                f"diagnose(loss=...) must return a floating scalar (the loss); it returned {shape}."
            )

        def step(float_leaves, array_leaves):
            if not backward:
                return value(float_leaves, array_leaves)
            return jax.value_and_grad(value)(float_leaves, array_leaves)

        closed = jax.make_jaxpr(step)(float_leaves, array_leaves)
        trace = _Trace(closed, backward)
        compare = self._compare

        def evaluate(array_leaves):
            # The jaxpr takes the floating leaves (differentiated), then all the array leaves.
            flat = [array_leaves[dynamic.index(i)] for i in floating] + list(array_leaves)
            evaluation = _Evaluation(compare)
            evaluation.run(closed, [_exact(x) for x in flat], flat, (), False)
            trace.evaluation = evaluation
            return evaluation.outputs()

        trace.evaluate = jax.jit(evaluate)
        return trace


def _report(results, rules: Rules, dtypes, max_error) -> DiagnosisReport:
    trace = results[0][0]
    ev = trace.evaluation
    sites = ev.sites
    indices = ev.indices()
    # Ranges: every batch's values together, by module and by primitive.
    by_module: dict[tuple[str, bool], list[RangeStats]] = collections.defaultdict(list)
    by_op: dict[tuple[str, bool], list[RangeStats]] = collections.defaultdict(list)
    per_site: dict[int, list[RangeStats]] = collections.defaultdict(list)
    for _, values in results:
        for row, index in enumerate(indices["ranges"]):
            stats = RangeStats.from_summary(
                values["range_counts"][row], values["range_extremes"][row]
            )
            site = sites[index]
            by_module[site.module, site.backward].append(stats)
            by_op[site.primitive, site.backward].append(stats)
            per_site[index].append(stats)
    modules = tuple(RangeRow(m, b, RangeStats.merge(s)) for (m, b), s in by_module.items())
    ops = tuple(RangeRow(p, b, RangeStats.merge(s)) for (p, b), s in by_op.items())
    birth = _birth(results, sites, indices["births"])
    errors = _errors(results, sites, indices["errors"])
    reasons, keep = _overflowing(per_site, sites, birth, errors, max_error)
    recommended = None
    if keep:
        recommended = rules
        f32 = rules.default.with_compute_dtype(jnp.float32).with_fp8(None)
        for path in reversed(keep):
            # The root's own operations run under the default policy, which no rule replaces.
            if path:
                recommended = recommended.with_rule(path, f32)
            else:
                recommended = recommended.with_default(f32)
    backward = [r.stats for r in modules if r.backward]
    loss_scale = _loss_scale(RangeStats.merge(backward)) if trace.backward and backward else None
    fp8 = _fp8(results, sites, indices["dots"])
    return DiagnosisReport(
        policy=rules,
        dtypes=dtypes,
        batches=len(results),
        modules=modules,
        ops=ops,
        errors=errors,
        birth=birth,
        rules=recommended,
        reasons=tuple(reasons),
        loss_scale=loss_scale,
        fp8=fp8,
    )


def _birth(results, sites, indices) -> Birth | None:
    for batch, (_, values) in enumerate(results):
        for row, index in enumerate(indices):
            out_bad, in_bad = values["births"][row]
            if out_bad > 0 and in_bad == 0:
                s = sites[index]
                return Birth(
                    s.module, s.primitive, s.location, s.backward, s.dtype, int(out_bad), batch
                )
    return None


def _errors(results, sites, indices) -> tuple[ErrorRow, ...]:
    worst: dict[str, ErrorRow] = {}
    for _, values in results:
        for row, index in enumerate(indices):
            local, accumulated = (float(v) for v in values["errors"][row])
            s = sites[index]
            old = worst.get(s.module)
            if old is None:
                worst[s.module] = ErrorRow(s.module, local, s.primitive, s.location, accumulated)
                continue
            if local > old.local:
                old = dataclasses.replace(
                    old, local=local, primitive=s.primitive, location=s.location
                )
            worst[s.module] = dataclasses.replace(
                old, accumulated=max(old.accumulated, accumulated)
            )
    return tuple(worst.values())


def _overflowing(per_site, sites, birth, errors, max_error) -> tuple[list[str], list[str]]:
    """The modules to keep in float32 and why: values that overflow the dtype they are
    computed in, the non-finite birth, an error entering above ``max_error``."""
    why: dict[str, list[str]] = collections.defaultdict(list)
    for index, parts in per_site.items():
        s = sites[index]
        if s.dtype not in DTYPES:
            continue
        stats = RangeStats.merge(parts)
        share = stats.shares(s.dtype).overflow
        if share > 0:
            b = bounds(s.dtype)
            text = (
                f"its {s.primitive} ({'backward' if s.backward else 'forward'}) runs in {s.dtype} "
                f"and reaches {stats.amax:.3g} in the float32 run, past {s.dtype}'s "
                f"{float(jnp.finfo(jnp.dtype(s.dtype)).max):.5g} ({100 * share:.3g}% of its "
                f"values overflow from {float(b.overflow):.6g} up)"
            )
            if text not in why[s.module]:
                why[s.module].append(text)
    if birth is not None:
        why[birth.module].append(f"the first non-finite value is born there: {birth}")
    for row in errors:
        if row.local > max_error:
            why[row.module].append(
                f"its {row.primitive} at {row.location} loses {row.local:.3g} relative error "
                f"on exact inputs (more than max_error={max_error:g})"
            )
    order = [m for m in dict.fromkeys(s.module for s in sites) if m in why]
    reasons = [f"keep {m or '<root>'!r} in float32: " + "; ".join(why[m]) for m in order]
    return reasons, order


def _loss_scale(stats: RangeStats) -> LossScaleAdvice:
    candidates = tuple(
        LossScaleCandidate(k, stats.shares("float16", k)) for k in range(LOSS_SCALE_MAX_LOG2 + 1)
    )
    safe = [c for c in candidates if c.shares.overflow == 0]
    if not safe:
        c = candidates[0]
        return LossScaleAdvice(
            candidates,
            None,
            None,
            f"loss scale: none keeps the gradients in float16; even 2**0 overflows "
            f"{100 * c.shares.overflow:.3g}% of them (largest {stats.amax:.3g}): keep the "
            "modules that overflow in float32 first",
        )
    good = [c for c in safe if c.shares.flush <= FLUSH_TOLERANCE]
    chosen = good or [safe[-1]]
    low, high = chosen[0], chosen[-1]
    return LossScaleAdvice(
        candidates,
        low.log2_scale,
        high.log2_scale,
        f"loss scale for float16 gradients: 2**{low.log2_scale} to 2**{high.log2_scale}: "
        f"2**{high.log2_scale} overflows none of the {stats.finite:,} gradient values and "
        f"flushes {100 * high.shares.flush:.3g}%, 2**{low.log2_scale} flushes "
        f"{100 * low.shares.flush:.3g}% (unscaled: {100 * candidates[0].shares.flush:.3g}% "
        f"flushed); 2**{high.log2_scale + 1} would overflow "
        + (
            f"{100 * candidates[high.log2_scale + 1].shares.overflow:.3g}%"
            if high.log2_scale < LOSS_SCALE_MAX_LOG2
            else "(not measured)"
        ),
    )


def _fp8(results, sites, indices) -> tuple[Fp8Matmul, ...]:
    counter: collections.Counter = collections.Counter()
    found = []
    for row, index in enumerate(indices):
        s = sites[index]
        rank = counter[s.module, s.backward]
        counter[s.module, s.backward] += 1
        amax = tuple(tuple(float(v) for v in values["dots"][row]) for _, values in results)
        per_operand = np.array(amax)  # batches x 2
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = per_operand.max(axis=0) / per_operand.min(axis=0)
        ratio = float(np.nanmax(np.where(per_operand.max(axis=0) > 0, ratios, 1.0)))
        name = f"{s.module or '<root>'}#{rank} ({'backward' if s.backward else 'forward'})"
        if len(results) < 2:
            fit, why = False, f"fp8: {name}: one batch; fitness needs the amax of several"
        else:
            fit = ratio <= FP8_STABLE_RATIO
            verdict = "fit for" if fit else "not fit for"
            why = (
                f"fp8: {name} is {verdict} delayed scaling: its operands' amax moves by "
                f"{ratio:.3g}x across {len(results)} batches (fit: at most {FP8_STABLE_RATIO:g}x)"
            )
        found.append(Fp8Matmul(s.module, rank, s.backward, amax, ratio, fit, why))
    return tuple(found)


def diagnose(
    target: Any,
    *,
    policy: RulesLike | None = None,
    loss: Callable[[Any], Any] | None = None,
    variables: Any = None,
    rngs: Any = None,
    method: Any = None,
    dtypes: Sequence[Any] = DTYPES,
    max_error: float = 0.05,
    compare: bool = True,
) -> Doctor:
    """The precision doctor, curried like :func:`mpjax.describe`:
    ``diagnose(target, policy=...)(*inputs)`` returns a :class:`DiagnosisReport`.

    The target runs under the policy, forward and, when it returns a scalar (or ``loss`` makes
    one of its output), backward with respect to every floating input (a linen model's
    variables, an NNX model's state, a function's array arguments), and side by side in
    float32. The report gives, per module and per primitive, the ranges of the values of the
    float32 run (largest and smallest nonzero magnitude, log2 histogram, and the shares that
    would overflow, become subnormal or flush to zero in each of ``dtypes``); per module, the
    relative error that enters there under the policy; the first operation whose inputs are
    finite and whose output is not; and recommendations: :class:`mpjax.Rules` that keep the
    modules that overflow or lose too much in float32, the loss scales that keep float16
    gradients in range, and which matmuls are fit for fp8 (with :meth:`Doctor.over` several
    batches).

    Args:
      target: a function (run through :func:`mpjax.autocast`), a function made by
        :func:`mpjax.autocast`, a linen module (wrapped by :func:`mpjax.linen.apply_policy`
        or not) or an NNX module (with a policy set or not).
      policy: the policy or :class:`mpjax.Rules` to diagnose; by default those of the target
        (a wrapped model or an autocast function).
      loss: a function of the target's output that returns the loss, to diagnose the backward
        pass of a target that does not return a scalar.
      variables, rngs, method: for a linen module, as for :func:`mpjax.describe` (the
        variables are initialized from the inputs when not given).
      dtypes: the dtypes whose range is reported, among ``float16``, ``bfloat16``,
        ``float8_e4m3fn`` and ``float8_e5m2``.
      max_error: a module whose operations make a larger relative error than this on exact
        inputs is recommended to stay in float32.
      compare: measure the precision lost (runs each forward operation once more); False
        gives the ranges, the birth and the recommendations from them alone, faster.

    Returns:
      A :class:`Doctor`: call it with the target's inputs as the target takes them.

    Raises:
      TypeError: for a target that is neither a function nor a model mpjax runs, or an option
        that does not apply to it.
      ValueError: for a dtype it does not measure, no policy for a target that has none, a
        negative ``max_error``; when called, inputs that the target cannot run on.

    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     with jax.named_scope("gram"):
    ...         g = x @ x.T  # 8 * 100**2: past float16's 65504
    ...     return jnp.sum(jnp.tanh(g))
    >>> report = diagnose(f, policy="mixed_float16")(jnp.full((4, 8), 100.0))
    >>> print(report.birth.module, report.birth.primitive, report.birth.dtype)
    gram dot_general float16
    >>> [rule.key for rule in report.rules.rules if not rule.builtin]
    ['gram']
    """
    dtypes = check_dtypes(dtypes, "diagnose")
    if not isinstance(max_error, int | float) or max_error < 0:
        raise ValueError(f"diagnose(max_error=...) must be a number >= 0; got {max_error!r}.")
    if not isinstance(compare, bool):
        raise TypeError(f"diagnose(compare=...) must be a bool; got {compare!r}.")
    if loss is not None and not callable(loss):
        raise TypeError(
            f"diagnose(loss=...) must be a function of the target's output; got {loss!r}."
        )
    runner: Runner = runner_of(target, "diagnose", variables=variables, rngs=rngs, method=method)
    if policy is None:
        if runner.rules is None:
            raise ValueError(
                f"diagnose() needs policy=... for this {type(target).__name__}, which has no "
                "policy of its own: a policy name ('mixed_float16'), a Policy or mpjax.Rules."
            )
        rules = runner.rules
    else:
        rules = as_rules(policy, "policy")
    return Doctor(runner, rules, loss, dtypes, float(max_error), compare)
