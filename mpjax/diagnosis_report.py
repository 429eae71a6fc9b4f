"""What the precision doctor found, as a value: :class:`DiagnosisReport` and its rows
(ranges, precision lost, the non-finite birth, the loss-scale and fp8 advice), with its text
table, histograms and JSON form.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpjax import range_stats
from mpjax.range_stats import RangeStats, Shares, bounds
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
]

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


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
      low: the recommended range's lower exponent (see ``high``).
      high: the recommended range ``2**low ... 2**high``: no value overflows and at most
        ``mpjax.recommendations.FLUSH_TOLERANCE`` of them flush (or, if no scale flushes that
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
      fit: whether ``ratio <= mpjax.recommendations.FP8_STABLE_RATIO`` with at least two
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
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=1)


def _shares_text(shares: Shares) -> str:
    def pct(x):
        return "0" if x == 0 else f"{100 * x:.3g}%"

    return "/".join(pct(x) for x in (shares.overflow, shares.subnormal, shares.flush))
