"""Gradients in the policy's reduce dtype: what the casting engine binds where a value the
policy casts down to its compute dtype (a param stored wider) would otherwise get its gradient
summed in the compute dtype.

JAX differentiates a bfloat16 matmul in bfloat16: the gradient of its float32 weight, a sum
over every token of the batch, is written in bfloat16 and widened to float32 only afterwards.
Under data parallelism XLA sums that gradient over devices where it is written, so it also
crosses the network in bfloat16. ``Policy.reduce_dtype`` names the dtype instead
(the param dtype by default), and where it is wider than the compute dtype the engine binds
three operations through this module:

- a matmul (``dot_general``) with a cast-down operand: :func:`dot_general`, whose backward
  computes that operand's gradient with ``preferred_element_type`` the reduce dtype. Tensor
  Cores and the MXU accumulate in float32 either way; only the result written changes.
- a bias added to a matmul's output: :func:`broadcast_bias` broadcasts the bias over the batch
  in the reduce dtype before casting it, so its gradient (the output's cotangent summed over
  the batch) sums in the reduce dtype.
- a mixture of experts' ragged dot (``ragged_dot_general``), whatever the dtypes:
  :func:`mpjax.grouped.matmul.grouped_dot`, its three GEMMs grouped, the weights' gradient in
  the reduce dtype; under an fp8 recipe (tensorwise or rowwise),
  :func:`mpjax.grouped.fp8.grouped_fp8_dot`, the same in fp8.
- a lookup (``gather``) from a wider table in a region that returns the compute dtype
  (:func:`mpjax.embedding_policy`): :func:`lookup` gathers the rows from the table cast to the
  compute dtype, so a sharded table sends compute-dtype rows, and scatter-adds their
  cotangents into the table's gradient in the reduce dtype.

The matmul is a ``jax.custom_vjp``: forward-mode differentiation (``jax.jvp``,
``jax.jacfwd``) cannot go through it, and the engine binds plain matmuls inside
``lax.while_loop`` bodies, which only forward mode differentiates. Convolutions and fp8
matmuls compute their gradients in the compute dtype.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import block_scaled, fp8
from mpjax import jax_compat as compat
from mpjax.grouped import capacity as grouped_capacity
from mpjax.grouped import fp8 as grouped_fp8
from mpjax.grouped import matmul as grouped_matmul
from mpjax.policy import Policy, is_floating

__all__ = ["Route", "broadcast_bias", "dot_general", "lookup", "route", "stored_values"]

compat.widen_narrow_dots_on_cpu()  # this module's weight gradients are bf16 x bf16 -> f32 dots

# Operations that move, reshape or cast a value without computing from it: a param read through
# them is still the param.
_STRUCTURAL = frozenset(
    {
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
        "copy_p",
        "dynamic_slice",
        "expand_dims",
        "reshape",
        "rev",
        "slice",
        "squeeze",
        "transpose",
    }
)


def _remaining(axes: Sequence[int], *removed: Sequence[int]) -> list[int]:
    gone = set(itertools.chain(*removed))
    return [i for i in axes if i not in gone]


def _lhs_gradient(g, y, x_ndim, dimension_numbers, precision, preferred, swap_ans=False):
    """The gradient of ``dot_general(x, y)``'s left operand for the output cotangent ``g``,
    as JAX's transpose rule computes it, but with its own ``preferred_element_type``."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(range(x_ndim), x_contract, x_batch)
    y_kept = _remaining(range(y.ndim), y_contract, y_batch)
    n_batch = len(x_batch)
    if swap_ans:
        ans_y = range(n_batch, n_batch + len(y_kept))
    else:
        ans_y = range(n_batch + len(x_kept), n_batch + len(x_kept) + len(y_kept))
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(range(n_batch)), tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_sorted_by_y)
    out = lax.dot_general(g, y, dims, precision=precision, preferred_element_type=preferred)
    return lax.transpose(out, tuple(int(a) for a in out_axes))


def _rhs_gradient(g, x, y_ndim, dimension_numbers, precision, preferred):
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _lhs_gradient(g, x, y_ndim, swapped, precision, preferred, swap_ans=True)


