"""The precision report: what rules resolved to, module by module, for linen and NNX models,
and the dtypes each module's matmuls ran in, read from the jaxpr."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mpjax.inspection import inspect_matmuls
from mpjax.policy import Policy, is_floating, short_dtype_name
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
      matmuls: the matmuls and convolutions that ran in the module's region (its own code,
        not its children's), forward and backward, counted by operand dtypes:
        ``(("bf16,bf16", 3),)``. Empty when the report was made without example inputs.
    """

    path: str
    type_name: str
    policy: Policy
    rule: str
    param_count: int
    param_bytes: int
    matmuls: tuple[tuple[str, int], ...] = ()


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
        header = ("path", "type", "params", "compute", "output", "rule", "#params", "bytes",
                  "matmuls ran in")
        body = [
            (r.path or "<root>", r.type_name, r.policy.param_dtype.name,
             r.policy.compute_dtype.name, r.policy.output_dtype.name, r.rule,
             f"{r.param_count:,}", _human_bytes(r.param_bytes),
             " ".join(f"{n}x {dtypes}" for dtypes, n in r.matmuls) or "-")
            for r in self.rows
        ]
        total = ("total", "", "", "", "", "", f"{self.total_params:,}",
                 _human_bytes(self.total_bytes), "")
        lines = [format_table(header, body, footer=total, right=frozenset({6, 7}))]
        lines += [f"warning: {p}" for p in self.problems]
        return "\n".join(lines)


def matmuls_by_region(fn: Callable[..., Any], *args) -> dict[str, tuple[tuple[str, int], ...]]:
    """The matmuls and convolutions of ``fn`` and of its gradient, by the module path of the
    precision region they ran in, counted by operand dtypes.

    Read from the jaxpr of ``jax.grad`` of the sum of ``fn``'s floating outputs with respect to
    the floating leaves of ``args`` (arrays or ``jax.ShapeDtypeStruct``): forward and backward
    matmuls, nothing computed. A matmul outside any region counts for the root (``""``).
    """
    leaves, tree = jax.tree.flatten(args)
    floating = [i for i, leaf in enumerate(leaves) if is_floating(leaf)]

    def loss(float_leaves, all_leaves):
        merged = list(all_leaves)
        for i, leaf in zip(floating, float_leaves):
            merged[i] = leaf
        outs = jax.tree.leaves(fn(*jax.tree.unflatten(tree, merged)))
        outs = [x for x in outs if is_floating(x)]
        return sum((jnp.sum(x.astype(jnp.float32)) for x in outs), jnp.zeros((), jnp.float32))

    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for m in inspect_matmuls(jax.grad(loss), [leaves[i] for i in floating], leaves):
        dtypes = ",".join(short_dtype_name(d) for d in m.operand_dtypes)
        counts[m.region or ""][dtypes] += 1
    return {path: tuple(sorted(c.items())) for path, c in counts.items()}

