"""What a sharded step sends between devices: the collectives of an optimized HLO module, as rows
of a plan (:class:`PlanCollective`), each with its kind, dtype, bytes per device and what it
carries.

XLA's SPMD partitioner writes the communication a sharding implies as collectives: an FSDP
step all-gathers each sharded parameter before its matmuls and reduce-scatters its gradient
after them; data parallelism all-reduces gradients. A GPU compile writes them as instructions
(``all-gather-start``, ``all-reduce``, ``reduce-scatter``...), or wraps them in ``async-start``
computations; a TPU compile also fuses a reduce-scatter into a ``fusion`` whose computation
holds the ``all-reduce`` (``%all-reduce-scatter.3``). Each keeps the JAX op name of the
operation it serves, whose precision regions name the module (:mod:`mpjax.casting.regions`):
``h3/attn/qkv``, in the backward pass for a gradient.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

import numpy as np

from mpjax.casting import regions
from mpjax.planning.hlo_text import HloComputation, HloInstruction, HloModule, HloShape
from mpjax.planning.rows import bytes_text, kernel_computations, np_dtype, op_name_of

__all__ = [
    "COLLECTIVE_KINDS",
    "PlanCollective",
    "bytes_by_kind",
    "read_collectives",
    "seconds_bound",
    "table_rows",
]

COLLECTIVE_KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)
"""The kinds of :class:`PlanCollective`, in the order a plan lists them."""

# HLO opcodes of collectives (their ``-start`` halves for the asynchronous ones; the ``-done``
# halves move nothing more), by kind.
_OPCODES = {
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "reduce-scatter-start": "reduce-scatter",
    "all-to-all": "all-to-all",
    "all-to-all-start": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}
_IOTA_GROUPS = re.compile(r"^\[(?P<dims>[\d,]+)\]<=\[")
_MESH_GROUPS = re.compile(r"^mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<over>[^}]*)\}")


@dataclasses.dataclass(frozen=True)
class PlanCollective:
    """One collective of a :class:`~mpjax.Plan`: data moved between devices.

    Attributes:
      name: the HLO instruction that runs it (the collective, or the fusion that holds it).
      computation: the HLO computation holding that instruction.
      kind: one of :data:`COLLECTIVE_KINDS`.
      dtype: the dtype of the data it moves.
      bytes: per device and execution, the size of the array it assembles or reduces: the
        gathered result of an all-gather, the operand of a reduce-scatter or an all-reduce,
        what a permute or an all-to-all sends. On a ring over ``devices`` devices each device
        sends ``(devices - 1) / devices`` of that (twice for an all-reduce).
      devices: how many devices each group of the collective spans (2 for a permute).
      executions: how many times one call runs it (loop trip counts included).
      op_name: the JAX op name of the operation it serves.
      modules: the paths of the modules whose values it carries (``"h3/attn/qkv"``), from its
        own op name, or for a collective XLA combined from several (one all-gather of many
        parameters), from the operations that produce its operands; empty where they are
        outside any module's precision region.
    """

    name: str
    computation: str
    kind: str
    dtype: np.dtype
    bytes: int
    devices: int
    executions: int
    op_name: str = ""
    modules: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        """The first of ``modules`` (``""`` if none)."""
        return self.modules[0] if self.modules else ""

    @property
    def modules_text(self) -> str:
        """``modules`` for a table: the first three, and how many more."""
        more = len(self.modules) - 3
        return ", ".join(self.modules[:3]) + (f" and {more} more" if more > 0 else "") or "-"

    @property
    def backward(self) -> bool:
        """Whether it serves the backward pass (a gradient's reduction, mostly)."""
        return "transpose(" in self.op_name

    @property
    def total_bytes(self) -> int:
        """``bytes`` times ``executions``: per device and call."""
        return self.bytes * self.executions

    @property
    def wire_bytes(self) -> int:
        """What each device sends for it per call, on a ring over its group of ``n``: ``(n -
        1) / n`` of ``total_bytes`` for a gather, a scatter or an all-to-all, twice that for an
        all-reduce (a reduce-scatter, then a gather), all of it for a permute."""
        if self.kind == "collective-permute":
            return self.total_bytes
        share = (self.devices - 1) / self.devices if self.devices > 1 else 0.0
        return round(self.total_bytes * share * (2 if self.kind == "all-reduce" else 1))


def bytes_by_kind(collectives: Sequence[PlanCollective]) -> dict[str, int]:
    """``total_bytes`` summed by kind and dtype (``"all-gather bfloat16"``), in the order of
    :data:`COLLECTIVE_KINDS`."""
    totals: dict[str, int] = {}
    for c in sorted(collectives, key=lambda c: COLLECTIVE_KINDS.index(c.kind)):
        key = f"{c.kind} {c.dtype.name}"
        totals[key] = totals.get(key, 0) + c.total_bytes
    return totals


def seconds_bound(collectives: Sequence[PlanCollective], bandwidth: float) -> float:
    """A lower bound on the time ``collectives`` take: what each device sends
    (:attr:`PlanCollective.wire_bytes`) at its chip's whole interconnect ``bandwidth``, none of
    it overlapped. A bound computed from the plan, not a measurement."""
    return sum(c.wire_bytes for c in collectives) / bandwidth


def table_rows(
    collectives: Sequence[PlanCollective], bandwidth: float, estimate: float | None
) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The header and rows of a plan's table of collectives; with an interconnect
    ``bandwidth`` each row's time bound (:func:`seconds_bound`), and with an ``estimate`` of
    the step's time, the bound's share of it."""
    header: tuple[str, ...] = ("collective", "kind", "dtype", "bytes", "devices", "module")
    header += ("pass", "runs")
    timed = bandwidth > 0
    if timed:
        header += ("time bound",) + (("of the estimate",) if estimate else ())
    rows = []
    for c in collectives:
        row: tuple[str, ...] = (
            c.name,
            c.kind,
            c.dtype.name,
            bytes_text(c.bytes),
            str(c.devices),
            c.modules_text,
            "backward" if c.backward else "forward",
            str(c.executions),
        )
        if timed:
            bound = seconds_bound([c], bandwidth)
            row += (f"{bound * 1e3:.3g} ms",) + ((f"{bound / estimate:.1%}",) if estimate else ())
        rows.append(row)
    return header, rows


def _array_bytes(shape: HloShape) -> int:
    return shape.size * np_dtype(shape.dtype).itemsize


def _group_size(inst: HloInstruction) -> int:
    """How many devices each of ``inst``'s groups spans, from its ``replica_groups``: listed
    (``{{0,1,2,3}}``), an iota (``[2,4]<=[8]``: groups of 4) or mesh axes
    (``mesh['data'=2,'fsdp'=4] {'fsdp'}``: the named axes' sizes multiplied)."""
    if inst.attribute("source_target_pairs") is not None:
        return 2
    groups = (inst.attribute("replica_groups") or "").strip()
    mesh = _MESH_GROUPS.match(groups)
    if mesh is not None:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh["axes"])}
        return math.prod(sizes.get(name, 1) for name in re.findall(r"'([^']+)'", mesh["over"]))
    iota = _IOTA_GROUPS.match(groups)
    if iota is not None:
        return int(iota["dims"].split(",")[-1])
    first = re.match(r"\{\{([\d,]*)\}", groups)
    if first is not None and first[1]:
        return len(first[1].split(","))
    return 1


