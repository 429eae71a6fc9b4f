"""Optimizer state stored in 8 or 4 bits a value, for any optax transformation: Adam in about 4
bytes a parameter with bfloat16 params.

:func:`quantized_state` keeps the moments of a wrapped optax transformation (Adam's ``mu`` and
``nu``, momentum's ``trace``, Lion's ``mu``) blockwise quantized, as bitsandbytes'
``Adam8bit`` and torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` do: each step
dequantizes them to float32, runs the wrapped update in float32, and quantizes the new moments
again (:mod:`mpjax.optim.quantization` has the formats and the layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax.optim.gradient_checks import (
    InitTrees,
    check_params,
    check_transformation,
    check_update,
    is_box,
)
from mpjax.optim.loss_scaling_readers import step_applied
from mpjax.optim.quantization import (
    QuantFormat,
    QuantizedArray,
    check_block_size,
    quant_format,
    quantize_blockwise,
    unquantizable_reason,
)
from mpjax.optim.rounding import ROUNDINGS, check_rounding, next_rounding_keys, rounding_key, widen
from mpjax.policy import is_floating, short_dtype_name
from mpjax.table import format_table

__all__ = [
    "DEFAULT_MIN_SIZE",
    "UNSIGNED_FIELDS",
    "QuantizationChoice",
    "QuantizationChoices",
    "QuantizedState",
    "quantization_choices",
    "quantized_state",
]

#: Leaves with fewer elements stay float32 unless a mask asks for them (bitsandbytes'
#: ``min_8bit_size`` and torchao's rule).
DEFAULT_MIN_SIZE = 4096

#: The state fields that are never negative, which take a format's unsigned map (Adam's and
#: RMSProp's ``nu``, Adagrad's ``sum_of_squares``, Adafactor's ``v_row``, ``v_col`` and ``v``).
#: Every other field (``mu``, ``trace``, a field of your own) takes the signed map.
UNSIGNED_FIELDS = ("nu", "sum_of_squares", "v_row", "v_col", "v")

# Fields never quantized by default: a master copy (refused) and a gradient accumulator.
_ACCUMULATOR = "acc_grads"


class QuantizedState(NamedTuple):
    """State of :func:`quantized_state`.

    Attributes:
      inner_state: the wrapped transformation's state, its chosen leaves stored as
        :class:`mpjax.QuantizedArray` (codes and a float32 absmax per block).
      key: raw PRNG key data (uint32) with stochastic rounding, advanced once per update (not
        on a step that :func:`mpjax.loss_scaling` inside skipped); ``optax.EmptyState()`` with
        rounding to nearest.
    """

    inner_state: optax.OptState
    key: jax.Array | optax.EmptyState


@dataclasses.dataclass(frozen=True)
class QuantizationChoice:
    """How one floating leaf of an optimizer state is stored, and why.

    Attributes:
      path: the leaf's path in the wrapped transformation's state (``"[0].mu['w']"``).
      shape: its shape.
      stored: ``"dynamic8 signed"`` (the format and map) or the dtype it keeps (``"f32"``).
      reason: why it stays wide (``"4 elements, fewer than min_size 4096"``), or
        ``"quantized"``.
    """

    path: str
    shape: tuple[int, ...]
    stored: str
    reason: str


@dataclasses.dataclass(frozen=True)
class QuantizationChoices:
    """The choice :func:`quantized_state` makes for each floating leaf of a state; made by
    :func:`quantization_choices`. ``str`` gives :meth:`table`.

    Attributes:
      rows: one :class:`QuantizationChoice` per floating leaf, in tree order.
    """

    rows: tuple[QuantizationChoice, ...]

    @property
    def quantized(self) -> tuple[QuantizationChoice, ...]:
        """The rows of the leaves stored quantized."""
        return tuple(r for r in self.rows if r.reason == "quantized")

    def table(self) -> str:
        """The rows as a table: leaf, shape, stored as, why."""
        body = [(r.path, str(r.shape), r.stored, r.reason) for r in self.rows]
        return format_table(("leaf", "shape", "stored", "why"), body)

    def __str__(self) -> str:
        return self.table()


@dataclasses.dataclass(frozen=True)
class _Config:
    """The checked arguments of :func:`quantized_state` and :func:`quantization_choices`."""

    formats: QuantFormat | dict[str, QuantFormat]
    block_size: int | None
    min_size: int
    mask: Any
    unsigned_fields: frozenset[str]


def _config(
    format: Any, block_size: Any, min_size: Any, mask: Any, unsigned_fields: Any, where: str
) -> _Config:
    if isinstance(format, Mapping):
        if not format:
            raise ValueError(f"{where}: format is an empty mapping; name a state field.")
        for name in format:
            if not isinstance(name, str):
                raise TypeError(
                    f"{where}: the keys of a format mapping are state field names (strings "
                    f"such as 'mu'), got {name!r}."
                )
        formats: QuantFormat | dict[str, QuantFormat] = {
            name: quant_format(f, f"{where} format for {name!r}") for name, f in format.items()
        }
    else:
        formats = quant_format(format, f"{where} format")
    if block_size is not None:
        block_size = check_block_size(block_size, f"{where}: block_size")
        four_bit = [f for f in _all(formats) if f.bits == 4]
        if four_bit and block_size < 2:
            raise ValueError(
                f"{where}: block_size must be at least 2 for the 4-bit format "
                f"{four_bit[0].name!r} (two codes share a byte), got {block_size}."
            )
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ValueError(
            f"{where}: min_size must be a non-negative integer (elements), got {min_size!r}."
        )
    if mask is not None and not callable(mask) and not jax.tree.leaves(mask):
        raise ValueError(f"{where}: mask has no leaves; pass a tree of bools like the params.")
    if isinstance(unsigned_fields, str) or not all(isinstance(n, str) for n in unsigned_fields):
        raise TypeError(
            f"{where}: unsigned_fields must be a sequence of state field names, got "
            f"{unsigned_fields!r}."
        )
    return _Config(formats, block_size, int(min_size), mask, frozenset(unsigned_fields))


def _all(formats: QuantFormat | dict[str, QuantFormat]) -> list[QuantFormat]:
    return list(formats.values()) if isinstance(formats, dict) else [formats]


def _mask_by_path(config: _Config, params: Any, where: str) -> dict[tuple, bool]:
    """The mask's value for each param, by the param's path."""
    if config.mask is None:
        return {}
    mask = config.mask(params) if callable(config.mask) else config.mask
    if jax.tree.structure(mask) != jax.tree.structure(params):  # type: ignore[operator]
        raise ValueError(
            f"{where}: the mask tree does not match the params tree.\n"
            f"  mask:   {jax.tree.structure(mask)}\n  params: {jax.tree.structure(params)}"
        )
    out = {}
    for path, value in jax.tree_util.tree_leaves_with_path(mask):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(
                f"{where}: mask{jax.tree_util.keystr(path)} must be True (quantize this param's "
                f"state) or False (keep it wide), got {value!r}."
            )
        out[tuple(path)] = bool(value)
    return out


def _split(path: tuple, param_paths: set[tuple]) -> tuple[list[str], tuple | None]:
    """The state field names along ``path`` and the path of the param the leaf belongs to (the
    longest ending of ``path`` that is a param's path), or None when it belongs to none."""
    for k in range(len(path) + 1):
        if tuple(path[k:]) in param_paths:
            return [e.name for e in path[:k] if isinstance(e, jax.tree_util.GetAttrKey)], tuple(
                path[k:]
            )
    return [e.name for e in path if isinstance(e, jax.tree_util.GetAttrKey)], None


def _decide(
    config: _Config, inner_state: Any, params: Any, where: str
) -> list[tuple[QuantizationChoice, tuple[QuantFormat, bool, int] | None]]:
    """For each floating leaf of ``inner_state`` (in tree order), its row and how to quantize
    it (format, signed, block size), or None to keep it wide.

    Raises:
      ValueError: for a leaf the mask asks for that cannot be quantized, a master-weights copy
        that would be, and format field names that match no floating leaf.
    """
    mask = _mask_by_path(config, params, where)
    param_paths = {tuple(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    decisions: list[tuple[QuantizationChoice, tuple[QuantFormat, bool, int] | None]] = []
    seen_fields: set[str] = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(inner_state):
        if not is_floating(leaf):
            continue
        fields, param_path = _split(path, param_paths)
        seen_fields.update(fields)
        at, shape = jax.tree_util.keystr(path), tuple(np.shape(leaf))
        wide = short_dtype_name(leaf.dtype)

        def keep(reason: str, at: str = at, shape: tuple = shape, wide: str = wide) -> None:
            decisions.append((QuantizationChoice(at, shape, wide, reason), None))

        if isinstance(config.formats, dict):
            named = [f for f in fields[::-1] if f in config.formats]
            if not named:
                keep(f"its fields {fields} are not named in format")
                continue
            fmt = config.formats[named[0]]
        else:
            fmt = config.formats
        if not shape:
            keep("a scalar (a counter or hyperparameter)")
            continue
        explicit = mask.get(param_path) if param_path is not None else None
        if explicit is False:
            keep(f"mask is False for params{jax.tree_util.keystr(param_path or ())}")
            continue
        if "master" in fields:
            raise ValueError(
                f"{where}: the wrapped state holds a master-weights copy (at {at}), which "
                f"would be stored in {fmt.name}. Put master_weights outside: "
                "master_weights(quantized_state(inner, ...))."
            )
        if _ACCUMULATOR in fields and explicit is None:
            keep("a gradient accumulator: put optax.MultiSteps outside quantized_state")
            continue
        block = config.block_size or fmt.block_size
        reason = unquantizable_reason(shape, fmt, block)
        if explicit and reason is not None:
            raise ValueError(
                f"{where}: the mask asks to quantize {at} of shape {shape} in {fmt.name}, but "
                f"{reason}. Set the mask False for params{jax.tree_util.keystr(param_path or ())} "
                "to keep it wide, or pick a block_size that divides its last axis."
            )
        size = int(np.prod(shape, dtype=np.int64))
        if not explicit and size < config.min_size:
            keep(f"{size} elements, fewer than min_size {config.min_size}")
            continue
        if reason is not None:
            keep(reason)
            continue
        signed = not any(f in config.unsigned_fields for f in fields[-1:])
        stored = f"{fmt.name} {'signed' if signed else 'unsigned'}"
        decisions.append((QuantizationChoice(at, shape, stored, "quantized"), (fmt, signed, block)))
    if isinstance(config.formats, dict):
        missing = [n for n in config.formats if n not in seen_fields]
        if missing:
            raise ValueError(
                f"{where}: {missing} name no floating leaf of the wrapped optimizer's state. "
                f"Field names with floating leaves: {sorted(seen_fields)}."
            )
    return decisions


def quantization_choices(
    inner: optax.GradientTransformation,
    params: Any,
    format: Any = "dynamic8",
    *,
    block_size: int | None = None,
    min_size: int = DEFAULT_MIN_SIZE,
    mask: Any = None,
    unsigned_fields: tuple[str, ...] = UNSIGNED_FIELDS,
) -> QuantizationChoices:
    """How :func:`quantized_state` with these arguments stores each floating leaf of
    ``inner``'s state for ``params``, and why a leaf stays wide. Takes the arguments of
    :func:`quantized_state` (but the rounding) and the params; builds the state abstractly
    (``jax.eval_shape``), so it costs no memory.

    Raises:
      What :func:`quantized_state` and its ``init`` raise for the same arguments.

    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.zeros((64, 256)), "b": jnp.zeros(256)}
    >>> print(quantization_choices(optax.adam(1e-3), params))
    leaf         shape      stored             why
    -----------  ---------  -----------------  --------------------------------------
    [0].mu['b']  (256,)     f32                256 elements, fewer than min_size 4096
    [0].mu['w']  (64, 256)  dynamic8 signed    quantized
    [0].nu['b']  (256,)     f32                256 elements, fewer than min_size 4096
    [0].nu['w']  (64, 256)  dynamic8 unsigned  quantized
    """
    check_transformation(inner, "quantization_choices")
    config = _config(format, block_size, min_size, mask, unsigned_fields, "quantization_choices")
    check_params(params, "quantization_choices")
    inner_state = jax.eval_shape(inner.init, params)
    rows = tuple(row for row, _ in _decide(config, inner_state, params, "quantization_choices"))
    return QuantizationChoices(rows)


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def _dequantized(tree: Any) -> Any:
    """``tree`` with each :class:`QuantizedArray` replaced by the float32 array it stores."""
    return jax.tree.map(
        lambda x: x.dequantize() if _is_quantized(x) else x, tree, is_leaf=_is_quantized
    )


def quantized_state(
    inner: optax.GradientTransformation,
    format: Any = "dynamic8",
    *,
    block_size: int | None = None,
    min_size: int = DEFAULT_MIN_SIZE,
    mask: Any = None,
    unsigned_fields: tuple[str, ...] = UNSIGNED_FIELDS,
    rounding: str = "nearest",
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s optimizer state blockwise quantized, computing every update in float32.

    ``update`` dequantizes the stored moments to float32 (and widens the gradients, the params
    and any other narrow state leaf), runs ``inner``, and quantizes its new moments again, to
    nearest or stochastically; the updates come back in the gradients' dtypes. A step that
    :func:`mpjax.loss_scaling` inside ``inner`` skipped keeps the stored codes, absmaxes and key
    bit for bit (requantizing what was dequantized is not always the identity: bitsandbytes'
    signed map has no -1).

    Which leaves (decided by ``init``; :func:`quantization_choices` lists the choices and
    reasons): every non-scalar floating leaf of ``inner``'s state with at least ``min_size``
    elements whose last axis is a multiple of the block size (blocks run along the last axis,
    so that a leaf sharded along its leading axes keeps whole blocks on each device); the
    others stay as ``inner`` keeps them, as bitsandbytes and torchao keep small and odd-sized
    tensors in float32. A gradient accumulator (``optax.MultiSteps``' ``acc_grads``) stays
    wide: put ``MultiSteps`` outside. With a ``format`` mapping, only the named state fields
    (``{"mu": "dynamic8"}``) are quantized. ``mask`` (a tree of bools like the params, or a
    function of the params returning one, as ``optax.masked`` takes) chooses per param: False
    keeps every state leaf of that param wide (embeddings, norms), True quantizes them whatever
    their size, and refuses (``ValueError``, at ``init``) a leaf that cannot be.

    Which map: a leaf under a field of ``unsigned_fields`` (``nu`` and the other squared
    moments) takes the format's unsigned map, every other leaf (``mu``, ``trace``, unknown
    fields) the signed one. Adafactor's factored ``v_row`` and ``v_col`` are vectors of a
    matrix's rows and columns: they stay float32 under ``min_size`` unless very large.

    Order: ``low_precision_params(loss_scaling(quantized_state(adamw, ...)))`` or
    ``master_weights(loss_scaling(quantized_state(...)))``; ``optax.MultiSteps`` outside.
    Wrapping a ``master_weights`` state is refused, as with :func:`mpjax.state_precision`.

    Args:
      inner: the optax transformation whose state to store (``optax.adamw(lr)``, a chain...).
      format: ``"dynamic8"`` (the default: bitsandbytes' 8-bit blockwise dynamic maps),
        ``"e4m3"``, ``"dynamic4"`` (torchao's 4-bit maps), a :class:`mpjax.QuantFormat`, or a
        mapping from state field names to those (``{"mu": "dynamic4", "nu": "dynamic8"}``).
      block_size: elements per block along the last axis, a positive power of two; by default
        the format's (256, and 128 for ``"dynamic4"``).
      min_size: leaves with fewer elements stay wide unless the mask asks for them.
      mask: a tree of bools with the params' structure, a function of the params returning
        one, or None (the size rule alone).
      unsigned_fields: the state fields stored with the unsigned map.
      rounding: ``"nearest"`` (the default) or ``"stochastic"`` (unbiased between the two
        codes around each value; its key carried in the state, as in
        :func:`mpjax.state_precision`).
      seed: an integer or a PRNG key, for stochastic rounding.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`QuantizedState`.

    Raises:
      TypeError: for an ``inner`` that is not an optax transformation, a bad ``rounding``
        type, ``seed``, format or mask values.
      ValueError: for an unknown format or rounding, a block size that is not a power of two,
        a negative ``min_size``; from ``init``, a leaf the mask asks for that cannot be
        quantized, a field name that matches no floating leaf, or a master-weights copy.

    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.zeros((64, 256)), "b": jnp.zeros(256)}
    >>> state = quantized_state(optax.adam(1e-3), "dynamic8").init(params)
    >>> state.inner_state[0].mu["w"], state.inner_state[0].nu["b"].dtype
    (QuantizedArray(dynamic8, signed, shape=(64, 256), block_size=256), dtype('float32'))
    """
    check_transformation(inner, "quantized_state")
    rounding = check_rounding(rounding, ROUNDINGS, "quantized_state")
    config = _config(format, block_size, min_size, mask, unsigned_fields, "quantized_state")
    seed_key = rounding_key(seed)  # checked whatever the rounding
    key0 = seed_key if rounding == "stochastic" else optax.EmptyState()
    inner = optax.with_extra_args_support(inner)
    init_trees = InitTrees()

    def init(params):
        check_params(params, "quantized_state")
        init_trees.add(params)
        inner_state = inner.init(params)
        decisions = iter(_decide(config, inner_state, params, "quantized_state"))
        # A boxed leaf (params in nnx.Param boxes give moments in them too) is replaced whole:
        # nnx.Optimizer boxes each array of the state it gets, the codes and the absmaxes
        # alike, and would not restore a QuantizedArray kept inside a box.
        nodes, treedef = jax.tree.flatten(inner_state, is_leaf=is_box)
        out = []
        for node in nodes:
            leaf = jax.tree.leaves(node)[0] if is_box(node) else node
            how = next(decisions)[1] if is_floating(leaf) else None
            if how is None:
                out.append(node)
            else:
                fmt, signed, block = how
                out.append(quantize_blockwise(leaf, fmt, signed=signed, block_size=block))
        return QuantizedState(jax.tree.unflatten(treedef, out), key0)

    def update(updates, state, params=None, **extra_args):
        check_update(
            updates,
            state,
            params,
            QuantizedState,
            "quantized_state",
            needs_params=False,
            init_trees=init_trees,
        )
        wide_state = widen(_dequantized(state.inner_state))
        new_updates, new_inner = inner.update(
            widen(updates), wide_state, widen(params), **extra_args
        )
        new_updates = jax.tree.map(lambda u, g: u.astype(g.dtype), new_updates, updates)
        stored, treedef = jax.tree.flatten(state.inner_state, is_leaf=_is_quantized)
        new_leaves = jax.tree.leaves(new_inner)
        count = sum(map(_is_quantized, stored))
        applied = step_applied(new_inner) if count else jnp.array(True)
        key, keys = state.key, list[jax.Array]()
        if rounding == "stochastic":
            key, keys = next_rounding_keys(state.key, count, applied)
        key_iter = iter(keys)
        out = []
        for old, new in zip(stored, new_leaves):
            if _is_quantized(old):
                q = quantize_blockwise(
                    new,
                    old.format,
                    signed=old.signed,
                    block_size=old.block_size,
                    rounding=rounding,
                    key=next(key_iter, None),
                )
                # A skipped step keeps what is stored, bit for bit.
                codes = jnp.where(applied, q.codes, old.codes)
                absmax = jnp.where(applied, q.absmax, old.absmax)
                out.append(QuantizedArray(codes, absmax, q.format, q.signed, q.block_size))
            elif is_floating(old):
                out.append(new.astype(old.dtype))
            else:
                out.append(new)
        return new_updates, QuantizedState(jax.tree.unflatten(treedef, out), key)

    return optax.GradientTransformationExtraArgs(init, update)
