"""How mpjax lowers operations: XLA's CPU dots and block-scaled GEMMs as a GPU computes them,
the platform lowering targets, and primitives whose CUDA lowering is a kernel chosen for the
target GPU (see :mod:`mpjax.jax_compat`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax._src import (
    xla_bridge,  # the platform name lowering uses ("cuda" for "gpu")
)
from jax._src.cudnn.scaled_matmul_stablehlo import (
    _scaled_matmul_p as scaled_matmul_p,  # the block-scaled GEMM, for its CPU lowering
)
from jax._src.interpreters import batching as _batching  # a primitive's vmap rule
from jax._src.interpreters import mlir as _mlir  # lowerings: bf16 -> f32 dots on the CPU, kernels
from jax.extend import core as jex_core

from mpjax.jax_compat._jaxprs import _JAX_VERSION


def mixed_fp8_dots() -> bool:
    """Whether this JAX's XLA compiles a GPU ``dot`` whose operands are two different float8
    types (e5m2 x e4m3, the fp8 backward GEMMs) with its default flags.

    XLA's Triton GEMMs of jax 0.8 refuse them ("Dot operation only supports same types for lhs
    and rhs"; cuBLASLt, with Triton GEMMs off, takes them); those of jax 0.10.2 and 0.12 take
    them. Versions in between were not checked, and are treated like 0.8.
    """
    return _JAX_VERSION >= (0, 10, 2)


def mosaic_mixed_fp8_wgmma() -> bool:
    """Whether this JAX's Mosaic GPU multiplies two different float8 types (e5m2 x e4m3, the
    fp8 backward GEMMs) in a Hopper ``wgmma``: jax 0.12's does (PTX takes independent
    ``.atype`` and ``.btype``); jax 0.8.1's refuses ("WGMMA requires A and B to have the same
    element type"). Versions in between were not checked, and are treated like 0.8.1."""
    return _JAX_VERSION >= (0, 12)


def widen_narrow_dots_on_cpu() -> None:
    """Lowers a CPU ``dot_general`` of two bf16 (or f16) operands with an f32 result (the
    reduce dtype's weight gradients) on operands widened to f32: XLA's CPU runtime lacks that
    dot ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32", jax 0.8.1 and
    0.12, in some fusions), and the products of two bf16 values are exact in f32."""
    entry = _mlir._platform_specific_lowerings["cpu"][lax.dot_general_p]
    rule: Any = getattr(entry, "rule", entry)
    if getattr(rule, "_mpjax_widens", False):
        return

    def lower(ctx: Any, lhs: Any, rhs: Any, **params: Any) -> Any:
        avals, (out,) = list(ctx.avals_in), ctx.avals_out
        narrow = {np.dtype(jax.numpy.bfloat16), np.dtype(np.float16)}
        if {np.dtype(a.dtype) for a in avals} <= narrow and out.dtype == np.float32:
            wide = [a.update(dtype=np.dtype(np.float32)) for a in avals]
            lhs, rhs = (_mlir.convert_hlo(ctx, x, a, w) for x, a, w in zip((lhs, rhs), avals, wide))
            ctx = ctx.replace(avals_in=wide)
        return rule(ctx, lhs, rhs, **params)

    lower._mpjax_widens = True  # type: ignore[attr-defined]
    _mlir.register_lowering(lax.dot_general_p, lower, platform="cpu")


def lowering_platform() -> str:
    """The platform name JAX lowers for on the default backend, as ``lax.platform_dependent``
    and :func:`cond_platforms` name platforms: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``
    (``jax.default_backend()`` says ``"gpu"`` for the GPU ones)."""
    return xla_bridge.canonicalize_platform(jax.default_backend())


BLOCK_SCALED_MATMUL = "scaled_matmul_wrapper"
"""The jaxpr primitive of ``jax.nn.scaled_matmul`` (the same name in jax 0.8.1 and 0.12): a
block-scaled GEMM on ``(B, M, K)`` and ``(B, N, K)`` values and their block scales."""


def emulate_block_scaled_matmuls_on_cpu() -> None:
    """Lowers ``jax.nn.scaled_matmul`` on the CPU as a Blackwell GEMM computes it: the values
    times their block scales, multiplied and accumulated in float32, rounded once to the output
    dtype. jax 0.8.1 has no CPU lowering; 0.12's multiplies in the output dtype, and inside a
    larger jit XLA's CPU may then accumulate a bf16 GEMM in bf16 (2% off over 64 terms)."""
    lowering = _mlir.lower_fun(_emulated, multiple_results=False)
    _mlir.register_lowering(scaled_matmul_p, lowering, platform="cpu")


def _emulated(a: Any, b: Any, a_scales: Any, b_scales: Any, *, preferred_element_type: Any):
    f32 = np.float32  # (B, M, K) as (B, M, K / block, block), times its scales
    a, b = (
        x.reshape(*s.shape, -1).astype(f32) * s.astype(f32)[..., None]
        for x, s in ((a, a_scales), (b, b_scales))
    )
    dims = (((2, 3), (2, 3)), ((0,), (0,)))
    out = lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=f32)
    return out.astype(preferred_element_type)


# --- Primitives lowered per GPU: kernels chosen for the target at lowering --------------


class GpuTarget(NamedTuple):
    """The GPU a lowering for CUDA is for: its device (a compile-only one in a compile without
    the hardware), compute capability as ``(major, minor)`` and number of SMs."""

    device: Any
    capability: tuple[int, int]
    cores: int


