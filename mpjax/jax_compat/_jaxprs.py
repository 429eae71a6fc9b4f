"""Reading and rebuilding jaxprs: equation params, atoms, name stacks, the binding convention
of primitives, matmul precisions, the params of higher-order primitives, abstract values, and a
step's loops (see :mod:`mpjax.jax_compat`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax._src import (
    source_info_util,  # the name stack of the trace in progress
)
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives

_DropVar: type[Any]
if hasattr(jex_core, "jaxprs_in_params"):  # jax >= 0.10
    _DropVar = jex_core.DropVar
    _jaxprs_in_params = jex_core.jaxprs_in_params
else:  # jax 0.8 and 0.9 have them in jax.core only (the type checker runs the newest JAX)
    _DropVar = jax.core.DropVar  # type: ignore[attr-defined]
    _jaxprs_in_params = jax.core.jaxprs_in_params  # type: ignore[attr-defined]


_JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3] if part.isdigit())


class UnsupportedJaxError(RuntimeError):
    """Raised when an equation lacks a param mpjax reads: this JAX is newer (or older) than
    the versions :mod:`mpjax.jax_compat` knows."""


def _param(eqn: Any, name: str) -> Any:
    try:
        return eqn.params[name]
    except KeyError:
        raise UnsupportedJaxError(
            f"mpjax cannot read {eqn.primitive.name!r} equations of jax {jax.__version__}: they "
            f"have no param {name!r} (they have {sorted(eqn.params)}). mpjax supports jax 0.8.1 "
            "to 0.12; mpjax/jax_compat/ is the place to teach it another version."
        ) from None


# --- Jaxprs and atoms ---------------------------------------------------------------------


def closed(jaxpr: Any) -> jex_core.ClosedJaxpr:
    """``jaxpr`` as a ClosedJaxpr (remat and shard_map carry open jaxprs, with no consts); from
    jax 0.11 every jaxpr is closed (``ClosedJaxpr`` is ``Jaxpr``) and it is returned as is."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        return jaxpr
    return jex_core.ClosedJaxpr(jaxpr, ())


def checkpoint_name_of(eqn: Any) -> str | None:
    """The name of a ``jax.ad_checkpoint.checkpoint_name`` equation, or None for another one."""
    return eqn.params.get("name") if eqn.primitive.name == "name" else None


def is_literal(atom: Any) -> bool:
    """Whether an equation input is a constant written into the jaxpr (``2.0`` in ``x * 2.0``)."""
    return isinstance(atom, jex_core.Literal)


def is_dropvar(atom: Any) -> bool:
    """Whether an equation output is a DropVar: unused (printed ``_``), with no value to store.
    From jax 0.10.1 unused outputs are plain variables that nothing reads (False here)."""
    return isinstance(atom, _DropVar)


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs in ``eqn``'s params (non-empty for higher-order primitives)."""
    return list(_jaxprs_in_params(eqn.params))


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a value being traced (inside ``jax.jit``, ``jax.grad``...) rather than
    a concrete array."""
    return isinstance(x, jax.core.Tracer)


# --- Binding and names --------------------------------------------------------------------


def bind_equation(eqn: Any, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Binds ``eqn``'s primitive to ``invals``, as ``jax.core.eval_jaxpr`` does.

    ``params`` replaces the equation's params (for example a new ``preferred_element_type``).
    Returns the outputs as a list. ``get_bind_params`` returned ``(subfuns, params)`` before
    jax 0.9.2 and returns params (subfuns inside) since; both are handled.
    """
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns: tuple[Any, ...] = ()
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
    # The equation's context carries its abstract mesh, compute_on and threefry settings; its
    # traceback goes to the equation bound here, as in jax.core.eval_jaxpr, so that what the
    # engine binds still points at the user's line (reports, errors, profiles).
    manager = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
    with manager, source_info_util.user_context(eqn.source_info.traceback):
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def scope_names(eqn: Any) -> tuple[str, ...]:
    """The ``jax.named_scope`` names around ``eqn``, outermost first, transforms left out:
    JAX's name stack mixes scopes (``named_scope``, Flax module names) with transformation
    markers (``jvp(...)``, ``transpose(...)``); only scopes name a region of user code."""
    return tuple(e.name for e in eqn.source_info.name_stack.stack if type(e).__name__ == "Scope")


