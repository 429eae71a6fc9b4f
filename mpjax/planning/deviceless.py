"""Compiling for a GPU or a TPU this machine does not have: the compile-only devices of JAX's
CUDA plugin (a GPU described by a ``GpuTargetConfigProto`` in text form) and of libtpu (a TPU
slice named by its topology), and the deviceless compile that :func:`mpjax.plan` reads.

Both install without the hardware (``jax[cuda12]``, ``jax[tpu]``). What a compile takes differs
between their versions; every difference seen is handled here, by what the installed version
does rather than by its number (the tests of ``tests/test_plan.py`` on what differs between
JAX versions pin each):

* the CUDA plugin of jax 0.8 needs ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` to start without a GPU
  (set by :mod:`mpjax.jax_compat` as mpjax is imported, before JAX starts its backends), knows
  fewer fields of the GPU description (:func:`cuda_topology`), autotunes Triton GEMMs and
  cannot print a deviceless executable's HLO (:func:`deviceless_compile`);
* a deviceless GPU compile's ``cost_analysis()`` is None; a TPU compile's is XLA's estimate;
* the libtpu of jax 0.8 assumes a host of 2x2x1 chips (:func:`tpu_topology`).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import sys
import tempfile
from typing import Any, NamedTuple

import jax
from jax.experimental import topologies

__all__ = [
    "CudaTopology",
    "DevicelessCompile",
    "cuda_plugin_installed",
    "cuda_topology",
    "deviceless_compile",
    "libtpu_installed",
    "tpu_topology",
]

# --- GPUs: the CUDA plugin ------------------------------------------------------------------

_CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_UNKNOWN_FIELD = re.compile(r'(\d+):\d+: Message type "[\w.]*?(\w+)" has no field named "(\w+)"')
_NEEDS_AUTOTUNING = "autotune result cache hit for deviceless compilation"
# CUB's radix sort (XLA's GPU sort of large arrays) sizes its scratch by asking the device, and
# a compile-only B200 has none to ask: a sort (a mixture of experts' dispatch) fails to compile
# with this; XLA's own sort compiles (an H100's compile does not ask).
_CUB_SORT_NEEDS_DEVICE = "cudaErrorInvalidDevice"
_CUB_SORT = "xla_gpu_enable_cub_radix_sort"
# What this process learned about the installed jaxlib's deviceless compiles: whether Triton
# GEMMs need autotuning off, whether the HLO must be read from an XLA dump (deviceless_compile).
_deviceless: dict[str, bool] = {}


def cuda_plugin_installed() -> bool:
    """Whether a JAX CUDA plugin (``jax[cuda12]`` or ``jax[cuda13]``) is installed."""
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # no jax_plugins package, or a blocked module
            return False
    return False


@contextlib.contextmanager
def _stderr_to(log: Any) -> Any:
    """Points file descriptor 2 at ``log`` while the block runs: XLA's C++ code logs there,
    past ``sys.stderr``."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _drop_field(text: str, line: int, field: str) -> str:
    """``text`` without the field that starts on ``line`` (1-based), its ``{...}`` block
    included; without the first field of that name if the line holds another one."""
    lines = text.split("\n")
    starts = re.compile(rf"^\s*{re.escape(field)}\s*[:{{]")
    index = line - 1
    if not (0 <= index < len(lines) and starts.match(lines[index])):
        index = next(i for i, s in enumerate(lines) if starts.match(s))
    end, depth = index, 0
    for end in range(index, len(lines)):
        depth += lines[end].count("{") - lines[end].count("}")
        if depth <= 0:
            break
    return "\n".join(lines[:index] + lines[end + 1 :])


def _version_block(text: str, field: str) -> str | None:
    """The string field ``field: "12.8.0"`` of ``text`` as a ``{major minor patch}`` block."""
    match = re.search(rf'^\s*{field}:\s*"(\d+)\.(\d+)(?:\.(\d+))?"', text, re.MULTILINE)
    if match is None:
        return None
    major, minor, patch = match[1], match[2], match[3] or "0"
    return f"{field} {{\n  major: {major}\n  minor: {minor}\n  patch: {patch}\n}}\n"


class CudaTopology(NamedTuple):
    """A compile-only CUDA topology and the fields of the target description that the
    installed jaxlib did not know (``"GpuDeviceInfoProto.scalar_unit_description"``)."""

    topology: Any
    dropped: tuple[str, ...]


def cuda_topology(target_config: str, topology: str = "1x1x1") -> CudaTopology:
    """A compile-only topology of GPUs described by ``target_config``, a
    ``GpuTargetConfigProto`` in text form (the spec files of openxla/xla): one GPU, or
    ``topology`` as ``slices x hosts x GPUs per host`` (``"1x2x8"``: two hosts of eight).

    The proto grows with XLA and jaxlib parses it strictly: jaxlib 0.10.2 lacks
    ``collective_memory_granularity``, 0.8.1 about twenty fields of ``gpu_device_info``. The
    parser names one unknown field per try, in XLA's log only, so each try captures that log,
    drops the field named and parses again. Unknown fields describe the GPU more finely
    (cost-model rates, driver strings); the compute capability and memory sizes that choose
    kernels stay. ``gpu_device_info.runtime_version`` (a string) is moved instead, to the
    older top-level ``{major minor patch}`` CUDA version, without which XLA refuses fp8 cuBLAS
    GEMMs ("FP8 Custom Calls require CUDA 12.0 or newer").

    Raises:
      NotImplementedError: JAX's own error when no CUDA plugin is registered (it is absent,
        or it failed to start).
      Exception: jaxlib's error when the text does not parse for another reason.
    """
    text = target_config
    dropped: list[str] = []
    for _ in range(200):  # a bound, far above the fields of any spec
        with tempfile.TemporaryFile() as log:
            with _stderr_to(log):
                try:
                    made = topologies.get_topology_desc(
                        platform="cuda", target_config=text, topology=topology
                    )
                except NotImplementedError:
                    raise
                except Exception as error:  # jaxlib's error types vary between versions
                    failure = error
                else:
                    return CudaTopology(made, tuple(dropped))
            log.seek(0)
            logged = log.read().decode(errors="replace")
        match = _UNKNOWN_FIELD.search(logged)
        if match is None:
            sys.stderr.write(logged)
            raise failure
        line, message, field = int(match[1]), match[2], match[3]
        moved = (
            _version_block(text, field)
            if (message, field) == ("GpuDeviceInfoProto", "runtime_version")
            else None
        )
        text = _drop_field(text, line, field)
        if moved is not None:
            text += moved
        dropped.append(f"{message}.{field}")
    raise RuntimeError(f"the GPU target description kept failing to parse: {dropped}")


