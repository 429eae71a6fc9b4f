"""fp8 matmuls: e4m3 operands forward, e5m2 gradients backward, one scale per tensor.

An 8-bit float has a narrow range (e4m3: ±448 with 3 mantissa bits; e5m2: ±57344 with 2), so a
tensor is divided by a *scale* before the cast and multiplied by it after: ``x ≈ q * scale``
with ``q = saturate(x / scale)`` in fp8. :func:`dot_general` quantizes both operands of a
matmul to e4m3 in the forward pass and the incoming gradient to e5m2 in the backward pass (the
format with more range, since gradients span more binades than activations and weights), and
runs all three matmuls (forward, input gradient, weight gradient) on those values. Outputs and
accumulation stay in the compute dtype (bf16, f16 or f32).

The matmuls multiply the fp8 values themselves: each GEMM is a ``dot_general`` whose two
operands are float8 arrays, accumulating in f32 (``preferred_element_type``), and the product
of the two scales multiplies its output, which is then rounded to the compute dtype. XLA's GPU
compiler turns such a dot into an fp8 GEMM on Hopper (and Ada) GPUs whatever its GEMM flags:
a Triton GEMM with fp8 operands under its default flags, a cuBLASLt fp8 GEMM
(``__cublas$lt$matmul$f8``) with Triton GEMMs off. (The other form, a dot of dequantized
operands ``convert(q) * scale``, becomes an fp8 GEMM only with Triton GEMMs off: with XLA's
defaults the dot runs in bf16 and the dequantizations in separate kernels. Before jax 0.10.2
XLA's Triton GEMMs refuse a dot on two different fp8 types, so there the two backward GEMMs,
e5m2 x e4m3, take that form, with the same numbers: :func:`mpjax.jax_compat.mixed_fp8_dots`.) Elsewhere, on a
CPU for example, XLA runs the same arithmetic in wider types, so CPU results equal what the
GPU computes up to the order of the f32 sums. :func:`mpjax.hlo_dots` shows the fp8 dots of a
function; :func:`mpjax.plan` shows the GEMMs an H100 compile makes of them.

Scaling (:class:`Fp8Recipe`):

- ``"current"``: the scale of a tensor is ``amax(|x|) / fp8_max * 2**margin``, computed from
  the tensor itself at each step. Stateless, so it works wherever a matmul runs: under
  :func:`mpjax.autocast` of any function, in wrapped Flax models, in ``scan``, ``remat``,
  ``shard_map`` and under sharding (the amax of a sharded array is a global reduction).

- ``"delayed"``: each tensor's scale comes from the largest amax of the previous steps (an
  amax history of configurable length, as Transformer Engine and Flax's ``fp8_ops`` keep it).
  The state of one matmul is an :class:`Fp8Meta` of arrays that the caller carries from step
  to step, and the new state comes back as the *gradient* with respect to the old one, so one
  ``jax.grad`` gives both the parameter gradients and the next state: no side effects, so it
  jits, scans (the metas of scanned layers stacked along the scan axis), rematerializes,
  shards and checkpoints as plain arrays. :func:`delayed_dot_general` is one such matmul;
  through a policy the engine keeps one state per matmul: the ``"fp8"`` collection of a
  wrapped linen model, :class:`mpjax.nnx.Fp8State` for NNX, :func:`mpjax.fp8_state` and
  :func:`mpjax.with_fp8_state` for :func:`mpjax.autocast`.

Overflow: finite values beyond the fp8 range saturate to ±max (a plain cast makes them NaN in
e4m3 and inf in e5m2). Non-finite values stay non-finite, so an overflow in the forward pass or
in the gradients still reaches :func:`mpjax.loss_scaling`, which skips the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import jax_compat

E4M3 = np.dtype(jnp.float8_e4m3fn)
"""The forward format: 4 exponent and 3 mantissa bits, finite range ±448."""
E5M2 = np.dtype(jnp.float8_e5m2)
"""The gradient format: 5 exponent and 2 mantissa bits, finite range ±57344."""

SCALINGS = ("current", "delayed", "rowwise", "mxfp8", "nvfp4")
"""The scaling modes :class:`Fp8Recipe` accepts."""
BLOCK_SCALINGS = ("mxfp8", "nvfp4")
"""The scalings that run matmuls in a block format (:mod:`mpjax.block_scaled`)."""
NVFP4_INGREDIENTS = ("hadamard", "stochastic_rounding", "weight_blocks_2d")
"""The ingredients of NVIDIA's NVFP4 training recipe (:mod:`mpjax.block_scaled`), as
:class:`Fp8Recipe` and :func:`mpjax.block_scaled.dot_general` name them."""
# Their names in the string form, where each is turned off.
_INGREDIENT_OPTIONS = {
    "no_hadamard": "hadamard",
    "no_stochastic_rounding": "stochastic_rounding",
    "no_2d": "weight_blocks_2d",
}

_F32 = np.dtype(jnp.float32)
_COMPUTE_DTYPES = frozenset(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_MAX_MARGIN = 16


@dataclasses.dataclass(frozen=True, repr=False)
class Fp8Recipe:
    """How the matmuls of a policy run in fp8.

    Args:
      scaling: how scales are chosen. ``"current"``: one per tensor, from its amax at each
        step (stateless). ``"delayed"``: one per tensor, from the largest amax of the last
        ``history`` steps, kept in a state the caller carries (:func:`delayed_dot_general`;
        through a policy, a Flax collection, NNX Variables or :func:`mpjax.fp8_state` for
        autocast). ``"rowwise"``: one power of two per row of each operand of each GEMM (the
        axes it does not contract: per token for activations, per output channel for
        weights), e4m3 forward and backward (:func:`rowwise_dot_general`). ``"mxfp8"`` and
        ``"nvfp4"``: the block formats of Blackwell GPUs, a scale per 32 (16) values along the
        contraction (:mod:`mpjax.block_scaled`); they take no margin.
      history: the length of the amax history of delayed scaling (at least 1).
      margin: the scale is multiplied by ``2**margin``, leaving that many binades of headroom
        below the fp8 maximum (0 to 16).
      batched: also run batched matmuls (those with batch dimensions: attention's ``q @ k^T``
        and ``p @ v``, per-expert einsums) in fp8. By default only unbatched matmuls run in fp8:
        dense layers and einsums against a weight, where Transformer Engine runs fp8 too.
      hadamard, stochastic_rounding, weight_blocks_2d: ``"nvfp4"`` only: the ingredients of
        NVIDIA's NVFP4 training recipe (:mod:`mpjax.block_scaled`): a random Hadamard
        transform on the weight gradient's inputs, stochastic rounding of the output
        gradient, the weight in 16 x 16 tiles. Left None, each is on for NVFP4 (the whole
        recipe, for training) and absent for the other scalings; False turns one off, for an
        ablation (Transformer Engine's ``disable_rht``, ``disable_stochastic_rounding``,
        ``disable_2d_quantization``).
      capacity: block formats only: a mixture of experts' grouped GEMMs run as batched
        block-scaled GEMMs over each expert's first ``capacity * rows / experts`` rows (rounded
        up to 128), dropping the rows past that, as Switch Transformer's capacity factor
        (:mod:`mpjax.grouped.capacity`). None (the default): they run grouped in the compute
        dtype, dropping nothing, since no grouped GEMM takes a block format.

    ``str(recipe)`` is the form policy strings use (``"current"``, ``"current;margin=1"``,
    ``"delayed;history=16"``, ``"nvfp4;no_hadamard"``, ``"nvfp4;plain"`` for NVFP4 with none of
    the recipe, ``"mxfp8;capacity=1.25"``) and :meth:`parse` reads it back; options left at
    their defaults are left out.

    >>> Fp8Recipe()
    Fp8Recipe(scaling='current', history=1024, margin=0, batched=False)
    >>> str(Fp8Recipe("delayed", history=16, margin=1))
    'delayed;history=16;margin=1'
    """

    scaling: str = "current"
    history: int = 1024
    margin: int = 0
    batched: bool = False
    hadamard: bool | None = None
    stochastic_rounding: bool | None = None
    weight_blocks_2d: bool | None = None
    capacity: float | None = None

    def __post_init__(self):
        if not isinstance(self.scaling, str) or self.scaling not in SCALINGS:
            raise ValueError(
                f"Fp8Recipe(scaling=...) must be one of {', '.join(map(repr, SCALINGS))}; got "
                f"{self.scaling!r}."
            )
        if (
            isinstance(self.history, bool)
            or not isinstance(self.history, (int, np.integer))
            or self.history < 1
        ):
            raise ValueError(
                f"Fp8Recipe(history=...) must be an int, at least 1; got {self.history!r}."
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, np.integer)):
            raise TypeError(
                f"Fp8Recipe(margin=...) must be an int from 0 to {_MAX_MARGIN}; got "
                f"{self.margin!r} of type {type(self.margin).__name__}."
            )
        if not 0 <= self.margin <= _MAX_MARGIN:
            raise ValueError(
                f"Fp8Recipe(margin=...) must be from 0 to {_MAX_MARGIN}; got {self.margin}."
            )
        if not isinstance(self.batched, (bool, np.bool_)):
            raise TypeError(f"Fp8Recipe(batched=...) must be True or False; got {self.batched!r}.")
        if self.scaling in BLOCK_SCALINGS and self.margin:
            raise ValueError(
                f"Fp8Recipe(margin=...) does not apply to {self.scaling}, whose block scales are "
                f"chosen per block by the format's own rule; got margin={self.margin}."
            )
        object.__setattr__(self, "history", int(self.history))
        object.__setattr__(self, "margin", int(self.margin))
        object.__setattr__(self, "batched", bool(self.batched))
        for name in NVFP4_INGREDIENTS:
            flag = getattr(self, name)
            if flag is not None and not isinstance(flag, (bool, np.bool_)):
                raise TypeError(
                    f"Fp8Recipe({name}=...) must be True, False or None; got {flag!r} of type "
                    f"{type(flag).__name__}."
                )
            if self.scaling != "nvfp4":
                if flag is not None:
                    raise ValueError(
                        f"Fp8Recipe({name}=...) is an ingredient of NVFP4's training recipe; "
                        f"scaling {self.scaling!r} takes none (scaling='nvfp4' does)."
                    )
                continue
            object.__setattr__(self, name, True if flag is None else bool(flag))
        if self.capacity is not None:
            if isinstance(self.capacity, bool) or not isinstance(
                self.capacity, (int, float, np.integer, np.floating)
            ):
                raise TypeError(
                    f"Fp8Recipe(capacity=...) must be a number (experts' slots per expert's "
                    f"share of the rows, such as 1.25) or None; got {self.capacity!r}."
                )
            if not (math.isfinite(self.capacity) and self.capacity > 0):
                raise ValueError(
                    f"Fp8Recipe(capacity=...) must be positive and finite; got {self.capacity}."
                )
            if self.scaling not in BLOCK_SCALINGS:
                raise ValueError(
                    f"Fp8Recipe(capacity=...) runs experts as batched block-scaled GEMMs; "
                    f"scaling {self.scaling!r} has grouped fp8 GEMMs and takes none "
                    f"({', '.join(BLOCK_SCALINGS)} do)."
                )
            object.__setattr__(self, "capacity", float(self.capacity))

    def __repr__(self) -> str:
        fields = (f.name for f in dataclasses.fields(self))
        shown = (f"{n}={getattr(self, n)!r}" for n in fields if getattr(self, n) is not None)
        return f"Fp8Recipe({', '.join(shown)})"

    def __str__(self) -> str:
        parts = [self.scaling]
        if self.history != 1024:
            parts.append(f"history={self.history}")
        if self.margin:
            parts.append(f"margin={self.margin}")
        if self.batched:
            parts.append("batched")
        if self.scaling == "nvfp4":
            off = [o for o, name in _INGREDIENT_OPTIONS.items() if not getattr(self, name)]
            parts.extend(["plain"] if len(off) == len(_INGREDIENT_OPTIONS) else off)
        if self.capacity is not None:
            parts.append(f"capacity={self.capacity:g}")
        return ";".join(parts)

    @classmethod
    def parse(cls, text: str) -> Fp8Recipe:
        """Reads the string form: the scaling, then ``;``-separated options (``margin=N``,
        ``history=N``, ``batched``; for ``nvfp4``, ``no_hadamard``, ``no_stochastic_rounding``,
        ``no_2d``, or ``plain`` for none of the recipe).

        Raises:
          ValueError: for an unknown scaling or option, or a margin that is not an integer.

        >>> Fp8Recipe.parse("delayed;history=16")
        Fp8Recipe(scaling='delayed', history=16, margin=0, batched=False)
        """
        if not isinstance(text, str):
            raise TypeError(f"Fp8Recipe.parse takes a string; got {text!r}.")
        scaling, *options = (part.strip() for part in text.split(";"))
        fields: dict[str, Any] = {"scaling": scaling}
        for option in options:
            key, sep, value = option.partition("=")
            if option == "batched":
                fields["batched"] = True
            elif option in _INGREDIENT_OPTIONS and scaling == "nvfp4":
                fields[_INGREDIENT_OPTIONS[option]] = False
            elif option == "plain" and scaling == "nvfp4":
                fields.update(dict.fromkeys(NVFP4_INGREDIENTS, False))
            elif key in ("margin", "history") and sep and value.lstrip("-").isdigit():
                fields[key] = int(value)
            elif key == "capacity" and sep and _is_number(value):
                fields[key] = float(value)
            else:
                raise ValueError(
                    f"Unknown fp8 option {option!r} in {text!r}. Options: history=N (delayed "
                    "scaling's amax history, at least 1), margin=N (an integer from 0 to 16), "
                    "batched, for mxfp8 and nvfp4 capacity=F (experts as batched GEMMs over "
                    "F times their share of the rows), and for nvfp4 alone no_hadamard, "
                    "no_stochastic_rounding, no_2d or plain (none of NVIDIA's recipe), after "
                    "the scaling, separated by ';'."
                )
        return cls(**fields)

    @property
    def block_scaled(self) -> bool:
        """Whether the matmuls run in a block format (``"mxfp8"``, ``"nvfp4"``)."""
        return self.scaling in BLOCK_SCALINGS

    def applies_to(self, dimension_numbers: Any) -> bool:
        """Whether a ``dot_general`` with these dimension numbers runs in fp8 under this
        recipe: always when ``batched``, else only without batch dimensions."""
        (_, _), (lhs_batch, rhs_batch) = dimension_numbers
        return self.batched or not (len(lhs_batch) or len(rhs_batch))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def fp8_recipe(spec: Fp8Recipe | str) -> Fp8Recipe:
    """The :class:`Fp8Recipe` that ``spec`` names: a recipe (returned as is) or its string form.

    >>> fp8_recipe("current")
    Fp8Recipe(scaling='current', history=1024, margin=0, batched=False)
    """
    if isinstance(spec, Fp8Recipe):
        return spec
    if isinstance(spec, str):
        return Fp8Recipe.parse(spec)
    raise TypeError(
        f"fp8 must be an mpjax.Fp8Recipe or its string form (for example 'current'); got "
        f"{spec!r} of type {type(spec).__name__}."
    )


def _fp8_max(dtype: np.dtype) -> float:
    return float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
    """``x / scale`` in the fp8 ``dtype``, computed in f32, finite values saturating at ±max.

    Non-finite values stay non-finite (inf becomes NaN in e4m3, which has no inf), so an
    overflow upstream is not hidden.

    >>> import jax.numpy as jnp
    >>> quantize(jnp.array([1.0, 1000.0, jnp.inf]), E4M3, jnp.float32(1.0))
    Array([1, 448, nan], dtype=float8_e4m3fn)
    """
    dtype = np.dtype(dtype)
    y = x.astype(_F32) / scale.astype(_F32)
    bound = _fp8_max(dtype)
    return jnp.where(jnp.isfinite(y), jnp.clip(y, -bound, bound), y).astype(dtype)


def dequantize(q: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
    """``q * scale`` in ``dtype``: the form (``convert`` then ``multiply`` by a broadcast
    scalar) that XLA folds into an fp8 GEMM when the result feeds a ``dot``."""
    dtype = np.dtype(dtype)
    return q.astype(dtype) * scale.astype(dtype)


def current_scale(x: jax.Array, dtype: Any, margin: int = 0) -> jax.Array:
    """The f32 scale that maps ``amax(|x|)`` to the fp8 maximum of ``dtype`` (times
    ``2**margin``); 1 when ``x`` is all zeros or holds a non-finite value.

    >>> import jax.numpy as jnp
    >>> current_scale(jnp.array([-896.0, 3.0]), E4M3)
    Array(2., dtype=float32)
    """
    amax = jnp.max(jnp.abs(x)).astype(_F32)
    usable = (amax > 0) & jnp.isfinite(amax)
    scale = amax / _fp8_max(np.dtype(dtype)) * (2.0**margin)
    return jnp.where(usable, scale, jnp.ones((), _F32))


def _representable_scale(scale: jax.Array, compute: np.dtype) -> jax.Array:
    """The scale rounded to the compute dtype (and kept above its smallest normal), so that
    quantizing divides by exactly what dequantizing multiplies by."""
    tiny = float(jnp.finfo(compute).tiny)
    return jnp.maximum(scale, tiny).astype(compute).astype(_F32)


class _Quantized(NamedTuple):
    """A tensor in fp8 and the scale it was quantized with (rounded to the compute dtype)."""

    q: jax.Array
    scale: jax.Array


def _quantized(x: jax.Array, dtype: np.dtype, scale: jax.Array) -> _Quantized:
    scale = _representable_scale(scale, np.dtype(x.dtype))
    return _Quantized(quantize(x, dtype, scale), scale)


def _matmul(a: _Quantized, b: _Quantized, dimension_numbers, precision, compute):
    """The GEMM on the fp8 values themselves, accumulated in f32, scaled after: the form
    XLA compiles to an fp8 GEMM (cuBLASLt's or Triton's) whatever its GEMM flags."""
    out = lax.dot_general(
        a.q, b.q, dimension_numbers, precision=precision, preferred_element_type=_F32
    )
    return (out * (a.scale * b.scale)).astype(compute)


def kept_axes(ndim: int, *removed: Sequence[int]) -> list[int]:
    """The axes of an ``ndim`` operand of a ``dot_general`` that are neither contracted nor
    batched (``removed``: its contracted and batch axes)."""
    gone = {axis for axes in removed for axis in axes}
    return [axis for axis in range(ndim) if axis not in gone]


def _transpose_lhs(lhs_ndim, rhs_ndim, dimension_numbers, swap_ans=False):
    """The dimension numbers and the output permutation that give the gradient of a
    ``dot_general``'s lhs (of rank ``lhs_ndim``; the rhs ``y`` is of rank ``rhs_ndim``) as
    ``transpose(dot_general(g, y, ...))``: the transposition
    ``jax.grad`` does for a ``dot_general``, written out so that both factors can stay fp8."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = kept_axes(lhs_ndim, x_contract, x_batch)
    y_kept = kept_axes(rhs_ndim, y_contract, y_batch)
    n_batch = len(x_batch)
    if swap_ans:  # g's axes: batch, y's kept, x's kept
        ans_y = range(n_batch, n_batch + len(y_kept))
    else:  # g's axes: batch, x's kept, y's kept
        ans_y = range(n_batch + len(x_kept), n_batch + len(x_kept) + len(y_kept))
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(range(n_batch)), tuple(y_batch)))
    x_contract_by_y = [x_contract[i] for i in np.argsort(y_contract)]
    permutation = tuple(int(i) for i in np.argsort([*x_batch, *x_kept, *x_contract_by_y]))
    return dims, permutation