def current_scope_names() -> tuple[str, ...]:
    """The ``jax.named_scope`` names open around the code being traced right now, outermost
    first, as :func:`scope_names` reads them off an equation once it is recorded. JAX starts a
    fresh name stack for each nested trace (``jit``, ``scan``, ``checkpoint``), so these are
    the scopes opened inside the innermost one."""
    stack = source_info_util.current_name_stack().stack
    return tuple(e.name for e in stack if type(e).__name__ == "Scope")


def name_stack(eqn: Any) -> str:
    """``eqn``'s name stack as JAX prints it, transforms included: ``"transpose(jvp(MLP))"``."""
    return str(eqn.source_info.name_stack)


def traced_at(eqn: Any) -> Any:
    """A context manager under which the equations traced get ``eqn``'s traceback: the casts
    the engine writes around an equation point at the user's line, like the equation."""
    return source_info_util.user_context(eqn.source_info.traceback)


def is_backward(eqn: Any) -> bool:
    """Whether ``eqn`` computes a gradient: its name stack has a ``transpose(...)`` transform,
    which ``jax.grad``/``jax.vjp`` put around the equations of the backward pass."""
    return any(
        type(e).__name__ == "Transform" and e.name == "transpose"
        for e in eqn.source_info.name_stack.stack
    )


# mpjax's own frames: the casts it writes (a region's output boundary, the engine's casts)
# belong to the line that called the module or wrote the operation, outside mpjax.
_MPJAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # mpjax/


def source_location(eqn: Any) -> str:
    """Where ``eqn`` was written: the innermost frame of its traceback outside JAX and outside
    mpjax, ``"file.py:12:8 (fn)"`` (``"unknown"`` when the traceback was not recorded). An
    operation mpjax writes, such as the cast at a module's output boundary, is where the
    module was called; one with only JAX's and mpjax's frames (traced inside mpjax alone, as
    a root module's output cast is), ``"mpjax's cast in <its scope>"``."""
    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    if not frames:
        return "unknown"
    frame = next((f for f in frames if not f.file_name.startswith(_MPJAX_DIR)), None)
    if frame is None:  # traced inside mpjax alone (a root module's output cast): its scope
        return f"mpjax's cast in {'/'.join(scope_names(eqn)) or 'the traced function'}"
    if frame.start_column != 0:
        return f"{frame.file_name}:{frame.start_line}:{frame.start_column} ({frame.function_name})"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def preferred_element_type(eqn: Any) -> np.dtype | None:
    """The accumulation dtype written in a matmul or convolution equation, or None."""
    dtype = eqn.params.get("preferred_element_type")
    return None if dtype is None else np.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class DotParams:
    """What a ``dot_general`` equation computes, in ``lax.dot_general``'s terms."""

    dimension_numbers: Any  # ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))
    precision: Any


def dot_params(eqn: Any) -> DotParams:
    """The dimension numbers and precision of a ``dot_general`` equation."""
    return DotParams(_param(eqn, "dimension_numbers"), eqn.params.get("precision"))


@dataclasses.dataclass(frozen=True)
class RaggedDotParams:
    """What a ``ragged_dot_general`` equation computes, in ``lax.ragged_dot_general``'s terms
    (the same params in jax 0.8.1 and 0.12, which adds ``out_sharding``)."""

    dimension_numbers: Any  # a lax.RaggedDotDimensionNumbers
    group_offset: Any


def ragged_dot_params(eqn: Any) -> RaggedDotParams:
    """The dimension numbers and group offset of a ``ragged_dot_general`` equation."""
    return RaggedDotParams(
        _param(eqn, "ragged_dot_dimension_numbers"), eqn.params.get("group_offset")
    )


# --- Matmul precision -----------------------------------------------------------------------

_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
_HIGH = (lax.Precision.HIGH, lax.Precision.HIGH)
_DEFAULT = (lax.Precision.DEFAULT, lax.Precision.DEFAULT)
# mpjax's names of the precisions of f32 matmuls, as the ``precision`` param of ``dot_general``
# and of ``conv_general_dilated`` carries each. Convolutions take no dot algorithm (JAX lowers a
# ``DotAlgorithmPreset`` on a convolution as DEFAULT, silently): theirs is the nearest
# ``lax.Precision``. ``lax.DotAlgorithmPreset`` has these members in every supported JAX.
_PRECISION_PARAMS: dict[str, tuple[Any, Any]] = {
    "highest": (_HIGHEST, _HIGHEST),
    "high": (_HIGH, _HIGH),
    "default": (None, None),
    "bf16_3x": (lax.DotAlgorithmPreset.BF16_BF16_F32_X3, _HIGH),
    "tf32": (lax.DotAlgorithmPreset.TF32_TF32_F32, None),
    "bf16": (lax.DotAlgorithmPreset.BF16_BF16_F32, None),
}
MATMUL_PRECISIONS: tuple[str, ...] = tuple(_PRECISION_PARAMS)
"""The names of the precisions an f32 matmul can run at (``Policy.f32_matmul_precision``)."""
# Primitives whose ``precision`` param says how their f32 operands are multiplied.
_PRECISION_PRIMITIVES = frozenset(
    {"dot_general", "conv_general_dilated", "ragged_dot_general", "grouped_matmul"}
)


