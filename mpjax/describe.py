"""``mpjax.describe``: one entry point for the precision report of anything mpjax runs.

It sits above the integrations (:mod:`mpjax.linen`, :mod:`mpjax.nnx`, :mod:`mpjax.autocast`),
which build their reports from the types in :mod:`mpjax.report`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx

from mpjax import linen as mp_linen
from mpjax import nnx as mp_nnx
from mpjax.autocast import autocast_report


def describe(model: Any, *args, **kwargs) -> Any:
    """Returns (and prints) the precision report of a linen or NNX model wrapped by mpjax, or of
    a function made by :func:`mpjax.autocast`.

    Dispatches to :func:`mpjax.linen.describe` for linen modules, to :func:`mpjax.nnx.describe`
    for NNX modules and to :func:`mpjax.autocast_report` for autocast functions; see those for
    the arguments.

    Raises:
      TypeError: if ``model`` is none of these.
    """
    if hasattr(model, "__mpjax_autocast__"):
        return autocast_report(model, *args, **kwargs)
    if isinstance(model, nnx.Module):
        return mp_nnx.describe(model, *args, **kwargs)
    if isinstance(model, nn.Module):
        return mp_linen.describe(model, *args, **kwargs)
    raise TypeError(
        "describe() takes a flax.linen or flax.nnx module or a function made by mpjax.autocast; "
        f"got {type(model).__name__}."
    )