@contextlib.contextmanager
def _scopes(names: Sequence[str]) -> Iterator[None]:
    """The named scopes ``names``, outermost first, for a custom VJP's primal function: where
    nothing differentiates it, its equations stay inside its call, under name stacks of their
    own, from which reports read the module they run in. (Differentiated, its forward and
    backward functions are inlined where it was called, under the caller's name stack.)"""
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(jax.named_scope(name))
        yield


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    dimension_numbers: Any,
    precision: Any,
    compute: Any,
    reduce: Any,
    scope: Sequence[str] = (),
    prune: bool = True,
) -> jax.Array:
    """``lax.dot_general`` of ``lhs`` and ``rhs`` cast to ``compute``, its result in
    ``compute``; the gradient of an operand given wider than ``compute`` is computed in
    ``reduce`` (then cast to the operand's dtype), the other's in ``compute``. ``scope``: the
    named scopes it is called under. ``prune``: compute only the gradients of the operands
    being differentiated (JAX's symbolic zeros, which ``jax.shard_map`` bodies lack).

    >>> x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.float32)
    >>> dims = (((1,), (0,)), ((), ()))
    >>> f = lambda w: dot_general(x, w, dimension_numbers=dims, precision=None,
    ...                           compute=jnp.bfloat16, reduce=jnp.float32).sum()
    >>> [e.params["preferred_element_type"] for e in jax.make_jaxpr(jax.grad(f))(w).eqns
    ...  if e.primitive.name == "dot_general"]
    [dtype(bfloat16), dtype('float32')]
    """
    (lc, rc), (lb, rb) = dimension_numbers
    dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    compute, reduce = np.dtype(compute), np.dtype(reduce)
    wide = tuple(np.dtype(jax.typeof(a).dtype) for a in (lhs, rhs))

    def gradient_dtype(dtype: np.dtype) -> np.dtype:
        return reduce if dtype.itemsize > compute.itemsize else compute

    def forward(x, y):
        return lax.dot_general(x, y, dims, precision=precision, preferred_element_type=compute)

    @jax.custom_vjp
    def matmul(lhs, rhs):
        with _scopes(scope):
            return forward(lhs.astype(compute), rhs.astype(compute))

    ndims = (jax.typeof(lhs).ndim, jax.typeof(rhs).ndim)

    def fwd(lhs, rhs):
        # Each operand's gradient needs the other operand: kept only for an operand being
        # differentiated, so no gradient is computed that nothing asks for (an input's).
        need = (lhs.perturbed, rhs.perturbed) if prune else (True, True)
        if prune:
            lhs, rhs = lhs.value, rhs.value
        x, y = lhs.astype(compute), rhs.astype(compute)
        return forward(x, y), (x if need[1] else None, y if need[0] else None)

    def bwd(residuals, g):
        x, y = residuals
        if isinstance(g, jax.custom_derivatives.SymbolicZero):
            return None, None
        dx = dy = None
        if y is not None:
            dx = _lhs_gradient(g, y, ndims[0], dims, precision, gradient_dtype(wide[0]))
            dx = dx.astype(wide[0])
        if x is not None:
            dy = _rhs_gradient(g, x, ndims[1], dims, precision, gradient_dtype(wide[1]))
            dy = dy.astype(wide[1])
        return dx, dy

    matmul.defvjp(fwd, bwd, symbolic_zeros=prune)
    return matmul(lhs, rhs)


def broadcast_bias(bias: jax.Array, shape: Sequence[int], compute: Any, reduce: Any) -> jax.Array:
    """``bias`` broadcast to ``shape`` in ``reduce``, then cast to ``compute``: its gradient,
    the cotangent summed over the broadcast axes, sums in ``reduce``.

    >>> f = lambda b: broadcast_bias(b, (4, 3), jnp.bfloat16, jnp.float32).sum()
    >>> [str(e.outvars[0].aval) for e in jax.make_jaxpr(jax.grad(f))(jnp.ones(3)).eqns
    ...  if e.primitive.name == "reduce_sum" and e.outvars[0].aval.shape == (3,)]
    ['float32[3]']
    """
    return jnp.broadcast_to(bias.astype(reduce), tuple(shape)).astype(compute)


