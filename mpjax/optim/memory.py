"""What training keeps in memory per parameter: the params, the optimizer state and its master
copies, read from the real pytrees.

With Adam, float32 training keeps 4 bytes of params and 8 of moments per parameter; mixed
precision with bfloat16 params and float32 master weights keeps 2 + 4 + 8 = 14. Where the bytes
go depends on how the optimizer is composed (:func:`mpjax.master_weights`,
:func:`mpjax.state_precision`, :func:`mpjax.low_precision_params`, loss scaling, gradient
accumulation), so :func:`memory_report` counts them from the trees themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from mpjax.optim.gradient_checks import is_box
from mpjax.optim.quantization import QuantizedArray
from mpjax.policy import is_floating, short_dtype_name
from mpjax.table import format_table, human_bytes

__all__ = ["MemoryReport", "MemoryRow", "memory_report"]


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """One part of a :class:`MemoryReport`: the leaves of one kind and dtype.

    Attributes:
      part: ``"params"``, or the optimizer-state field the leaves sit under (the last
        attribute name on their path: ``"mu"``, ``"nu"``, ``"master"``, ``"compensation"``,
        ``"acc_grads"``, ``"count"``, ``"key"``...); ``"state"`` for a leaf under none.
      dtype: the leaves' dtype name; for quantized leaves (:class:`mpjax.QuantizedArray`),
        their format's name (``"dynamic8"``).
      bytes: their size in bytes (the global size of sharded arrays); for quantized leaves,
        codes and absmaxes together.
    """

    part: str
    dtype: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per parameter of params and optimizer state; made by :func:`memory_report`.
    ``str`` gives :meth:`table`.

    Attributes:
      param_count: the number of floating-point param elements (what "per parameter" divides
        by).
      rows: the params by dtype, then the optimizer state by part and dtype, in tree order.
    """

    param_count: int
    rows: tuple[MemoryRow, ...]

    @property
    def param_bytes(self) -> int:
        return sum(r.bytes for r in self.rows if r.part == "params")

    @property
    def state_bytes(self) -> int:
        return sum(r.bytes for r in self.rows if r.part != "params")

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.state_bytes

    @property
    def bytes_per_param(self) -> float:
        """Params and optimizer state together, per parameter."""
        return self.total_bytes / max(self.param_count, 1)

    def part_bytes(self, part: str) -> int:
        """The bytes of one part (``"mu"``...), over all its dtypes; 0 if there is none.

        Raises:
          TypeError: if ``part`` is not a string.
        """
        if not isinstance(part, str):
            raise TypeError(
                f"part_bytes: part must be a part's name (a string such as 'mu'; the report "
                f"has {sorted({r.part for r in self.rows})}), got {part!r} of type "
                f"{type(part).__name__}."
            )
        return sum(r.bytes for r in self.rows if r.part == part)

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        """The rows with bytes and bytes per parameter, and the total."""
        n = max(self.param_count, 1)
        body = [(r.part, r.dtype, human_bytes(r.bytes), f"{r.bytes / n:.2f}") for r in self.rows]
        total = ("total", "", human_bytes(self.total_bytes), f"{self.bytes_per_param:.2f}")
        return format_table(
            ("part", "dtype", "bytes", "bytes/param"),
            body,
            footer=total,
            right=frozenset({2, 3}),
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data: ``{"param_count": ..., "rows": [{"part",
        "dtype", "bytes", "bytes_per_param"}, ...], "param_bytes", "state_bytes",
        "total_bytes", "bytes_per_param"}``."""
        n = max(self.param_count, 1)
        return {
            "param_count": self.param_count,
            "rows": [{**dataclasses.asdict(r), "bytes_per_param": r.bytes / n} for r in self.rows],
            "param_bytes": self.param_bytes,
            "state_bytes": self.state_bytes,
            "total_bytes": self.total_bytes,
            "bytes_per_param": self.bytes_per_param,
        }


def _nbytes(leaf: Any) -> int:
    if isinstance(leaf, QuantizedArray):
        return leaf.nbytes
    return int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _leaves_with_paths(tree: Any) -> list[tuple[tuple, Any]]:
    """The leaves of ``tree`` with their paths, a box's value (:func:`is_box`: an NNX
    ``Variable``, such as the ``OptArray`` in which ``nnx.Optimizer`` keeps each array of its
    state) at the path of the box, so that it counts under the field holding it (``mu``), not
    the box's own ``value``. A :class:`QuantizedArray` is one leaf, at its own path."""
    boxes_as_leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: is_box(x) or isinstance(x, QuantizedArray)
    )[0]
    return [
        (path, leaf)
        for path, node in boxes_as_leaves
        for leaf in jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, QuantizedArray))
    ]