def _lowering_target(ctx: Any) -> GpuTarget | None:
    """The GPU a CUDA lowering rule's ``ctx`` lowers for: the first device of the backend the
    module is compiled by (the CUDA plugin's compile-only client in a deviceless compile, whose
    devices know their compute capability; ``ctx.module_context.get_backend()`` would look for
    a local GPU and fail there), or None where none is known."""
    backend = getattr(ctx.module_context, "backend", None)
    devices = backend.devices() if backend is not None else []
    if not devices:
        return None
    device = devices[0]
    capability = getattr(device, "compute_capability", None)
    if not capability:
        return None
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return GpuTarget(device, (major, minor), int(getattr(device, "core_count", 0) or 0))


@contextlib.contextmanager
def _as_default_gpu(target: GpuTarget) -> Any:
    """Makes ``target``'s device the one Mosaic GPU kernels are written for while they are
    lowered: Mosaic reads the architecture from the default device, and JAX's grouped-GEMM
    kernels read the SM count from ``jax.devices()[0]`` / ``jax.local_devices()[0]`` as they
    are traced, which in a compile without the hardware are this machine's CPU."""
    saved = jax.devices, jax.local_devices
    local = jax.devices()[0].platform == "gpu"
    try:
        if not local:
            jax.devices = lambda *a, **k: [target.device]
            jax.local_devices = lambda *a, **k: [target.device]
        with jax.default_device(target.device):
            yield
    finally:
        jax.devices, jax.local_devices = saved


def gpu_chosen_primitive(
    name: str,
    abstract_eval: Callable[..., Any],
    default: Callable[..., Any],
    choose: Callable[[GpuTarget, Sequence[Any], dict], Callable[..., Any] | None],
    cpu: Callable[..., Any] | None = None,
) -> Any:
    """A primitive that computes ``default`` (XLA's operations) wherever it runs, except that
    lowered for a CUDA GPU it computes what ``choose(target, avals, params)`` returns for that
    GPU (a Pallas kernel), when it returns one. The choice is made per target as the program is
    lowered, so one traced step gets the Hopper kernel compiled for an H100, the Blackwell one
    for a B200 and XLA's path elsewhere, with or without the hardware.

    ``abstract_eval(*avals, **params)`` gives the output's shape and dtype (a
    ``jax.ShapeDtypeStruct``); ``default(*args, **params)`` and the chosen function compute it
    from arrays. Batched by ``jax.vmap``, it computes ``default`` for each element in turn. It
    has no derivative of its own: it is meant to be called from a ``jax.custom_vjp``. ``cpu``,
    if given, is what it computes lowered for the CPU (XLA's CPU may accumulate a bf16 GEMM in
    bf16 where a GPU or a TPU accumulates in f32)."""
    primitive = jex_core.Primitive(name)
    primitive.def_impl(default)
    primitive.def_abstract_eval(
        lambda *avals, **params: jax.core.ShapedArray(
            abstract_eval(*avals, **params).shape, abstract_eval(*avals, **params).dtype
        )
    )
    _mlir.register_lowering(primitive, _mlir.lower_fun(default, multiple_results=False))
    if cpu is not None:
        _mlir.register_lowering(
            primitive, _mlir.lower_fun(cpu, multiple_results=False), platform="cpu"
        )

    def cuda(ctx: Any, *args: Any, **params: Any) -> Any:
        target = _lowering_target(ctx)
        chosen = None if target is None else choose(target, ctx.avals_in, params)
        if target is None or chosen is None:
            return _mlir.lower_fun(default, multiple_results=False)(ctx, *args, **params)
        with _as_default_gpu(target):
            return _mlir.lower_fun(chosen, multiple_results=False)(ctx, *args, **params)

    _mlir.register_lowering(primitive, cuda, platform="cuda")

    def batched(args: Sequence[Any], dims: Sequence[Any], **params: Any) -> tuple[Any, int]:
        # One call per element of the batch (lax.map): XLA's own ragged dot has no vmap rule
        # for most batch axes.
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        moved = [
            jax.numpy.broadcast_to(x, (size, *x.shape))
            if d is None
            else jax.numpy.moveaxis(x, d, 0)
            for x, d in zip(args, dims)
        ]
        return lax.map(lambda a: default(*a, **params), moved), 0

    _batching.primitive_batchers[primitive] = batched
    return primitive


def mosaic_gpu_interpretable() -> bool:
    """Whether Pallas can interpret Mosaic GPU kernels on any platform: jax 0.12 can
    (``force_gpu_interpret_mode``); jax 0.8.1 has no GPU interpreter."""
    from jax.experimental.pallas import mosaic_gpu  # its kernels: where they are asked for

    return hasattr(mosaic_gpu, "force_gpu_interpret_mode")


@contextlib.contextmanager
def mosaic_gpu_interpreted(cores: int = 4, detect_races: bool = False) -> Any:
    """Runs the Mosaic GPU kernels traced inside it with Pallas's GPU interpreter, slowly, on
    any platform: how the grouped-GEMM kernels' numbers are checked on a CPU. The kernels read
    the number of SMs off ``jax.devices()[0]`` as they are traced; here they see ``cores``.
    With ``detect_races``, the interpreter raises on a read or write of shared memory that no
    barrier orders against another thread's (a stage of a pipeline refilled too early)."""
    from jax.experimental.pallas import mosaic_gpu  # its kernels: where they are asked for

    device = type("InterpretedGpu", (), {"core_count": cores, "platform": "gpu"})()
    saved = jax.devices, jax.local_devices
    try:
        jax.devices = lambda *a, **k: [device]
        jax.local_devices = lambda *a, **k: [device]
        with mosaic_gpu.force_gpu_interpret_mode(
            mosaic_gpu.InterpretGPUParams(detect_races=detect_races)
        ):
            yield
    finally:
        jax.devices, jax.local_devices = saved