def lookup(
    bind: Callable[[jax.Array, jax.Array], jax.Array],
    table: jax.Array,
    indices: jax.Array,
    compute: Any,
    reduce: Any,
    scope: Sequence[str] = (),
) -> jax.Array:
    """``bind(table, indices)`` (a gather) on ``table`` cast to ``compute``; the table's
    gradient scatter-adds the rows' cotangents in ``reduce``, then takes the table's dtype.
    ``scope``: the named scopes it is called under.

    >>> take = lambda t, i: t[i]
    >>> f = lambda t: lookup(take, t, jnp.array([0, 0, 1]), jnp.bfloat16, jnp.float32)
    >>> f(jnp.ones((2, 3))).dtype, jax.grad(lambda t: f(t).sum())(jnp.ones((2, 3)))[0]
    (dtype(bfloat16), Array([2., 2., 2.], dtype=float32))
    """
    compute, reduce = np.dtype(compute), np.dtype(reduce)
    dtype = jax.typeof(table).dtype

    @jax.custom_vjp
    def gather(table, indices):
        with _scopes(scope):
            return bind(table.astype(compute), indices)

    like = jax.ShapeDtypeStruct(jax.typeof(table).shape, reduce)

    def fwd(table, indices):
        return bind(table.astype(compute), indices), indices

    def bwd(indices, g):
        (grad,) = jax.linear_transpose(lambda t: bind(t, indices), like)(g.astype(reduce))
        return grad.astype(dtype), None

    gather.defvjp(fwd, bwd)
    return gather(table, indices)


class Route(NamedTuple):
    """How the engine binds one equation so that its cast-down operands get their gradients
    in the reduce dtype: ``wide`` are the operands it must not cast (they are given in their
    own dtype), ``bind(invals, params)`` the operation's outputs; ``label``, if not empty, how
    reports name what ran instead of the equation's category (``"grouped"``); ``ran``, if not
    None, the dtype its floating operands are multiplied in, where reports would otherwise
    show the compute dtype (fp8)."""

    wide: frozenset[int]
    bind: Callable[[list, Any], list]
    label: str = ""
    ran: Any = None


def stored_values(jaxpr: Any) -> set:
    """The variables of ``jaxpr`` that hold its inputs (params, data) as they came, or moved
    by structural operations only: the values whose gradients are sums over the batch, which
    the reduce dtype is for. An activation computed from them (a softmax's probabilities, cast
    down for the matmul with the values) keeps its gradient in the compute dtype."""
    stored = set(jaxpr.invars) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        source = eqn.invars[0] if eqn.invars else None
        if eqn.primitive.name in _STRUCTURAL and not compat.is_literal(source) and source in stored:
            stored.update(eqn.outvars)
    return stored


def _is_cast_down(aval: Any, compute: np.dtype) -> bool:
    return is_floating(aval.dtype) and np.dtype(aval.dtype).itemsize > compute.itemsize


