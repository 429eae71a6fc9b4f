"""The precision doctor's side-by-side evaluation: a jaxpr evaluated twice, *as it runs* (the
policy's casts and dtypes) and *exactly* (the same equations with every value in float32: casts
to a lower precision become identities and matmuls accumulate in float32; this is the float32
reference run of the same function), measuring each equation on the way. Each equation is
attributed to the module whose precision region it runs in (or its named scopes), and to the
forward or backward pass.

- Ranges come from the exact values: per equation, the summary
  (:func:`mpjax.doctor.range_stats.summarize`) of the values it computes (copies such as reshapes and
  casts, ``STRUCTURAL``, left out, except the casts of gradients to float16, whose values run
  there from then on: the loss scale applies to them).
- A non-finite birth is an equation whose inputs are all finite and whose output is not, as
  it runs: the non-finite values of each output are counted where it is computed, and an
  equation's inputs are the outputs counted before it.
- The precision lost *in* an equation is measured by running it as the policy runs it on the
  exact inputs cast to the dtypes it takes, against the exact equation on those same inputs:
  that relative error is what enters there, whatever came before (the rounding of the inputs
  counts at the cast that rounds them). The relative error of the value as it ran, against
  the exact one, is what has accumulated.
- Matmuls have the amax of their two operands (exact) measured, for fp8 fitness.
- A mixture of experts' routing decision, a ``top_k`` of the forward pass, has the share of
  its rows measured whose chosen indices differ as it runs from the exact run's: tokens the
  policy sends to other experts than float32 would. Each is paired with the last forward
  matmul evaluated before it (the router's logits, in a mixture of experts) and its dtype.
- Mask fills are not numbers the model computes: where a select (``jnp.where(mask, s, fill)``)
  takes a case that is a constant *fill* (a literal, or a broadcast or cast of one, at least
  :data:`FILL_MIN` in magnitude or not finite: ``finfo(dtype).min``, ``-inf``, ``-1e9``), the
  positions it takes it at are *masked*, and so are the positions elementwise operations
  compute from masked ones (the softmax's ``exp(s - max)`` of them). Masked values are counted
  apart in the ranges (``RangeStats.masked``) and left out of the
  errors; a fill's own non-finite values are no birth.

The evaluation runs equation by equation, outside any trace: each equation, both ways, with
its measures, is one small jitted *kernel*, compiled once for all the equations that share its
primitive, params and types (the layers of a model share theirs), and each value is dropped
once nothing reads it. Compiling a few hundred small kernels is quicker than compiling one
function of the whole model evaluated three times, and the model's values are never all held
at once. The measures stay on the device until :meth:`Evaluation.assemble` reads them all.

Higher-order primitives that are calls (``jit``, ``remat``, custom derivatives) are looked
into, and so is a ``lax.platform_dependent`` conditional whose default branch runs on this
platform (XLA's attention, where cuDNN's is for CUDA); a ``scan`` is looked into step by step
(its body evaluated once per step, so that layers stacked by ``nn.scan`` or ``lax.scan`` are
measured in their own modules); ``while`` loops and other conditionals count as one equation
whose outputs are measured.

``__all__`` is what :mod:`mpjax.doctor.diagnosis` uses: :class:`Evaluation` (with :class:`Site`, what
it measured where) and :func:`to_exact`, the exact counterpart of an input.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import jax_compat as compat
from mpjax.casting.regions import innermost
from mpjax.doctor import range_stats
from mpjax.policy import is_floating

__all__ = ["FILL_MIN", "STRUCTURAL", "Evaluation", "Kernels", "Site", "to_exact"]

# Equations whose outputs copy, move or cast their inputs' values: their ranges are those of
# their inputs. (A cast still can overflow, and loses precision: births and errors see it.)
STRUCTURAL = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "copy",
        "copy_p",
        "slice",
        "dynamic_slice",
        "rev",
        "concatenate",
        "pad",
        "name",
        "reduce_precision",
    }
)
_CAST = frozenset({"convert_element_type", "reduce_precision"})
FILL_MIN = 1e4
"""The smallest magnitude of a constant that counts as a mask fill (BERT's ``-10000``; Flax,
Equinox and mpjax's attention fill with ``finfo(dtype).min`` or a fraction of it)."""
# Operations that move a value's entries: a mask of its positions moves the same way.
_MOVES = frozenset(
    {"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "rev", "slice"}
)
# Operations that copy values, cast them or compute each entry from the same entries of
# their inputs: masked entries in, masked entries out.
_ELEMENTWISE = frozenset(
    {
        "convert_element_type",
        "reduce_precision",
        "copy",
        "copy_p",
        "stop_gradient",
        "add",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "neg",
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "tanh",
        "logistic",
        "integer_pow",
        "square",
        "sqrt",
        "rsqrt",
        "abs",
        "pow",
    }
)
# A value whose every entry is a mask fill (a fill constant and its broadcasts and casts).
FILL = "fill"
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
_ROUTING = frozenset({"top_k"})  # a mixture of experts' choice of experts
_F32 = np.dtype(np.float32)


def _is_low(dtype: Any) -> bool:
    return is_floating(dtype) and np.dtype(dtype).itemsize < 4


def to_exact(x: Any) -> Any:
    """``x`` as the exact evaluation takes it: in float32 if it is a lower-precision float,
    else as it is."""
    dtype = jax.typeof(x).dtype if not isinstance(x, np.ndarray | np.generic) else x.dtype
    return x.astype(jnp.float32) if _is_low(dtype) else x


def _cast(x: Any, dtype: Any) -> Any:
    if is_floating(jax.typeof(x).dtype) and jax.typeof(x).dtype != np.dtype(dtype):
        return lax.convert_element_type(x, dtype)
    return x


def _has_nonfinite(*arrays: Any) -> jax.Array:
    """Whether any of ``arrays`` holds an inf or a NaN: ``x * 0`` is NaN exactly there, and
    one sum finds it (quicker than counting, which :func:`_nonfinite` does only then)."""
    return jnp.isnan(sum(jnp.sum(x.astype(jnp.float32) * 0) for x in arrays))


def _relative_error(value: Any, exact: Any) -> jax.Array:
    """``||value - exact|| / ||exact||`` over the entries where ``exact`` is finite; inf when
    ``value`` is not finite there."""
    value, exact = value.astype(jnp.float32), exact.astype(jnp.float32)

    def finite(value, exact):
        diff = value - exact
        return jnp.sqrt(jnp.sum(diff * diff)), jnp.sqrt(jnp.sum(exact * exact))

    def masked(value, exact):
        ok = jnp.isfinite(exact)
        diff = jnp.where(ok, value - exact, 0.0)
        bad = jnp.any(ok & ~jnp.isfinite(value))
        norm = jnp.sqrt(jnp.sum(jnp.where(ok, exact, 0.0) ** 2))
        return jnp.where(bad, jnp.inf, jnp.sqrt(jnp.sum(diff * diff))), norm

    error, norm = lax.cond(_has_nonfinite(value, exact), masked, finite, value, exact)
    return error / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)


def _flipped(actual: jax.Array, exact: jax.Array) -> jax.Array:
    """The share of the rows of two ``top_k`` index outputs (all axes but the last) that chose
    a different set of indices: the order within a row aside."""
    differ = jnp.any(jnp.sort(actual, axis=-1) != jnp.sort(exact, axis=-1), axis=-1)
    return jnp.mean(differ.astype(jnp.float32))


def _nonfinite(x: jax.Array) -> jax.Array:
    """How many entries of ``x`` are inf or NaN."""
    return lax.cond(
        _has_nonfinite(x),
        lambda x: jnp.sum(~jnp.isfinite(x), dtype=jnp.int32),
        lambda x: jnp.int32(0),
        x,
    )


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _is_fill(value: Any) -> bool:
    """Whether a constant (a literal, a scalar const) is a mask fill: a single float at least
    :data:`FILL_MIN` in magnitude, or not finite."""
    if np.size(value) != 1:  # before reading it: a const may be a large device array
        return False
    # The dtype before the value: a PRNG key (a scanned layer's rng) converts to no array.
    dtype = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
    if not is_floating(dtype):
        return False
    v = float(np.asarray(value).reshape(()).astype(np.float32))
    return not np.isfinite(v) or abs(v) >= FILL_MIN


def _without(x: jax.Array, masked: jax.Array) -> jax.Array:
    return jnp.where(masked, jnp.zeros((), x.dtype), x)


def _relative_error_unmasked(value: Any, exact: Any, masked: jax.Array) -> jax.Array:
    """:func:`_relative_error` over the entries not ``masked``."""
    return _relative_error(_without(value, masked), _without(exact, masked))


@dataclasses.dataclass(frozen=True)
class Site:
    """An equation the evaluation measured: what, where, in which pass and dtype."""

    primitive: str
    module: str
    backward: bool
    dtype: str
    location: str


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What is measured of one equation with floating outputs (``outputs`` of them): the
    non-finite values of each as it runs (``counts``: not for a copy, whose outputs hold
    non-finite values only where its inputs do), the range summary of its exact values, the
    amax of its first ``operands`` floating operands (matmuls), and the errors (entering, with
    ``local`` when a lower-precision value takes part, and accumulated)."""

    outputs: int
    counts: bool
    ranges: bool
    operands: int
    errors: bool
    local: bool


def _floating(atoms: Sequence[Any]) -> list[int]:
    return [i for i, v in enumerate(atoms) if is_floating(v.aval.dtype)]


def _plan(eqn: Any, backward: bool, compare: bool) -> _Plan | None:
    """What to measure of ``eqn``, or None for an equation with no floating output."""
    floats_out = _floating(eqn.outvars)
    if not floats_out:
        return None
    name = eqn.primitive.name
    # A cast of a gradient to float16 is where it starts to run there: its range counts for
    # the loss scale (a float32 gradient cast to float16 overflows under it).
    ranges = name not in STRUCTURAL or (
        backward
        and name in _CAST
        and np.dtype(eqn.outvars[0].aval.dtype) == np.dtype(jnp.float16)
        and not _is_low(eqn.invars[0].aval.dtype)
    )
    errors = compare and not backward and (ranges or name in _CAST)
    local = errors and any(_is_low(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars))
    operands = min(len(_floating(eqn.invars)), 2) if name in _MATMULS else 0
    counts = ranges or name in _CAST
    return _Plan(len(floats_out), counts, ranges, operands, errors, local)


def _computed(eqn: Any, plan: _Plan | None, ex_in: list, ac_in: list):
    """``eqn`` both ways: its outputs (exact, as it runs) and, when its errors are measured
    (:class:`_Plan`), its floating outputs as the policy computes them on exact inputs and
    the exact ones they are compared with."""
    ac_out = compat.bind_equation(eqn, ac_in)
    if plan is None and not _floating(eqn.invars):
        return ac_out, ac_out, [], []
    ex_out = _exact_equation(eqn, ex_in)
    if plan is None or not plan.local:
        return ex_out, ac_out, [], []
    # The equation as the policy runs it, on the exact inputs in the dtypes it takes, against
    # the exact equation on those same inputs: what rounding the inputs loses is counted at
    # the cast that rounds them, not again at each use. (An equation with no lower-precision
    # value runs exactly: nothing enters there.)
    floats_out = _floating(eqn.outvars)
    local_in = [_cast(x, v.aval.dtype) for x, v in zip(ex_in, eqn.invars)]
    local = compat.bind_equation(eqn, local_in)
    if any(_is_low(v.aval.dtype) for v in eqn.invars):
        reference = _exact_equation(eqn, [to_exact(x) for x in local_in])
        return ex_out, ac_out, [local[i] for i in floats_out], [reference[i] for i in floats_out]
    return ex_out, ac_out, [local[i] for i in floats_out], []


# The measures, each compiled once per shape and dtype it is given (a model's equations share
# few), apart from the equations: the many equation kernels stay quick to compile.
_measure_nonfinite = jax.jit(_nonfinite)
_measure_range = jax.jit(range_stats.summarize)
_measure_amax = jax.jit(_amax)
_measure_error = jax.jit(_relative_error)
_measure_error_unmasked = jax.jit(_relative_error_unmasked)
_measure_flipped = jax.jit(_flipped)


@jax.jit
def _any(*masks: jax.Array) -> jax.Array:
    out = masks[0]
    for m in masks[1:]:
        out = out | m
    return out


@functools.partial(jax.jit, static_argnums=0)
def _select_mask(shape: tuple, which: jax.Array, cases: tuple) -> jax.Array:
    """The positions where a select takes a masked entry: ``cases`` each True (a fill), False
    (no masked entry) or a mask."""
    full = [jnp.broadcast_to(jnp.asarray(c, bool), shape) for c in cases]
    return lax.select_n(jnp.broadcast_to(which, shape), *full)


def _masks(eqn: Any, values: list) -> list[Any]:
    """The masked positions of ``eqn``'s outputs (:data:`FILL`, a boolean mask, or None), from
    its inputs (``values``, each a ``_Value`` whose last entry is its mask)."""
    name = eqn.primitive.name
    ins = [v[3] for v in values]
    none: list[Any] = [None] * len(eqn.outvars)
    if all(m is None for m in ins):
        return none
    if all(m is FILL for m in ins):  # computed from fills alone: a fill
        return [FILL if is_floating(v.aval.dtype) else None for v in eqn.outvars]
    if len(eqn.outvars) != 1 or not is_floating(eqn.outvars[0].aval.dtype):
        return none
    shape = tuple(eqn.outvars[0].aval.shape)
    if name == "select_n":
        cases = tuple(True if m is FILL else (False if m is None else m) for m in ins[1:])
        return [_select_mask(shape, values[0][0], cases)]
    if name in _MOVES and ins[0] is not None and ins[0] is not FILL:
        return [compat.bind_equation(eqn, [ins[0]])[0]]
    if name in _ELEMENTWISE:
        # A fill as an operand of arithmetic (``max(-inf, x)``) is a constant, not a position.
        arrays = [m for m in ins if m is not None and m is not FILL]
        if arrays and all(tuple(m.shape) in (shape, ()) for m in arrays):
            return [jnp.broadcast_to(_any(*arrays), shape)]
    return none


class _Measures(NamedTuple):
    """The measures of one equation (device values until :meth:`Evaluation.assemble`), each
    a list with one entry per floating output or operand, empty where :class:`_Plan` measures
    nothing: the non-finite count of each output as it ran, the range summaries of the exact
    ones, the amaxes of its first operands, the error entering each (nothing enters where no
    value of lower precision takes part) and the error accumulated in each."""

    nonfinite: list
    ranges: list
    operands: list
    entering: list
    accumulated: list


def _aval_key(aval: Any) -> tuple:
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))


def _kernel_key(eqn: Any, plan: _Plan | None) -> Any:
    """What makes two equations' kernels the same: primitive, params, types and literals.
    Equations whose params do not hash (rare) get a kernel of their own."""
    ins = tuple(
        (str(np.dtype(a.aval.dtype)), np.asarray(a.val).tobytes())
        if compat.is_literal(a)
        else _aval_key(a.aval)
        for a in eqn.invars
    )
    key = (
        eqn.primitive,
        tuple(sorted(eqn.params.items())),
        ins,
        tuple(_aval_key(v.aval) for v in eqn.outvars),
        plan,
    )
    try:
        hash(key)
    except TypeError:
        return ("equation", id(eqn))
    return key


def _make_kernel(eqn: Any, plan: _Plan | None) -> Callable[[list, list], Any]:
    """:func:`_computed` of ``eqn`` as one jitted function of its non-literal inputs (exact,
    as they run); the literals are written into it."""
    literals = {i: a.val for i, a in enumerate(eqn.invars) if compat.is_literal(a)}

    def kernel(ex_in: list, ac_in: list):
        ex_it, ac_it = iter(ex_in), iter(ac_in)
        ex_all, ac_all = [], []
        for i in range(len(eqn.invars)):
            if i in literals:
                ex_all.append(to_exact(literals[i]))
                ac_all.append(literals[i])
            else:
                ex_all.append(next(ex_it))
                ac_all.append(next(ac_it))
        return _computed(eqn, plan, ex_all, ac_all)

    return jax.jit(kernel)


class Kernels:
    """The compiled kernels of one traced target, shared by all its evaluations, and what is
    known of its jaxprs (when each value is read the last time)."""

    def __init__(self):
        self._kernels: dict[Any, Callable] = {}
        self._dead: dict[int, tuple[Any, dict[int, list]]] = {}

    def __len__(self) -> int:
        return len(self._kernels)

    def kernel(self, eqn: Any, plan: _Plan | None) -> Callable:
        key = _kernel_key(eqn, plan)
        found = self._kernels.get(key)
        if found is None:
            found = self._kernels[key] = _make_kernel(eqn, plan)
        return found

    def dead_after(self, jaxpr: Any) -> dict[int, list]:
        """``{i: the variables no equation after the i-th reads}`` (outputs excepted)."""
        known = self._dead.get(id(jaxpr))
        if known is not None and known[0] is jaxpr:
            return known[1]
        last: dict[Any, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for atom in eqn.invars:
                if not compat.is_literal(atom):
                    last[atom] = i
            for var in eqn.outvars:
                if not compat.is_dropvar(var):
                    last.setdefault(var, i)
        kept = {v for v in jaxpr.outvars if not compat.is_literal(v)}
        dead: dict[int, list] = {}
        for var, i in last.items():
            if var not in kept:
                dead.setdefault(i, []).append(var)
        self._dead[id(jaxpr)] = (jaxpr, dead)
        return dead


# A value in the evaluation: exact, as it runs, where its non-finite count as it runs is (a
# count known on the host, ("input", index) for a jaxpr's input, ("site", site, output) for
# an equation's output, or ("copy", refs) for a copy of the values at refs), and its masked
# positions (see _masks).
_Value = tuple[Any, Any, Any, Any]


def _step_of(mask: Any, i: int) -> Any:
    """The mask of step ``i``'s slice of a scan's xs whose mask is ``mask``."""
    return mask if mask is None or mask is FILL else mask[i]


def _stacked(masks: list[Any], shape: tuple) -> Any:
    """The mask of a scan's ys stacked from its steps' ``masks`` (each of ``shape``)."""
    if all(m is None for m in masks):
        return None
    if all(m is FILL for m in masks):
        return FILL
    return jnp.stack(
        [
            jnp.zeros(shape, bool) if m is None else jnp.ones(shape, bool) if m is FILL else m
            for m in masks
        ]
    )


class Evaluation:
    """Evaluates a jaxpr exactly and as it runs, side by side, collecting per equation the
    measures of :mod:`mpjax.doctor.side_by_side`: :meth:`run` it on concrete inputs, then
    :meth:`assemble` the measures and read them by ``indices`` into ``sites``."""

    def __init__(self, compare: bool, kernels: Kernels | None = None):
        self.compare = compare
        self.kernels = Kernels() if kernels is None else kernels
        self.platform = compat.lowering_platform()
        self.sites: list[Site] = []
        # Per site: its plan, its measures, and where the non-finite counts of its floating
        # inputs are (see _Value); and the counts of the jaxprs' inputs.
        self._plans: list[_Plan] = []
        self._measures: list[_Measures] = []
        self._inputs: list[list[Any]] = []
        self._inputs_counted: list[Any] = []
        self._fills: list[bool] = []  # per site: whether its outputs are mask fills
        # Routing decisions (forward top_k): the share of rows chosen differently (device
        # values), and per decision its site with the last forward matmul's before it.
        self._flipped: list[Any] = []
        self.routing: list[tuple[int, int | None]] = []
        self._last_matmul: int | None = None

    def _counted(self, values: Sequence[Any]) -> list[Any]:
        """Where the non-finite counts of ``values`` (inputs of a jaxpr) are: counted now."""
        refs: list[Any] = []
        for x in values:
            if is_floating(jax.typeof(x).dtype):
                self._inputs_counted.append(_measure_nonfinite(x))
                refs.append(("input", len(self._inputs_counted) - 1))
            else:
                refs.append(0)
        return refs

    def run(self, closed: Any, exact: Sequence[Any], actual: Sequence[Any]) -> tuple[list, list]:
        """Evaluates ``closed`` on its inputs (exact, as they run): its outputs both ways."""
        refs = self._counted(list(actual))
        outs = self._closed(closed, [(*v, None) for v in zip(exact, actual, refs)], (), False)
        return [v[0] for v in outs], [v[1] for v in outs]

    def _closed(self, closed: Any, inputs: list[_Value], path, backward) -> list[_Value]:
        consts = list(closed.consts)
        refs = self._counted(consts)
        values = [(to_exact(c), c, r, FILL if _is_fill(c) else None) for c, r in zip(consts, refs)]
        return self._jaxpr(closed.jaxpr, values, inputs, path, backward)

    def _jaxpr(self, jaxpr, consts: list[_Value], inputs: list[_Value], path, backward):
        env: dict[Any, _Value] = {}

        def read(atom) -> _Value:
            if compat.is_literal(atom):
                value = atom.val
                finite = not is_floating(np.asarray(value).dtype) or np.isfinite(value)
                return to_exact(value), value, 0 if finite else 1, FILL if _is_fill(value) else None
            return env[atom]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, inputs))
        dead = self.kernels.dead_after(jaxpr)
        for i, eqn in enumerate(jaxpr.eqns):
            where = path + compat.scope_names(eqn)
            backward_eqn = backward or compat.is_backward(eqn)
            ins = [read(a) for a in eqn.invars]
            inner = self._inner_jaxpr(eqn)
            if eqn.primitive.name == "scan":
                outs = self._scan(eqn, ins, where, backward_eqn)
            elif inner is not None:
                sub, skip = inner
                outs = self._closed(sub, ins[skip:], where, backward_eqn)
            else:
                outs = self._equation(eqn, ins, where, backward_eqn)
            for var, out in zip(eqn.outvars, outs):
                if not compat.is_dropvar(var):
                    env[var] = out
            for var in dead.get(i, ()):
                env.pop(var, None)
        return [read(a) for a in jaxpr.outvars]

    def _scan(self, eqn: Any, ins: list[_Value], path, backward) -> list[_Value]:
        """A scan, its body evaluated once per step on the step's slices of the xs: its ys
        are the steps' stacked, their non-finite values those of the steps' (a slice counts
        those of the whole xs)."""
        p = compat.scan_params(eqn)
        if p.length == 0:
            return self._equation(eqn, ins, path, backward)
        n_c, n_carry = p.num_consts, p.num_carry
        consts, carry, xs = ins[:n_c], ins[n_c : n_c + n_carry], ins[n_c + n_carry :]
        steps = []
        for i in reversed(range(p.length)) if p.reverse else range(p.length):
            x = [(e[i], a[i], r, _step_of(m, i)) for e, a, r, m in xs]
            outs = self._closed(p.jaxpr, [*consts, *carry, *x], path, backward)
            carry = outs[:n_carry]
            steps.append(outs[n_carry:])
        if p.reverse:
            steps.reverse()
        ys = [
            (
                jnp.stack([step[k][0] for step in steps]),
                jnp.stack([step[k][1] for step in steps]),
                ("copy", [step[k][2] for step in steps]),
                _stacked([step[k][3] for step in steps], steps[0][k][0].shape),
            )
            for k in range(len(eqn.outvars) - n_carry)
        ]
        return [*carry, *ys]

    def _inner_jaxpr(self, eqn: Any) -> tuple[Any, int] | None:
        """The jaxpr an equation evaluates, looked into, and how many of its first inputs it
        does not take; None for an equation evaluated as one."""
        sub = _inner_jaxpr(eqn)
        if sub is not None:
            return sub, 0
        platforms = compat.cond_platforms(eqn) if eqn.primitive.name == "cond" else None
        if platforms is None:
            return None
        # lax.platform_dependent: looked into when this platform runs its default branch (the
        # index input is dropped). A branch of this platform's own (cuDNN's fused attention on
        # CUDA) may take only the dtypes it was written for, which the exact evaluation would
        # change: the conditional then runs as one equation, typed as written.
        if any(p is not None and self.platform in p for p in platforms):
            return None
        default = [i for i, p in enumerate(platforms) if p is None]
        return (compat.cond_branches(eqn)[default[0]], 1) if default else None

    def _equation(self, eqn: Any, ins: list[_Value], path, backward) -> list[_Value]:
        plan = _plan(eqn, backward, self.compare)
        kernel = self.kernels.kernel(eqn, plan)
        dynamic = [i for i, a in enumerate(eqn.invars) if not compat.is_literal(a)]
        ex_out, ac_out, local, reference = kernel(
            [ins[i][0] for i in dynamic], [ins[i][1] for i in dynamic]
        )
        masks = _masks(eqn, ins)
        if plan is None:
            return [(e, a, 0, m) for e, a, m in zip(ex_out, ac_out, masks)]
        floats_out = _floating(eqn.outvars)
        actual = [ac_out[i] for i in floats_out]
        exact = [ex_out[i] for i in floats_out]
        # The masked entries of each floating output, to leave out (all of a fill's).
        out_masks = [masks[i] for i in floats_out]
        left_out = [jnp.ones((), bool) if m is FILL else m for m in out_masks]

        def range_of(x, m):
            return _measure_range(x) if m is None else _measure_range(x, m)

        def error_of(a, b, m):
            return _measure_error(a, b) if m is None else _measure_error_unmasked(a, b, m)

        measures = _Measures(
            nonfinite=[_measure_nonfinite(x) for x in actual] if plan.counts else [],
            ranges=[range_of(x, m) for x, m in zip(exact, left_out)] if plan.ranges else [],
            operands=[_measure_amax(ins[i][0]) for i in _floating(eqn.invars)[: plan.operands]],
            entering=[error_of(a, b, m) for a, b, m in zip(local, reference or exact, left_out)],
            accumulated=(
                [error_of(a, b, m) for a, b, m in zip(actual, exact, left_out)]
                if plan.errors
                else []
            ),
        )
        region = innermost(path)
        self.sites.append(
            Site(
                primitive=eqn.primitive.name,
                module=region.path if region is not None else "/".join(path),
                backward=backward,
                dtype=np.dtype(eqn.outvars[floats_out[0]].aval.dtype).name,
                location=compat.source_location(eqn),
            )
        )
        self._plans.append(plan)
        self._measures.append(measures)
        self._fills.append(all(m is FILL for m in out_masks))
        inputs = [ins[i][2] for i in _floating(eqn.invars)]
        self._inputs.append(inputs)
        site = len(self._measures) - 1
        if not backward and eqn.primitive.name in _MATMULS:
            self._last_matmul = site
        if not backward and self.compare and eqn.primitive.name in _ROUTING:
            self._flipped.append(_measure_flipped(ac_out[1], ex_out[1]))
            self.routing.append((site, self._last_matmul))
        refs: list[Any] = [0] * len(ex_out)
        for rank, i in enumerate(floats_out):
            refs[i] = ("site", site, rank) if plan.counts else ("copy", inputs)
        return [(e, a, r, m) for e, a, r, m in zip(ex_out, ac_out, refs, masks)]

    def assemble(self) -> dict[str, np.ndarray]:
        """Per site, the measures as host values: non-finite counts of outputs and inputs,
        range summaries (counts, extremes), matmul operand amaxes, errors (entering,
        accumulated), the routing decisions' shares of rows chosen differently, each stacked
        in the order of ``indices``."""
        inputs_counted, measured, flipped = jax.device_get(
            (self._inputs_counted, self._measures, self._flipped)
        )

        def count(ref) -> int:
            if isinstance(ref, int):
                return ref
            if ref[0] == "input":
                return int(inputs_counted[ref[1]])
            if ref[0] == "copy":  # as many as its inputs hold, as far as births go
                return sum(count(r) for r in ref[1])
            return int(measured[ref[1]].nonfinite[ref[2]])

        width = range_stats.summary_size()
        counts, extremes, births, errors, dots = [], [], [], [], []
        for plan, m, inputs, fill in zip(self._plans, measured, self._inputs, self._fills):
            held = sum(count(r) for r in inputs)
            out = int(np.sum(m.nonfinite)) if plan.counts else held
            # A fill's non-finite values (-inf, or finfo.min cast to float16) are no birth.
            births.append([out, held + out if fill else held])
            if plan.ranges:
                counts.append(np.sum([c for c, _ in m.ranges], axis=0))
                extremes.append([max(e[0] for _, e in m.ranges), min(e[1] for _, e in m.ranges)])
            if plan.operands:
                dots.append(m.operands)
            if plan.errors:
                errors.append([max(m.entering, default=0.0), max(m.accumulated)])
        return {
            "range_counts": np.array(counts, np.int64).reshape(-1, width),
            "range_extremes": np.array(extremes, np.float32).reshape(-1, 2),
            "births": np.array(births, np.int64).reshape(-1, 2),
            "errors": np.array(errors, np.float32).reshape(-1, 2),
            "dots": np.array(dots, np.float32),
            "routing": np.array(flipped, np.float32),
        }

    def indices(self) -> dict[str, list[int]]:
        return {
            "ranges": [i for i, p in enumerate(self._plans) if p.ranges],
            "births": list(range(len(self._plans))),
            "errors": [i for i, p in enumerate(self._plans) if p.errors],
            "dots": [i for i, p in enumerate(self._plans) if p.operands],
            "routing": [site for site, _ in self.routing],
        }


def _inner_jaxpr(eqn: Any) -> Any | None:
    """The jaxpr a call-like equation evaluates (looked into), or None."""
    name = eqn.primitive.name
    if name in ("jit", "pjit"):
        return compat.jit_params(eqn).jaxpr
    if name in ("remat2", "checkpoint"):
        return compat.remat_params(eqn).jaxpr
    if name in compat.CALL_PRIMITIVES or name in ("custom_jvp_call", "custom_vjp_call"):
        return compat.call_jaxpr(eqn)
    return None


def _exact_equation(eqn: Any, ex_in: list) -> list:
    """``eqn`` on float32 values: a cast to a lower precision keeps the value, a matmul
    accumulates in float32; an equation that takes no float32 operands runs as written on
    its inputs cast back, its outputs widened."""
    name = eqn.primitive.name
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    if not any(_is_low(a.dtype) for a in avals):
        return compat.bind_equation(eqn, ex_in)
    if name in _CAST:
        target = np.dtype(eqn.outvars[0].aval.dtype)
        return [lax.convert_element_type(ex_in[0], _F32 if _is_low(target) else target)]
    cast_back = [_cast(x, v.aval.dtype) for x, v in zip(ex_in, eqn.invars)]
    if compat.sub_jaxprs(eqn):  # a loop or conditional: its bodies are typed as written
        return [to_exact(x) for x in compat.bind_equation(eqn, cast_back)]
    params = None
    preferred = compat.preferred_element_type(eqn)
    if preferred is not None and _is_low(preferred):
        params = {**eqn.params, "preferred_element_type": _F32}
    try:
        outs = compat.bind_equation(eqn, ex_in, params)
    except (TypeError, ValueError):
        outs = compat.bind_equation(eqn, cast_back)
    return [to_exact(x) for x in outs]
