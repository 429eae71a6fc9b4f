"""The precision report: what rules resolved to, module by module, for linen, NNX and Equinox
models, and the dtypes each module's operations and matmuls ran in, read from the jaxpr.

:mod:`mpjax.linen`, :mod:`mpjax.nnx` and :mod:`mpjax.equinox` build it; :func:`mpjax.describe`
returns it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from mpjax import jax_compat
from mpjax.casting.regions import innermost
from mpjax.inspection.matmuls import (
    MATMUL_PRIMITIVES,
    call_on_leaves,
    gradient_jaxpr,
    is_array,
    matmul_info,
    walk_jaxpr,
)
from mpjax.policy import (
    PURE_FLOAT16_NOTE,
    Policy,
    is_floating,
    is_pure_float16,
    short_dtype_name,
)
from mpjax.table import format_table, human_bytes


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
        not its children's), forward and backward, counted by operand dtypes and, for float32
        operands, the precision they run at (``Policy.f32_matmul_precision``):
        ``(("bf16,bf16", 3), ("f32,f32@highest", 3))``. Empty when the report was made
        without example inputs (see ``PrecisionReport.matmuls_traced``).
      computes: the floating dtypes the operations of the module's region (its own code, not
        its children's) computed in, forward and backward, each with the number of operations
        that had an input or output in it: ``(("bf16", 4), ("f32", 10))``. Every operation
        counts, matmuls included, except casts (``convert_element_type``), the sums of a
        value's gradients from its several uses (``add_any``, in the value's dtype: the
        caller's) and the ``checkpoint_name`` identities (the regions' output boundaries); an
        operation with inputs and outputs in two dtypes counts for both. A module kept in float32 by a rule computes in ``f32`` only. The table's
        "ops ran in" column names the dtypes. Empty when the report was made without example
        inputs, like ``matmuls``.
    """

    path: str
    type_name: str
    policy: Policy
    rule: str
    param_count: int
    param_bytes: int
    matmuls: tuple[tuple[str, int], ...] = ()
    computes: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-serialisable data (dtype names as strings, tuples as lists)."""
        policy = self.policy
        return {
            "path": self.path,
            "type": self.type_name,
            "policy": {
                "param_dtype": policy.param_dtype.name,
                "compute_dtype": policy.compute_dtype.name,
                "output_dtype": policy.output_dtype.name,
                "f32_matmul_precision": policy.f32_matmul_precision,
            },
            "rule": self.rule,
            "param_count": self.param_count,
            "param_bytes": self.param_bytes,
            "matmuls": [[dtypes, count] for dtypes, count in self.matmuls],
            "computes": [[dtype, count] for dtype, count in self.computes],
        }


class Report(Protocol):
    """What :func:`mpjax.describe` returns, whatever it describes: ``str(report)`` is
    ``report.table()``."""

    def table(self) -> str:
        """The report as a text table."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data."""
        ...


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """The modules of a model with their resolved dtypes, parameter sizes and the dtypes their
    operations and matmuls ran in; made by :func:`mpjax.describe`. ``str`` gives :meth:`table`.

    Attributes:
      rows: one :class:`ModuleRow` per module, in traversal order.
      problems: rules that never matched or were shadowed (see :meth:`mpjax.Rules.problems`).
      matmuls_traced: whether the model was traced with example inputs, so that the rows'
        ``computes`` and ``matmuls`` are known; the table has its "ops ran in" and "matmuls ran
        in" columns only then.
    """

    rows: tuple[ModuleRow, ...]
    problems: tuple[str, ...] = ()
    matmuls_traced: bool = True

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
        return self.table()

    def table(self) -> str:
        """The rows as a text table with a total, then the problems as warnings and the notes."""
        header = (
            "path",
            "type",
            "params",
            "compute",
            "output",
            "rule",
            "#params",
            "bytes",
            "ops ran in",
            "matmuls ran in",
        )
        body = [
            (
                r.path or "<root>",
                r.type_name,
                r.policy.param_dtype.name,
                r.policy.compute_dtype.name,
                r.policy.output_dtype.name,
                r.rule,
                f"{r.param_count:,}",
                human_bytes(r.param_bytes),
                # The dtypes alone: how many operations a module's code writes changes with the
                # JAX version that traces it, the dtypes they compute in do not.
                " ".join(dtype for dtype, _ in r.computes) or "-",
                " ".join(f"{n}x {dtypes}" for dtypes, n in r.matmuls) or "-",
            )
            for r in self.rows
        ]
        total = (
            "total",
            "",
            "",
            "",
            "",
            "",
            f"{self.total_params:,}",
            human_bytes(self.total_bytes),
            "",
            "",
        )
        # The last two columns are the traced dtypes, unknown without example inputs.
        columns = len(header) if self.matmuls_traced else len(header) - 2
        lines = [
            format_table(
                header[:columns],
                [row[:columns] for row in body],
                footer=total[:columns],
                right=frozenset({6, 7}),
            )
        ]
        lines += [f"warning: {p}" for p in self.problems]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    @property
    def notes(self) -> tuple[str, ...]:
        """What the table's reader should know about its policies, such as that pure float16 (``"fp16"``)
        is not AMP, where a module runs it."""
        if any(is_pure_float16(r.policy) for r in self.rows):
            return (PURE_FLOAT16_NOTE,)
        return ()

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data: ``{"rows": [...], "problems": [...], "notes": [...],
        "matmuls_traced": ..., "total_params": ..., "total_bytes": ...}``, each row as
        :meth:`ModuleRow.to_dict` gives it."""
        return {
            "rows": [r.to_dict() for r in self.rows],
            "problems": list(self.problems),
            "notes": list(self.notes),
            "matmuls_traced": self.matmuls_traced,
            "total_params": self.total_params,
            "total_bytes": self.total_bytes,
        }


def unflatten_with(tree: Any, leaves: list, *replaced: tuple[Sequence[int], Sequence[Any]]) -> Any:
    """``jax.tree.unflatten(tree, leaves)`` with, for each ``(indices, values)`` of
    ``replaced`` in turn, the leaves at ``indices`` replaced by ``values``: a function of some
    of its arguments' leaves (traced or differentiated) called with all of them."""
    merged = list(leaves)
    for indices, values in replaced:
        for i, leaf in zip(indices, values):
            merged[i] = leaf
    return jax.tree.unflatten(tree, merged)


