"""The precision report: what rules resolved to, module by module, for linen and NNX models."""

from __future__ import annotations

import dataclasses
from typing import Any

from mpjax.policy import Policy
from mpjax.table import format_table


@dataclasses.dataclass(frozen=True)
class ModuleRow:
    """One module of a :class:`PrecisionReport`.

    Attributes:
      path: the module's ``/``-joined path (``""`` for the root).
      type_name: the module's class name.
      policy: the policy resolved for it.
      rule: the name of the rule that decided it, or ``"default"``.
      param_count: number of parameter elements the module owns directly (not its children).
      param_bytes: bytes those parameters take in their stored dtypes.
    """

    path: str
    type_name: str
    policy: Policy
    rule: str
    param_count: int
    param_bytes: int


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024:
            break
    return f"{size:.1f} {unit}"


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """A table of modules with their resolved dtypes and parameter sizes; ``str`` prints it.

    Attributes:
      rows: one :class:`ModuleRow` per module, in traversal order.
      problems: rules that never matched or were shadowed (see :meth:`mpjax.Rules.problems`).
    """

    rows: tuple[ModuleRow, ...]
    problems: tuple[str, ...] = ()

    @property
    def total_params(self) -> int:
        return sum(r.param_count for r in self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(r.param_bytes for r in self.rows)

    def row(self, path: str) -> ModuleRow:
        """The row of the module at ``path``."""
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(f"No module at path {path!r}. Paths: {[r.path for r in self.rows]}")

    def __str__(self) -> str:
        header = ("path", "type", "params", "compute", "output", "rule", "#params", "bytes")
        body = [
            (r.path or "<root>", r.type_name, r.policy.param_dtype.name,
             r.policy.compute_dtype.name, r.policy.output_dtype.name, r.rule,
             f"{r.param_count:,}", _human_bytes(r.param_bytes))
            for r in self.rows
        ]
        total = ("total", "", "", "", "", "", f"{self.total_params:,}",
                 _human_bytes(self.total_bytes))
        lines = [format_table(header, body, footer=total, right=frozenset({6, 7}))]
        lines += [f"warning: {p}" for p in self.problems]
        return "\n".join(lines)


def describe(model: Any, *args, **kwargs) -> Any:
    """Returns (and prints) the precision report of a linen or NNX model wrapped by mpjax, or of
    a function made by :func:`mpjax.autocast`.

    Dispatches to :func:`mpjax.linen.describe` for linen modules, to :func:`mpjax.nnx.describe`
    for NNX modules and to :func:`mpjax.autocast_report` for autocast functions; see those for
    the arguments.
    """
    if hasattr(model, "__mpjax_autocast__"):
        from mpjax.autocast import autocast_report

        return autocast_report(model, *args, **kwargs)
    import flax.linen as nn  # Deferred: Flax is only needed for Flax models.
    from flax import nnx

    if isinstance(model, nnx.Module):
        from mpjax import nnx as mp_nnx

        return mp_nnx.describe(model, *args, **kwargs)
    if isinstance(model, nn.Module):
        from mpjax import linen as mp_linen

        return mp_linen.describe(model, *args, **kwargs)
    raise TypeError(
        "describe() takes a flax.linen or flax.nnx module or a function made by mpjax.autocast; "
        f"got {type(model).__name__}."
    )
