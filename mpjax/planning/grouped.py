"""The grouped GEMMs of a plan: what a mixture of experts' ragged dots compiled to.

A grouped GEMM (:mod:`mpjax.grouped.matmul`) compiles to a kernel where the target has one:
JAX's Mosaic GPU kernels on an H100 or a B200 (``custom-call`` ``mosaic_gpu_v2``), XLA's own
ragged-dot kernel on a TPU (``tpu_custom_call`` named ``ragged-dot-none``). Where it has none,
XLA expands the ragged dot into a dense GEMM over every group: G times the FLOPs, or more. A
grouped GEMM's named scope (:func:`mpjax.grouped.matmul.scope_name`) carries its form and sizes
into the compiled program's op names, so each of these reads as one :class:`~mpjax.PlanGemm`
with its ``grouped`` form and ``model_flops``, the FLOPs the grouped GEMM needs. A
``lax.ragged_dot`` written without mpjax carries no such scope: its dense expansion is named by
its op name (``.../ragged_dot_general``), its needed FLOPs unknown. mpjax's kernels that
take each expert's tokens padded to whole blocks (the weight gradient of fp8 on Hopper and of
any dtype on Blackwell, all three fp8 GEMMs on Blackwell): how many blocks depends on the
routing, so such a kernel counts the most its operand holds, at most ``G x 127`` rows past the
model's.

A block format's experts at a capacity (:mod:`mpjax.grouped.capacity`) run as batched
block-scaled GEMMs over every expert's slots; their scope marks them ``grouped="at_capacity"``
with the ragged dot's ``model_flops``, so the summary shows what the slots' padding costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from mpjax.grouped import capacity
from mpjax.grouped.matmul import FORMS, SCOPE, kernel_refusal
from mpjax.planning.hlo_text import HloInstruction, HloModule
from mpjax.planning.rows import (
    PlanGemm,
    dtype_key,
    inside,
    kernel_computations,
    np_dtype,
    op_name_of,
)
from mpjax.planning.targets import Target
from mpjax.table import flops_text

__all__ = ["annotate_grouped", "grouped_lines", "read_grouped"]

_MOSAIC = "mosaic_gpu_v2"
_TPU_RAGGED_DOT = "ragged-dot-none"  # XLA's TPU kernel (its metadata call is ragged-dot-metadata)
_RAGGED = "ragged_dot_general"  # JAX's primitive, in the op name of what XLA made of it
AT_CAPACITY = "at_capacity"
"""The ``grouped`` form of the batched GEMMs of experts at a capacity."""


def _scoped(op_name: str) -> tuple[str, int, int, int] | None:
    """``(form, rows, k, n)`` of the grouped GEMM whose scope ``op_name`` carries, or None."""
    match = SCOPE.search(op_name)
    if match is None:
        return None
    return match["form"], int(match["rows"]), int(match["k"]), int(match["n"])


def _model_flops(rows: int, k: int, n: int) -> int:
    """A grouped GEMM's FLOPs: each of its ``rows`` meets one ``k x n`` matrix (forward and
    input gradient), or each contributes to one (weight gradient): ``2 * rows * k * n``."""
    return 2 * rows * k * n


def _kernel_row(
    inst: HloInstruction, library: str, where: str, executions: int, computation
) -> PlanGemm | None:
    """The row of a grouped-GEMM kernel, read from its scope, or for XLA's TPU kernel without
    one from its operands (the first two-dimensional operands are the token rows)."""
    if not inst.shapes:
        return None
    out = inst.shapes[0]
    op_name = op_name_of(inst)
    scoped = _scoped(op_name)
    shapes = [computation.operand_shape(inst, i) for i in range(len(inst.operands))]
    data = [s for s in shapes if s is not None and jnp.issubdtype(np_dtype(s.dtype), jnp.floating)]
    if scoped is not None:
        form, rows, k, n = scoped
    elif len(data) >= 2 and len(data[0].dims) == 2:
        rows, reduced = data[0].dims
        if len(out.dims) == 3:  # the weight gradient: [G, K, N] from [T, K] and [T, N]
            form, k, n = "weight_gradient", out.dims[1], out.dims[2]
        else:  # [T, C] times the groups' matrices into [T, O]
            form, k, n = "forward", reduced, out.dims[-1]
    else:
        return None
    lhs_dtype, rhs_dtype = (np_dtype(s.dtype) for s in (data * 2)[:2]) if data else (None, None)
    lhs_shape, rhs_shape = _per_group_shapes(form, rows, k, n)
    flops = _model_flops(rows, k, n)
    if scoped is not None and data and len(data[0].dims) == 2:
        # mpjax's padded kernels take each group's tokens in whole blocks: their token operand
        # holds the most rows they can (``pad_groups``): [M', K] (or [K, M']), [M', N] for
        # the input gradient.
        padded = sum(data[0].dims) - (n if form == "input_gradient" else k)
        flops = _model_flops(max(padded, rows), k, n)
    return PlanGemm(
        name=inst.name,
        computation=where,
        library=library,
        lhs_dtype=lhs_dtype or np_dtype(out.dtype),
        rhs_dtype=rhs_dtype or np_dtype(out.dtype),
        out_dtype=np_dtype(out.dtype),
        flops=flops,
        executions=executions,
        lhs_shape=lhs_shape,
        rhs_shape=rhs_shape,
        op_name=op_name,
        grouped=form,
        model_flops=_model_flops(rows, k, n),
    )


def read_grouped(module: HloModule) -> tuple[PlanGemm, ...]:
    """The grouped-GEMM kernels of ``module``: Mosaic GPU kernels that carry a grouped GEMM's
    scope (library ``"mosaic"``) and XLA's TPU ragged-dot kernels (library ``"mxu"``), alone
    or inside a fusion (XLA fuses a kernel in a loop with the slicing of its operands)."""
    rows = []
    for where, executions in kernel_computations(module).items():
        for kernel in module.computations[where].instructions:
            if kernel.opcode == "custom-call":
                found = [(kernel, where)]
            elif kernel.opcode == "fusion":
                found = list(inside(module, kernel))
            else:
                continue
            for inst, holder in found:
                target = inst.custom_call_target or ""
                if target == _MOSAIC and _scoped(op_name_of(inst)) is not None:
                    library = "mosaic"
                elif target == "tpu_custom_call" and inst.name.startswith(_TPU_RAGGED_DOT):
                    library = "mxu"
                else:
                    continue
                row = _kernel_row(inst, library, where, executions, module.computations[holder])
                if row is not None:
                    rows.append(dataclasses.replace(row, name=kernel.name))
    return tuple(rows)


def annotate_grouped(gemms: Sequence[PlanGemm]) -> tuple[PlanGemm, ...]:
    """``gemms`` with the dense GEMMs XLA made of ragged dots marked: their ``grouped`` form
    and ``model_flops`` where a grouped GEMM's scope says them, ``grouped="ragged_dot"`` (and
    no model FLOPs) for a ``lax.ragged_dot`` written without mpjax."""
    marked = []
    for g in gemms:
        scoped = _scoped(g.op_name)
        at_capacity = capacity.SCOPE.search(g.op_name)
        if at_capacity is not None:
            rows, k, n = (int(at_capacity[key]) for key in ("rows", "k", "n"))
            g = dataclasses.replace(g, grouped=AT_CAPACITY, model_flops=_model_flops(rows, k, n))
        elif scoped is not None:
            form, rows, k, n = scoped
            g = dataclasses.replace(g, grouped=form, model_flops=_model_flops(rows, k, n))
        elif g.op_name.rsplit("/", 1)[-1].startswith(_RAGGED):
            g = dataclasses.replace(g, grouped="ragged_dot")
        marked.append(g)
    return tuple(marked)


def grouped_lines(gemms: Sequence[PlanGemm], target: Target | None) -> list[str]:
    """A plan's summary of its grouped GEMMs: those that run as kernels, and the dense GEMMs
    XLA expanded ragged dots into, with the FLOPs they waste and why no kernel took them."""
    batched = [g for g in gemms if g.grouped == AT_CAPACITY]
    gemms = [g for g in gemms if g.grouped != AT_CAPACITY]
    kernels = [g for g in gemms if g.grouped and g.library in ("mosaic", "mxu")]
    dense = [g for g in gemms if g.grouped and g.library not in ("mosaic", "mxu")]
    lines = []
    if batched and all(g.model_flops for g in batched):
        runs = sum(g.executions for g in batched)
        flops = sum(g.flops * g.executions for g in batched)
        work = sum((g.model_flops or 0) * g.executions for g in batched)
        scaled = sum(g.flops * g.executions for g in batched if g.block_scaled)
        lines.append(
            f"experts at a capacity: {runs} batched GEMM run{'s' * (runs != 1)}, "
            f"{flops_text(flops)} FLOPs for {flops_text(work)} of work (every slot "
            f"multiplied: {flops / work:.2f}x), {scaled / flops:.1%} of them block-scaled"
        )
    if kernels:
        runs = sum(g.executions for g in kernels)
        flops = sum(g.flops * g.executions for g in kernels)
        by_dtype: dict[str, int] = {}
        for g in kernels:
            key = dtype_key(g.lhs_dtype, g.rhs_dtype)
            by_dtype[key] = by_dtype.get(key, 0) + g.flops * g.executions
        shares = ", ".join(
            f"{key} {n / flops:.1%}" for key, n in sorted(by_dtype.items(), key=lambda kv: -kv[1])
        )
        work = sum((g.model_flops or g.flops) * g.executions for g in kernels)
        padded = (
            f" at most for {flops_text(work)} of work, each expert's tokens padded to whole "
            "blocks where a kernel contracts over them;"
            if flops > work
            else ","
        )
        lines.append(
            f"grouped GEMMs: {runs} kernel run{'s' * (runs != 1)} ({flops_text(flops)} "
            f"FLOPs{padded} each token against its own expert only; {shares})"
        )
    by_form: dict[tuple[str, str], list[PlanGemm]] = {}
    capability = target.chip.compute_capability if target is not None else None
    for g in dense:
        reason = None
        shapes = _operand_shapes(g)
        if capability is not None and shapes is not None and g.grouped in FORMS:
            lhs, rhs = shapes
            reason = kernel_refusal(capability[0], g.grouped, lhs, rhs, np.dtype(g.lhs_dtype))
        by_form.setdefault((g.grouped or "", reason or ""), []).append(g)
    for (form, reason), group in by_form.items():
        runs = sum(g.executions for g in group)
        flops = sum(g.flops * g.executions for g in group)
        known = [g.model_flops * g.executions for g in group if g.model_flops is not None]
        needed = f" for {flops_text(sum(known))} of work" if len(known) == len(group) else ""
        lines.append(
            f"grouped GEMMs expanded dense by XLA: {form}, {runs} run{'s' * (runs != 1)}, "
            f"{flops_text(flops)} FLOPs{needed}" + (f" ({reason})" if reason else "")
        )
    return lines


def _per_group_shapes(form: str, rows: int, k: int, n: int) -> tuple[tuple[int, ...], ...]:
    """A grouped GEMM's operands as a plan shows them: the token rows, and one group's matrix
    (``(k, n)``; the output gradient ``(rows, n)`` for the weight gradient)."""
    if form == "forward":
        return (rows, k), (k, n)
    if form == "input_gradient":
        return (rows, n), (k, n)
    return (rows, k), (rows, n)


def _operand_shapes(g: PlanGemm) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The grouped GEMM's operand shapes as :func:`~mpjax.grouped.matmul.kernel_refusal`
    takes them (one group for the weights), from its scope's sizes; None for a GEMM whose op
    name carries no grouped GEMM's scope (a ``lax.ragged_dot`` written without mpjax)."""
    scoped = _scoped(g.op_name)
    if scoped is None:
        return None
    form, rows, k, n = scoped
    if form == "weight_gradient":
        return (rows, k), (rows, n)
    return ((rows, n) if form == "input_gradient" else (rows, k)), (1, k, n)