def _dequantized_matmul(a: _Quantized, b: _Quantized, dimension_numbers, precision, compute):
    """The same GEMM on the fp8 values dequantized into the compute dtype (exactly: the scales
    are representable there), for an XLA that cannot take two different fp8 types in a dot
    (:func:`mpjax.jax_compat.mixed_fp8_dots`). XLA makes it an fp8 GEMM only with its Triton
    GEMMs off; with its default flags it runs in the compute dtype."""
    return lax.dot_general(
        dequantize(a.q, compute, a.scale),
        dequantize(b.q, compute, b.scale),
        dimension_numbers,
        precision=precision,
        preferred_element_type=compute,
    )


def _gradient_matmul(g, y, lhs_ndim, dimension_numbers, precision, compute, swap_ans=False):
    dims, permutation = _transpose_lhs(lhs_ndim, y.q.ndim, dimension_numbers, swap_ans)
    matmul = _matmul if jax_compat.mixed_fp8_dots() else _dequantized_matmul
    return lax.transpose(matmul(g, y, dims, precision, compute), permutation)


def _forward(lhs, rhs, scales, dimension_numbers, precision):
    """The forward matmul on e4m3 operands; its residuals are the fp8 values and their
    scales (half the bytes of bf16 residuals), which the backward GEMMs take as they are."""
    a, b = _quantized(lhs, E4M3, scales[0]), _quantized(rhs, E4M3, scales[1])
    return _matmul(a, b, dimension_numbers, precision, np.dtype(lhs.dtype)), (a, b)


