"""The compile-only devices a plan compiles for: a target's GPUs from JAX's CUDA plugin and
XLA's description of the GPU (``gpu_targets/``), a TPU slice's from libtpu, made once per
process and target; why there are none on this machine (:func:`plan_unavailable`, with what to
install); and a mesh over them for sharding a step as it would run there (:func:`plan_mesh`).
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from mpjax.planning import deviceless
from mpjax.planning.targets import CHIPS, parse_target

__all__ = ["PlanUnavailableError", "plan_mesh", "plan_unavailable", "target_devices"]


class PlanUnavailableError(RuntimeError):
    """Raised by :func:`mpjax.plan` when this machine's JAX cannot compile for the target: the CUDA
    plugin or libtpu is not installed, or did not start. The message says what to do."""


def _spec(name: str) -> str:
    return (importlib.resources.files("mpjax.planning") / "gpu_targets" / name).read_text()


_NOT_INSTALLED = {
    "gpu": (
        "mpjax.plan compiles for a GPU with JAX's CUDA plugin, which is not installed. It "
        'installs on a machine without a GPU too: pip install "mpjax[cuda12]" (which is '
        "jax[cuda12]). Set JAX_PLATFORMS=cpu in the environment so that JAX keeps computing on "
        "the CPU."
    ),
    "tpu": (
        "mpjax.plan compiles for a TPU with libtpu, which is not installed. It installs on a "
        'machine without a TPU too: pip install "mpjax[tpu]" (which is jax[tpu]). Set '
        "JAX_PLATFORMS=cpu in the environment so that JAX keeps computing on the CPU."
    ),
}
_NOT_STARTED = (
    "JAX's CUDA plugin is installed but did not start, so JAX cannot compile for a GPU: {error}\n"
    "Without a GPU the plugin's check of the local CUDA installation fails. Set "
    "JAX_PLATFORMS=cpu in the environment before starting Python (or before the first JAX "
    "computation); with jax 0.8 set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 as well, unless mpjax is "
    "imported before that first computation (it sets it then)."
)


@functools.cache
def target_devices(name: str) -> tuple[tuple[Any, ...], str, int]:
    """The compile-only devices of the target ``name``, the device's name, and how many
    devices share a chip."""
    target = parse_target(name)
    if target.platform == "gpu":
        if not deviceless.cuda_plugin_installed():
            raise PlanUnavailableError(_NOT_INSTALLED["gpu"])
        spec = _spec(target.chip.spec)
        try:
            topology = deviceless.cuda_topology(spec, target.topology).topology
        except NotImplementedError as error:
            raise PlanUnavailableError(_NOT_STARTED.format(error=error)) from error
        except Exception as error:
            raise PlanUnavailableError(
                f"JAX's CUDA plugin could not make a compile-only {name} device: {error}"
            ) from error
        match = re.search(r'device_description_str:\s*"([^"]*)"', spec)
        return tuple(topology.devices), match[1] if match else name, 1
    if not deviceless.libtpu_installed():
        raise PlanUnavailableError(_NOT_INSTALLED["tpu"])
    try:
        devices = tuple(deviceless.tpu_topology(target.topology).devices)
    except Exception as error:
        if "INVALID_ARGUMENT" in str(error):  # a slice that cannot exist
            raise ValueError(f"{target.topology!r} is not a TPU slice: {error}") from error
        raise PlanUnavailableError(
            f"libtpu could not make the compile-only TPU slice {target.topology!r}: {error}"
        ) from error
    # A chip whose cores are devices of their own (v4's two) shares its HBM and peak among
    # them; a plan for one chip compiles for its first device.
    first = tuple(getattr(devices[0], "coords", ()))
    per_chip = sum(tuple(getattr(d, "coords", ())) == first for d in devices)
    if target.name in CHIPS:
        devices = devices[:1]
    return devices, devices[0].device_kind, max(per_chip, 1)


def plan_unavailable(target: str = "h100") -> str | None:
    """Why :func:`mpjax.plan` cannot compile for ``target`` on this machine, or None when it can.

    It makes the compile-only devices that :func:`mpjax.plan` uses (once per process and target),
    so it answers for this process as it is now.

    >>> reason = plan_unavailable()  # None where "mpjax[cuda12]" is installed
    >>> reason = plan_unavailable("v5p")  # None where "mpjax[tpu]" is installed
    """
    name = parse_target(target, caller="plan_unavailable").name
    try:
        target_devices(name)
    except PlanUnavailableError as error:
        return str(error)
    return None


def plan_mesh(
    target: str, axis_shapes: Sequence[int] | None = None, axis_names: Sequence[str] = ("data",)
) -> Mesh:
    """A mesh over ``target``'s compile-only devices, for sharding code to run unchanged
    against a TPU slice or GPUs this machine does not have: build ``NamedSharding(mesh, spec)`` from
    it and give :func:`mpjax.plan` ``jax.ShapeDtypeStruct`` values (or arrays) with those
    shardings.

    Args:
      target: a TPU slice (``"v5p:2x2x2"``), GPUs on hosts (``"h100:2x8"``) or any
        :func:`mpjax.plan` target.
      axis_shapes: the mesh's shape; by default one axis over every device.
      axis_names: the mesh's axis names, one per axis.

    Raises:
      ValueError: if the target is unknown or no slice libtpu can make, or the axes do not
        multiply to its device count.
      PlanUnavailableError: if this machine cannot compile for it.
    """
    name = parse_target(target, caller="plan_mesh").name
    devices, _, _ = target_devices(name)
    shape = tuple(axis_shapes) if axis_shapes is not None else (len(devices),)
    if len(shape) != len(tuple(axis_names)) or int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"plan_mesh: axis_shapes {shape} with axis_names {tuple(axis_names)} must have one "
            f"name per axis and multiply to the {len(devices)} devices of {name!r}."
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), tuple(axis_names))