def takes_precision(eqn: Any) -> bool:
    """Whether ``eqn`` is a matmul or convolution with a ``precision`` param."""
    return eqn.primitive.name in _PRECISION_PRIMITIVES and "precision" in eqn.params


def _left_default(precision: Any) -> bool:
    return precision is None or (
        isinstance(precision, tuple) and all(p == lax.Precision.DEFAULT for p in precision)
    )


def precision_left_default(eqn: Any) -> bool:
    """Whether the code that made ``eqn`` left its precision at the default: no ``precision``
    (None in the jaxpr) or ``lax.Precision.DEFAULT`` for both operands. A
    ``lax.DotAlgorithmPreset`` (``DEFAULT`` included) or any other precision was chosen."""
    return _left_default(eqn.params.get("precision"))


def with_precision(eqn: Any, params: dict | None, name: str) -> dict | None:
    """``params`` (``eqn``'s own when None) with the ``precision`` that mpjax calls ``name``
    (one of :data:`MATMUL_PRECISIONS`), or ``params`` unchanged for ``"default"``."""
    dot, conv = _PRECISION_PARAMS[name]
    value = conv if eqn.primitive.name == "conv_general_dilated" else dot
    if value is None:
        return params
    return {**(eqn.params if params is None else params), "precision": value}


def precision_name(eqn: Any, params: dict | None = None) -> str:
    """The precision written in a matmul equation (or in ``params``, the params it is bound
    with), by mpjax's name (:data:`MATMUL_PRECISIONS`): ``"default"`` when none was chosen
    (:func:`precision_left_default`). A dot algorithm mpjax has no name for is its
    ``lax.DotAlgorithmPreset`` name in lower case (``"bf16_bf16_f32_x6"``); operands at
    different precisions, ``"high,default"``."""
    precision = (eqn.params if params is None else params).get("precision")
    if precision is None or _left_default(precision):
        return "default"
    if isinstance(precision, lax.DotAlgorithmPreset):
        names = [n for n, (dot, _) in _PRECISION_PARAMS.items() if dot == precision]
        return names[0] if names else precision.name.lower()
    if isinstance(precision, tuple) and len(set(precision)) == 1:
        precision = precision[0]
    if isinstance(precision, lax.Precision):
        return precision.name.lower()
    return ",".join(lax.Precision(p).name.lower() for p in precision)


# --- Higher-order primitives --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JitParams:
    """What ``jax.jit`` needs to re-create a ``jit``/``pjit`` equation around its jaxpr."""

    jaxpr: jex_core.ClosedJaxpr
    name: str
    donate_argnums: tuple[int, ...]
    keep_unused: bool
    inline: Any  # a bool, or a jax.Inline from jax 0.11: pass it to jax.jit(inline=...)


def jit_params(eqn: Any) -> JitParams:
    return JitParams(
        jaxpr=closed(_param(eqn, "jaxpr")),
        name=_param(eqn, "name"),
        donate_argnums=tuple(i for i, d in enumerate(_param(eqn, "donated_invars")) if d),
        keep_unused=bool(_param(eqn, "keep_unused")),
        inline=_param(eqn, "inline"),
    )


@dataclasses.dataclass(frozen=True)
class ScanParams:
    """A ``scan`` equation: its body takes ``num_consts`` consts, ``num_carry`` carries and the
    xs (the equation's inputs, in that order) and returns the carries, then the ys."""

    jaxpr: jex_core.ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool


def scan_params(eqn: Any) -> ScanParams:
    if "ft_in" in eqn.params:  # jax >= 0.11: flat trees of (consts, carry, xs), (carry, ys)
        num_consts, num_carry, _ = (len(part) for part in eqn.params["ft_in"].unpack())
    else:
        num_consts, num_carry = _param(eqn, "num_consts"), _param(eqn, "num_carry")
    return ScanParams(
        closed(_param(eqn, "jaxpr")),
        num_consts,
        num_carry,
        _param(eqn, "length"),
        bool(_param(eqn, "reverse")),
        _param(eqn, "unroll"),
    )


