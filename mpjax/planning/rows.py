"""What an optimized HLO module runs and holds, as the parts of a plan: its GEMMs with their
operand dtypes and precision, fused attention kernels and scatters, read from XLA's text for a
GPU or a TPU, and the memory XLA's analysis of the compile reports (:class:`PlanMemory`).

A GPU compile wraps each GEMM in a Triton or cuDNN fusion or a cuBLAS custom call, a
block-scaled GEMM (``jax.nn.scaled_dot_general`` on a Blackwell GPU) in cuDNN's
``__cudnn$blockScaledDot`` custom call, and fused attention in a cuDNN custom call; a TPU
compile runs matmuls as ``dot`` or ``convolution`` instructions (a batched matmul is written as
a convolution whose batch dimensions are dilated windows) on its matrix units, and Pallas
kernels as ``tpu_custom_call``. :func:`read_module` turns either into the fields of a
:class:`~mpjax.Plan`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpjax.planning.hlo_text import HloComputation, HloInstruction, HloModule, HloShape
from mpjax.planning.targets import Target
from mpjax.table import flops_text

__all__ = [
    "LIBRARIES",
    "PlanAttention",
    "PlanGemm",
    "PlanMemory",
    "PlanScatter",
    "block_scaled_lines",
    "bytes_text",
    "dtype_key",
    "inside",
    "kernel_computations",
    "loop_trip_counts",
    "memory_of",
    "np_dtype",
    "op_name_of",
    "out_of_memory",
    "read_module",
    "trip_count",
]

LIBRARIES = (
    "cublaslt",
    "cublaslt_fp8",
    "cublas",
    "triton",
    "cudnn",
    "cudnn_block_scaled",
    "xla",
    "mxu",
    "mosaic",
)
"""What runs a :class:`PlanGemm`: on a GPU cuBLASLt (``__cublas$lt$matmul``), its fp8 form
(``__cublas$lt$matmul$f8``), legacy cuBLAS (``__cublas$gemm``), a Triton GEMM fusion, a cuDNN
GEMM fusion, cuDNN's block-scaled GEMM (``__cudnn$blockScaledDot``), XLA's own emitter (a
``dot`` left in place or inside an ordinary fusion) or a Pallas Mosaic GPU kernel (a grouped
GEMM, :mod:`mpjax.planning.grouped`); on a TPU its matrix units (``"mxu"``)."""

_BLOCK_SCALED_DOT = "__cudnn$blockScaledDot"
# ``jax.nn.scaled_dot_general``'s block-scaled matmul in an HLO op name: the operation
# (``.../scaled_matmul``, ``scaled_matmul_wrapper`` in some JAX versions) or the function JAX
# wraps it in (``.../jit(_scaled_matmul)/dot_general`` where it lowers it to a dot, on a TPU).
_SCALED_MATMUL = re.compile(r"(?<!\w)_?scaled_matmul(?:_wrapper)?(?!\w)")

_HBM_OOM = re.compile(
    r"required for HLO temporaries \((?P<need>[\d.]+)(?P<unit>[KMGT]?)\) exceeds available "
    r"HBM \((?P<have>[\d.]+)(?P<unit2>[KMGT]?)\)"
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# Instructions whose called computations run as part of the caller's own sequence of kernels;
# every other called computation (a fusion's body, a reducer) runs inside one kernel.
# A TPU7x runs its collectives on its SparseCores, in computations a call-start launches.
_CONTROL_FLOW = frozenset({"while", "conditional", "call", "async-start", "call-start"})
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_HLO_DTYPES = {"pred": "bool", "bf16": "bfloat16", "c64": "complex64", "c128": "complex128"}
# Words in a TPU custom call's JAX name that make it an attention kernel (Pallas's flash and
# splash attention, and mpjax's own).
_TPU_ATTENTION = re.compile(r"flash|splash|attention|mha", re.IGNORECASE)
_TPU_BACKWARD = re.compile(r"bwd|backward|transpose\(", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class PlanGemm:
    """One GEMM (a matmul kernel) of a :class:`~mpjax.Plan`.

    Attributes:
      name: the HLO instruction that launches it (a fusion or a custom call).
      computation: the HLO computation holding that instruction (the entry computation, or a
        loop body).
      library: what runs it: on a GPU ``"cublaslt"`` (``__cublas$lt$matmul``),
        ``"cublaslt_fp8"`` (``__cublas$lt$matmul$f8``), ``"cublas"`` (legacy
        ``__cublas$gemm``), ``"triton"`` (a Triton GEMM fusion), ``"cudnn"`` (a cuDNN GEMM
        fusion), ``"cudnn_block_scaled"`` (cuDNN's block-scaled GEMM,
        ``__cudnn$blockScaledDot``) or ``"xla"`` (a ``dot`` XLA emits itself, alone or inside
        an ordinary fusion); on a TPU ``"mxu"`` (a ``dot`` or ``convolution`` XLA runs on the
        matrix units); :data:`LIBRARIES` lists them.
      lhs_dtype: the left operand's dtype, as the GEMM reads it; for a block-scaled GEMM its
        data's (``float8_e4m3fn`` for MXFP8, ``float4_e2m1fn`` for NVFP4), not its scales'.
      rhs_dtype: the right operand's dtype.
      out_dtype: the dtype it writes. A GEMM that XLA splits along its contracted dimension
        (split-K, common for weight gradients) writes float32 partial sums, which a following
        fusion adds and converts: its operands then show the split as an extra dimension.
      flops: ``2 * prod(output dims) * prod(contracted dims)``, for one execution; for a
        block-scaled GEMM, whose data operands are ``(B, M, K)`` and ``(B, N, K)``,
        ``2 * B * M * N * K``; for a TPU ``convolution``, two per multiply-add of a window tap
        that reads real input (a batched matmul's batch windows sum over nothing; a padded
        border reads less).
      executions: how many times one call of the function runs it: the product of the trip
        counts XLA knows for the loops around it (1 outside loops, and for a loop whose trip
        count XLA does not know).
      lhs_shape: the left operand's shape.
      rhs_shape: the right operand's shape.
      op_name: the JAX name of the operation it came from (``"jit(step)/.../dot_general"``),
        when the HLO carries one.
      precision: how float32 operands are multiplied, as the HLO says: ``"default"`` (the
        platform's fastest: TF32 on an Ampere or Hopper GPU, one bf16 pass on a TPU),
        ``"high"`` (TF32 on a GPU, three bf16 passes on a TPU) or ``"highest"`` (true float32 on
        a GPU, six bf16 passes on a TPU), or the dot algorithm the HLO names
        (``"dot_f32_f32_f32"``). Operands narrower than float32 ignore it.
      block_scaled: whether it is a block-scaled GEMM, multiplying blocks of its operands by
        their scales in the kernel (library ``"cudnn_block_scaled"``).
      scale_dtype: a block-scaled GEMM's scales' dtype (``float8_e8m0fnu`` for MXFP8,
        ``float8_e4m3fn`` for NVFP4); None for any other GEMM.
      grouped: for a mixture of experts' grouped GEMM, its form (``"forward"``,
        ``"input_gradient"``, ``"weight_gradient"``), or ``"ragged_dot"`` for a dense GEMM XLA
        made of a ``lax.ragged_dot`` written without mpjax; None for any other GEMM
        (:mod:`mpjax.planning.grouped`).
      model_flops: for a grouped GEMM, the FLOPs it needs (each row against its own group's
        matrix): ``flops`` for a kernel, less than ``flops`` for a dense expansion. None where
        not known.
    """

    name: str
    computation: str
    library: str
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    out_dtype: np.dtype
    flops: int
    executions: int = 1
    lhs_shape: tuple[int, ...] = ()
    rhs_shape: tuple[int, ...] = ()
    op_name: str = ""
    precision: str = "default"
    block_scaled: bool = False
    scale_dtype: np.dtype | None = None
    grouped: str | None = None
    model_flops: int | None = None

    @property
    def emulated_block_scaled(self) -> bool:
        """Whether it is an ordinary GEMM that a block-scaled matmul
        (``jax.nn.scaled_dot_general``'s ``scaled_matmul``) became: its operands dequantized
        and multiplied in a wider dtype, as XLA does where the target has no block-scaled GEMM
        kernel (before Blackwell, on a TPU). Read from the HLO's op name."""
        return not self.block_scaled and bool(_SCALED_MATMUL.search(self.op_name))


@dataclasses.dataclass(frozen=True)
class PlanAttention:
    """One fused attention kernel of a :class:`~mpjax.Plan`: a cuDNN ``__cudnn$fmha*`` custom
    call on a GPU, a Pallas flash-attention kernel (``tpu_custom_call``) on a TPU.

    Attributes:
      name: the HLO instruction.
      target: the custom-call target, for example ``"__cudnn$fmhaSoftmax"`` or
        ``"__cudnn$fmhaSoftmaxBackward"`` (variants name dropout, scale, bias or mask), or
        ``"tpu_custom_call"``.
      backward: whether it is the backward pass.
      dtype: the dtype of the queries.
      flops: nominal matmul FLOPs for one execution, from the query and key shapes: two
        GEMMs forward (``4*B*H*Tq*Tk*D``), four backward (``8*B*H*Tq*Tk*D``, split evenly
        where the backward pass is two kernels, as Pallas's is). A causal or other mask is not
        discounted, and the backward pass's recomputation of the scores not added.
      executions: as for :class:`PlanGemm`.
      op_name: as for :class:`PlanGemm`.
      declares_cost: whether the kernel declares its cost to XLA's cost model, which counts
        a custom call only by what it declares: Pallas's forward kernel does, its two backward
        kernels do not, so a TPU estimate leaves their time out
        (``Plan.uncosted_seconds``). True for cuDNN's calls (a GPU plan has no
        estimate).
    """

    name: str
    target: str
    backward: bool
    dtype: np.dtype
    flops: int
    executions: int = 1
    op_name: str = ""
    declares_cost: bool = True


@dataclasses.dataclass(frozen=True)
class PlanScatter:
    """One scatter of a :class:`~mpjax.Plan` (an embedding gradient's scatter-add, for one).

    Attributes:
      name: the HLO instruction that launches it (usually an ``input_scatter_fusion``).
      computation: the computation holding that instruction.
      dtype: the dtype of the array scattered into: the dtype the updates accumulate in.
      executions: as for :class:`PlanGemm`.
      op_name: as for :class:`PlanGemm`.
    """

    name: str
    computation: str
    dtype: np.dtype
    executions: int = 1
    op_name: str = ""


def np_dtype(hlo_type: str) -> np.dtype:
    """The NumPy dtype of an HLO element type: ``bf16`` -> bfloat16, ``f8e4m3fn`` ->
    float8_e4m3fn."""
    name = _HLO_DTYPES.get(hlo_type)
    if name is None:
        match = re.fullmatch(r"([fsu])(\d+)(.*)", hlo_type)
        if match is None:
            raise ValueError(f"unknown HLO element type {hlo_type!r}")
        kind = {"f": "float", "s": "int", "u": "uint"}[match[1]]
        name = f"{kind}{match[2]}" + (f"_{match[3]}" if match[3] else "")
    return np.dtype(jnp.dtype(name))


def _dims(value: str | None) -> tuple[int, ...]:
    """``"{1,2}"`` as ``(1, 2)``."""
    return tuple(int(d) for d in (value or "").strip("{}").split(",") if d.strip())


def _prod(values: Any) -> int:
    return math.prod(int(v) for v in values)


def op_name_of(inst: HloInstruction) -> str:
    """The JAX op name in ``inst``'s metadata (``"jit(step)/.../dot_general"``), or ``""``."""
    match = _OP_NAME.search(inst.attribute("metadata") or "")
    return match[1] if match else ""


def _fusion_kind(inst: HloInstruction) -> str:
    """A fusion's backend kind (``"__triton_gemm"``, ``"__cudnn$fusion"``), or ``""``."""
    config = inst.backend_config().get("fusion_backend_config", {})
    return str(config.get("kind", "")) if isinstance(config, dict) else ""


def _fusion_library(kind: str) -> str:
    if "triton" in kind:
        return "triton"
    if "cudnn" in kind:
        return "cudnn"
    return "xla"


def _cublas_library(target: str) -> str:
    if target.startswith("__cublas$lt$matmul$f8"):
        return "cublaslt_fp8"
    if target.startswith("__cublas$lt$matmul"):
        return "cublaslt"
    return "cublas"


def trip_count(module: HloModule, computation: HloComputation, loop: HloInstruction) -> int:
    """How many times the ``while`` instruction ``loop`` of ``computation`` runs its body: the
    count a GPU compile writes in its backend config, or, as a TPU compile writes none, read
    from its condition, ``counter < N`` on an element of the loop's tuple, less the counter's
    initial constant (0 when it is not a constant in sight, as JAX's scans and fori_loops
    start). 1 when neither says."""
    count = loop.backend_config().get("known_trip_count", {})
    if isinstance(count, dict) and "n" in count:
        return int(count["n"])
    condition = module.computations.get((loop.attribute("condition") or "").lstrip("%"))
    if condition is None:
        return 1
    root = next((i for i in condition.instructions if i.root), None)
    if root is None or root.opcode != "compare" or root.attribute("direction") != "LT":
        return 1
    counter, bound = (condition.get(name) for name in root.operands[:2])
    if counter is None or bound is None or counter.opcode != "get-tuple-element":
        return 1
    limit = _constant(bound)
    if limit is None:
        return 1
    start: int | None = None
    init = computation.get(loop.operands[0]) if loop.operands else None
    index = int(counter.attribute("index") or -1)
    if init is not None and init.opcode == "tuple" and 0 <= index < len(init.operands):
        source = computation.get(init.operands[index])
        start = _constant(source) if source is not None else None
    return max(limit - (start or 0), 1)


def _constant(inst: HloInstruction) -> int | None:
    """The value of an integer scalar ``constant``, else None."""
    if inst.opcode != "constant" or not re.fullmatch(r"-?\d+", inst.literal):
        return None
    return int(inst.literal)


def loop_trip_counts(module: HloModule) -> tuple[int, ...]:
    """The trip count (:func:`trip_count`) of each loop the program wrote that one call of
    ``module`` reaches, in HLO order: JAX's ``while`` (a ``scan``, a ``fori_loop``), not the
    loops XLA makes itself (a matmul split into steps over collective permutes, whose op name
    is the matmul's)."""
    return tuple(
        trip_count(module, module.computations[where], inst)
        for where in kernel_computations(module)
        for inst in module.computations[where].instructions
        if inst.opcode == "while" and op_name_of(inst).rsplit("/", 1)[-1] == "while"
    )


def kernel_computations(module: HloModule) -> dict[str, int]:
    """The computations that launch kernels, each with how many times one call runs it:
    the entry, and what its loops, conditionals and calls run (a while body times its trip
    count, :func:`trip_count`)."""
    executions = {module.entry: 1}
    todo = [module.entry]
    while todo:
        computation = module.computations[todo.pop()]
        for inst in computation.instructions:
            if inst.opcode not in _CONTROL_FLOW:
                continue
            times = trip_count(module, computation, inst) if inst.opcode == "while" else 1
            for callee in inst.called_computations():
                if callee in module.computations and callee not in executions:
                    executions[callee] = executions[computation.name] * times
                    todo.append(callee)
    return executions


def inside(module: HloModule, inst: HloInstruction) -> list[tuple[HloInstruction, str]]:
    """Every instruction of the computations ``inst`` calls, nested calls included, with the
    name of the computation holding it."""
    found = []
    seen: set[str] = set()
    todo = list(inst.called_computations())
    while todo:
        name = todo.pop(0)
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        for inner in module.computations[name].instructions:
            found.append((inner, name))
            todo += inner.called_computations()
    return found


def _precision(inst: HloInstruction) -> str:
    """How ``inst`` (a ``dot``, ``convolution`` or cuBLAS call) multiplies float32 operands:
    its dot algorithm if it names one, else its operand precision (``"default"`` when
    unset)."""
    algorithm = inst.attribute("algorithm")
    if algorithm and algorithm != "alg_unset":
        return algorithm
    precision = (inst.attribute("operand_precision") or "").strip("{}").split(",")
    config = inst.backend_config().get("gemm_backend_config", {})
    if isinstance(config, dict) and isinstance(config.get("precision_config"), dict):
        precision_config = config["precision_config"]
        algorithm = str(precision_config.get("algorithm", "ALG_UNSET")).lower()
        if algorithm != "alg_unset":
            return algorithm
        precision = [str(p) for p in precision_config.get("operand_precision", ())]
    levels = ("default", "high", "highest")
    named = [p.strip().lower() for p in precision if p.strip().lower() in levels]
    return max(named, key=levels.index) if named else "default"


def _window_taps(
    size: int, outputs: int, window: int, stride: int, low: int, base: int, dilation: int
) -> int:
    """How many (output position, window tap) pairs of one spatial dimension of a convolution
    read a real input element, not padding or a hole of the dilated base: the input's ``size``
    elements sit at every ``base``-th position after ``low`` positions of padding, and output
    position ``o`` reads positions ``o * stride + j * dilation`` for ``j`` below ``window``."""
    extent = (size - 1) * base + 1
    taps = np.arange(window) * dilation
    total = 0
    for start in range(-low, outputs * stride - low, stride):
        at = start + taps
        total += int(np.count_nonzero((at >= 0) & (at < extent) & (at % base == 0)))
    return total


def _window_values(window: str, key: str, rank: int, default: int) -> list[int] | None:
    found = re.search(rf"\b{key}=([-0-9_x]+)", window)
    if found is None:
        return [default] * rank
    values = found[1].split("x")
    if len(values) != rank:
        return None
    return [int(v.split("_")[0]) for v in values]


def _convolution_flops(
    inst: HloInstruction, lhs: HloShape, rhs: HloShape, out: HloShape
) -> int | None:
    """The FLOPs of a ``convolution``: two per multiply-add, each output element multiplying
    its input features by every window tap that reads a real input element. XLA's TPU compiler
    writes a batched matmul as a convolution whose batch dimensions are windows over a dilated
    or padded base (``window={size=16x4 stride=15x3 lhs_dilate=16x4}``, or ``size=2x4
    stride=2x4 pad=1_1x3_3 lhs_dilate=1x3`` in a transpose): each output element of such a
    dimension meets one real tap, so it sums over nothing there. None when the dimension labels
    or the window do not parse."""
    labels = re.fullmatch(r"([0-9bf]+)_([0-9io]+)->([0-9bf]+)", inst.attribute("dim_labels") or "")
    if labels is None or [len(g) for g in labels.groups()] != [
        len(lhs.dims),
        len(rhs.dims),
        len(out.dims),
    ]:
        return None
    lhs_labels, rhs_labels, out_labels = labels.groups()
    rank = sum(label.isdigit() for label in lhs_labels)
    window = inst.attribute("window") or ""
    fields = [
        values
        for key, default in (("stride", 1), ("pad", 0), ("lhs_dilate", 1), ("rhs_dilate", 1))
        if (values := _window_values(window, key, rank, default)) is not None
    ]
    if len(fields) != 4:
        return None
    strides, lows, bases, dilations = fields
    summed = rhs.dims[rhs_labels.index("i")]
    outputs = out.size
    for dim in range(rank):
        label = str(dim)
        size = lhs.dims[lhs_labels.index(label)]
        width = rhs.dims[rhs_labels.index(label)]
        positions = out.dims[out_labels.index(label)]
        taps = _window_taps(
            size, positions, width, strides[dim], lows[dim], bases[dim], dilations[dim]
        )
        summed *= taps
        outputs //= positions
    return 2 * outputs * summed


def _gemm(
    computation: HloComputation,
    inst: HloInstruction,
    contracting: tuple[int, ...] | None,
    name: str,
    where: str,
    library: str,
    executions: int,
) -> PlanGemm | None:
    """The row of a matmul ``inst``; ``contracting`` names the dimensions of its first operand
    it sums over, or is None for a convolution (read from its labels)."""
    lhs, rhs = computation.operand_shape(inst, 0), computation.operand_shape(inst, 1)
    if lhs is None or rhs is None or not inst.shapes:
        return None
    out = inst.shapes[0]
    if contracting is None:
        flops = _convolution_flops(inst, lhs, rhs, out)
        if flops is None:
            return None
    else:
        flops = 2 * out.size * _prod(lhs.dims[d] for d in contracting)
    return PlanGemm(
        name=name,
        computation=where,
        library=library,
        lhs_dtype=np_dtype(lhs.dtype),
        rhs_dtype=np_dtype(rhs.dtype),
        out_dtype=np_dtype(out.dtype),
        flops=flops,
        executions=executions,
        lhs_shape=lhs.dims,
        rhs_shape=rhs.dims,
        op_name=op_name_of(inst),
        precision=_precision(inst),
    )


def _block_scaled_gemm(
    computation: HloComputation,
    inst: HloInstruction,
    name: str,
    where: str,
    executions: int,
) -> PlanGemm | None:
    """The row of a ``__cudnn$blockScaledDot`` call: its operands are the left data
    ``(B, M, K)``, the right data ``(B, N, K)`` and their scales."""
    lhs, rhs = computation.operand_shape(inst, 0), computation.operand_shape(inst, 1)
    scale = computation.operand_shape(inst, 2)
    if lhs is None or rhs is None or not inst.shapes:
        return None
    if len(lhs.dims) == 3 and len(rhs.dims) == 3:
        batch, m, k = lhs.dims
        flops = 2 * batch * m * rhs.dims[1] * k
    else:  # an unexpected layout: the output's elements, each a sum over K
        flops = 2 * inst.shapes[0].size * (lhs.dims[-1] if lhs.dims else 1)
    return PlanGemm(
        name=name,
        computation=where,
        library="cudnn_block_scaled",
        lhs_dtype=np_dtype(lhs.dtype),
        rhs_dtype=np_dtype(rhs.dtype),
        out_dtype=np_dtype(inst.shapes[0].dtype),
        flops=flops,
        executions=executions,
        lhs_shape=lhs.dims,
        rhs_shape=rhs.dims,
        op_name=op_name_of(inst),
        block_scaled=True,
        scale_dtype=np_dtype(scale.dtype) if scale is not None else None,
    )


def _attention_flops(q: HloShape, k: HloShape, config: Mapping[str, Any], backward: bool) -> int:
    # The backward call carries no bmm1 numbers; its bmm2_grad_gemm2 (dO x V^T) has the same
    # dimension layout as bmm1 (Q x K^T), so it reads the query and key shapes the same way.
    # Without either (an unknown version), JAX's default layout BTNH is assumed.
    numbers = config.get("bmm1_dot_dimension_numbers") or config.get(
        "bmm2_grad_gemm2_dot_dimension_numbers", {}
    )
    lhs_batch = tuple(int(d) for d in numbers.get("lhs_batch_dimensions", (0, 2)))
    lhs_contracting = tuple(int(d) for d in numbers.get("lhs_contracting_dimensions", (3,)))
    rhs_batch = tuple(int(d) for d in numbers.get("rhs_batch_dimensions", (0, 2)))
    rhs_contracting = tuple(int(d) for d in numbers.get("rhs_contracting_dimensions", (3,)))
    batch = _prod(q.dims[d] for d in lhs_batch)
    head = _prod(q.dims[d] for d in lhs_contracting)
    tq = _prod(s for d, s in enumerate(q.dims) if d not in lhs_batch + lhs_contracting)
    tk = _prod(s for d, s in enumerate(k.dims) if d not in rhs_batch + rhs_contracting)
    return (4 if backward else 2) * 2 * batch * tq * tk * head


def _row_of(
    inst: HloInstruction,
    computation: HloComputation,
    *,
    kernel: HloInstruction,
    where: str,
    library: str,
    executions: int,
) -> PlanGemm | PlanAttention | PlanScatter | None:
    """What ``inst``, an instruction of ``computation`` run by the kernel ``kernel`` of the
    computation ``where``, adds to a plan, if anything."""
    target = inst.custom_call_target or ""
    if inst.opcode == "dot":
        contracting = _dims(inst.attribute("lhs_contracting_dims"))
        return _gemm(computation, inst, contracting, kernel.name, where, library, executions)
    if inst.opcode == "convolution":
        return _gemm(computation, inst, None, kernel.name, where, library, executions)
    if target.startswith("__cublas$"):
        config = inst.backend_config().get("gemm_backend_config")
        if not isinstance(config, dict) or "dot_dimension_numbers" not in config:
            return None  # a cuBLAS call that is no GEMM (a triangular solve)
        numbers = config["dot_dimension_numbers"]
        contracting = tuple(int(d) for d in numbers["lhs_contracting_dimensions"])
        library = _cublas_library(target)
        return _gemm(computation, inst, contracting, kernel.name, where, library, executions)
    if target == _BLOCK_SCALED_DOT:
        return _block_scaled_gemm(computation, inst, kernel.name, where, executions)
    if target.startswith("__cudnn$fmha"):
        q, k = computation.operand_shape(inst, 0), computation.operand_shape(inst, 1)
        if q is None or k is None:
            return None
        backward = "Backward" in target
        config = inst.backend_config().get("cudnn_fmha_backend_config", {})
        return PlanAttention(
            name=kernel.name,
            target=target,
            backward=backward,
            dtype=np_dtype(q.dtype),
            flops=_attention_flops(q, k, config, backward),
            executions=executions,
            op_name=op_name_of(inst),
        )
    if target == "tpu_custom_call" and _TPU_ATTENTION.search(op_name_of(inst)):
        return _tpu_attention(inst, computation, kernel=kernel, executions=executions)
    if inst.opcode == "scatter" and inst.shapes:
        dtype = np_dtype(inst.shapes[0].dtype)
        return PlanScatter(kernel.name, where, dtype, executions, op_name_of(inst))
    return None


def _tpu_attention(
    inst: HloInstruction, computation: HloComputation, *, kernel: HloInstruction, executions: int
) -> PlanAttention | None:
    """The row of a Pallas attention kernel on a TPU: queries and keys are its first two
    operands, laid out ``[batch, heads, length, head_dim]`` (the layout of JAX's Pallas TPU
    attention kernels); the backward pass is two kernels (one for the queries' gradient, one
    for the keys' and values'), each given half the backward pass's nominal FLOPs."""
    q, k = computation.operand_shape(inst, 0), computation.operand_shape(inst, 1)
    if q is None or k is None or len(q.dims) != 4 or len(k.dims) != 4:
        return None
    batch, heads, tq, head_dim = q.dims
    tk = k.dims[2]
    backward = bool(_TPU_BACKWARD.search(op_name_of(inst)))
    # Mosaic's backend config holds the cost a kernel declares (pallas_call's cost_estimate);
    # a config that does not parse says nothing either way.
    config = inst.backend_config().get("custom_call_config")
    return PlanAttention(
        name=kernel.name,
        target="tpu_custom_call",
        backward=backward,
        dtype=np_dtype(q.dtype),
        flops=4 * batch * heads * tq * tk * head_dim,
        executions=executions,
        op_name=op_name_of(inst),
        declares_cost=not isinstance(config, dict) or "cost_estimate" in config,
    )


def read_module(module: HloModule, platform: str) -> dict[str, Any]:
    """The fields of a :class:`~mpjax.Plan` that the optimized ``module``, compiled for
    ``platform`` (``"gpu"`` or ``"tpu"``), decides: its GEMMs, fused attention and scatters,
    and its fusion and custom-call counts."""
    rows: list[PlanGemm | PlanAttention | PlanScatter] = []
    fusions = custom_calls = 0
    for where, executions in kernel_computations(module).items():
        for kernel in module.computations[where].instructions:
            if kernel.opcode == "fusion":
                fusions += 1
                library = _fusion_library(_fusion_kind(kernel))
                found = list(inside(module, kernel))
            elif kernel.opcode in ("custom-call", "dot", "convolution", "scatter"):
                if kernel.opcode == "custom-call":
                    custom_calls += 1
                library = "xla"  # for a dot left unfused: XLA's own emitter runs it
                found = [(kernel, where)]
            else:
                continue
            if platform == "tpu":
                library = "mxu"
            for inst, holder in found:
                row = _row_of(
                    inst,
                    module.computations[holder],
                    kernel=kernel,
                    where=where,
                    library=library,
                    executions=executions,
                )
                if isinstance(row, PlanGemm) and not row.op_name:
                    # A dot XLA made inside a fusion (a dequantized block-scaled matmul's)
                    # carries no op name of its own; the fusion has the operation's.
                    row = dataclasses.replace(row, op_name=op_name_of(kernel))
                if row is not None:
                    rows.append(row)
    return {
        "gemms": tuple(r for r in rows if isinstance(r, PlanGemm)),
        "attention": tuple(r for r in rows if isinstance(r, PlanAttention)),
        "scatters": tuple(r for r in rows if isinstance(r, PlanScatter)),
        "fusions": fusions,
        "custom_calls": custom_calls,
    }


def bytes_text(n: float) -> str:
    """``n`` bytes for a reader: ``"1.23 GB"``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def dtype_key(lhs: np.dtype, rhs: np.dtype) -> str:
    """A matmul's operand dtypes as a plan names them: ``"bfloat16"`` when both are, else
    ``"float8_e4m3fn x float8_e5m2"``."""
    return lhs.name if lhs == rhs else f"{lhs.name} x {rhs.name}"


def block_scaled_lines(
    gemms: Sequence[PlanGemm], total_flops: int, target: Target | None
) -> list[str]:
    """A plan's summary of its block-scaled matmuls: the block-scaled GEMMs' runs and share of
    the ``total_flops``; and, where some block-scaled matmuls became ordinary GEMMs
    (``PlanGemm.emulated_block_scaled``), that they are emulated and why: the ``target``
    (None for a plan read from HLO text alone) has no block-scaled GEMM kernels, or the
    compile chose none."""
    lines = []
    scaled = [g for g in gemms if g.block_scaled]
    flops = sum(g.flops * g.executions for g in scaled)
    if scaled and total_flops:
        runs = sum(g.executions for g in scaled)
        lines.append(
            f"block-scaled GEMMs: {runs} run{'s' * (runs != 1)} ({flops_text(flops)} FLOPs, "
            f"{flops / total_flops:.1%} of the matmul FLOPs)"
        )
    emulated = [g for g in gemms if g.emulated_block_scaled]
    if emulated:
        runs = sum(g.executions for g in emulated)
        dtypes = ", ".join(sorted({dtype_key(g.lhs_dtype, g.rhs_dtype) for g in emulated}))
        why = "the compile chose no block-scaled GEMM kernel for them"
        if target is not None and not target.chip.block_scaled_gemms:
            capability = target.chip.compute_capability
            why = f"no block-scaled GEMM kernels on {target.chip.name}" + (
                f", compute capability {capability[0]}.{capability[1]} < 10.0" if capability else ""
            )
        lines.append(
            f"block-scaled matmuls: emulated ({why}): {runs} GEMM run{'s' * (runs != 1)} in "
            f"{dtypes} after dequantizing the operands"
        )
    return lines


@dataclasses.dataclass(frozen=True)
class PlanMemory:
    """What one device of a :class:`Plan` holds, from XLA's memory analysis of the compile.

    Attributes:
      argument_bytes: the function's inputs on the device.
      output_bytes: its outputs on the device.
      alias_bytes: outputs that reuse an input's buffer (donated arguments), counted once.
      temp_bytes: temporaries: activations kept for the backward pass, workspaces.
      generated_code_bytes: the compiled program.
      capacity_bytes: the device's memory (its chip's HBM, shared by its cores).
      available_bytes: what XLA said it could use, where a compile failed for lack of it
        (XLA reserves part of the HBM); else None.
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    capacity_bytes: int
    available_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """Everything the device holds at the peak XLA planned for."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.generated_code_bytes
        )

    @property
    def fits(self) -> bool:
        """Whether the step fits in the device's memory (in what XLA said was available,
        where it said)."""
        limit = self.available_bytes if self.available_bytes is not None else self.capacity_bytes
        return self.total_bytes <= limit

    @property
    def margin_bytes(self) -> int:
        """Memory left over, negative where some is missing, against the capacity, or what XLA said was
        available."""
        limit = self.available_bytes if self.available_bytes is not None else self.capacity_bytes
        return limit - self.total_bytes

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        margin = f"{bytes_text(abs(self.margin_bytes))} {'left' if self.fits else 'missing'}"
        if self.available_bytes is None:
            limit = f"{bytes_text(self.capacity_bytes)}"
        else:
            limit = f"{bytes_text(self.available_bytes)} available"
        return (
            f"memory per device: {bytes_text(self.total_bytes)} of {limit} ({verdict}, "
            f"{margin}): arguments {bytes_text(self.argument_bytes)}, outputs "
            f"{bytes_text(self.output_bytes)}, temporaries {bytes_text(self.temp_bytes)}"
        )


def memory_of(analysis: Any, capacity: int) -> PlanMemory | None:
    """The :class:`PlanMemory` of XLA's memory ``analysis`` of a compile (None stays None)."""
    if analysis is None:
        return None
    return PlanMemory(
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        alias_bytes=int(analysis.alias_size_in_bytes),
        temp_bytes=int(analysis.temp_size_in_bytes),
        generated_code_bytes=int(analysis.generated_code_size_in_bytes),
        capacity_bytes=capacity,
    )


def out_of_memory(error: Exception, capacity: int) -> PlanMemory | None:
    """The memory of a TPU compile that stopped for lack of it, from XLA's message."""
    match = _HBM_OOM.search(str(error))
    if match is None:
        return None
    need = float(match["need"]) * _UNITS[match["unit"]]
    have = float(match["have"]) * _UNITS[match["unit2"]]
    return PlanMemory(0, 0, 0, int(need), 0, capacity, available_bytes=int(have))