def _backward(operands, g, g_scale, dimension_numbers, precision):
    """The gradients of both operands from the e5m2-quantized ``g``: the straight-through
    estimator for the forward rounding, with fp8 operands in both backward GEMMs (e5m2 x
    e4m3)."""
    a, b = operands
    compute = np.dtype(g.dtype)
    qg = _quantized(g, E5M2, g_scale)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    swapped = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    dlhs = _gradient_matmul(qg, b, a.q.ndim, dimension_numbers, precision, compute)
    drhs = _gradient_matmul(qg, a, b.q.ndim, swapped, precision, compute, swap_ans=True)
    return dlhs, drhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _current(lhs, rhs, dimension_numbers, precision, margin):
    return _current_fwd(lhs, rhs, dimension_numbers, precision, margin)[0]


def _current_fwd(lhs, rhs, dimension_numbers, precision, margin):
    scales = (current_scale(lhs, E4M3, margin), current_scale(rhs, E4M3, margin))
    return _forward(lhs, rhs, scales, dimension_numbers, precision)


def _current_bwd(dimension_numbers, precision, margin, operands, g):
    scale = current_scale(g, E5M2, margin)
    return _backward(operands, g, scale, dimension_numbers, precision)


_current.defvjp(_current_fwd, _current_bwd)