def _part(path: tuple) -> str:
    names = [e.name for e in path if isinstance(e, jax.tree_util.GetAttrKey)]
    return names[-1] if names else "state"


def _rows(pairs: list[tuple[str, Any]]) -> list[MemoryRow]:
    """Sums of bytes by (part, dtype), in order of first appearance."""
    totals: dict[tuple[str, str], int] = {}
    for part, leaf in pairs:
        if isinstance(leaf, QuantizedArray):
            key = (part, leaf.format.name)
        else:
            key = (part, short_dtype_name(leaf.dtype))
        totals[key] = totals.get(key, 0) + _nbytes(leaf)
    return [MemoryRow(part, dtype, n) for (part, dtype), n in totals.items()]


def memory_report(params: Any, opt_state: Any) -> MemoryReport:
    """Counts the bytes of ``params`` and ``opt_state``, per parameter and by part.

    Reads shapes and dtypes only, so it takes arrays or ``jax.ShapeDtypeStruct`` trees: the
    bytes of a model too large to build are ``memory_report(*jax.eval_shape(init, ...))``. Each
    optimizer-state leaf counts under the last attribute name on its path, which names what it
    is in optax's and mpjax's states (``ScaleByAdamState.mu``, ``MasterWeightsState.master``,
    ``LowPrecisionParamsState.compensation``); a quantized moment (:func:`mpjax.quantized_state`)
    counts its codes and absmaxes together under its field, with its format's name for a dtype.
    Sizes are global: a sharded array counts
    whole, whatever each device holds. Gradients and activations are not counted.

    Args:
      params: the params pytree (arrays or ``jax.ShapeDtypeStruct``; NNX: ``nnx.state(model,
        nnx.Param)``).
      opt_state: the optimizer state pytree, as ``tx.init(params)`` returns it (NNX:
        ``optimizer.opt_state``, whose leaves count under their fields, ``mu``, ``nu``...).

    Returns:
      A :class:`MemoryReport`.

    Raises:
      ValueError: if ``params`` holds no floating-point leaf.
      TypeError: if either tree is None, or a leaf of either is not an array (a Python
        number, a string).

    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.zeros((1000,), jnp.bfloat16)}
    >>> report = memory_report(params, optax.adam(1e-3).init(params))
    >>> print(report)
    part    dtype    bytes  bytes/param
    ------  -----  -------  -----------
    params  bf16   2.0 KiB         2.00
    count   int32      4 B         0.00
    mu      bf16   2.0 KiB         2.00
    nu      bf16   2.0 KiB         2.00
    ------  -----  -------  -----------
    total          5.9 KiB         6.00
    """
    for tree, what in ((params, "params"), (opt_state, "opt_state")):
        if tree is None:
            raise TypeError(
                f"memory_report: {what} is None; pass the {what} tree (for no optimizer state, "
                "an empty tuple)."
            )
    pairs = []
    for tree, what in ((params, "params"), (opt_state, "opt_state")):
        for path, leaf in _leaves_with_paths(tree):
            if what == "opt_state" and isinstance(leaf, QuantizedArray):
                pairs.append((_part(path), leaf))
                continue
            if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
                raise TypeError(
                    f"memory_report: {what}{jax.tree_util.keystr(path)} is {leaf!r} of type "
                    f"{type(leaf).__name__}, not an array or jax.ShapeDtypeStruct."
                )
            pairs.append(("params" if what == "params" else _part(path), leaf))
    floating = [leaf for part, leaf in pairs if part == "params" and is_floating(leaf)]
    if not floating:
        raise ValueError("memory_report: params holds no floating-point array.")
    count = sum(int(np.prod(np.shape(leaf), dtype=np.int64)) for leaf in floating)
    return MemoryReport(count, tuple(_rows(pairs)))
