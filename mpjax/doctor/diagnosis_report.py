"""What the precision doctor found, as a value: :class:`DiagnosisReport` and its rows
(ranges, precision lost, the non-finite birth, the loss-scale and fp8 advice), with its text
views (:meth:`DiagnosisReport.summary`, the verdict and the modules it names, and
:meth:`DiagnosisReport.table`, everything), histograms and JSON form.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpjax.doctor import range_stats
from mpjax.doctor.range_stats import RangeStats, Shares, bounds
from mpjax.rules import Rules
from mpjax.table import format_table

__all__ = [
    "Birth",
    "DiagnosisReport",
    "ErrorRow",
    "Fp8Matmul",
    "LossScaleAdvice",
    "LossScaleCandidate",
    "RangeRow",
    "RoutingRow",
]

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
WIDTH = 100
"""The width :meth:`DiagnosisReport.summary` keeps to."""
_NO_SHARES = Shares(0.0, 0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class RangeRow:
    """The ranges of the values computed in one module or by one primitive, in one pass.

    Attributes:
      where: the module path (``""`` for the root) or the primitive name.
      backward: True for the gradient pass.
      stats: their :class:`mpjax.doctor.range_stats.RangeStats` (the float32 run's values); their
        ``shares(dtype)`` are what rounding them all to ``dtype`` would do.
      runs_in: the dtypes the values are computed in under the policy.
      as_run: the shares of the values that overflow, turn subnormal or flush to zero in the
        dtype each is computed in (none for float32): what the policy does to them.
    """

    where: str
    backward: bool
    stats: RangeStats
    runs_in: tuple[str, ...] = ()
    as_run: Shares = _NO_SHARES

    @classmethod
    def of(cls, where: str, backward: bool, parts: Sequence[tuple[str, RangeStats]]) -> RangeRow:
        """The row of values computed in several parts, each ``(dtype it runs in, stats)``."""
        counts = np.zeros(3)
        for dtype, stats in parts:
            if dtype in _SHORT:
                counts += np.array(dataclasses.astuple(stats.shares(dtype))) * stats.finite
        merged = RangeStats.merge([stats for _, stats in parts])
        as_run = Shares(*(float(c) / max(merged.finite, 1) for c in counts))
        runs_in = tuple(sorted({d for d, _ in parts}, key=lambda d: (d not in _SHORT, d)))
        return cls(where, backward, merged, runs_in, as_run)

    def to_dict(self, dtypes: Sequence[str]) -> dict[str, Any]:
        return {
            "where": self.where,
            "pass": "backward" if self.backward else "forward",
            **self.stats.to_dict(dtypes),
            "runs_in": list(self.runs_in),
            "as_run": self.as_run.to_dict(),
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
      candidates: each scale ``2**0 ... 2**32`` with the shares of the gradient values (those
        that run in float16 under the policy, their casts to float16 included, as the float32
        run computes them, times the scale) it would overflow, make subnormal or flush to zero
        in float16. Gradients computed in float32 are left out: no loss scale overflows them.
      low: the recommended range's lower exponent (see ``high``).
      high: the recommended range ``2**low ... 2**high``: no value overflows and at most
        ``mpjax.doctor.recommendations.FLUSH_TOLERANCE`` of them flush (or, if no scale flushes that
        little, the largest scale that overflows nothing); None when every scale overflows.
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
      fit: whether ``ratio <= mpjax.doctor.recommendations.FP8_STABLE_RATIO`` with at least two
        batches seen.
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
class RoutingRow:
    """A mixture of experts' routing decision (a ``top_k`` of the forward pass) under the
    policy, against float32's.

    Attributes:
      module: the module the ``top_k`` runs in.
      location: its source line.
      flipped: the largest share, over the batches, of its rows (tokens) that chose other
        indices (experts) than in the float32 run.
      logits_module: the module of the last matmul before it, the router's logits in a
        mixture of experts (None if no matmul came before it).
      logits_dtype: the dtype that matmul computes in under the policy.
      recommend: whether the report's rules route ``logits_module`` in float32
        (:func:`mpjax.router_policy`): some tokens chose other experts and the logits' matmul
        runs narrower than float32, in a module a rule can name.
      why: the finding with its figures.
    """

    module: str
    location: str
    flipped: float
    logits_module: str | None
    logits_dtype: str | None
    recommend: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DiagnosisReport:
    """What :func:`mpjax.diagnose` found; ``str`` gives :meth:`summary` (the verdict and the
    modules it names), :meth:`table` every row, :meth:`to_json` everything.

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
      loss_scale: the loss scales that keep float16 gradients in float16's range (None
        without a backward pass or when no gradient runs in float16).
      fp8: per matmul, its fitness for fp8.
      keep: the paths of the modules ``rules`` keeps in float32, in the order they first ran
        (``reasons`` says why, in the same order).
      max_error: the error entering a module above which it is kept in float32.
      routing: per routing decision (a mixture of experts' ``top_k``), how many tokens chose
        other experts than in float32 and whether ``rules`` routes its logits in float32.
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
    keep: tuple[str, ...] = ()
    max_error: float = 0.05
    routing: tuple[RoutingRow, ...] = ()

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
        return self.summary()

    def _verdict(self) -> list[str]:
        """The verdict's items: why each module is kept in float32, the loss scale, fp8."""
        items = list(self.reasons)
        items += [r.why for r in self.routing if r.flipped > 0 and not r.recommend]
        if self.loss_scale is not None:
            items.append(self.loss_scale.why)
        if self.batches > 1 and self.fp8:
            fit = sum(m.fit for m in self.fp8)
            items.append(
                f"fp8: {fit} of {len(self.fp8)} matmuls are fit for delayed scaling, by how "
                f"their operands' amax moves across {self.batches} batches (report.fp8 says "
                "why for each)"
            )
        elif self.fp8:
            items.append(
                f"fp8: {len(self.fp8)} matmuls; their fitness needs the amax of several "
                "batches (diagnose(...).over(batches))"
            )
        return items

    def summary(self) -> str:
        """The report for a terminal, at most ``WIDTH`` (100) columns wide: the verdict first
        (the modules to keep in float32 and why, the loss scale, fp8), the figures of the
        modules it keeps, and what the others come to. Each module the verdict keeps is in the
        table, and no other: the overflow and flush columns are what the policy does to the
        values, in the dtype each is computed in. :meth:`table` has every row."""
        plural = "es" if self.batches != 1 else ""
        passes = "forward and backward" if any(r.backward for r in self.modules) else "forward"
        lines = [
            f"precision diagnosis under {self.policy.default} ({passes}, "
            f"{self.batches} batch{plural})"
        ]
        if self.keep:
            n = len(self.keep)
            lines.append(
                f"verdict: keep {n} module{'s' if n != 1 else ''} in float32 (report.rules):"
            )
        else:
            lines.append("verdict: the policy keeps every module")
        for item in self._verdict():
            lines += textwrap.wrap(item, WIDTH, initial_indent="- ", subsequent_indent="  ")
        if self.keep:
            lines += ["", self._kept_table()]
        others = [m for m in dict.fromkeys(r.where for r in self.modules) if m not in self.keep]
        if others:
            errors = [r for r in self.errors if r.module in others]
            worst = max(errors, key=lambda r: r.local, default=None)
            text = (
                f"{len(others)} {'other ' if self.keep else ''}module"
                f"{'s' if len(others) != 1 else ''}: no value overflows the dtype it is "
                "computed in and no non-finite value is born"
            )
            if worst is not None:
                text += (
                    f"; the error entering stays within max_error={self.max_error:g} (at most "
                    f"{worst.local:.2g}, in {worst.module or '<root>'})"
                )
            lines += [""] + textwrap.wrap(text + ".", WIDTH)
        masked = [r for r in self.modules if r.stats.masked]
        if masked:
            names = list(dict.fromkeys(r.where or "<root>" for r in masked))
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            text = (
                f"mask fills, counted apart (constants written where a mask excludes a "
                f"position, not numbers the model computes): {sum(r.stats.masked for r in masked):,}"
                f" values in {shown}."
            )
            lines += textwrap.wrap(text, WIDTH)
        lines += [
            "every row: report.table(); one module: report.module(path), report.histogram(path)"
        ]
        return "\n".join(lines)

    def _kept_table(self) -> str:
        """The rows of the modules the verdict keeps, with what the policy does to them."""
        errors = {r.module: r for r in self.errors}
        body = []
        for path in self.keep:
            name = path or "<root>"
            name = name if len(name) <= 32 else "..." + name[-29:]
            rows = [r for r in self.modules if r.where == path]
            if not rows:  # only casts ran there (a birth at one): no ranges to show
                error = errors.get(path)
                local = "-" if error is None else f"{error.local:.2e}"
                body.append((name, "-", "-", "-", "-", "-", local))
            for r in rows:
                error = errors.get(path) if not r.backward else None
                body.append(
                    (
                        name,
                        "bwd" if r.backward else "fwd",
                        "+".join(_SHORT.get(d, d.replace("float", "f")) for d in r.runs_in),
                        f"{r.stats.amax:.3g}",
                        _percent(r.as_run.overflow),
                        _percent(r.as_run.flush),
                        "-" if error is None else f"{error.local:.2e}",
                    )
                )
        header = ("module", "pass", "runs in", "amax", "overflow", "flushed", "error entering")
        return format_table(header, body, right=frozenset({3, 4, 5, 6}))

    def _range_table(self, rows: Sequence[RangeRow], title: str) -> str:
        short = {d: _SHORT[d] for d in self.dtypes}
        header = (
            title,
            "pass",
            "runs in",
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
                    "+".join(_SHORT.get(d, d.replace("float", "f")) for d in r.runs_in),
                    f"{s.count:,}"
                    + (f" ({s.nonfinite} non-finite)" if s.nonfinite else "")
                    + (f" (+{s.masked:,} mask fill)" if s.masked else ""),
                    f"{s.amax:.3g}",
                    "-" if math.isinf(s.min_nonzero) else f"{s.min_nonzero:.3g}",
                    "-" if log2 is None else f"[{log2[0]}, {log2[1]}]",
                    *(_shares_text(s.shares(d)) for d in self.dtypes),
                )
            )
        return format_table(header, body, right=frozenset({3, 4, 5}))

    def table(self) -> str:
        """The whole report as text: ranges by module and by primitive (``runs in``: the
        dtypes the values are computed in; ``over/sub/ftz``: the shares rounding them all to
        each dtype would overflow, make subnormal or flush to zero, whatever they run in; mask
        fills counted apart), the precision lost by module, the non-finite birth, and the
        recommendations. :meth:`summary` is the short form."""
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
        lines += [f"- {r.why}" for r in self.routing if not r.recommend]
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

    def plot(self, *where: str, backward: bool = False, ax: Any = None) -> Any:
        """The log2-magnitude histograms of the values of the modules (or else primitives)
        named, in one pass, as the share of the finite values in each power of two, with
        where each of ``dtypes`` stops (``--``, its largest value: above it overflows),
        turns subnormal (``-.``, its smallest normal) and flushes to zero (``:``) drawn as
        vertical lines: how far a gradient histogram sits below float16's subnormals shows
        the loss scale it needs. With no name, all the values of the pass. Needs matplotlib.

        Args:
          where: module paths or primitive names, as in ``modules`` and ``ops``.
          backward: the gradient pass rather than the forward one.
          ax: the matplotlib Axes to draw in; a new figure's by default.

        Returns:
          The Axes.

        Raises:
          KeyError: for a name with no values in that pass.
          ImportError: without matplotlib.
        """
        pass_name = "backward" if backward else "forward"
        if where:
            found = []
            for name in where:
                row = next(
                    (
                        r
                        for r in (*self.modules, *self.ops)
                        if r.where == name and r.backward == backward
                    ),
                    None,
                )
                if row is None:
                    raise KeyError(f"No {pass_name} values for {name!r}.")
                found.append((name or "<root>", row.stats))
        else:
            parts = [r.stats for r in self.modules if r.backward == backward]
            if not parts:
                raise KeyError(f"No {pass_name} values in this report.")
            found = [(f"all {pass_name} values", RangeStats.merge(parts))]
        if ax is None:
            try:
                import matplotlib.pyplot as plt  # optional: only plots need it
            except ImportError as error:
                raise ImportError(
                    "DiagnosisReport.plot needs matplotlib: pip install matplotlib"
                ) from error
            _, ax = plt.subplots(figsize=(8, 4))
        for label, stats in found:
            share = stats.histogram / max(stats.finite, 1)
            log2 = np.arange(share.size) + range_stats.LOG2_MIN
            ax.step(log2, share, where="post", label=f"{label} ({stats.finite:,} values)")
        styles = {"overflow": "--", "normal": "-.", "nonzero": ":"}
        for i, dtype in enumerate(self.dtypes):
            b = bounds(dtype)
            for field, style in styles.items():
                ax.axvline(
                    float(np.log2(getattr(b, field))),
                    linestyle=style,
                    color=f"C{len(found) + i}",
                    linewidth=1,
                    label=f"{_SHORT[dtype]} {'max' if field == 'overflow' else field}",
                )
        ranges = [s.log2_range() for _, s in found]
        known = [r for r in ranges if r is not None]
        if known:
            ax.set_xlim(min(r[0] for r in known) - 4, max(r[1] for r in known) + 5)
            ax.set_yscale("log")
        ax.set_xlabel("log2 |value|")
        ax.set_ylabel("share of the values")
        ax.set_title(f"{pass_name} values under {self.policy.default}")
        ax.legend(fontsize="small", ncol=2)
        return ax

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
            "keep": list(self.keep),
            "max_error": self.max_error,
            "routing": [r.to_dict() for r in self.routing],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=1)


def _percent(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:.3g}%"


def _shares_text(shares: Shares) -> str:
    return "/".join(_percent(x) for x in (shares.overflow, shares.subnormal, shares.flush))