@dataclasses.dataclass(frozen=True)
class WhileParams:
    """A ``while`` equation's inputs are the cond consts, the body consts, then the carries."""

    cond_jaxpr: jex_core.ClosedJaxpr
    cond_nconsts: int
    body_jaxpr: jex_core.ClosedJaxpr
    body_nconsts: int


def while_params(eqn: Any) -> WhileParams:
    return WhileParams(
        closed(_param(eqn, "cond_jaxpr")),
        _param(eqn, "cond_nconsts"),
        closed(_param(eqn, "body_jaxpr")),
        _param(eqn, "body_nconsts"),
    )


def cond_branches(eqn: Any) -> tuple[jex_core.ClosedJaxpr, ...]:
    """The branches of a ``cond`` equation; its first input is the branch index."""
    return tuple(closed(b) for b in _param(eqn, "branches"))


def cond_platforms(eqn: Any) -> tuple[tuple[str, ...] | None, ...] | None:
    """For a ``cond`` made by ``lax.platform_dependent``, the platforms of each branch (None
    for the default branch), as its ``branches_platforms`` param holds them; None for a
    ``cond`` on a value.

    Such a ``cond`` is resolved when it is lowered, for the platform it is lowered for: the
    other branches are never lowered, so they may hold operations that platform cannot run.
    """
    return eqn.params.get("branches_platforms")


@dataclasses.dataclass(frozen=True)
class RematParams:
    """What ``jax.checkpoint`` needs to re-create a ``remat``/``checkpoint`` equation."""

    jaxpr: jex_core.ClosedJaxpr
    prevent_cse: bool
    policy: Any


def remat_params(eqn: Any) -> RematParams:
    return RematParams(
        closed(_param(eqn, "jaxpr")), bool(_param(eqn, "prevent_cse")), _param(eqn, "policy")
    )


CALL_PRIMITIVES = frozenset({jex_primitives.closed_call_p.name, jex_primitives.call_p.name})
"""Names of the primitives that only evaluate their ``call_jaxpr``: ``closed_call`` and
``call``, or ``eval_jaxpr`` from jax 0.11 (``jax.grad`` of ``jax.checkpoint`` makes them)."""


def call_jaxpr(eqn: Any) -> jex_core.ClosedJaxpr:
    """The jaxpr of a :data:`CALL_PRIMITIVES` equation, or the primal jaxpr of a
    ``custom_jvp_call``/``custom_vjp_call`` equation."""
    return closed(_param(eqn, "call_jaxpr"))


@dataclasses.dataclass(frozen=True)
class ShardMapParams:
    jaxpr: jex_core.ClosedJaxpr
    kwargs: dict  # keyword arguments of jax.shard_map other than the function


def shard_map_params(eqn: Any) -> ShardMapParams:
    p = eqn.params
    axes = "newly_manual_axes" if "newly_manual_axes" in p else "manual_axes"  # jax < 0.10.2
    kwargs = dict(
        mesh=_param(eqn, "mesh"),
        in_specs=tuple(_param(eqn, "in_specs")),
        out_specs=tuple(_param(eqn, "out_specs")),
        check_vma=_param(eqn, "check_vma"),
        axis_names=set(_param(eqn, axes)),
    )
    return ShardMapParams(closed(_param(eqn, "jaxpr")), kwargs)


# --- Abstract values and tracing ----------------------------------------------------------


def retyped(x: Any, like: Any) -> Any:
    """The abstract value of ``x`` with the dtype and weak type of the aval ``like``.

    Unlike a ``jax.ShapeDtypeStruct``, it keeps what else the type of ``x`` carries (sharding,
    the varying manual axes inside ``shard_map``), so a function traced at it (see
    :func:`trace_at`) sees the same types as where ``x`` lives.
    """
    return jax.typeof(x).update(dtype=like.dtype, weak_type=getattr(like, "weak_type", False))


def weakly_typed(aval: Any) -> Any:
    """``aval`` marked weakly typed."""
    return aval.update(weak_type=True)


def trace_at(fn: Callable[..., Any], avals: Sequence[Any]) -> jex_core.ClosedJaxpr:
    """``jax.make_jaxpr(fn)`` at abstract values (``make_jaxpr`` accepts avals as arguments)."""
    return jax.make_jaxpr(fn)(*avals)


# --- Mutable array references (NNX variables made with ``ref=True`` hold one) ---------------