def _row(
    inst: HloInstruction,
    computation: HloComputation,
    kind: str,
    *,
    name: str,
    where: str,
    executions: int,
    op_name: str,
) -> list[PlanCollective]:
    """The rows of one collective: one per dtype it moves (XLA combines the collectives of
    several values into one, of several dtypes: an all-gather of f32 norms and int32
    positions), each with the modules of the values of that dtype."""
    n = len(inst.operands)
    operands = [computation.operand_shape(inst, i) for i in range(n)]
    results = list(inst.shapes)
    if inst.opcode.endswith("-start") and results:
        # An async start's shape is ((operands...), (results...), context...): the results
        # follow the copies of the operands.
        results = results[n : 2 * n] if len(results) >= 2 * n else [max(results, key=_array_bytes)]
    producers = [computation.get(operand) for operand in inst.operands]
    if n > 1 and len(results) == n and all(s is not None for s in operands):
        # Combined: value i is operand i and result i, of the module that produced it.
        values = [
            ([s, r], regions.module_path_in_op_name(op_name_of(p)) if p else "")
            for s, r, p in zip(operands, results, producers)
            if s is not None
        ]
    else:
        arrays = [s for s in operands if s is not None] + results
        if not arrays:
            return []
        modules = [regions.module_path_in_op_name(op_name)]
        if n > 1:
            modules = [regions.module_path_in_op_name(op_name_of(p)) for p in producers if p]
        sent = sum(_array_bytes(s) for s in operands if s is not None)
        widest = max(arrays, key=_array_bytes)
        row = PlanCollective(
            name=name,
            computation=where,
            kind=kind,
            dtype=np_dtype(widest.dtype),
            bytes=max(sent, sum(map(_array_bytes, results))),
            devices=_group_size(inst),
            executions=executions,
            op_name=op_name,
            modules=tuple(dict.fromkeys(m for m in modules if m)),
        )
        return [row]
    by_dtype: dict[np.dtype, tuple[int, list[str]]] = {}
    for pair, module in values:
        widest = max(pair, key=_array_bytes)
        dtype = np_dtype(widest.dtype)
        total, modules = by_dtype.get(dtype, (0, []))
        by_dtype[dtype] = (total + _array_bytes(widest), [*modules, module])
    return [
        PlanCollective(
            name=name,
            computation=where,
            kind=kind,
            dtype=dtype,
            bytes=total,
            devices=_group_size(inst),
            executions=executions,
            op_name=op_name,
            modules=tuple(dict.fromkeys(m for m in modules if m)),
        )
        for dtype, (total, modules) in by_dtype.items()
    ]


