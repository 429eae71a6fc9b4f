"""fp8 matmuls: e4m3 operands forward, e5m2 gradients backward, one scale per tensor.

An 8-bit float has a narrow range (e4m3: ±448 with 3 mantissa bits; e5m2: ±57344 with 2), so a
tensor is divided by a *scale* before the cast and multiplied by it after: ``x ≈ q * scale``
with ``q = saturate(x / scale)`` in fp8. :func:`dot_general` quantizes both operands of a
matmul to e4m3 in the forward pass and the incoming gradient to e5m2 in the backward pass (the
format with more range, since gradients span more binades than activations and weights), and
runs all three matmuls (forward, input gradient, weight gradient) on those values. Outputs and
accumulation stay in the compute dtype (bf16, f16 or f32).

The matmuls are written the way XLA's GPU compiler recognizes fp8 GEMMs: each operand of the
``dot`` is ``convert(f8 value) * broadcast(scale)``, with an f32 scalar scale and default
precision. On Hopper (and Ada) GPUs XLA rewrites that into a cuBLASLt fp8 GEMM that reads the
fp8 values and applies the scales itself; elsewhere it runs the same arithmetic in the compute
dtype, so CPU results equal what the GPU computes up to accumulation order.
:func:`mpjax.hlo_dots` shows the pattern in a function's HLO.

Scaling (:class:`Fp8Recipe`):

- ``"current"``: the scale of a tensor is ``amax(|x|) / fp8_max * 2**margin``, computed from
  the tensor itself at each step. Stateless, so it works wherever a matmul runs: under
  :func:`mpjax.autocast` of any function, in wrapped Flax models, in ``scan``, ``remat``,
  ``shard_map`` and under sharding (the amax of a sharded array is a global reduction).

Overflow: finite values beyond the fp8 range saturate to ±max (a plain cast makes them NaN in
e4m3 and inf in e5m2). Non-finite values stay non-finite, so an overflow in the forward pass or
in the gradients still reaches :func:`mpjax.loss_scaling`, which skips the step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3 = np.dtype(jnp.float8_e4m3fn)
"""The forward format: 4 exponent and 3 mantissa bits, finite range ±448."""
E5M2 = np.dtype(jnp.float8_e5m2)
"""The gradient format: 5 exponent and 2 mantissa bits, finite range ±57344."""

SCALINGS = ("current",)
"""The scaling modes :class:`Fp8Recipe` accepts."""

_F32 = np.dtype(jnp.float32)
_COMPUTE_DTYPES = frozenset(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_MAX_MARGIN = 16


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How the matmuls of a policy run in fp8.

    Args:
      scaling: how scales are chosen; ``"current"``: from the amax of each tensor at each step.
      margin: the scale is multiplied by ``2**margin``, leaving that many binades of headroom
        below the fp8 maximum (0 to 16).
      batched: also run batched matmuls (those with batch dimensions: attention's ``q @ k^T``
        and ``p @ v``, per-expert einsums) in fp8. By default only unbatched matmuls run in fp8:
        dense layers and einsums against a weight, where Transformer Engine runs fp8 too.

    ``str(recipe)`` is the form policy strings use (``"current"``, ``"current;margin=1"``,
    ``"current;batched"``) and :meth:`parse` reads it back.

    >>> Fp8Recipe()
    Fp8Recipe(scaling='current', margin=0, batched=False)
    >>> str(Fp8Recipe(margin=1, batched=True))
    'current;margin=1;batched'
    """

    scaling: str = "current"
    margin: int = 0
    batched: bool = False

    def __post_init__(self):
        if not isinstance(self.scaling, str) or self.scaling not in SCALINGS:
            raise ValueError(
                f"Fp8Recipe(scaling=...) must be one of {', '.join(map(repr, SCALINGS))}; got "
                f"{self.scaling!r}."
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
        object.__setattr__(self, "margin", int(self.margin))
        object.__setattr__(self, "batched", bool(self.batched))

    def __str__(self) -> str:
        parts = [self.scaling]
        if self.margin:
            parts.append(f"margin={self.margin}")
        if self.batched:
            parts.append("batched")
        return ";".join(parts)

    @classmethod
    def parse(cls, text: str) -> Fp8Recipe:
        """Reads the string form: the scaling, then ``;``-separated options (``margin=N``,
        ``batched``).

        Raises:
          ValueError: for an unknown scaling or option, or a margin that is not an integer.

        >>> Fp8Recipe.parse("current;margin=2")
        Fp8Recipe(scaling='current', margin=2, batched=False)
        """
        if not isinstance(text, str):
            raise TypeError(f"Fp8Recipe.parse takes a string; got {text!r}.")
        scaling, *options = (part.strip() for part in text.split(";"))
        fields: dict[str, Any] = {"scaling": scaling}
        for option in options:
            key, sep, value = option.partition("=")
            if option == "batched":
                fields["batched"] = True
            elif key == "margin" and sep and value.lstrip("-").isdigit():
                fields["margin"] = int(value)
            else:
                raise ValueError(
                    f"Unknown fp8 option {option!r} in {text!r}. Options: margin=N (an integer "
                    "from 0 to 16) and batched, after the scaling, separated by ';'."
                )
        return cls(**fields)

    def applies_to(self, dimension_numbers: Any) -> bool:
        """Whether a ``dot_general`` with these dimension numbers runs in fp8 under this
        recipe: always when :attr:`batched`, else only without batch dimensions."""
        (_, _), (lhs_batch, rhs_batch) = dimension_numbers
        return self.batched or not (len(lhs_batch) or len(rhs_batch))


def fp8_recipe(spec: Fp8Recipe | str) -> Fp8Recipe:
    """The :class:`Fp8Recipe` that ``spec`` names: a recipe (returned as is) or its string form.

    >>> fp8_recipe("current")
    Fp8Recipe(scaling='current', margin=0, batched=False)
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


def _qdq(x: jax.Array, dtype: np.dtype, margin: int) -> jax.Array:
    compute = np.dtype(x.dtype)
    scale = _representable_scale(current_scale(x, dtype, margin), compute)
    return dequantize(quantize(x, dtype, scale), compute, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _operand(x: jax.Array, margin: int) -> jax.Array:
    """An e4m3-quantized forward operand; its gradient passes straight through."""
    return _qdq(x, E4M3, margin)


def _operand_fwd(x, margin):
    return _qdq(x, E4M3, margin), None


def _operand_bwd(margin, _, g):
    return (g,)


_operand.defvjp(_operand_fwd, _operand_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient(y: jax.Array, margin: int) -> jax.Array:
    """The identity, whose gradient is quantized to e5m2 before the backward matmuls use it."""
    return y


def _gradient_fwd(y, margin):
    return y, None


def _gradient_bwd(margin, _, g):
    return (_qdq(g, E5M2, margin),)


_gradient.defvjp(_gradient_fwd, _gradient_bwd)


def check_compute_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a numpy dtype, if fp8 matmuls can run with it (bf16, f16, f32).

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
    >>> x, w = jnp.ones((2, 8), jnp.bfloat16), jnp.full((8, 3), 0.5, jnp.bfloat16)
    >>> dot_general(x, w, (((1,), (0,)), ((), ())))
    Array([[4, 4, 4],
           [4, 4, 4]], dtype=bfloat16)
    """
    recipe = fp8_recipe(recipe)
    with jax.numpy_dtype_promotion("standard"):
        compute = check_compute_dtype(jnp.promote_types(lhs.dtype, rhs.dtype))
    lhs = _operand(lhs.astype(compute), recipe.margin)
    rhs = _operand(rhs.astype(compute), recipe.margin)
    out = lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=compute
    )
    return _gradient(out, recipe.margin)