def is_ref(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Ref`` (a mutable array reference)."""
    return isinstance(x, jax.Ref)


def ref_like(template: Any, value: Any) -> Any:
    """``value`` in a new ``jax.Ref`` if ``template`` is a ref, else ``value`` itself.

    To replace the array of an NNX variable whatever it holds: a variable made with
    ``ref=True`` keeps a ref as its raw value, and must get one back.
    """
    return jax.new_ref(value) if is_ref(template) else value


# --- Loops: a step's scans, and the step with them unrolled (mpjax.plan's estimates) --------

# The primitives whose jaxprs XLA compiles into the program around them (a Pallas kernel's
# jaxpr, ``pallas_call``'s, becomes Mosaic code instead: its loops are no XLA loops).
_INLINED = frozenset(
    {"jit", "pjit", "closed_call", "call", "eval_jaxpr", "remat2", "checkpoint", "cond"}
    | {"custom_jvp_call", "custom_vjp_call", "shard_map", "scan"}
)


class Loop(NamedTuple):
    """A ``scan`` or ``while`` equation of a jaxpr (:func:`loops`): where it is (``path``, for
    :func:`unrolled`), its trip count (None for a ``while``), its ``unroll`` param, the index
    of the loop it runs in (None at the top), and its name stack."""

    path: tuple[Any, ...]
    length: int | None
    unroll: int
    parent: int | None
    name: str


def loops(jaxpr: Any) -> list[Loop]:
    """The loops of ``jaxpr`` and of the jaxprs XLA compiles into it, outer ones first. A
    ``while``'s body is not searched: it runs a number of times known only at run time."""
    found: list[Loop] = []

    def walk(j: Any, path: tuple[Any, ...], parent: int | None) -> None:
        for i, eqn in enumerate(_open(j).eqns):
            name = eqn.primitive.name
            if name == "while":
                found.append(Loop((*path, i), None, 1, parent, name_stack(eqn)))
            if name not in _INLINED:
                continue
            here = parent
            if name == "scan":
                length, unroll = _param(eqn, "length"), int(_param(eqn, "unroll"))
                found.append(Loop((*path, i), length, unroll, parent, name_stack(eqn)))
                here = len(found) - 1
            for key, value in eqn.params.items():
                for k, sub in enumerate(value if isinstance(value, tuple) else (value,)):
                    if isinstance(sub, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
                        walk(sub, (*path, i, key, k), here)

    walk(jaxpr, (), None)
    return found


def _open(j: Any) -> Any:
    return j if isinstance(j, jex_core.Jaxpr) else j.jaxpr


def unrolled(jaxpr: Any, unrolls: dict[tuple[Any, ...], int]) -> Any:
    """``jaxpr`` with the ``unroll`` param of the scan at each path of ``unrolls`` (a
    :attr:`Loop.path`) set to its value; the rest shared with ``jaxpr``."""

    def replace(j: Any, path: tuple[Any, ...], unroll: int) -> Any:
        inner, (i, *rest) = _open(j), path
        eqn = inner.eqns[i]
        params = {**eqn.params, "unroll": unroll}
        if rest:
            key, k, *rest = rest
            value = eqn.params[key]
            subs = list(value) if isinstance(value, tuple) else [value]
            subs[k] = replace(subs[k], tuple(rest), unroll)
            params = {**eqn.params, key: tuple(subs) if isinstance(value, tuple) else subs[0]}
        eqns = [*inner.eqns[:i], eqn.replace(params=params), *inner.eqns[i + 1 :]]
        new = inner.replace(eqns=eqns)
        return new if isinstance(j, jex_core.Jaxpr) else j.replace(jaxpr=new)

    for path, unroll in unrolls.items():
        jaxpr = replace(jaxpr, path, unroll)
    return jaxpr


def scan_copies(length: int, unroll: int) -> int:
    """How many copies of a scan's body its lowering writes (``lax.scan``'s implementation,
    the same from jax 0.8.1 to 0.12): ``unroll`` in a loop of ``length // unroll`` trips and
    the remainder after it, or all ``length`` where the loop would run at most once."""
    trips, remainder = divmod(length, unroll) if unroll else (0, length)
    return length if trips <= 1 else unroll + remainder


def jaxpr_function(jaxpr: Any) -> Callable[..., list[Any]]:
    """A function evaluating the closed ``jaxpr`` on its flat inputs (for ``jax.jit``)."""
    return jex_core.jaxpr_as_fun(closed(jaxpr))