# --- Rowwise scaling -----------------------------------------------------------------------


def rowwise_scale(x: jax.Array, contract: Sequence[int], dtype: Any, margin: int = 0) -> jax.Array:
    """The f32 scales of ``x``'s rows for a GEMM contracting its axes ``contract``: one per
    index of the other axes (kept with size 1 along ``contract``), each the smallest power of
    two at least ``amax(|row|) / fp8_max`` (times ``2**margin``), so that no finite value
    saturates and dividing by it is exact; 1 for a row of zeros or one holding a non-finite
    value.

    >>> import jax.numpy as jnp
    >>> rowwise_scale(jnp.array([[896.0, 3.0], [1.0, 0.5]]), (1,), E4M3).ravel().tolist()
    [2.0, 0.00390625]
    """
    amax = jnp.max(jnp.abs(x), axis=tuple(contract), keepdims=True)
    return power_of_two_scale(amax, dtype, margin)


def power_of_two_scale(amax: jax.Array, dtype: Any, margin: int = 0) -> jax.Array:
    """:func:`rowwise_scale`'s rule on amaxes already taken: for each, the smallest power of
    two at least ``amax / fp8_max`` (times ``2**margin``), in f32; 1 for an amax that is zero or
    not finite.

    >>> power_of_two_scale(jnp.array([896.0, 1.0, 0.0]), E4M3).tolist()
    [2.0, 0.00390625, 1.0]
    """
    amax = amax.astype(_F32)
    usable = (amax > 0) & jnp.isfinite(amax)
    mantissa, exponent = jnp.frexp(jnp.where(usable, amax / _fp8_max(np.dtype(dtype)), 1.0))
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent) + margin
    tiny = int(np.log2(np.finfo(np.float32).tiny))  # no subnormal scale
    return jnp.where(usable, jnp.ldexp(jnp.ones((), _F32), jnp.maximum(exponent, tiny)), 1.0)


