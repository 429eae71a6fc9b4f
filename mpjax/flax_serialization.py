"""``flax.serialization`` support for the loss-scale values of :mod:`mpjax.optim.loss_scale` and
the quantized moments of :mod:`mpjax.optim.quantization`.

The loss scales and :class:`~mpjax.optim.quantization.QuantizedArray` are plain JAX pytrees, so
orbax and every ``jax.tree_util`` based checkpointer handle them as they are.
``flax.serialization`` (``to_bytes``, ``to_state_dict``, Flax's ``TrainState`` checkpoints)
knows only the types registered with it; this module registers the three loss scales and the
quantized array, so the optimizer side itself never imports Flax. The state dicts hold the array
leaves by field name (``{"loss_scale": ..., "counter": ...}`` for a dynamic scale,
``{"loss_scale": ...}`` for a static one, ``{}`` for none, ``{"codes": ..., "absmax": ...}``
for a quantized array), as ``flax.struct`` dataclasses serialize; restoring rebuilds the
target's type with the target's static fields (hyperparameters; format, map and block size).

>>> import flax.serialization
>>> from mpjax.optim.loss_scale import DynamicLossScale
>>> flax.serialization.to_state_dict(DynamicLossScale(8.0))
{'loss_scale': Array(8., dtype=float32), 'counter': Array(0, dtype=int32)}
"""

from __future__ import annotations

from typing import Any

import flax.serialization
import jax

from mpjax.optim.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from mpjax.optim.quantization import QuantizedArray


def _children(target: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The named array fields of a loss scale or quantized array, one level deep, and its tree
    structure."""
    children, treedef = jax.tree_util.tree_flatten_with_path(
        target, is_leaf=lambda x: x is not target
    )
    return [(path[0].name, value) for path, value in children], treedef


def _to_state_dict(target: Any) -> dict[str, Any]:
    children, _ = _children(target)
    return {name: flax.serialization.to_state_dict(value) for name, value in children}


def _from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    children, treedef = _children(target)
    names = [name for name, _ in children]
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(
            f"Missing field(s) {missing} in the state dict of a {type(target).__name__} while "
            f"restoring an instance of {type(target).__name__}, at path "
            f"{flax.serialization.current_path()}."
        )
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise ValueError(
            f"Unknown field(s) {unknown} in the state dict while restoring an instance of "
            f"{type(target).__name__} at path {flax.serialization.current_path()}."
        )
    values = [
        flax.serialization.from_state_dict(value, state[name], name=name)
        for name, value in children
    ]
    return jax.tree.unflatten(treedef, values)


for _cls in (DynamicLossScale, StaticLossScale, NoOpLossScale, QuantizedArray):
    flax.serialization.register_serialization_state(
        _cls, _to_state_dict, _from_state_dict, override=True
    )
