"""What a function would run on an H100 (or an A100, an H200), found on a machine without one.

JAX's CUDA plugin (``pip install "mpjax[cuda12]"``, which installs on a machine without a GPU)
compiles for a GPU described by a text file instead of one it finds: a *deviceless* compile.
XLA's GPU compiler then makes the decisions that settle what mixed precision really costs: which
matmuls become cuBLAS or Triton GEMMs and with which operand dtypes, whether attention becomes
one cuDNN flash-attention call, in which dtype a scatter-add accumulates, how many kernels are
left. :func:`gpu_plan` compiles a function that way and reads those decisions from the
optimized HLO, as a :class:`GpuPlan`.

What it cannot tell: without a GPU there is no autotuning, so Triton GEMMs keep an untuned tile
and a real GPU may choose cuBLAS or Triton differently for each GEMM (compile with
``triton_gemm=False`` to see every GEMM as cuBLAS); and nothing runs, so there are no timings.

The GPU descriptions are XLA's own (``GpuTargetConfigProto`` text files from openxla/xla,
``xla/backends/gpu/target_config/specs/`` at commit ``4336d12e``, Apache-2.0, shipped in
``mpjax/gpu_targets/``). What differs between JAX versions in this path (fields the installed
jaxlib does not know, autotuning, reading the HLO back) is handled in :mod:`mpjax.jax_compat`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from mpjax import jax_compat
from mpjax.hlo_text import HloComputation, HloInstruction, HloModule, HloShape, parse_module
from mpjax.inspection import check_function
from mpjax.table import format_table

__all__ = [
    "GpuAttention",
    "GpuCompilerUnavailableError",
    "GpuGemm",
    "GpuPlan",
    "GpuScatter",
    "LIBRARIES",
    "TARGETS",
    "gpu_plan",
    "gpu_plan_unavailable",
]

TARGETS = {"h100": "h100_sxm.txtpb", "a100": "a100_sxm_80.txtpb", "h200": "h200.txtpb"}
"""The GPUs :func:`gpu_plan` compiles for (H100 SXM 80GB, A100 SXM 80GB, H200) and their
description files in ``mpjax/gpu_targets/``."""

LIBRARIES = ("cublaslt", "cublaslt_fp8", "cublas", "triton", "cudnn", "xla")
"""What runs a :class:`GpuGemm`: cuBLASLt (``__cublas$lt$matmul``), its fp8 form
(``__cublas$lt$matmul$f8``), legacy cuBLAS (``__cublas$gemm``), a Triton GEMM fusion, a cuDNN
GEMM fusion, or XLA's own emitter (a ``dot`` left in place or inside an ordinary fusion)."""

_LIMITS = (
    "Limits: a deviceless compile (no GPU): no autotuning, so Triton GEMM tiles are untuned "
    "and a real GPU may choose cuBLAS or Triton differently per GEMM; nothing ran, so no timings."
)
_LIMITS_AUTOTUNED = (
    "Limits: read from a compile on the GPU itself (autotuned, as it runs); the plan has no "
    "timings."
)
# Instructions whose called computations run as part of the caller's own sequence of kernels;
# every other called computation (a fusion's body, a reducer) runs inside one kernel.
_CONTROL_FLOW = frozenset({"while", "conditional", "call", "async-start"})
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_HLO_DTYPES = {"pred": "bool", "bf16": "bfloat16", "c64": "complex64", "c128": "complex128"}


class GpuCompilerUnavailableError(RuntimeError):
    """Raised by :func:`gpu_plan` when this machine's JAX cannot compile for a GPU: the CUDA
    plugin is not installed or did not start. The message says what to do."""