def _output_scale(scale: jax.Array, batch, kept, contract, other_kept: int, first: bool):
    """An operand's row scales laid out along a ``dot_general``'s output axes (batch, lhs kept,
    rhs kept), size 1 along the other operand's ``other_kept`` axes."""
    moved = jnp.transpose(scale, (*batch, *kept, *contract))
    sizes = moved.shape[: len(batch) + len(kept)]
    ones = (1,) * other_kept
    b, k = sizes[: len(batch)], sizes[len(batch) :]
    return moved.reshape((*b, *k, *ones) if first else (*b, *ones, *k))


def _rowwise_matmul(a, b, dimension_numbers, compute, margin):
    """A GEMM on e4m3 operands scaled per row, accumulated in f32, the outer product of the
    row scales applied to its output, rounded to ``compute``."""
    (a_contract, b_contract), (a_batch, b_batch) = dimension_numbers
    a_kept, b_kept = kept_axes(a.ndim, a_contract, a_batch), kept_axes(b.ndim, b_contract, b_batch)
    sa = rowwise_scale(a, a_contract, E4M3, margin)
    sb = rowwise_scale(b, b_contract, E4M3, margin)
    out = lax.dot_general(
        quantize(a, E4M3, sa), quantize(b, E4M3, sb), dimension_numbers, preferred_element_type=_F32
    )
    scale = _output_scale(sa, a_batch, a_kept, a_contract, len(b_kept), True) * _output_scale(
        sb, b_batch, b_kept, b_contract, len(a_kept), False
    )
    return (out * scale).astype(compute)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rowwise(lhs, rhs, dimension_numbers, margin):
    return _rowwise_matmul(lhs, rhs, dimension_numbers, np.dtype(lhs.dtype), margin)


