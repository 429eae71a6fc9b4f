"""The memory traffic of a GPU step's kernels that are no matmul: what its fusions read from and
write to the GPU's memory, and that traffic's time at the memory's published bandwidth.

A matmul roofline (:attr:`mpjax.Plan.roofline_seconds`) takes everything that is no matmul as
free. Most of it is memory bound: norms, activations, casts, an fp8 or block format's
quantizations (an amax, a scale, the values rounded and packed), the Hadamard transforms of
NVFP4's recipe, the optimizer's update. XLA's GPU backend wraps almost every such operation in a
``fusion``, one kernel each, so the bytes the fusions read and write, at the memory's bandwidth,
are the time those kernels cannot take less of. A deviceless GPU compile carries no cost
analysis (XLA fills none in without a GPU), so :func:`fusion_traffic` counts the bytes from the
optimized HLO itself:

- each fusion writes its result, or only the update of a result it updates in place (a
  ``dynamic-update-slice`` root, as a scanned layer's slot of a stacked gradient), whose
  buffer it does not read;
- it reads each parameter whole, or only the parts that slices take where every use of the
  parameter is a ``slice``, ``dynamic-slice`` or ``gather``, seen through bitcasts and
  reshapes (a scanned layer's weights out of the stack, one weight out of a buffer XLA packed
  several into);
- a fusion that holds a GEMM (Triton's, cuDNN's) is the GEMM's, which the roofline counts by its
  FLOPs, and is left out;
- each counts as often as its loop runs (:func:`mpjax.planning.rows.kernel_computations`).

Caches and fusion XLA does at run time are not modelled: the count is what the kernels move
with nothing kept between them, an estimate from the compiled program, not a measurement.
Elements are counted at their bit width (e2m1 and int4 values packed two to a byte).
"""

from __future__ import annotations

import re

from mpjax.planning.hlo_text import HloComputation, HloInstruction, HloModule, HloShape
from mpjax.planning.rows import inside, kernel_computations

__all__ = ["fusion_bytes", "fusion_traffic"]

_GEMM_OPCODES = frozenset({"dot", "convolution", "custom-call", "scaled-dot"})
_SLICING = frozenset({"slice", "dynamic-slice", "gather"})
_VIEWS = frozenset({"bitcast", "reshape"})
_IN_PLACE = "dynamic-update-slice"
_BITS = re.compile(r"[a-z]*?(\d+)")


def _bits(hlo_type: str) -> int:
    """An HLO element type's width in bits: ``bf16`` 16, ``f4e2m1fn`` 4, ``pred`` 8, a token
    0."""
    if hlo_type == "pred":
        return 8
    match = _BITS.match(hlo_type)
    return int(match[1]) if match else 0


def _bytes(shapes: tuple[HloShape, ...]) -> int:
    return sum(-(-shape.size * _bits(shape.dtype) // 8) for shape in shapes)


def _users(computation: HloComputation, name: str) -> list[HloInstruction]:
    return [inst for inst in computation.instructions if name in inst.operands]


def _sliced(computation: HloComputation, name: str) -> int | None:
    """The bytes the slices of ``name`` take where every use of it is a slice (seen through
    bitcasts and reshapes, which move nothing); None where a use reads it whole."""
    users = _users(computation, name)
    if not users:
        return None
    total = 0
    for user in users:
        if user.opcode in _SLICING and user.operands[0] == name:
            total += _bytes(user.shapes)
            continue
        inner = _sliced(computation, user.name) if user.opcode in _VIEWS else None
        if inner is None:
            return None
        total += inner
    return total


def _read(computation: HloComputation, parameter: HloInstruction) -> int:
    """What a fused computation reads of one of its parameters: nothing of a buffer it updates
    in place, the slices every use takes, or the whole parameter."""
    users = _users(computation, parameter.name)
    if users and all(u.opcode == _IN_PLACE and u.operands[0] == parameter.name for u in users):
        return 0  # the buffer updated in place
    sliced = _sliced(computation, parameter.name)
    whole = _bytes(parameter.shapes)
    return whole if sliced is None else min(sliced, whole)


def _written(computation: HloComputation, root: HloInstruction) -> int:
    """What a fused computation writes: its result, or the update of a result updated in
    place, for each element of a tuple result."""
    if root.opcode == "tuple":
        parts = [computation.get(name) for name in root.operands]
        if all(part is not None for part in parts):
            return sum(_written(computation, part) for part in parts if part is not None)
    if root.opcode == _IN_PLACE:
        update = computation.operand_shape(root, 1)
        if update is not None:
            return _bytes((update,))
    return _bytes(root.shapes)


def fusion_bytes(module: HloModule, kernel: HloInstruction) -> int | None:
    """The bytes one run of the ``fusion`` instruction ``kernel`` reads and writes (the module
    docstring says how they are counted); None for a fusion that holds a GEMM, and for an
    instruction that is no fusion."""
    if kernel.opcode != "fusion":
        return None
    if any(inst.opcode in _GEMM_OPCODES for inst, _ in inside(module, kernel)):
        return None
    called = [
        module.computations[c] for c in kernel.called_computations() if c in module.computations
    ]
    if not called:
        return _bytes(kernel.shapes)
    fused = called[0]
    reads = sum(_read(fused, inst) for inst in fused.instructions if inst.opcode == "parameter")
    root = next((inst for inst in fused.instructions if inst.root), None)
    writes = _written(fused, root) if root is not None else _bytes(kernel.shapes)
    return reads + writes


def fusion_traffic(module: HloModule) -> int:
    """The bytes one call of ``module`` (an optimized GPU module) moves in its fusions that are
    no GEMM, each counted as often as its loop runs."""
    total = 0
    for where, executions in kernel_computations(module).items():
        for kernel in module.computations[where].instructions:
            moved = fusion_bytes(module, kernel)
            if moved:
                total += moved * executions
    return total
