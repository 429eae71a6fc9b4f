"""What a trace knows of the devices it runs on (the mesh and platform of a traced value's
sharding), Pallas's TPU flash attention and interpreter, and the environment compile-only
devices need before JAX starts its backends (see :mod:`mpjax.jax_compat`)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

from mpjax.jax_compat._jaxprs import _JAX_VERSION

PALLAS_BLOCK = pallas_flash.MIN_BLOCK_SIZE
"""The block size of Pallas's TPU flash attention along both sequences, forward and backward
(JAX's default block sizes): sequence lengths must be multiples of it."""


def pallas_flash_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool, scale: float
) -> jax.Array:
    """Pallas's TPU flash attention (forward and backward kernels, through its ``custom_vjp``)
    on ``[batch, heads, length, head_dim]`` operands, with JAX's default block sizes
    (``PALLAS_BLOCK``, 128, along both sequences, one batch row a block).

    It lowers to Mosaic ``tpu_custom_call`` instructions, which compile for TPUs only, unless traced in
    :func:`pallas_tpu_interpreted`.
    """
    b, n, t, h = query.shape
    blocks = pallas_flash.BlockSizes.get_default(b, n, t, key.shape[2], h)
    return pallas_flash.flash_attention(
        query, key, value, causal=is_causal, sm_scale=scale, block_sizes=blocks
    )


def partitioned_axes(x: Any) -> dict[str, int]:
    """The axes of the mesh of ``x``'s sharding as it is traced that XLA partitions the step
    over, by name, with their sizes: the input shardings of a ``jax.jit`` reach every value
    computed from them, on an abstract mesh of all the step's devices. Axes of one device and
    the manual axes of an enclosing ``shard_map`` (whose values are one device's share
    already) are left out; an unsharded value, or one traced outside ``jit``, has none. A Mosaic
    kernel (Pallas) cannot be partitioned by XLA: it runs on these axes under a ``shard_map``
    of :func:`traced_mesh`."""
    mesh = traced_mesh(x)
    if mesh is None:
        return {}
    manual = manual_axes(x)
    return {name: int(size) for name, size in mesh.shape.items() if size > 1 and name not in manual}


def manual_axes(x: Any) -> frozenset[str]:
    """The axes of the mesh of ``x``'s sharding as it is traced that an enclosing ``shard_map``
    made manual (none outside one)."""
    mesh = traced_mesh(x)
    if mesh is None:
        return frozenset()
    types = zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False)
    return frozenset(name for name, kind in types if kind == jax.sharding.AxisType.Manual)


def varying_axes(x: Any) -> tuple[str, ...]:
    """The manual axes of an enclosing ``shard_map`` over which ``x`` differs from device to
    device, sorted: the axes it is sharded over there. None outside a ``shard_map``, or under
    one with ``check_vma=False``. jax 0.8.1 keeps them in the type's ``vma``; 0.12 in its
    ``manual_axis_type.varying``."""
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)
    if varying is None:
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return tuple(sorted(varying or ()))


def traced_mesh(x: Any) -> Any:
    """The abstract mesh of ``x``'s sharding as it is traced (``jax.sharding.AbstractMesh``,
    which ``jax.shard_map`` takes), or None where it has none."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return None
    return mesh


def traced_platform(x: Any) -> str | None:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``) of the devices ``x``'s sharding places it
    on as it is traced, read off the abstract device of its mesh (a step lowered for the
    compile-only devices of an ahead-of-time compile names theirs), or None where it names
    none."""
    mesh = traced_mesh(x)
    device = getattr(mesh, "abstract_device", None)
    if device is None:
        return None
    platform = getattr(device, "platform", None)
    if platform is not None:
        return platform
    # jax 0.8's abstract devices have a kind and no platform: "cpu", "TPU v5", "NVIDIA H100".
    kind = str(getattr(device, "device_kind", "")).lower()
    return "cpu" if kind == "cpu" else "tpu" if kind.startswith("tpu") else "gpu" if kind else None


def pallas_interpreter_runs_sharded() -> bool:
    """Whether Pallas's TPU interpreter (:func:`pallas_tpu_interpreted`) runs kernels under a
    ``shard_map`` of several CPU devices. Seen: jax 0.12 runs them; jax 0.8.1's interpreter
    waits on a barrier of every device from host callbacks XLA's CPU runtime runs one at a
    time, and hangs. On TPUs the kernels run under ``shard_map`` on either."""
    return _JAX_VERSION >= (0, 12)


def pallas_tpu_interpreted() -> contextlib.AbstractContextManager[None]:
    """Runs the Pallas TPU kernels traced inside it with Pallas's TPU interpreter, on any
    platform (slowly): how the kernels' numbers are checked on a CPU."""
    return pltpu.force_tpu_interpret_mode()


# --- The environment of compile-only devices, set before JAX starts its backends -------


def _compile_only_environment(platforms: str) -> None:
    """Where ``platforms`` (JAX's ``jax_platforms``, ``"cpu"``, or empty for its default) names
    no CUDA, skips the jax 0.8 CUDA plugin's check of the local CUDA installation (without a GPU
    it fails and leaves the plugin unregistered for compile-only targets, as later plugins no
    longer do); where it names no TPU, lets several processes load libtpu (which locks it to
    one), each compiling for TPU targets (a benchmark's workers). At import, before JAX starts
    its backends."""
    names = {p.strip() for p in platforms.split(",") if p.strip()}
    if names and not names & {"cuda", "gpu"}:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if names and "tpu" not in names:
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


_compile_only_environment(getattr(jax.config, "jax_platforms", None) or "")