def _rowwise_fwd(lhs, rhs, dimension_numbers, margin):
    return _rowwise(lhs, rhs, dimension_numbers, margin), (lhs, rhs)


def _rowwise_bwd(dimension_numbers, margin, residuals, g):
    """Both gradients from GEMMs whose operands are quantized again per row of *that* GEMM (a
    row scale runs across the contraction, which differs between the three GEMMs), e4m3 for
    the incoming gradient too: the saved operands are the unquantized ones."""
    lhs, rhs = residuals
    compute = np.dtype(lhs.dtype)
    g = g.astype(compute)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    swapped = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    dims, permutation = _transpose_lhs(lhs.ndim, rhs.ndim, dimension_numbers)
    dlhs = lax.transpose(_rowwise_matmul(g, rhs, dims, compute, margin), permutation)
    dims, permutation = _transpose_lhs(rhs.ndim, lhs.ndim, swapped, swap_ans=True)
    drhs = lax.transpose(_rowwise_matmul(g, lhs, dims, compute, margin), permutation)
    return dlhs, drhs


_rowwise.defvjp(_rowwise_fwd, _rowwise_bwd)


def rowwise_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    *,
    margin: int = 0,
    precision: Any = None,
) -> jax.Array:
    """``lax.dot_general`` in fp8 with a power-of-two scale per row of each operand (the
    rowwise recipe of torchao's float8 training): e4m3 operands in all three GEMMs, each
    quantized per row of the GEMM it enters (for the forward GEMM, per token of the
    activations and per output channel of the weights), the scales applied to the f32 output.

    Finer scales than one per tensor keep a row of small values from losing its bits to
    another row's outlier, which is why the incoming gradient runs in e4m3 too. The operands
    are saved unquantized for the backward pass (each backward GEMM quantizes them along its
    own rows), as bf16 matmuls save them.

    Args:
      lhs, rhs: the operands; computed in the wider of their dtypes (bf16, f16 or f32).
      dimension_numbers: as for ``lax.dot_general``.
      margin: binades of headroom, as in :class:`Fp8Recipe`.
      precision: must be None (``DEFAULT``), the precision fp8 GEMMs have.

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[448.0, 1.0], [0.25, 0.5]], jnp.bfloat16)
    >>> rowwise_dot_general(x, jnp.eye(2, dtype=jnp.bfloat16), (((1,), (0,)), ((), ())))
    Array([[448, 1],
           [0.25, 0.5]], dtype=bfloat16)
    """
    del precision  # fp8 GEMMs have one precision
    recipe = Fp8Recipe("rowwise", margin=margin)  # checks the margin
    lhs, rhs = _in_compute_dtype(lhs, rhs)
    return _rowwise(lhs, rhs, dimension_numbers, recipe.margin)