def eval_shape_of(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``jax.eval_shape(fn, *args, **kwargs)`` with the leaves that are not arrays or
    ``jax.ShapeDtypeStruct`` (flags such as ``deterministic=True``) passed as static values."""
    traced, arrays = call_on_leaves(fn, args, kwargs, lambda _, leaf: is_array(leaf))
    return jax.eval_shape(traced, arrays)


@dataclasses.dataclass(frozen=True)
class RegionDtypes:
    """What ran in one precision region, forward and backward: the rows' ``computes`` and
    ``matmuls`` (see :class:`ModuleRow`).

    Attributes:
      computes: the floating dtypes its operations computed in, with the number of
        operations in each: ``(("bf16", 4), ("f32", 10))``.
      matmuls: its matmuls and convolutions, counted by operand dtypes and, for float32
        operands, precision: ``(("bf16,bf16", 3), ("f32,f32@highest", 3))``.
    """

    computes: tuple[tuple[str, int], ...] = ()
    matmuls: tuple[tuple[str, int], ...] = ()


# A cast, and the sum of the gradients of a value used in two places (a residual stream that
# feeds a norm and skips it): JAX adds them in the value's dtype where the uses meet, under the
# scope of one of them, so a norm of a float16 stream would show float16 for its caller's sum.
_NOT_COMPUTE = frozenset({"convert_element_type", "add_any"})


def _is_compute(eqn: Any) -> bool:
    """Whether ``eqn`` computes in the dtypes of its values: not a higher-order primitive
    (its inner equations are counted themselves), a cast or a gradients' sum
    (``_NOT_COMPUTE``), or a ``checkpoint_name`` (an identity, which a region's output
    boundary is)."""
    return not (
        jax_compat.sub_jaxprs(eqn)
        or eqn.primitive.name in _NOT_COMPUTE
        or jax_compat.checkpoint_name_of(eqn) is not None
    )


def _floating_dtypes(eqn: Any) -> set[str]:
    """The short names of the floating dtypes of ``eqn``'s inputs (literals included) and
    outputs."""
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    return {short_dtype_name(aval.dtype) for aval in avals if is_floating(aval)}


def dtypes_by_region(fn: Callable[..., Any], *args, **kwargs) -> dict[str, RegionDtypes]:
    """What the operations of ``fn`` and of its gradient computed in, by the module path of
    the precision region they ran in: the floating dtypes of each region's operations, and its
    matmuls and convolutions counted by operand dtypes (``"bf16,bf16"``) and, for float32
    operands, the precision they run at (``"f32,f32@highest"``).

    Read from one trace, the jaxpr of ``jax.grad`` of the sum of ``fn(*args, **kwargs)``'s
    floating outputs with respect to the floating array leaves of the arguments (arrays or
    ``jax.ShapeDtypeStruct``): forward and backward, nothing computed. Leaves that are not
    arrays (flags such as ``deterministic=True``) are static. An operation inside a nested
    jaxpr (a ``jax.jit`` or ``remat`` in a module's code) counts for the region around it,
    where the casting engine runs it. A matmul outside any region counts for the root
    (``""``); the dtypes of the other operations outside every region are left out: they are
    this function's own (the sum it differentiates and the seed of its gradient), as every
    operation of a wrapped model runs in the region of one of its modules.
    """
    closed = gradient_jaxpr(fn, args, kwargs)
    computes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    matmuls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for eqn, context, scopes, backward in walk_jaxpr(closed.jaxpr):
        if not _is_compute(eqn):
            continue
        region = innermost(scopes)
        path = "" if region is None else region.path
        if region is not None:
            computes[path].update(_floating_dtypes(eqn))
        if eqn.primitive.name in MATMUL_PRIMITIVES:
            m = matmul_info(eqn, context, scopes, backward)
            dtypes = ",".join(short_dtype_name(d) for d in m.operand_dtypes)
            if m.f32_precision is not None:
                dtypes += f"@{m.f32_precision}"
            if m.block_format is not None:
                dtypes += f"@{m.block_format}"
            if m.grouped is not None:
                dtypes += "@grouped"
            matmuls[path][dtypes] += 1
    return {
        path: RegionDtypes(
            computes=tuple(sorted(computes[path].items())),
            matmuls=tuple(sorted(matmuls[path].items())),
        )
        for path in computes.keys() | matmuls.keys()
    }
