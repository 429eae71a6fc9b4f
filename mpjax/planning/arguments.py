"""What :func:`mpjax.plan` compiles its function's arguments as: each array leaf a
``jax.ShapeDtypeStruct`` on the target's compile-only devices, keeping the sharding it was given
there, so that the plan compiles the program the user will run.

A sharding counts as the target's when its devices are compile-only devices of the target's
kind and number: from :func:`mpjax.plan_mesh`, or from the user's own
``jax.experimental.topologies.get_topology_desc`` for the same slice (other objects than
``plan_mesh``'s, the same devices to the compiler). An array on one local device (a plain array)
is replicated over the devices the sharded arguments use. A sharding over several devices that
cannot be the target's (CPU devices, another chip's, another count) is refused: replacing it
would plan another program than the one asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["on_target"]


def _devices_of(x: Any) -> tuple[Any, ...] | None:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return None
    return tuple(sorted(sharding.device_set, key=lambda d: d.id))


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def on_target(
    args: tuple, kwargs: dict, devices: Sequence[Any], target: str, caller: str = "plan"
) -> tuple[tuple, dict]:
    """The array leaves of ``args`` and ``kwargs`` as ``jax.ShapeDtypeStruct`` on ``target``'s compile-only
    ``devices``: a sharding on the target's devices is kept as it is, a leaf on one device (or
    none) is replicated over the devices the kept shardings use (``devices`` when none).

    Raises:
      ValueError: naming the argument's path, for a sharding over several devices that are not
        the target's, or arguments on two different sets of the target's devices.
    """
    kind = devices[0].device_kind
    count = len(devices)
    tree = (args, kwargs)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    chosen: tuple[Any, ...] | None = None
    for path, x in leaves:
        placed = _devices_of(x) if _is_array(x) else None
        if placed is None or len(placed) == 1:
            continue
        name = ("args", "kwargs")[path[0].idx] + jax.tree_util.keystr(path[1:])
        ours = len(placed) == count and all(getattr(d, "device_kind", None) == kind for d in placed)
        if not ours:
            found = f"{len(placed)} {placed[0].platform} devices ({placed[0].device_kind})"
            raise ValueError(
                f"{caller}: the argument {name} is sharded over {found}, which cannot be the "
                f"{count} compile-only {kind} devices of {target!r}. Build its mesh on the "
                f"target's devices: mpjax.plan_mesh({target!r}, shape, names), or "
                "jax.experimental.topologies.get_topology_desc for the same slice; a plain "
                "array (on one device) is replicated."
            )
        if chosen is not None and set(placed) != set(chosen):
            raise ValueError(
                f"{caller}: the argument {name} is sharded over other {kind} devices than the "
                "arguments before it: shard every argument on one mesh."
            )
        chosen = placed
    mesh = Mesh(np.asarray(chosen or tuple(devices), dtype=object), ("devices",))
    replicated = NamedSharding(mesh, PartitionSpec())
    kept = set(chosen or ())

    def leaf(x: Any) -> Any:
        if not _is_array(x):
            return x
        weak = bool(getattr(x, "weak_type", False))
        sharding = getattr(x, "sharding", None)
        own = sharding is not None and kept and set(sharding.device_set) <= kept
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding if own else replicated, weak_type=weak
        )

    return jax.tree.map(leaf, tree)