def check_compute_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a numpy dtype, if fp8 (and block-scaled) matmuls can run with it (bf16, f16,
    f32).

    Raises:
      ValueError: for any other dtype.
    """
    dtype = np.dtype(dtype)
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(
            f"fp8 matmuls dequantize into the compute dtype, which must be bfloat16, float16 "
            f"or float32; got {dtype.name}."
        )
    return dtype


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    recipe: Fp8Recipe | str = "current",
    *,
    precision: Any = None,
) -> jax.Array:
    """``lax.dot_general`` with fp8 operands: e4m3 inputs forward, e5m2 gradient backward.

    Both operands are cast to the wider of their two dtypes (the compute dtype, which must be
    bfloat16, float16 or float32), quantized with per-tensor scales, and multiplied; the result
    is in the compute dtype. Under ``jax.grad`` the cotangent is quantized to e5m2 and both
    backward matmuls take fp8 operands too; the gradients reaching ``lhs`` and ``rhs`` are
    the backward matmuls' results, unquantized (a straight-through estimator for the
    forward rounding).

    Args:
      lhs, rhs: the operands.
      dimension_numbers: as for ``lax.dot_general``.
      recipe: an :class:`Fp8Recipe` or its string form.
      precision: as for ``lax.dot_general``; leave it None (``DEFAULT``) on GPU, the precision
        cuBLASLt fp8 GEMMs accept.

    >>> import jax.numpy as jnp
    >>> # amaxes of 7 and 3.5 give scales of 1/64 and 1/128 (7 / 448, 3.5 / 448): exact
    >>> x, w = jnp.full((2, 8), 7.0, jnp.bfloat16), jnp.full((8, 3), 3.5, jnp.bfloat16)
    >>> dot_general(x, w, (((1,), (0,)), ((), ())))
    Array([[196, 196, 196],
           [196, 196, 196]], dtype=bfloat16)
    """
    recipe = fp8_recipe(recipe)
    lhs, rhs = _in_compute_dtype(lhs, rhs)
    return _current(lhs, rhs, dimension_numbers, precision, recipe.margin)


def _in_compute_dtype(lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, jax.Array]:
    with jax.numpy_dtype_promotion("standard"):
        compute = check_compute_dtype(jnp.promote_types(lhs.dtype, rhs.dtype))
    return lhs.astype(compute), rhs.astype(compute)


# --- Delayed scaling ----------------------------------------------------------------------

# The rows of an Fp8Meta: the two forward operands (e4m3) and the incoming gradient (e5m2).
_ROLES = (E4M3, E4M3, E5M2)


class Fp8Meta(NamedTuple):
    """The delayed-scaling state of one fp8 matmul: f32 arrays, a pytree like any other.

    Attributes:
      scale: shape ``(3,)``: the scales the next step quantizes the lhs, the rhs and the
        incoming gradient with (``x ≈ q * scale``).
      amax_history: shape ``(history, 3)``: the amax of each of them over the last
        ``history`` steps, newest first.

    Stacked along leading axes (``(layers, 3)``, ``(layers, history, 3)``) it is the state
    of a matmul inside ``lax.scan`` over layers.
    """

    scale: jax.Array
    amax_history: jax.Array


def as_meta(value: Any) -> Fp8Meta:
    """``value`` as an :class:`Fp8Meta`: one already, a ``(scale, amax_history)`` pair, or a
    mapping with those keys (what some checkpoint libraries restore a named tuple as).

    Raises:
      TypeError: for anything else.
    """
    if isinstance(value, Fp8Meta):
        return value
    if isinstance(value, Mapping) and set(value) == set(Fp8Meta._fields):
        return Fp8Meta(**value)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Fp8Meta(*value)
    raise TypeError(
        "An fp8 state entry must be an mpjax.fp8.Fp8Meta (or a (scale, amax_history) pair, or "
        f"a mapping with those keys); got {type(value).__name__}."
    )


def init_meta(history: int = 1024, shape: tuple[int, ...] = ()) -> Fp8Meta:
    """The state of a matmul that has not run yet: scales of 1 and an all-zero history.

    Args:
      history: how many steps' amaxes the scale is taken from (at least 1; 1 uses the last
        step's amax only).
      shape: leading axes to stack the state along (``(layers,)`` for a matmul inside a scan
        over layers).

    Raises:
      ValueError: for a history shorter than 1.
      TypeError: for a history that is not an int.

    >>> init_meta(4).amax_history.shape
    (4, 3)
    """
    if isinstance(history, bool) or not isinstance(history, (int, np.integer)):
        raise TypeError(
            f"init_meta(history=...) must be an int, at least 1; got {history!r} of type "
            f"{type(history).__name__}."
        )
    if history < 1:
        raise ValueError(f"init_meta(history=...) must be at least 1; got {history}.")
    shape = tuple(shape)
    return Fp8Meta(jnp.ones((*shape, 3), _F32), jnp.zeros((*shape, int(history), 3), _F32))


def next_meta(meta: Fp8Meta, amax: jax.Array, margin: int = 0) -> Fp8Meta:
    """The state after a step whose three tensors had these ``amax`` values (shape ``(3,)``).

    The history rolls by one with ``amax`` in front; each scale becomes the largest amax in
    its history divided by its format's maximum, times ``2**margin``. A row whose amax is not
    finite (an overflow, a step that loss scaling skips) keeps its history and scale; a row
    whose history is all zeros keeps its scale.

    >>> meta = next_meta(init_meta(2), jnp.array([896.0, 112.0, 0.0]))
    >>> meta.scale.tolist(), meta.amax_history.tolist()
    ([2.0, 0.25, 1.0], [[896.0, 112.0, 0.0], [0.0, 0.0, 0.0]])
    """
    amax = amax.astype(_F32)
    finite = jnp.isfinite(amax)
    rolled = jnp.roll(meta.amax_history, 1, axis=0).at[0].set(amax)
    history = jnp.where(finite, rolled, meta.amax_history)
    largest = jnp.max(history, axis=0)
    bounds = jnp.array([_fp8_max(d) for d in _ROLES], _F32)
    scale = jnp.where(largest > 0, largest / bounds * (2.0**margin), meta.scale)
    return Fp8Meta(scale, history)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _delayed(lhs, rhs, meta, dimension_numbers, precision, margin):
    return _delayed_fwd(lhs, rhs, meta, dimension_numbers, precision, margin)[0]


def _delayed_fwd(lhs, rhs, meta, dimension_numbers, precision, margin):
    out, operands = _forward(lhs, rhs, meta.scale[:2], dimension_numbers, precision)
    return out, (operands, meta, _amax(lhs), _amax(rhs))


def _delayed_bwd(dimension_numbers, precision, margin, residuals, g):
    operands, meta, amax_lhs, amax_rhs = residuals
    dlhs, drhs = _backward(operands, g, meta.scale[2], dimension_numbers, precision)
    new = next_meta(meta, jnp.stack([amax_lhs, amax_rhs, _amax(g)]), margin)
    return dlhs, drhs, new


_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def delayed_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    meta: Fp8Meta,
    *,
    margin: int = 0,
    precision: Any = None,
) -> jax.Array:
    """``lax.dot_general`` in fp8 with delayed scaling: the scales come from ``meta``.

    Forward, ``lhs`` and ``rhs`` are quantized to e4m3 with ``meta.scale[0]`` and
    ``meta.scale[1]``, saturating where a tensor outgrew its scale; under ``jax.grad`` the
    incoming gradient is quantized to e5m2 with ``meta.scale[2]`` and both backward matmuls
    take fp8 operands. The gradient with respect to ``meta`` is the *next* state
    (:func:`next_meta` of this step's three amaxes), so differentiate with respect to the
    state as well and keep that gradient as the new state::

        grads, new_meta = jax.grad(loss, argnums=(0, 1))(params, meta, batch)

    Don't add such gradients up: with gradient accumulation keep the state of one micro-batch.
    Outside ``jax.grad`` (evaluation) the state simply stays as it is.

    Args:
      lhs, rhs: the operands; computed in the wider of their dtypes (bf16, f16 or f32).
      dimension_numbers: as for ``lax.dot_general``.
      meta: the state, from :func:`init_meta` or the previous step's gradient.
      margin: binades of headroom, as in :class:`Fp8Recipe`.
      precision: as for ``lax.dot_general``; leave it None on GPU.

    >>> import jax, jax.numpy as jnp
    >>> x, w = jnp.ones((2, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16)
    >>> loss = lambda w, meta: delayed_dot_general(x, w, (((1,), (0,)), ((), ())), meta).sum()
    >>> _, meta = jax.grad(loss, argnums=(0, 1))(w, init_meta(4))
    >>> meta.amax_history[0].tolist()  # this step's amaxes: lhs, rhs, gradient
    [1.0, 1.0, 1.0]
    """
    try:
        meta = as_meta(meta)
    except TypeError as error:
        raise TypeError(
            f"delayed_dot_general(meta=...) takes an mpjax.fp8.Fp8Meta (from init_meta() or "
            f"the previous step's gradient): {error}"
        ) from None
    recipe = Fp8Recipe(margin=margin)  # checks the margin
    lhs, rhs = _in_compute_dtype(lhs, rhs)
    return _delayed(lhs, rhs, meta, dimension_numbers, precision, recipe.margin)