def _dumped_hlo(directory: str) -> str:
    """The optimized HLO an XLA dump in ``directory`` holds."""
    paths = sorted(glob.glob(os.path.join(directory, "*gpu_after_optimizations.txt")))
    if not paths:
        raise RuntimeError(f"XLA wrote no optimized HLO to {directory}: {os.listdir(directory)}")
    with open(paths[-1]) as f:
        return f.read()


class DevicelessCompile(NamedTuple):
    """What a compile for a compile-only device gives: the optimized HLO text, XLA's memory
    analysis (None where the executable has none), its cost analysis as a dict (None on a
    GPU, where XLA fills none in without one), the shardings of its flat inputs and outputs
    (what a compile of the same program with other loop unrolling must keep), and the options
    the compile set itself to compile without the device, each ``(name, value, why)``."""

    hlo_text: str
    memory: Any
    cost: dict[str, float] | None
    input_shardings: tuple[Any, ...] = ()
    output_shardings: tuple[Any, ...] = ()
    changed: tuple[tuple[str, Any, str], ...] = ()


def _cost_analysis(compiled: Any) -> dict[str, float] | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # a backend without a cost model raises rather than returning None
        return None
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per executable
        cost = cost[0] if cost else None
    return {str(k): float(v) for k, v in cost.items()} if cost else None


def _memory_analysis(compiled: Any) -> Any:
    try:
        return compiled.memory_analysis()
    except Exception:  # old jaxlibs' deviceless GPU executables cannot report it
        return None


def deviceless_compile(lowered: Any, compiler_options: dict[str, Any]) -> DevicelessCompile:
    """Compiles ``lowered`` (lowered for a :func:`cuda_topology` mesh or a TPU topology's)
    with ``compiler_options``; returns the optimized HLO text and XLA's analyses.

    Two differences of old jaxlibs (0.8.1, gone by 0.10.2) are handled, and remembered for the
    process: Triton GEMMs autotuned by default, which needs a GPU ("Expect autotune result
    cache hit for deviceless compilation"; retried with ``xla_gpu_autotune_level=0``, each
    Triton GEMM's default tile, as later versions do without a GPU), and an executable that
    cannot print its HLO (``as_text()`` None; repeated with an XLA dump, read from there).
    A sort that CUB's radix sort would run asks a device for its scratch (a Blackwell
    compile): retried with XLA's own sort (``xla_gpu_enable_cub_radix_sort=False``), said in
    ``changed``.
    """
    changed: list[tuple[str, Any, str]] = []
    while True:
        options = dict(compiler_options) | {name: value for name, value, _ in changed}
        if _deviceless.get("untuned"):
            options.setdefault("xla_gpu_autotune_level", 0)
        with tempfile.TemporaryDirectory() as directory:
            if _deviceless.get("dump"):
                options.update(xla_dump_to=directory, xla_dump_hlo_as_text=True)
            try:
                compiled = lowered.compile(options)
            except Exception as error:
                if _NEEDS_AUTOTUNING in str(error) and not _deviceless.get("untuned"):
                    _deviceless["untuned"] = True
                    continue
                if _CUB_SORT_NEEDS_DEVICE in str(error) and _CUB_SORT not in options:
                    why = (
                        "CUB's radix sort sizes its scratch on a device, which a compile "
                        "without one lacks: the sorts are XLA's own here, CUB's on the GPU"
                    )
                    changed.append((_CUB_SORT, False, why))
                    continue
                raise
            text = _dumped_hlo(directory) if _deviceless.get("dump") else compiled.as_text()
            if text:
                return DevicelessCompile(
                    text,
                    _memory_analysis(compiled),
                    _cost_analysis(compiled),
                    tuple(jax.tree.leaves(compiled.input_shardings)),
                    tuple(jax.tree.leaves(compiled.output_shardings)),
                    tuple(changed),
                )
            _deviceless["dump"] = True


# --- TPUs: libtpu ---------------------------------------------------------------------------


def libtpu_installed() -> bool:
    """Whether ``libtpu`` (``jax[tpu]``) is installed: it compiles for TPUs on any machine."""
    try:
        return importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        return False


def tpu_topology(name: str) -> Any:
    """The compile-only devices of the TPU slice ``name`` (``"v5p:2x2x1"``), from libtpu.

    A slice of one chip is asked for with one chip per host: the libtpu of jax 0.8 assumes a
    host of 2x2x1 chips and refuses a smaller slice, where newer ones assume what fits."""
    one_chip = all(d == "1" for d in name.partition(":")[2].split("x"))
    options = {"chips_per_host_bounds": (1, 1, 1)} if one_chip else {}
    return topologies.get_topology_desc(topology_name=name, platform="tpu", **options)