def _fused(module: HloModule, fusion: HloInstruction) -> Iterator[HloInstruction]:
    for callee in fusion.called_computations():
        if callee in module.computations:
            for inst in module.computations[callee].instructions:
                if inst.opcode in _OPCODES:
                    yield inst


def read_collectives(module: HloModule) -> tuple[PlanCollective, ...]:
    """The collectives one call of the optimized ``module`` runs, in HLO order."""
    rows: list[PlanCollective] = []
    for where, executions in kernel_computations(module).items():
        computation = module.computations[where]
        for inst in computation.instructions:
            if inst.opcode in _OPCODES:
                found = _row(
                    inst,
                    computation,
                    _OPCODES[inst.opcode],
                    name=inst.name,
                    where=where,
                    executions=executions,
                    op_name=op_name_of(inst),
                )
            elif inst.opcode == "fusion" and (inner := next(_fused(module, inst), None)):
                # A TPU fusion around a collective: what crosses devices is the fusion's input
                # and output; a reduction whose output is smaller than its input scatters it.
                kind = _OPCODES[inner.opcode]
                found = _row(
                    inst,
                    computation,
                    kind,
                    name=inst.name,
                    where=where,
                    executions=executions,
                    op_name=op_name_of(inst) or op_name_of(inner),
                )
                if kind == "all-reduce" and _smaller_output(inst, computation):
                    found = [dataclasses.replace(row, kind="reduce-scatter") for row in found]
                found = [dataclasses.replace(row, devices=_group_size(inner)) for row in found]
            else:
                continue
            rows.extend(found)
    return tuple(rows)


def _smaller_output(inst: HloInstruction, computation: HloComputation) -> bool:
    operand = computation.operand_shape(inst, 0)
    if operand is None or not inst.shapes:
        return False
    return inst.shapes[0].size < operand.size
