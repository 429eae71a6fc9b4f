"""Inspection: which dtype each matmul and convolution of a function really runs in.

Mixed precision is easy to get silently wrong (an f32 kernel promotes a bf16 dot to f32, a
backward matmul gets an f32 cotangent). These helpers read the jaxpr, nested jaxprs included
(``jit``, ``scan``, ``while``, ``cond``, ``remat``, custom derivatives, ``shard_map``), so users
can check their own models the way mpjax's tests check mpjax.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any, overload

import jax
import numpy as np

from mpjax import jax_compat
from mpjax.deprecation import warn_deprecated
from mpjax.regions import innermost
from mpjax.table import format_table

MATMUL_PRIMITIVES = frozenset(
    {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
)
"""Primitive names that :func:`inspect_matmuls` reports."""


@dataclasses.dataclass(frozen=True)
class MatmulInfo:
    """One matmul or convolution found in a jaxpr.

    Attributes:
      primitive: the primitive's name, for example ``"dot_general"``.
      lhs_dtype, rhs_dtype: operand dtypes.
      out_dtype: the dtype the primitive returns.
      preferred_element_type: the ``preferred_element_type`` written in the jaxpr, or None.
        JAX sets it to the output dtype by default; a bf16 x bf16 -> bf16 dot still accumulates
        in f32 on GPU Tensor Cores.
      lhs_shape, rhs_shape, out_shape: shapes.
      scope: JAX's name stack for the equation, for example ``"transpose(jvp(MLP))"``; empty
        when the function sets no names.
      context: the higher-order primitives enclosing it, outermost first, for example
        ``("pjit", "scan")``.
      region: the path of the module whose precision region it ran in (``"block/attn"``,
        ``""`` for the root of a wrapped model), or None outside any region (see
        :mod:`mpjax.regions`).
    """

    primitive: str
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    out_dtype: np.dtype
    preferred_element_type: np.dtype | None
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    scope: str
    context: tuple[str, ...]
    region: str | None = None

    @property
    def operand_dtypes(self) -> tuple[np.dtype, np.dtype]:
        return (self.lhs_dtype, self.rhs_dtype)


class MatmulReport(tuple):
    """A tuple of :class:`MatmulInfo` whose ``str`` is a readable table."""

    def __str__(self) -> str:
        header = ("primitive", "lhs", "rhs", "out", "preferred", "context", "scope")
        rows = [
            (
                m.primitive,
                f"{m.lhs_dtype.name}{list(m.lhs_shape)}",
                f"{m.rhs_dtype.name}{list(m.rhs_shape)}",
                f"{m.out_dtype.name}{list(m.out_shape)}",
                m.preferred_element_type.name if m.preferred_element_type is not None else "-",
                "/".join(m.context) or "-",
                m.scope or "-",
            )
            for m in self
        ]
        if not rows:
            return "no matmuls or convolutions"
        return format_table(header, rows)

    def operand_dtypes(self) -> collections.Counter:
        """Counts matmuls by their (lhs dtype name, rhs dtype name)."""
        return collections.Counter((m.lhs_dtype.name, m.rhs_dtype.name) for m in self)


def _iter_eqns(jaxpr: Any, context: tuple[str, ...]) -> Iterator[tuple[Any, tuple[str, ...]]]:
    for eqn in jaxpr.eqns:
        yield eqn, context
        for sub in jax_compat.sub_jaxprs(eqn):
            yield from _iter_eqns(sub, (*context, eqn.primitive.name))


def iter_equations(
    fn: Callable[..., Any], *args, **kwargs
) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """Yields ``(equation, context)`` for every equation of ``fn``'s jaxpr, nested ones included.

    ``context`` names the enclosing higher-order primitives, outermost first.
    """
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    yield from _iter_eqns(closed.jaxpr, ())


def _matmuls(
    fn: Callable[..., Any], primitives: frozenset[str], args: tuple, kwargs: dict
) -> MatmulReport:
    found = []
    for eqn, context in iter_equations(fn, *args, **kwargs):
        if eqn.primitive.name not in primitives:
            continue
        lhs, rhs = (v.aval for v in eqn.invars[:2])
        out = eqn.outvars[0].aval
        region = innermost(jax_compat.scope_names(eqn))
        found.append(
            MatmulInfo(
                primitive=eqn.primitive.name,
                lhs_dtype=np.dtype(lhs.dtype),
                rhs_dtype=np.dtype(rhs.dtype),
                out_dtype=np.dtype(out.dtype),
                preferred_element_type=jax_compat.preferred_element_type(eqn),
                lhs_shape=tuple(lhs.shape),
                rhs_shape=tuple(rhs.shape),
                out_shape=tuple(out.shape),
                scope=jax_compat.name_stack(eqn),
                context=context,
                region=None if region is None else region.path,
            )
        )
    return MatmulReport(found)


def _warn_uncurried(name: str, option: str) -> None:
    warn_deprecated(
        f"{name}(fn, *args, **kwargs)",
        f"{name}(fn)(*args, **kwargs) (and {name}(fn, {option}=...)(*args, **kwargs) for the "
        "option), so that none of fn's own keywords is taken for an option",
        stacklevel=3,
    )


@overload
def inspect_matmuls(
    fn: Callable[..., Any], /, *, primitives: frozenset[str] = ...
) -> Callable[..., MatmulReport]: ...


@overload
def inspect_matmuls(
    fn: Callable[..., Any], arg: Any, /, *args: Any, primitives: frozenset[str] = ..., **kwargs: Any
) -> MatmulReport: ...


def inspect_matmuls(
    fn: Callable[..., Any],
    /,
    *args: Any,
    primitives: frozenset[str] = MATMUL_PRIMITIVES,
    **kwargs: Any,
) -> Callable[..., MatmulReport] | MatmulReport:
    """Lists every matmul/convolution ``fn`` performs, with dtypes; curried like
    ``jax.make_jaxpr``: ``inspect_matmuls(fn)(*args, **kwargs)``.

    To see the backward pass, inspect the gradient function, for example
    ``inspect_matmuls(jax.grad(loss))(params, batch)``. The returned function takes ``fn``'s
    arguments exactly as ``fn`` does, so any keyword reaches ``fn``.

    Args:
      fn: any function JAX can trace.
      primitives: the primitive names to report.

    Returns:
      A function that takes example arguments of ``fn`` (arrays or ``jax.ShapeDtypeStruct``),
      traces it (nothing is computed) and returns a :class:`MatmulReport` (a tuple of
      :class:`MatmulInfo`, printed as a table).

    The form ``inspect_matmuls(fn, *args, **kwargs)``, with the example arguments after ``fn``,
    still returns the report directly for one release, with a ``DeprecationWarning``.

    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    >>> report = inspect_matmuls(jnp.dot)(x, w)
    >>> [(m.lhs_dtype.name, m.rhs_dtype.name, m.out_dtype.name) for m in report]
    [('bfloat16', 'bfloat16', 'bfloat16')]
    """
    if args or kwargs:
        _warn_uncurried("inspect_matmuls", "primitives")
        return _matmuls(fn, primitives, args, kwargs)

    def report(*args: Any, **kwargs: Any) -> MatmulReport:
        return _matmuls(fn, primitives, args, kwargs)

    return report


_HLO_OP = re.compile(r"=\s*[^=]*?\s([a-z][a-z0-9\-_]*)\(")


def _hlo_op_counts(
    fn: Callable[..., Any], compiled: bool, args: tuple, kwargs: dict
) -> collections.Counter:
    lowered = jax.jit(fn).lower(*args, **kwargs)
    text = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
    if text is None:
        raise RuntimeError("XLA returned no HLO text for this function on this backend.")
    counts: collections.Counter = collections.Counter()
    for line in text.splitlines():
        match = _HLO_OP.search(line)
        if match and not line.startswith("HloModule"):
            counts[match.group(1)] += 1
    return counts


@overload
def hlo_op_counts(
    fn: Callable[..., Any], /, *, compiled: bool = ...
) -> Callable[..., collections.Counter]: ...


@overload
def hlo_op_counts(
    fn: Callable[..., Any], arg: Any, /, *args: Any, compiled: bool = ..., **kwargs: Any
) -> collections.Counter: ...


def hlo_op_counts(
    fn: Callable[..., Any],
    /,
    *args: Any,
    compiled: bool = True,
    **kwargs: Any,
) -> Callable[..., collections.Counter] | collections.Counter:
    """Counts HLO instructions by opcode in ``jax.jit(fn)``; curried like ``jax.make_jaxpr``:
    ``hlo_op_counts(fn)(*args, **kwargs)``.

    Use it to compare two ways of writing the same model, for example
    ``hlo_op_counts(f)(x)["convert"]``. Compare counts taken on the same backend only: XLA's
    CPU backend, which has no bf16 GEMM, adds converts around bf16 dots that GPUs do not.

    Args:
      fn: the function to lower.
      compiled: count in the optimized HLO XLA runs (True), or in the HLO JAX emits before
        optimization (False).

    Returns:
      A function that takes example arguments of ``fn``, exactly as ``fn`` takes them, lowers
      ``jax.jit(fn)`` for them and returns a ``collections.Counter`` of opcodes.

    The form ``hlo_op_counts(fn, *args, **kwargs)``, with the example arguments after ``fn``,
    still returns the counts directly for one release, with a ``DeprecationWarning``.

    >>> import jax.numpy as jnp
    >>> hlo_op_counts(jnp.sin, compiled=False)(jnp.ones(3))["sine"]
    1
    """
    if args or kwargs:
        _warn_uncurried("hlo_op_counts", "compiled")
        return _hlo_op_counts(fn, compiled, args, kwargs)

    def counts(*args: Any, **kwargs: Any) -> collections.Counter:
        return _hlo_op_counts(fn, compiled, args, kwargs)

    return counts
