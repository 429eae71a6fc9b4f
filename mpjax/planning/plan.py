"""What a function would run on a GPU or a TPU, found on a machine without one.

JAX compiles for an accelerator it does not have: the CUDA plugin (``pip install
"mpjax[cuda12]"``) for a GPU described by a text file, ``libtpu`` (``pip install
"mpjax[tpu]"``) for a TPU slice named by its topology; both install on a machine without the
hardware. XLA's compiler then makes the decisions that settle what mixed precision really
costs: which matmuls run in which operand dtypes and at which float32 precision, whether
attention becomes one fused kernel, in which dtype a scatter-add accumulates, how many kernels
are left, how much memory each device needs. :func:`plan` compiles a function that way and
reads those decisions from the optimized HLO and XLA's analyses, as a :class:`Plan`.

What is measured and what is estimated: the matmuls, attention kernels, scatters and memory
are XLA's decisions for the target, read from the compile. Nothing runs, so there are no
timings: on a TPU the plan carries XLA's own *estimate* of the run time (its cost model's
``optimal_seconds``), and on every target a *roofline bound*, the matmul FLOPs at the chip's
published peak rate for their dtypes. XLA's estimate models its own instructions; a custom
call (a Pallas kernel) counts as much as the kernel's author declared, if anything. On a GPU
there is no autotuning without one, so Triton GEMMs keep an untuned tile and a real GPU may
choose cuBLAS or Triton differently for each GEMM (compile with ``triton_gemm=False`` to see
every GEMM as cuBLAS). Block-scaled matmuls (``jax.nn.scaled_dot_general``, MXFP8, NVFP4) are
cuDNN GEMMs of their own on a Blackwell GPU (:attr:`Plan.block_scaled_flops`); elsewhere XLA
dequantizes them into ordinary GEMMs, and the plan's summary says they are emulated.

The GPU descriptions are XLA's own (``GpuTargetConfigProto`` text files from openxla/xla,
``xla/backends/gpu/target_config/specs/`` at commit ``4336d12e``, B200's and GB200's at
``300ec95a``, Apache-2.0, shipped in ``mpjax/planning/gpu_targets/``); the chips' figures are
in :mod:`mpjax.planning.targets`.
What differs between JAX versions in this path is handled in :mod:`mpjax.jax_compat` and
:mod:`mpjax.planning.deviceless`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax.inspection.matmuls import check_function
from mpjax.planning import deviceless
from mpjax.planning.arguments import on_target
from mpjax.planning.collectives import (
    PlanCollective,
    bytes_by_kind,
    read_collectives,
    seconds_bound,
    table_rows,
)
from mpjax.planning.compile_only import compile_only
from mpjax.planning.devices import target_devices
from mpjax.planning.grouped import annotate_grouped, grouped_lines, read_grouped
from mpjax.planning.hlo_text import parse_module
from mpjax.planning.loops import PlanLoop, loop_costs, loop_lines
from mpjax.planning.rows import (
    PlanAttention,
    PlanGemm,
    PlanMemory,
    PlanScatter,
    block_scaled_lines,
    bytes_text,
    dtype_key,
    loop_trip_counts,
    memory_of,
    out_of_memory,
    read_module,
)
from mpjax.planning.targets import known_target, parse_target
from mpjax.planning.traffic import fusion_traffic
from mpjax.table import flops_text, format_table, seconds_text, shape_text

__all__ = ["Plan", "plan"]


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


def _read(hlo_text: str, platform: str) -> dict[str, Any]:
    """The fields of a :class:`Plan` read from an optimized HLO module's text."""
    module = parse_module(hlo_text)
    loops = {
        "collectives": read_collectives(module),
        "loop_trips": loop_trip_counts(module),
    }
    read = read_module(module, platform)
    read["gemms"] = annotate_grouped(read["gemms"]) + read_grouped(module)
    read["fusion_bytes"] = fusion_traffic(module) if platform == "gpu" else None
    return {**read, **loops}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a function compiles to for a GPU or a TPU; made by :func:`plan`. ``str`` gives
    :meth:`table`. Everything is per device.

    Attributes:
      target: the target's name (``"h100"``, ``"v5p"``, ``"v5p:2x2x1"``).
      device: the device the target describes (``"NVIDIA H100 80GB HBM3"``, ``"TPU v5"``).
      jax_version: the JAX that compiled it.
      options: the XLA options the compile was given, as sorted ``(name, value)`` pairs.
      gemms: every matmul kernel, in HLO order (:class:`PlanGemm`).
      attention: every fused attention kernel (:class:`PlanAttention`).
      scatters: every scatter (:class:`PlanScatter`).
      fusions: the number of ``fusion`` instructions in the computations that launch kernels
        (the entry computation, its loops' bodies and branches), each counted once however
        often its loop runs. XLA's GPU backend wraps almost every operation in a fusion, so
        ``fusions + custom_calls`` is close to the number of kernels.
      custom_calls: the number of ``custom-call`` instructions there (cuBLAS GEMMs, cuDNN
        attention, Pallas kernels and other library calls), counted the same way.
      hlo_text: the optimized HLO the plan was read from.
      autotuned: whether that HLO came from a compile on the GPU itself
        (:meth:`from_hlo_text`), where XLA autotunes each GEMM, rather than from a deviceless
        compile (:func:`plan`).
      platform: ``"gpu"`` or ``"tpu"``.
      devices: how many devices the compile was for.
      memory: what each device holds (:class:`PlanMemory`), or None where XLA gave no memory
        analysis (old jaxlibs' deviceless GPU compiles).
      estimated_seconds: XLA's estimate of one call's time (TPU only: its cost model's
        ``optimal_seconds``; None on a GPU, and where the cost model's figure is not positive).
        An estimate, not a measurement.
      bytes_accessed: the memory traffic XLA's cost model counts for one call (TPU only).
      fusion_bytes: the bytes one call's fusions that are no GEMM read and write, counted from
        the optimized HLO (GPU only, where XLA's cost model gives nothing without a device:
        :mod:`mpjax.planning.traffic` says how); None on a TPU, whose estimate covers them.
      rejected_seconds: XLA's cost model's time for one call where it is no time (zero or
        negative, seen for large steps on a v5e and a TPU7x), which the plan does not take as
        an estimate; None otherwise.
      modelled_flops: the FLOPs XLA's cost model counts for one call (TPU only): fewer than the
        plan's matmul FLOPs where a custom call (a Pallas kernel) declares less than it does, or
        nothing, so the estimate leaves that work out.
      peak_flops: the device's peak bfloat16 matmul rate, FLOP/s (its chip's, divided among the
        chip's cores where the target has several devices per chip).
      compiled: False when the compile failed for lack of memory (TPU): then ``memory`` says by
        how much, and nothing else was read.
      collectives: what the step sends between devices (:class:`PlanCollective`), in HLO
        order; empty for one device.
      loop_trips: the trip count of each loop of the optimized HLO (``scan`` over layers,
        ``fori_loop``, and loops XLA makes itself); the plan's FLOPs count every iteration.
      loops: the step's loops as the TPU estimate counts them (:class:`PlanLoop`): XLA's cost
        model counts a loop's body once, so the plan compiles the step again with its scans
        unrolled and takes that compile's estimate, each body counted its trip count times
        (:mod:`mpjax.planning.loops`). A step with a ``while_loop`` gets no estimate.
      adjustments: the options the plan set itself so that the step compiles without the
        device (in ``options`` too), each as ``"name=value: why"``; the summary says them.
    """

    target: str
    device: str
    jax_version: str
    options: tuple[tuple[str, Any], ...]
    gemms: tuple[PlanGemm, ...]
    attention: tuple[PlanAttention, ...]
    scatters: tuple[PlanScatter, ...]
    fusions: int
    custom_calls: int
    hlo_text: str = dataclasses.field(default="", repr=False, compare=False)
    autotuned: bool = False
    platform: str = "gpu"
    devices: int = 1
    memory: PlanMemory | None = None
    estimated_seconds: float | None = None
    bytes_accessed: float | None = None
    fusion_bytes: int | None = None
    modelled_flops: float | None = None
    rejected_seconds: float | None = None
    peak_flops: float | None = None
    compiled: bool = True
    collectives: tuple[PlanCollective, ...] = ()
    loop_trips: tuple[int, ...] = ()
    loops: tuple[PlanLoop, ...] = ()
    adjustments: tuple[str, ...] = ()

    @classmethod
    def from_hlo_text(cls, hlo_text: str, *, device: str, target: str = "") -> Plan:
        """The plan of an optimized GPU HLO module given as text: on a GPU, that of a compiled
        step, ``jax.jit(step).lower(*args).compile().as_text()``, which XLA autotuned for that
        GPU (what :func:`plan` cannot see without one).

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
                f"Plan.from_hlo_text takes the HLO module's text, got {type(hlo_text).__name__}."
            )
        if "HloModule" not in hlo_text:
            raise ValueError(
                "Plan.from_hlo_text takes an optimized HLO module's text (it starts with "
                f"'HloModule'), got {hlo_text[:60]!r}."
            )
        return cls(
            target=target,
            device=device,
            jax_version=jax.__version__,
            options=(),
            hlo_text=hlo_text,
            autotuned=True,
            **_read(hlo_text, "gpu"),
        )

    def _matmuls(self) -> Iterator[tuple[np.dtype, np.dtype, int, str]]:
        for g in self.gemms:
            yield g.lhs_dtype, g.rhs_dtype, g.flops * g.executions, g.precision
        for a in self.attention:
            # A fused kernel multiplies as its code says, which the HLO does not show.
            yield a.dtype, a.dtype, a.flops * a.executions, "kernel"

    @property
    def total_flops(self) -> int:
        """The matmul FLOPs of one call, GEMMs and fused attention, loop trip counts
        included."""
        return sum(flops for _, _, flops, _ in self._matmuls())

    @property
    def block_scaled_flops(self) -> int:
        """The matmul FLOPs of one call in block-scaled GEMMs (``PlanGemm.block_scaled``: MXFP8
        or NVFP4 on a Blackwell GPU); ``flop_share("block_scaled")`` is their share."""
        return sum(g.flops * g.executions for g in self.gemms if g.block_scaled)

    def flops_by_dtype(self) -> dict[str, int]:
        """Matmul FLOPs (GEMMs and fused attention, loop trip counts included) by operand
        dtype: ``"bfloat16"`` when both operands have that dtype, ``"float8_e4m3fn x
        float8_e5m2"`` when they differ. Largest first."""
        totals: dict[str, int] = {}
        for lhs, rhs, flops, _ in self._matmuls():
            key = dtype_key(lhs, rhs)
            totals[key] = totals.get(key, 0) + flops
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def float32_precisions(self) -> dict[str, int]:
        """The matmul FLOPs with a float32 operand by the precision they run at
        (``"default"``, ``"high"``, ``"highest"``, a dot algorithm, or ``"kernel"`` for a fused
        attention kernel, which multiplies as its code says): what "float32" means there. Largest first; empty without float32 matmuls."""
        totals: dict[str, int] = {}
        for lhs, rhs, flops, precision in self._matmuls():
            if np.dtype(np.float32) in (lhs, rhs):
                totals[precision] = totals.get(precision, 0) + flops
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

    def flop_share(self, dtype: Any) -> float:
        """The fraction of the matmul FLOPs (:meth:`flops_by_dtype`) whose operands are all of
        ``dtype``, or that run in block-scaled GEMMs; 0.0 when the function has no matmul.

        Args:
          dtype: a dtype (``jnp.bfloat16``, ``"bfloat16"``, ``np.float32``), ``"fp8"`` (``"fp4"``)
            for any 8-bit (4-bit) float operands, e4m3 and e5m2 mixed included, or
            ``"block_scaled"`` for block-scaled GEMMs (:attr:`block_scaled_flops`).

        Raises:
          ValueError: if ``dtype`` is none of these.
        """
        name = dtype.lower() if isinstance(dtype, str) else None
        if name == "block_scaled":
            return self.block_scaled_flops / self.total_flops if self.total_flops else 0.0
        if name in ("fp8", "fp4"):

            def matches(d: np.dtype) -> bool:
                return d.name.startswith(f"float{name[2]}")

        else:
            try:
                wanted = np.dtype(jnp.dtype(dtype))
            except TypeError:
                raise ValueError(
                    "flop_share: dtype must be 'fp8', 'fp4', 'block_scaled' or a dtype such as "
                    f"'bfloat16' or jnp.float32, got {dtype!r}."
                ) from None

            def matches(d: np.dtype) -> bool:
                return d == wanted

        total = self.total_flops
        if total == 0:
            return 0.0
        hits = sum(f for lhs, rhs, f, _ in self._matmuls() if matches(lhs) and matches(rhs))
        return hits / total

    @property
    def roofline_seconds(self) -> float | None:
        """A lower bound on one call's time, each matmul's FLOPs at the device's published
        peak for its operand dtypes and float32 precision, summed; memory traffic and
        everything that is no matmul taken as free. None for a plan read from HLO text alone
        (no target figures). A bound computed from the plan, not a measurement."""
        return self._seconds_at_peak(self._matmuls())

    def _seconds_at_peak(
        self, matmuls: Iterable[tuple[np.dtype, np.dtype, int, str]]
    ) -> float | None:
        """``matmuls`` (as :meth:`_matmuls` gives them) at the device's published peaks for
        their operand dtypes and precision, summed; None without target figures."""
        target = known_target(self.target)
        if target is None:
            return None
        share = self.peak_flops / target.chip.peak_flops["bf16"] if self.peak_flops else 1
        return sum(
            flops / (target.peak_flops(lhs.name, rhs.name, precision) * share)
            for lhs, rhs, flops, precision in matmuls
        )

    @property
    def fusion_seconds(self) -> float | None:
        """``fusion_bytes`` at the device's published memory bandwidth: the least time the
        kernels that are no matmul (norms, casts, quantizations, the optimizer) take, which
        :attr:`roofline_seconds` leaves out. None without a count (TPU plans) or target
        figures. A bound from the compiled program, not a measurement."""
        target = known_target(self.target)
        if self.fusion_bytes is None or target is None:
            return None
        return self.fusion_bytes / target.chip.hbm_bandwidth

    @property
    def uncosted_seconds(self) -> float | None:
        """The time XLA's estimate leaves out for the fused attention kernels that declare no
        cost (``PlanAttention.declares_cost``: Pallas's backward kernels), taken as their
        nominal FLOPs at the device's published peak: a causal mask's skipped blocks are not
        discounted, nor the scores' recomputation added. 0.0 where every kernel declares its
        cost; None without an estimate or target figures. Added to
        ``estimated_seconds``, it gives the fuller estimate the summary shows."""
        if self.estimated_seconds is None:
            return None
        return self._seconds_at_peak(
            (a.dtype, a.dtype, a.flops * a.executions, "kernel")
            for a in self.attention
            if not a.declares_cost
        )

    def mfu(self, model_flops: float | None = None) -> float | None:
        """The estimated model FLOPs utilization: ``model_flops`` (per device per call; by
        default the plan's own matmul FLOPs, which count recomputation too) over XLA's
        estimated time at the device's bfloat16 peak. None without an estimate (GPU targets).
        An estimate, since the time is.

        Raises:
          ValueError: if ``model_flops`` is not a positive number.
        """
        if model_flops is not None and (
            isinstance(model_flops, bool)
            or not isinstance(model_flops, (int, float))
            or model_flops <= 0
        ):
            raise ValueError(
                f"Plan.mfu: model_flops must be a positive number of FLOPs, got {model_flops!r}."
            )
        if not self.estimated_seconds or not self.peak_flops:
            return None
        flops = self.total_flops if model_flops is None else model_flops
        return flops / (self.estimated_seconds * self.peak_flops)

    def __str__(self) -> str:
        return self.table()

    def collective_bytes(self) -> dict[str, int]:
        """Bytes per device and call that the collectives move, by kind and dtype
        (``"all-gather bfloat16"``; ``PlanCollective.bytes`` says what is counted), in the
        order of :data:`~mpjax.planning.collectives.COLLECTIVE_KINDS`."""
        return bytes_by_kind(self.collectives)

    def collective_seconds(self) -> float | None:
        """A lower bound on the time the collectives take (TPU): what each device sends at its
        chip's published interconnect bandwidth, none of it overlapped with compute (XLA
        overlaps much of it). None where the target's bandwidth is not known (GPUs)."""
        target = known_target(self.target)
        if target is None or not target.chip.interconnect_bandwidth or not self.collectives:
            return None
        return seconds_bound(self.collectives, target.chip.interconnect_bandwidth)

    def summary(self) -> str:
        """The verdict lines: memory against the device's, the estimated time and MFU, the
        roofline bound, the FLOP shares by dtype and float32 precision, and block-scaled GEMMs."""
        lines = []
        if self.memory is not None:
            lines.append(str(self.memory))
        if not self.compiled:
            lines.append("the compile stopped there: nothing else to read")
            return "\n".join(lines)
        if self.estimated_seconds is not None:
            mfu = self.mfu()
            lines.append(
                f"estimated time per call (XLA's cost model, an estimate): "
                f"{seconds_text(self.estimated_seconds)}"
                + (f", estimated MFU {mfu:.1%} of the bf16 peak" if mfu is not None else "")
            )
        uncosted = self.uncosted_seconds
        if uncosted and self.estimated_seconds:
            kernels = sum(a.executions for a in self.attention if not a.declares_cost)
            fuller = self.estimated_seconds + uncosted
            mfu = self.mfu()
            lines.append(
                f"the estimate leaves out {kernels} attention kernel run"
                f"{'s' * (kernels != 1)} that declare no cost to XLA (Pallas's backward): at "
                f"their nominal FLOPs at the peak, {seconds_text(uncosted)} more, "
                f"{seconds_text(fuller)} in all"
                + (
                    f", estimated MFU {mfu * self.estimated_seconds / fuller:.1%}"
                    if mfu is not None
                    else ""
                )
            )
        lines += loop_lines(self.loops)
        if self.rejected_seconds is not None and not self.loops:
            lines.append(
                f"no time estimate: XLA's cost model gave {self.rejected_seconds:.3g} s for one "
                "call, which is no time"
            )
        if self.modelled_flops is not None and self.modelled_flops < 0.95 * self.total_flops:
            lines.append(
                f"XLA's cost model counts {flops_text(int(self.modelled_flops))} FLOPs in all, "
                f"fewer than the {flops_text(self.total_flops)} of the matmuls: custom calls "
                f"({self.custom_calls}) count only what their own cost estimates declare and a "
                "loop XLA made (a matmul split over permutes) counts its body once, so the "
                "estimate leaves work out"
            )
        roofline = self.roofline_seconds
        if roofline:
            lines.append(
                f"roofline bound (matmul FLOPs at the published peaks): {seconds_text(roofline)}"
            )
        traffic = self.fusion_seconds
        if roofline and traffic is not None and self.fusion_bytes is not None:
            lines.append(
                f"fusions that are no matmul move {bytes_text(self.fusion_bytes)}: a bound of "
                f"{seconds_text(traffic)} at the published memory bandwidth, "
                f"{seconds_text(roofline + traffic)} with the matmuls, none overlapped"
            )
        if self.collectives:
            moved = ", ".join(f"{k} {bytes_text(v)}" for k, v in self.collective_bytes().items())
            lines.append(f"collectives per device and call: {moved}")
        bound, estimate = self.collective_seconds(), self.estimated_seconds
        if bound is not None:
            share = f", {bound / estimate:.0%} of the estimated step" if estimate else ""
            lines.append(
                "collectives at the chips' published interconnect bandwidth, not overlapped: "
                f"at least {seconds_text(bound)}{share}"
            )
        total = self.total_flops
        if total:
            shares = ", ".join(
                f"{key} {flops / total:.1%}" for key, flops in self.flops_by_dtype().items()
            )
            lines.append(f"matmul FLOPs: {flops_text(total)} ({shares})")
            precisions = self.float32_precisions()
            if precisions:
                f32 = sum(precisions.values())
                lines.append(
                    "float32 matmuls at precision: "
                    + ", ".join(f"{k} {v / f32:.1%}" for k, v in precisions.items())
                )
        lines += block_scaled_lines(self.gemms, total, known_target(self.target))
        lines += grouped_lines(self.gemms, known_target(self.target))
        lines += [f"compiled with {adjustment}" for adjustment in self.adjustments]
        return "\n".join(lines)

    def table(self) -> str:
        """The plan as text: the GEMMs, the fused attention, the scatters, the kernel counts,
        the summary (:meth:`summary`) and the limits of the compile."""
        options = ", ".join(f"{k}={v}" for k, v in self.options) or "XLA's defaults"
        where = f"{self.devices} devices" if self.devices > 1 else "one device"
        parts = [
            f"{self.platform.upper()} plan for {self.target} ({self.device}, {where}), jax "
            f"{self.jax_version}, {options}",
            "",
        ]
        gemms = [
            (
                g.name,
                g.computation,
                g.library,
                shape_text(g.lhs_dtype, g.lhs_shape),
                shape_text(g.rhs_dtype, g.rhs_shape),
                g.out_dtype.name,
                g.precision if np.dtype(np.float32) in (g.lhs_dtype, g.rhs_dtype) else "",
                flops_text(g.flops),
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
                flops_text(a.flops),
                str(a.executions),
            )
            for a in self.attention
        ]
        scatters = [(s.name, s.computation, s.dtype.name, str(s.executions)) for s in self.scatters]
        header = ("GEMM", "computation", "library", "lhs", "rhs", "out", "f32 precision")
        parts += _section(header + ("FLOPs", "runs"), gemms) or (
            ["no GEMMs", ""] if self.compiled else []
        )
        parts += _section(("attention", "target", "pass", "dtype", "FLOPs", "runs"), attention)
        parts += _section(("scatter", "computation", "dtype", "runs"), scatters)
        known = known_target(self.target)
        bandwidth, estimate = (
            known.chip.interconnect_bandwidth if known else 0.0,
            self.estimated_seconds,
        )
        parts += _section(*table_rows(self.collectives, bandwidth, estimate))
        if self.compiled:
            fusions = f"{self.fusions} fusion{'s' * (self.fusions != 1)}"
            calls = f"{self.custom_calls} custom call{'s' * (self.custom_calls != 1)}"
            parts.append(f"kernels: {fusions}, {calls}")
        parts += [line for line in self.summary().split("\n") if line]
        parts.append(self.limits)
        return "\n".join(parts)

    @property
    def limits(self) -> str:
        """What the plan cannot tell, as the table's last line says it."""
        if self.autotuned:
            return (
                "Limits: read from a compile on the GPU itself (autotuned, as it runs); the plan "
                "has no timings."
            )
        if self.platform == "tpu":
            return (
                "Limits: a compile without a TPU: nothing ran, so times are XLA's estimate and a "
                "roofline bound, not measurements; a custom call (a Pallas kernel) counts in the "
                "estimate only as much as its own cost estimate says."
            )
        return (
            "Limits: a deviceless compile (no GPU): no autotuning, so Triton GEMM tiles are "
            "untuned and a real GPU may choose cuBLAS or Triton differently per GEMM; nothing "
            "ran, so no timings (the roofline bound is computed, not measured)."
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-serialisable data: the fields (dtypes as names, the HLO text
        left out), ``flops_by_dtype``, the float32 precisions, ``block_scaled_flops``, the
        estimates (each named an estimate or a bound) and ``limits``."""
        memory = None
        if self.memory is not None:
            memory = {
                **dataclasses.asdict(self.memory),
                "total_bytes": self.memory.total_bytes,
                "fits": self.memory.fits,
                "margin_bytes": self.memory.margin_bytes,
            }
        return {
            "target": self.target,
            "device": self.device,
            "platform": self.platform,
            "devices": self.devices,
            "jax_version": self.jax_version,
            "options": dict(self.options),
            "compiled": self.compiled,
            "gemms": [_row(g) for g in self.gemms],
            "attention": [_row(a) for a in self.attention],
            "scatters": [_row(s) for s in self.scatters],
            "collectives": [{**_row(c), "backward": c.backward} for c in self.collectives],
            "collective_bytes": self.collective_bytes(),
            "fusions": self.fusions,
            "custom_calls": self.custom_calls,
            "flops_by_dtype": self.flops_by_dtype(),
            "float32_precisions": self.float32_precisions(),
            "block_scaled_flops": self.block_scaled_flops,
            "memory": memory,
            "estimated_seconds": self.estimated_seconds,
            "uncosted_seconds": self.uncosted_seconds,
            "estimated_mfu": self.mfu(),
            "bytes_accessed": self.bytes_accessed,
            "fusion_bytes": self.fusion_bytes,
            "fusion_seconds": self.fusion_seconds,
            "modelled_flops": self.modelled_flops,
            "rejected_seconds": self.rejected_seconds,
            "loops": [{**_row(loop), "modelled": loop.modelled} for loop in self.loops],
            "adjustments": list(self.adjustments),
            "roofline_seconds": self.roofline_seconds,
            "peak_flops": self.peak_flops,
            "autotuned": self.autotuned,
            "limits": self.limits,
        }


# --- Compiling ------------------------------------------------------------------------------


def _estimate(cost: Mapping[str, float]) -> float | None:
    """XLA's estimated seconds, or None where its cost model gave none it could stand by: a
    v5e compile with many custom calls has returned a negative time."""
    seconds = cost.get("optimal_seconds")
    return seconds if seconds is not None and seconds > 0 else None


def plan(
    fn: Callable[..., Any],
    /,
    target: str = "h100",
    *,
    triton_gemm: bool | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[..., Plan]:
    """What ``fn`` would run on a GPU or a TPU, compiled on this machine without one; curried
    like ``jax.make_jaxpr``: ``plan(fn, target)(*args, **kwargs)``.

    Compiles ``jax.jit(fn)`` for the ``target`` and reads XLA's optimized HLO and analyses:
    every matmul with its operand dtypes and float32 precision (and on a GPU the library that
    runs it), fused attention, scatters with the dtype they accumulate in, kernel counts, the
    memory each device needs against its HBM, and on a TPU XLA's estimated time and MFU. Use it
    to check that a mixed-precision training step gets bf16 (or fp8) matmuls and fused
    attention, and fits, before renting the hardware. Needs ``pip install "mpjax[cuda12]"``
    for a GPU, ``pip install "mpjax[tpu]"`` for a TPU (both install without the hardware) and
    ``JAX_PLATFORMS=cpu`` set before JAX starts; :func:`plan_unavailable` says whether it can
    run.

    Limits: nothing runs, so times are estimates (XLA's cost model on a TPU) and bounds (the
    roofline), never measurements; on a GPU XLA does not autotune without one, so Triton GEMMs
    keep an untuned tile and a real GPU may choose cuBLAS or Triton differently for each GEMM
    (``triton_gemm=False`` shows every GEMM as cuBLAS).

    Args:
      fn: a function JAX can ``jit``. One already wrapped in ``jax.jit`` is lowered as it is,
        so its static arguments stay static.
      target: a GPU, ``"h100"`` (H100 SXM 80GB), ``"a100"`` (A100 SXM 80GB), ``"h200"``,
        ``"b200"``, ``"gb200"`` (a GB200's GPU), ``"b300"`` or ``"gb300"``; GPUs on hosts (``"h100:2x8"``,
        ``"b200:8"``); a TPU chip, ``"v4"``, ``"v5e"``, ``"v5p"`` or ``"v6e"``; or a TPU slice
        (``"v5p:2x2x1"``). :func:`plan_mesh` gives a target's devices for sharded arguments
        (unsharded ones are replicated on every device).
      triton_gemm: GPU only. None keeps XLA's default (GEMMs become Triton fusions where XLA
        supports them); False sets ``xla_gpu_enable_triton_gemm=False``, which sends every GEMM
        to cuBLAS(Lt); True sets it True.
      compiler_options: more XLA options for the compile (``{"xla_gpu_...": value}``).

    Returns:
      A function that takes example arguments of ``fn`` exactly as ``fn`` takes them (arrays or
      ``jax.ShapeDtypeStruct`` trees; only shapes, dtypes and shardings are read) and returns a
      :class:`Plan`. It raises :class:`PlanUnavailableError` when the CUDA plugin or libtpu is
      missing or did not start.

    Raises:
      TypeError: if ``fn`` is not callable, ``triton_gemm`` not None or a bool, or
        ``compiler_options`` not a mapping with string keys.
      ValueError: if ``target`` is unknown, ``triton_gemm`` is given for a TPU, or
        ``triton_gemm`` and ``compiler_options`` set ``xla_gpu_enable_triton_gemm``
        differently.

    >>> import jax.numpy as jnp
    >>> x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    >>> w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    >>> p = plan(jnp.matmul, triton_gemm=False)(x, w)  # doctest: +SKIP
    >>> [(g.library, g.lhs_dtype.name, g.flops) for g in p.gemms]  # doctest: +SKIP
    [('cublaslt', 'bfloat16', 268435456)]
    >>> plan(jnp.matmul, "v5p")(x, w).estimated_seconds  # doctest: +SKIP
    2.1e-06
    """
    check_function("plan", fn)
    parsed = parse_target(target)
    if triton_gemm is not None and not isinstance(triton_gemm, bool):
        raise TypeError(f"plan: triton_gemm must be None, True or False, got {triton_gemm!r}.")
    if triton_gemm is not None and parsed.platform == "tpu":
        raise ValueError(
            f"plan: triton_gemm chooses between GPU GEMM libraries; target {parsed.name!r} is a "
            "TPU. Leave it None."
        )
    if compiler_options is None:
        compiler_options = {}
    if not isinstance(compiler_options, Mapping) or not all(
        isinstance(k, str) for k in compiler_options
    ):
        raise TypeError(
            "plan: compiler_options must be a mapping from XLA option names to values, "
            f"got {compiler_options!r}."
        )
    options = dict(compiler_options)
    if triton_gemm is not None:
        given = options.setdefault("xla_gpu_enable_triton_gemm", triton_gemm)
        if given != triton_gemm:
            raise ValueError(
                f"plan: triton_gemm={triton_gemm} but compiler_options sets "
                f"xla_gpu_enable_triton_gemm={given!r}; set one of them."
            )
    trace = fn.trace if hasattr(fn, "trace") else jax.jit(fn).trace

    def compile_plan(*args: Any, **kwargs: Any) -> Plan:
        devices, device, per_chip = target_devices(parsed.name)
        capacity = parsed.chip.hbm_bytes // per_chip
        peak = parsed.chip.peak_flops["bf16"] / per_chip
        common: dict[str, Any] = {
            "target": parsed.name,
            "device": device,
            "jax_version": jax.__version__,
            "options": tuple(sorted(options.items())),
            "platform": parsed.platform,
            "devices": len(devices),
            "peak_flops": peak,
        }
        args, kwargs = on_target(args, kwargs, devices, parsed.name)
        # No host callback lowers for a device this process lacks (a loss-scaled step is
        # planned without its overflow warning's), and the plan says itself whether the target
        # runs block-scaled GEMMs or emulates them.
        with compile_only():
            traced = trace(*args, **kwargs)
            lowered = traced.lower()
        try:
            result = deviceless.deviceless_compile(lowered, options)
        except Exception as error:
            memory = out_of_memory(error, capacity)
            if memory is None:
                raise
            empty: dict[str, Any] = {"gemms": (), "attention": (), "scatters": ()}
            return Plan(**common, **empty, fusions=0, custom_calls=0, memory=memory, compiled=False)
        read = _read(result.hlo_text, parsed.platform)
        if result.changed:  # options the compile set to compile without the device
            set_here = {name: value for name, value, _ in result.changed}
            common["options"] = tuple(sorted({**options, **set_here}.items()))
            common["adjustments"] = tuple(
                f"{name}={value}: {why}" for name, value, why in result.changed
            )
        # XLA's cost model counts a loop's body once: each body is counted its trip count
        # times from compiles with the loops unrolled further (none for a while_loop).
        cost, loops = (
            loop_costs(traced, result, options) if parsed.platform == "tpu" else (None, ())
        )
        cost = cost or {}
        estimate = _estimate(cost)
        rejected = cost.get("optimal_seconds") if estimate is None else None
        if rejected is not None:
            why = f"XLA's cost model gave {rejected:.3g} s for the step with them unrolled"
            loops = tuple(dataclasses.replace(loop, modelled=False, why=why) for loop in loops)
        return Plan(
            **common,
            hlo_text=result.hlo_text,
            memory=memory_of(result.memory, capacity),
            loops=loops,
            estimated_seconds=estimate,
            rejected_seconds=rejected,
            bytes_accessed=cost.get("bytes accessed"),
            modelled_flops=cost.get("flops"),
            **read,
        )

    return compile_plan