@dataclasses.dataclass(frozen=True)
class GpuGemm:
    """One GEMM of a :class:`GpuPlan`.

    Attributes:
      name: the HLO instruction that launches it (a fusion or a custom call).
      computation: the HLO computation holding that instruction (the entry computation, or a
        loop body).
      library: what runs it: ``"cublaslt"`` (``__cublas$lt$matmul``), ``"cublaslt_fp8"``
        (``__cublas$lt$matmul$f8``), ``"cublas"`` (legacy ``__cublas$gemm``), ``"triton"`` (a
        Triton GEMM fusion), ``"cudnn"`` (a cuDNN GEMM fusion) or ``"xla"`` (a ``dot`` XLA
        emits itself, alone or inside an ordinary fusion); :data:`LIBRARIES` lists them.
      lhs_dtype: the left operand's dtype, as the GEMM reads it.
      rhs_dtype: the right operand's dtype.
      out_dtype: the dtype it writes. A GEMM that XLA splits along its contracted dimension
        (split-K, common for weight gradients) writes float32 partial sums, which a following
        fusion adds and converts: its operands then show the split as an extra dimension.
      flops: ``2 * prod(output dims) * prod(contracted dims)``, for one execution.
      executions: how many times one call of the function runs it: the product of the trip
        counts XLA knows for the loops around it (1 outside loops, and for a loop whose trip
        count XLA does not know).
      lhs_shape: the left operand's shape.
      rhs_shape: the right operand's shape.
      op_name: the JAX name of the operation it came from (``"jit(step)/.../dot_general"``),
        when the HLO carries one.
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


@dataclasses.dataclass(frozen=True)
class GpuAttention:
    """One fused attention call of a :class:`GpuPlan` (a cuDNN ``__cudnn$fmha*`` custom call).

    Attributes:
      name: the HLO instruction.
      target: the custom-call target, for example ``"__cudnn$fmhaSoftmax"`` or
        ``"__cudnn$fmhaSoftmaxBackward"``; variants name dropout, scale, bias or mask.
      backward: whether it is the backward pass.
      dtype: the dtype of the queries.
      flops: nominal matmul FLOPs for one execution, from the query and key shapes: two
        GEMMs forward (``4*B*H*Tq*Tk*D``), four backward (``8*B*H*Tq*Tk*D``). A causal or other
        mask is not discounted, and the backward pass's recomputation of the scores not added.
      executions: as for :class:`GpuGemm`.
      op_name: as for :class:`GpuGemm`.
    """

    name: str
    target: str
    backward: bool
    dtype: np.dtype
    flops: int
    executions: int = 1
    op_name: str = ""


@dataclasses.dataclass(frozen=True)
class GpuScatter:
    """One scatter of a :class:`GpuPlan` (an embedding gradient's scatter-add, for one).

    Attributes:
      name: the HLO instruction that launches it (usually an ``input_scatter_fusion``).
      computation: the computation holding that instruction.
      dtype: the dtype of the array scattered into: the dtype the updates accumulate in.
      executions: as for :class:`GpuGemm`.
      op_name: as for :class:`GpuGemm`.
    """

    name: str
    computation: str
    dtype: np.dtype
    executions: int = 1
    op_name: str = ""


def _flops_text(n: int) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _dtype_key(lhs: np.dtype, rhs: np.dtype) -> str:
    return lhs.name if lhs == rhs else f"{lhs.name} x {rhs.name}"


def _row(item: Any) -> dict[str, Any]:
    """A row dataclass as JSON-ready data: dtypes as names, shapes as lists."""

    def plain(value: Any) -> Any:
        if isinstance(value, np.dtype):
            return value.name
        return list(value) if isinstance(value, tuple) else value

    return {f.name: plain(getattr(item, f.name)) for f in dataclasses.fields(item)}


def _section(header: tuple[str, ...], rows: list[Any]) -> list[str]:
    """A table of ``rows`` and a blank line, or nothing without rows; FLOPs and runs, the
    numbers, align right."""
    right = frozenset(i for i, name in enumerate(header) if name in ("FLOPs", "runs"))
    return [format_table(header, rows, right=right), ""] if rows else []


def _shape_text(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"{dtype.name}{list(shape)}" if shape else dtype.name


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """What a function compiles to for a GPU; made by :func:`gpu_plan`. ``str`` gives
    :meth:`table`.

    Attributes:
      target: the target's name (``"h100"``).
      device: the GPU the target describes (``"NVIDIA H100 80GB HBM3"``).
      jax_version: the JAX that compiled it.
      options: the XLA options the compile was given, as sorted ``(name, value)`` pairs.
      gemms: every GEMM, in HLO order (:class:`GpuGemm`).
      attention: every fused attention call (:class:`GpuAttention`).
      scatters: every scatter (:class:`GpuScatter`).
      fusions: the number of ``fusion`` instructions in the computations that launch kernels
        (the entry computation and the bodies and branches of its loops and conditionals, not
        the computations fused into a kernel), each counted once however often its loop runs.
        XLA's GPU backend wraps almost every operation in a fusion, Triton GEMMs included, so
        ``fusions + custom_calls`` is close to the number of kernels (collectives and copies
        aside).
      custom_calls: the number of ``custom-call`` instructions there (cuBLAS GEMMs, cuDNN
        attention and other library calls), counted the same way.
      hlo_text: the optimized HLO the plan was read from.
      autotuned: whether that HLO came from a compile on the GPU itself
        (:meth:`from_hlo_text`), where XLA autotunes each GEMM, rather than from a deviceless
        compile (:func:`gpu_plan`).
    """

    target: str
    device: str
    jax_version: str
    options: tuple[tuple[str, Any], ...]
    gemms: tuple[GpuGemm, ...]
    attention: tuple[GpuAttention, ...]
    scatters: tuple[GpuScatter, ...]
    fusions: int
    custom_calls: int
    hlo_text: str = dataclasses.field(default="", repr=False, compare=False)
    autotuned: bool = False

    @classmethod
    def from_hlo_text(cls, hlo_text: str, *, device: str, target: str = "") -> GpuPlan:
        """The plan of an optimized GPU HLO module given as text: on a GPU, that of a compiled
        step, ``jax.jit(step).lower(*args).compile().as_text()``, which XLA autotuned for that
        GPU (what :func:`gpu_plan` cannot see without one).

        Args:
          hlo_text: the optimized HLO module's text.
          device: the GPU it was compiled for (``jax.devices()[0].device_kind``).
          target: a short name for it, if any.

        Raises:
          TypeError: if ``hlo_text`` is not a string.
          ValueError: if it holds no HLO module.
        """
        if not isinstance(hlo_text, str):
            raise TypeError(
                f"GpuPlan.from_hlo_text takes the HLO module's text, got {type(hlo_text).__name__}."
            )
        if "HloModule" not in hlo_text:
            raise ValueError(
                "GpuPlan.from_hlo_text takes an optimized HLO module's text (it starts with "
                f"'HloModule'), got {hlo_text[:60]!r}."
            )
        return cls(
            target=target,
            device=device,
            jax_version=jax.__version__,
            options=(),
            hlo_text=hlo_text,
            autotuned=True,
            **_read(parse_module(hlo_text)),
        )

    def _matmuls(self) -> Iterator[tuple[np.dtype, np.dtype, int]]:
        for g in self.gemms:
            yield g.lhs_dtype, g.rhs_dtype, g.flops * g.executions
        for a in self.attention:
            yield a.dtype, a.dtype, a.flops * a.executions

    @property
    def total_flops(self) -> int:
        """The matmul FLOPs of one call, GEMMs and fused attention, loop trip counts
        included."""
        return sum(flops for _, _, flops in self._matmuls())

    def flops_by_dtype(self) -> dict[str, int]:
        """Matmul FLOPs (GEMMs and fused attention, loop trip counts included) by operand
        dtype: ``"bfloat16"`` when both operands have that dtype, ``"float8_e4m3fn x
        float8_e5m2"`` when they differ. Largest first."""
        totals: dict[str, int] = {}
        for lhs, rhs, flops in self._matmuls():
            key = _dtype_key(lhs, rhs)
            totals[key] = totals.get(key, 0) + flops
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def flop_share(self, dtype: Any) -> float:
        """The fraction of the matmul FLOPs (:meth:`flops_by_dtype`) whose operands are all of
        ``dtype``; 0.0 when the function has no matmul.

        Args:
          dtype: a dtype (``jnp.bfloat16``, ``"bfloat16"``, ``np.float32``), or ``"fp8"`` for
            any 8-bit float operands (e4m3 and e5m2 mixed included).

        Raises:
          ValueError: if ``dtype`` is neither ``"fp8"`` nor a dtype.
        """
        if isinstance(dtype, str) and dtype.lower() == "fp8":

            def matches(d: np.dtype) -> bool:
                return d.name.startswith("float8")

        else:
            try:
                wanted = np.dtype(jnp.dtype(dtype))
            except TypeError:
                raise ValueError(
                    f"flop_share: dtype must be 'fp8' or a dtype such as 'bfloat16' or "
                    f"jnp.float32, got {dtype!r}."
                ) from None

            def matches(d: np.dtype) -> bool:
                return d == wanted

        total = self.total_flops
        if total == 0:
            return 0.0
        hits = sum(f for lhs, rhs, f in self._matmuls() if matches(lhs) and matches(rhs))
        return hits / total

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        """The plan as text: the GEMMs, the fused attention, the scatters, the kernel counts,
        the FLOP shares by operand dtype and the limits of a compile without a GPU."""
        options = ", ".join(f"{k}={v}" for k, v in self.options) or "XLA's defaults"
        parts = [
            f"GPU plan for {self.target} ({self.device}), jax {self.jax_version}, {options}",
            "",
        ]
        gemms = [
            (
                g.name,
                g.computation,
                g.library,
                _shape_text(g.lhs_dtype, g.lhs_shape),
                _shape_text(g.rhs_dtype, g.rhs_shape),
                g.out_dtype.name,
                _flops_text(g.flops),
                str(g.executions),
            )
            for g in self.gemms
        ]
        attention = [
            (
                a.name,
                a.target,
                "backward" if a.backward else "forward",
                a.dtype.name,
                _flops_text(a.flops),
                str(a.executions),
            )
            for a in self.attention
        ]
        scatters = [(s.name, s.computation, s.dtype.name, str(s.executions)) for s in self.scatters]
        parts += _section(
            ("GEMM", "computation", "library", "lhs", "rhs", "out", "FLOPs", "runs"), gemms
        ) or ["no GEMMs", ""]
        parts += _section(("attention", "target", "pass", "dtype", "FLOPs", "runs"), attention)
        parts += _section(("scatter", "computation", "dtype", "runs"), scatters)
        fusions = f"{self.fusions} fusion{'s' * (self.fusions != 1)}"
        calls = f"{self.custom_calls} custom call{'s' * (self.custom_calls != 1)}"
        parts.append(f"kernels: {fusions}, {calls}")
        total = self.total_flops
        if total:
            shares = ", ".join(
                f"{key} {flops / total:.1%}" for key, flops in self.flops_by_dtype().items()
            )
            parts.append(f"matmul FLOPs: {_flops_text(total)} ({shares})")
        parts.append(self.limits)
        return "\n".join(parts)

    @property
    def limits(self) -> str:
        """What the plan cannot tell, as the table's last line says it."""
        return _LIMITS_AUTOTUNED if self.autotuned else _LIMITS

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-serialisable data: the fields (dtypes as names, the HLO text
        left out), ``flops_by_dtype`` and ``limits``."""

        return {
            "target": self.target,
            "device": self.device,
            "jax_version": self.jax_version,
            "options": dict(self.options),
            "gemms": [_row(g) for g in self.gemms],
            "attention": [_row(a) for a in self.attention],
            "scatters": [_row(s) for s in self.scatters],
            "fusions": self.fusions,
            "custom_calls": self.custom_calls,
            "flops_by_dtype": self.flops_by_dtype(),
            "autotuned": self.autotuned,
            "limits": self.limits,
        }


# --- Reading the optimized HLO --------------------------------------------------------------


def _np_dtype(hlo_type: str) -> np.dtype:
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


def _op_name(inst: HloInstruction) -> str:
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


def _kernel_computations(module: HloModule) -> dict[str, int]:
    """The computations that launch kernels, each with how many times one call runs it:
    the entry, and what its loops, conditionals and calls run (a while body times its known
    trip count)."""
    executions = {module.entry: 1}
    todo = [module.entry]
    while todo:
        computation = module.computations[todo.pop()]
        for inst in computation.instructions:
            if inst.opcode not in _CONTROL_FLOW:
                continue
            times = 1
            if inst.opcode == "while":
                count = inst.backend_config().get("known_trip_count", {})
                times = int(count.get("n", 1)) if isinstance(count, dict) else 1
            for callee in inst.called_computations():
                if callee in module.computations and callee not in executions:
                    executions[callee] = executions[computation.name] * times
                    todo.append(callee)
    return executions


def _inside(module: HloModule, inst: HloInstruction) -> Iterator[tuple[HloInstruction, str]]:
    """Every instruction of the computations ``inst`` calls, nested calls included, with the
    name of the computation holding it."""
    seen: set[str] = set()
    todo = list(inst.called_computations())
    while todo:
        name = todo.pop(0)
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        for inner in module.computations[name].instructions:
            yield inner, name
            todo += inner.called_computations()


def _gemm(
    computation: HloComputation,
    inst: HloInstruction,
    contracting: tuple[int, ...],
    name: str,
    where: str,
    library: str,
    executions: int,
) -> GpuGemm | None:
    lhs, rhs = computation.operand_shape(inst, 0), computation.operand_shape(inst, 1)
    if lhs is None or rhs is None or not inst.shapes:
        return None
    out = inst.shapes[0]
    return GpuGemm(
        name=name,
        computation=where,
        library=library,
        lhs_dtype=_np_dtype(lhs.dtype),
        rhs_dtype=_np_dtype(rhs.dtype),
        out_dtype=_np_dtype(out.dtype),
        flops=2 * out.size * _prod(lhs.dims[d] for d in contracting),
        executions=executions,
        lhs_shape=lhs.dims,
        rhs_shape=rhs.dims,
        op_name=_op_name(inst),
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
) -> GpuGemm | GpuAttention | GpuScatter | None:
    """What ``inst``, an instruction of ``computation`` run by the kernel ``kernel`` of the
    computation ``where``, adds to a plan, if anything."""
    target = inst.custom_call_target or ""
    if inst.opcode == "dot":
        contracting = _dims(inst.attribute("lhs_contracting_dims"))
        return _gemm(computation, inst, contracting, kernel.name, where, library, executions)
    if target.startswith("__cublas$"):
        config = inst.backend_config().get("gemm_backend_config")
        if not isinstance(config, dict) or "dot_dimension_numbers" not in config:
            return None  # a cuBLAS call that is no GEMM (a triangular solve)
        numbers = config["dot_dimension_numbers"]
        contracting = tuple(int(d) for d in numbers["lhs_contracting_dimensions"])
        library = _cublas_library(target)
        return _gemm(computation, inst, contracting, kernel.name, where, library, executions)
    if target.startswith("__cudnn$fmha"):
        q, k = computation.operand_shape(inst, 0), computation.operand_shape(inst, 1)
        if q is None or k is None:
            return None
        backward = "Backward" in target
        config = inst.backend_config().get("cudnn_fmha_backend_config", {})
        return GpuAttention(
            name=kernel.name,
            target=target,
            backward=backward,
            dtype=_np_dtype(q.dtype),
            flops=_attention_flops(q, k, config, backward),
            executions=executions,
            op_name=_op_name(inst),
        )
    if inst.opcode == "scatter" and inst.shapes:
        dtype = _np_dtype(inst.shapes[0].dtype)
        return GpuScatter(kernel.name, where, dtype, executions, _op_name(inst))
    return None


def _read(module: HloModule) -> dict[str, Any]:
    """The fields of a :class:`GpuPlan` that the optimized ``module`` decides."""
    rows: list[GpuGemm | GpuAttention | GpuScatter] = []
    fusions = custom_calls = 0
    for where, executions in _kernel_computations(module).items():
        for kernel in module.computations[where].instructions:
            if kernel.opcode == "fusion":
                fusions += 1
                library = _fusion_library(_fusion_kind(kernel))
                found = list(_inside(module, kernel))
            elif kernel.opcode in ("custom-call", "dot", "scatter"):
                if kernel.opcode == "custom-call":
                    custom_calls += 1
                library = "xla"  # for a dot left unfused: XLA's own emitter runs it
                found = [(kernel, where)]
            else:
                continue
            for inst, holder in found:
                row = _row_of(
                    inst,
                    module.computations[holder],
                    kernel=kernel,
                    where=where,
                    library=library,
                    executions=executions,
                )
                if row is not None:
                    rows.append(row)
    return {
        "gemms": tuple(r for r in rows if isinstance(r, GpuGemm)),
        "attention": tuple(r for r in rows if isinstance(r, GpuAttention)),
        "scatters": tuple(r for r in rows if isinstance(r, GpuScatter)),
        "fusions": fusions,
        "custom_calls": custom_calls,
    }


# --- Compiling ------------------------------------------------------------------------------


def _spec(target: str) -> str:
    return (importlib.resources.files("mpjax") / "gpu_targets" / TARGETS[target]).read_text()


_NOT_INSTALLED = (
    "mpjax.gpu_plan compiles with JAX's CUDA plugin, which is not installed. It installs on a "
    'machine without a GPU too: pip install "mpjax[cuda12]" (which is jax[cuda12]). Set '
    "JAX_PLATFORMS=cpu in the environment so that JAX keeps computing on the CPU."
)
_NOT_STARTED = (
    "JAX's CUDA plugin is installed but did not start, so JAX cannot compile for a GPU: {error}\n"
    "Without a GPU the plugin's check of the local CUDA installation fails. Set "
    "JAX_PLATFORMS=cpu in the environment before starting Python (or before the first JAX "
    "computation); with jax 0.8 set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 as well, unless mpjax is "
    "imported before that first computation (it sets it then)."
)


@functools.cache
def _device(target: str) -> tuple[NamedSharding, str]:
    """The replicated sharding over one compile-only ``target`` GPU, and the GPU's name."""
    spec = _spec(target)
    try:
        topology = jax_compat.cuda_topology(spec).topology
    except NotImplementedError as error:
        raise GpuCompilerUnavailableError(_NOT_STARTED.format(error=error)) from error
    except Exception as error:
        raise GpuCompilerUnavailableError(
            f"JAX's CUDA plugin could not make a compile-only {target} device: {error}"
        ) from error
    mesh = topologies.make_mesh(topology, (1,), ("gpu",))
    match = re.search(r'device_description_str:\s*"([^"]*)"', spec)
    return NamedSharding(mesh, PartitionSpec()), match[1] if match else target


def _check_available(target: str) -> tuple[NamedSharding, str]:
    if not jax_compat.cuda_plugin_installed():
        raise GpuCompilerUnavailableError(_NOT_INSTALLED)
    return _device(target)


def gpu_plan_unavailable(target: str = "h100") -> str | None:
    """Why :func:`gpu_plan` cannot compile for ``target`` on this machine, or None when it can.

    It makes the compile-only device that :func:`gpu_plan` uses (once per process and target),
    so it answers for this process as it is now.

    >>> reason = gpu_plan_unavailable()  # None where "mpjax[cuda12]" is installed
    """
    target = _check_target(target)
    try:
        _check_available(target)
    except GpuCompilerUnavailableError as error:
        return str(error)
    return None


def _check_target(target: Any) -> str:
    if not isinstance(target, str) or target.lower() not in TARGETS:
        raise ValueError(f"gpu_plan: unknown target {target!r}; valid targets: {sorted(TARGETS)}.")
    return target.lower()


def _abstract(tree: Any, sharding: NamedSharding) -> Any:
    """Array leaves as ``jax.ShapeDtypeStruct`` on the compile-only GPU; other leaves (Python
    numbers, ``None``) as they are, for ``jit`` to treat as it always does."""

    def leaf(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            weak = bool(getattr(x, "weak_type", False))
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak)
        return x

    return jax.tree.map(leaf, tree)


def gpu_plan(
    fn: Callable[..., Any],
    /,
    target: str = "h100",
    *,
    triton_gemm: bool | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[..., GpuPlan]:
    """What ``fn`` would run on a GPU, compiled on this machine without one; curried like
    ``jax.make_jaxpr``: ``gpu_plan(fn)(*args, **kwargs)``.

    Compiles ``jax.jit(fn)`` for one ``target`` GPU with JAX's CUDA plugin, no GPU needed, and
    reads XLA's optimized HLO: every GEMM with the library that runs it and its operand dtypes,
    cuDNN fused attention, scatters with the dtype they accumulate in, and kernel counts. Use it
    to check that a mixed-precision training step gets bf16 (or fp8) Tensor Core GEMMs and
    flash attention before renting the GPU. Needs ``pip install "mpjax[cuda12]"`` (it installs
    without a GPU) and, on a machine without a GPU, ``JAX_PLATFORMS=cpu`` set before JAX
    starts; :func:`gpu_plan_unavailable` says whether it can run.

    Limits: without a GPU XLA does not autotune, so Triton GEMMs keep an untuned tile and a
    real GPU may choose cuBLAS or Triton differently for each GEMM (``triton_gemm=False`` shows
    every GEMM as cuBLAS); nothing runs, so there are no timings.

    Args:
      fn: a function JAX can ``jit``. One already wrapped in ``jax.jit`` is lowered as it is,
        so its static arguments stay static.
      target: the GPU: ``"h100"`` (H100 SXM 80GB), ``"a100"`` (A100 SXM 80GB) or ``"h200"``.
      triton_gemm: None keeps XLA's default (GEMMs become Triton fusions where XLA supports
        them); False sets ``xla_gpu_enable_triton_gemm=False``, which sends every GEMM to
        cuBLAS(Lt); True sets it True.
      compiler_options: more XLA options for the compile (``{"xla_gpu_...": value}``).

    Returns:
      A function that takes example arguments of ``fn`` exactly as ``fn`` takes them (arrays or
      ``jax.ShapeDtypeStruct`` trees; only shapes and dtypes are read) and returns a
      :class:`GpuPlan`. It raises :class:`GpuCompilerUnavailableError` when the CUDA plugin is
      missing or did not start.

    Raises:
      TypeError: if ``fn`` is not callable, ``triton_gemm`` not None or a bool, or
        ``compiler_options`` not a mapping with string keys.
      ValueError: if ``target`` is unknown, or ``triton_gemm`` and ``compiler_options`` set
        ``xla_gpu_enable_triton_gemm`` differently.

    >>> import jax.numpy as jnp
    >>> x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    >>> w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    >>> plan = gpu_plan(jnp.matmul, triton_gemm=False)(x, w)  # doctest: +SKIP
    >>> [(g.library, g.lhs_dtype.name, g.flops) for g in plan.gemms]  # doctest: +SKIP
    [('cublaslt', 'bfloat16', 268435456)]
    >>> plan.flop_share(jnp.bfloat16)  # doctest: +SKIP
    1.0
    """
    check_function("gpu_plan", fn)
    target = _check_target(target)
    if triton_gemm is not None and not isinstance(triton_gemm, bool):
        raise TypeError(f"gpu_plan: triton_gemm must be None, True or False, got {triton_gemm!r}.")
    if compiler_options is None:
        compiler_options = {}
    if not isinstance(compiler_options, Mapping) or not all(
        isinstance(k, str) for k in compiler_options
    ):
        raise TypeError(
            "gpu_plan: compiler_options must be a mapping from XLA option names to values, "
            f"got {compiler_options!r}."
        )
    options = dict(compiler_options)
    if triton_gemm is not None:
        given = options.setdefault("xla_gpu_enable_triton_gemm", triton_gemm)
        if given != triton_gemm:
            raise ValueError(
                f"gpu_plan: triton_gemm={triton_gemm} but compiler_options sets "
                f"xla_gpu_enable_triton_gemm={given!r}; set one of them."
            )
    lower = fn.lower if hasattr(fn, "lower") else jax.jit(fn).lower

    def plan(*args: Any, **kwargs: Any) -> GpuPlan:
        sharding, device = _check_available(target)
        args, kwargs = _abstract((args, kwargs), sharding)
        text = jax_compat.deviceless_hlo(lower(*args, **kwargs), options)
        return GpuPlan(
            target=target,
            device=device,
            jax_version=jax.__version__,
            options=tuple(sorted(options.items())),
            hlo_text=text,
            **_read(parse_module(text)),
        )

    return plan