def _grouped(
    eqn: Any, avals: Sequence[Any], policy: Policy, stored: frozenset[int]
) -> Route | None:
    """A mixture of experts' ragged dot (:func:`mpjax.grouped.matmul.grouped_form`) bound as
    :func:`mpjax.grouped.matmul.grouped_dot`: its three GEMMs grouped (JAX's own gradients of
    it expand into dense GEMMs on GPUs), in the compute dtype, the gradient of weights stored
    wider written in the reduce dtype. Its operands go in uncast; it casts them. None for
    another form (JAX's ragged dot in the compute dtype, as any matmul)."""
    p = compat.ragged_dot_params(eqn)
    lhs, rhs = avals[:2]
    transposed = grouped_matmul.grouped_form(p.dimension_numbers, lhs.ndim, rhs.ndim)
    if transposed is None or p.group_offset is not None:
        return None
    if not (is_floating(lhs.dtype) and is_floating(rhs.dtype)):
        return None
    compute = policy.compute_dtype
    wide = (
        1 in stored
        and _is_cast_down(rhs, compute)
        and policy.reduce_dtype.itemsize > (compute.itemsize)
    )
    reduce = policy.reduce_dtype if wide else compute

    recipe = policy.fp8
    if recipe is not None and recipe.scaling in grouped_fp8.GROUPED_SCALINGS:

        def fp8_grouped(invals, params):
            x, w, sizes = invals
            out = grouped_fp8.grouped_fp8_dot(
                x, w, sizes, compute=compute, reduce=reduce, transposed=transposed, recipe=recipe
            )
            return [out]

        label = "grouped fp8 rowwise" if recipe.scaling == "rowwise" else "grouped fp8"
        return Route(frozenset({0, 1}), fp8_grouped, label, fp8.E4M3)

    def grouped(invals, params):
        x, w, sizes = invals
        # The precision the engine chose for f32 operands (the policy's), or the code's own.
        precision = (eqn.params if params is None else params).get("precision")
        out = grouped_matmul.grouped_dot(
            x, w, sizes, compute=compute, reduce=reduce, transposed=transposed, precision=precision
        )
        return [out]

    label = "grouped"
    if recipe is not None:  # a block format: no grouped GEMM takes it
        why: str | None = "no block-scaled grouped GEMM; a capacity runs them batched"
        if recipe.capacity is not None:
            why = grouped_capacity.refusal(lhs.shape, rhs.shape, transposed, recipe.scaling)
            if why is None:

                def at_capacity(invals, params):
                    x, w, sizes = invals
                    out = grouped_capacity.capacity_dot(
                        x, w, sizes, recipe=recipe, compute=compute, transposed=transposed
                    )
                    return [out]

                label = f"grouped {recipe.scaling} at capacity {recipe.capacity:g}"
                return Route(
                    frozenset({0, 1}), at_capacity, label, block_scaled.FORMATS[recipe.scaling].data
                )
        label = f"grouped (not {recipe.scaling}: {why})"
    return Route(frozenset({0, 1}), grouped, label)


def route(
    eqn: Any,
    avals: Sequence[Any],
    lowered: bool,
    policy: Policy | None,
    bias_of: int | None,
    stored: frozenset[int],
    per_device: bool = False,
) -> Route | None:
    """The :class:`Route` of ``eqn`` under ``policy``, or None to bind it as it is.

    Args:
      eqn: the equation.
      avals: its inputs' avals, before any cast.
      lowered: whether the engine runs it in the compute dtype (a matmul, a bias add).
      policy: its region's policy (None: full precision).
      bias_of: the index of the matmul output it adds a bias to, if it does.
      stored: the indices of its operands that are :func:`stored_values`.
      per_device: whether it runs in a ``jax.shard_map`` body.
    """
    if policy is None:
        return None
    compute, reduce = policy.compute_dtype, policy.reduce_dtype
    name = eqn.primitive.name
    scope = compat.current_scope_names()
    if name == "gather" and policy.output_dtype == compute and _is_cast_down(avals[0], compute):

        def gather(invals, params):
            table, indices = invals

            def bind(t, i):
                (rows,) = compat.bind_equation(eqn, [t, i], params)
                return rows

            return [lookup(bind, table, indices, compute, reduce, scope)]

        return Route(frozenset({0}), gather)
    if name == "ragged_dot_general" and lowered:
        grouped = _grouped(eqn, avals, policy, stored)
        if grouped is not None:
            return grouped
    if reduce.itemsize <= compute.itemsize or policy.fp8 is not None:
        return None  # JAX's own gradients (and fp8's) are computed in the compute dtype
    if name == "dot_general" and lowered:
        wide = frozenset(i for i in (0, 1) if i in stored and _is_cast_down(avals[i], compute))
        if not wide or not all(is_floating(a.dtype) for a in avals[:2]):
            return None
        p = compat.dot_params(eqn)

        def matmul(invals, params):
            return [
                dot_general(
                    *invals,
                    dimension_numbers=p.dimension_numbers,
                    precision=p.precision,
                    compute=compute,
                    reduce=reduce,
                    scope=scope,
                    prune=not per_device,
                )
            ]

        return Route(wide, matmul)
    bias = None if bias_of is None else 1 - bias_of
    if bias is not None and bias in stored and lowered and _is_cast_down(avals[bias], compute):
        shape = eqn.outvars[0].aval.shape
        if tuple(avals[bias].shape) == tuple(shape):
            return None  # nothing is summed over

        def add(invals, params):
            invals = list(invals)
            invals[bias] = broadcast_bias(invals[bias], shape, compute, reduce)
            return compat.bind_equation(eqn, invals, params)

        return Route(frozenset({bias}), add)
    return None
