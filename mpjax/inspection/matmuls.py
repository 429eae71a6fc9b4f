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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import jax_compat
from mpjax.casting.regions import innermost, is_region
from mpjax.grouped.matmul import SCOPE as grouped_scope
from mpjax.policy import Policy, is_floating
from mpjax.table import format_table

MATMUL_PRIMITIVES = frozenset(
    {
        "dot_general",
        "conv_general_dilated",
        "ragged_dot",
        "ragged_dot_general",
        "grouped_matmul",
        jax_compat.BLOCK_SCALED_MATMUL,
    }
)
"""Primitive names that :func:`inspect_matmuls` reports: matmuls, convolutions, the
block-scaled GEMMs of ``jax.nn.scaled_matmul`` (:mod:`mpjax.block_scaled`) and the grouped GEMMs
of a mixture of experts (:mod:`mpjax.grouped.matmul`)."""
# A block-scaled GEMM's format by the dtypes of its values and its block scales.
_BLOCK_FORMATS = {
    ("float8_e4m3fn", "float8_e8m0fnu"): "mxfp8",
    ("float8_e5m2", "float8_e8m0fnu"): "mxfp8",
    ("float4_e2m1fn", "float8_e8m0fnu"): "mxfp4",
    ("float4_e2m1fn", "float8_e4m3fn"): "nvfp4",
}
_F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class MatmulInfo:
    """One matmul or convolution found in a jaxpr.

    Attributes:
      primitive: the primitive's name, for example ``"dot_general"``.
      lhs_dtype: the left operand's dtype.
      rhs_dtype: the right operand's dtype.
      out_dtype: the dtype the primitive returns.
      preferred_element_type: the ``preferred_element_type`` written in the jaxpr, or None.
        JAX sets it to the output dtype by default; a bf16 x bf16 -> bf16 dot still accumulates
        in f32 on GPU Tensor Cores.
      lhs_shape: the left operand's shape.
      rhs_shape: the right operand's shape.
      out_shape: the output's shape.
      scope: JAX's name stack for the equation, for example ``"transpose(jvp(MLP))"``; empty
        when the function sets no names. It holds mpjax's region names as JAX records them
        (``mpjax[p=f32,c=bf16,o=f32]block/fc1``); ``module``, ``policy`` and ``backward`` say
        the same once each, as the table shows them.
      context: the higher-order primitives enclosing it, outermost first, for example
        ``("pjit", "scan")``.
      region: the path of the module whose precision region it ran in (``"block/attn"``,
        ``""`` for the root of a wrapped model), or None outside any region (see
        :mod:`mpjax.casting.regions`).
      f32_precision: for a matmul with float32 operands, the precision they are multiplied
        at, as the jaxpr writes it, by the names of ``Policy.f32_matmul_precision``:
        ``"highest"`` (true float32), ``"high"``, ``"bf16_3x"``, ``"tf32"``, ``"bf16"``, or
        ``"default"`` when nothing chose one (one bf16 pass on TPU, TF32 on recent GPUs).
        None for other matmuls.
      block_format: for a block-scaled GEMM (:mod:`mpjax.block_scaled`), its format by the
        dtypes of its values and scales: ``"mxfp8"``, ``"nvfp4"`` (or ``"mxfp4"``); its
        operands are ``(B, M, K)`` and ``(B, N, K)``, blocked along K. None for other matmuls.
      policy: the policy of its precision region; None outside any region and inside
        :func:`mpjax.full_precision` (where ``region`` is not None).
      backward: whether it computes a gradient (it lies in a ``transpose`` of JAX's, in the
        equation's name stack or around a nested jaxpr holding it).
      user_scopes: the named scopes around it that are not mpjax's regions, outermost first
        (Flax module names, ``jax.named_scope``), those around a nested jaxpr included.
      grouped: for a grouped GEMM of :mod:`mpjax.grouped.matmul`, which of a ragged dot's
        three it is: ``"forward"``, ``"input_gradient"`` or ``"weight_gradient"``. None for
        other matmuls.
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
    f32_precision: str | None = None
    block_format: str | None = None
    policy: Policy | None = None
    backward: bool = False
    user_scopes: tuple[str, ...] = ()
    grouped: str | None = None

    @property
    def operand_dtypes(self) -> tuple[np.dtype, np.dtype]:
        return (self.lhs_dtype, self.rhs_dtype)

    @property
    def module(self) -> str:
        """The path of the module's region it ran in, once (``"<root>"`` for the root of a
        wrapped model), else its ``/``-joined ``user_scopes``, else ``"-"``."""
        if self.region is not None:
            return self.region or "<root>"
        return "/".join(self.user_scopes) or "-"

    @property
    def policy_text(self) -> str:
        """The region's policy as the table shows it, ``"p=f32,c=bf16,o=f32"`` or
        ``"full precision"``, and ``"-"`` outside any region (the function's own dtypes, or
        autocast's policy)."""
        if self.region is None:
            return "-"
        return "full precision" if self.policy is None else str(self.policy)


class MatmulReport(tuple):
    """A tuple of :class:`MatmulInfo` whose ``str`` is a readable table."""

    def __str__(self) -> str:
        header = (
            "primitive",
            "lhs",
            "rhs",
            "out",
            "preferred",
            "f32 precision",
            "context",
            "pass",
            "module",
            "policy",
        )
        rows = [
            (
                m.primitive
                + (f" ({m.block_format or m.grouped})" if m.block_format or m.grouped else ""),
                f"{m.lhs_dtype.name}{list(m.lhs_shape)}",
                f"{m.rhs_dtype.name}{list(m.rhs_shape)}",
                f"{m.out_dtype.name}{list(m.out_shape)}",
                m.preferred_element_type.name if m.preferred_element_type is not None else "-",
                m.f32_precision or "-",
                "/".join(m.context) or "-",
                "backward" if m.backward else "forward",
                m.module,
                m.policy_text,
            )
            for m in self
        ]
        if not rows:
            return "no matmuls or convolutions"
        return format_table(header, rows)

    def operand_dtypes(self) -> collections.Counter:
        """Counts matmuls by their (lhs dtype name, rhs dtype name)."""
        return collections.Counter((m.lhs_dtype.name, m.rhs_dtype.name) for m in self)


def check_function(caller: str, fn: Any) -> None:
    """Raises a ``TypeError`` naming ``caller`` unless ``fn`` is callable: the inspection
    functions are curried, ``caller(fn)(*args)``, and a common slip passes ``fn(x)``.

    >>> check_function("inspect_matmuls", 3)
    Traceback (most recent call last):
    ...
    TypeError: inspect_matmuls(fn): fn must be the function to inspect, got 3 of type int. Pass the function itself: inspect_matmuls(f)(x), not inspect_matmuls(f(x)).
    """
    if not callable(fn):
        raise TypeError(
            f"{caller}(fn): fn must be the function to inspect, got {fn!r} of type "
            f"{type(fn).__name__}. Pass the function itself: {caller}(f)(x), not "
            f"{caller}(f(x))."
        )


def walk_jaxpr(
    jaxpr: Any, context: tuple[str, ...] = (), scopes: tuple[str, ...] = (), backward: bool = False
) -> Iterator[tuple[Any, tuple[str, ...], tuple[str, ...], bool]]:
    """Yields ``(equation, context, scopes, backward)`` for every equation of ``jaxpr`` (a
    ``jax.extend.core.Jaxpr``), nested ones included.

    ``context`` names the enclosing higher-order primitives, outermost first. ``scopes`` are
    the ``jax.named_scope`` names around the equation, outermost first, those around the
    equations that enclose it included: JAX starts a fresh name stack for each nested trace
    (``jit``, ``checkpoint``, a loop's body), so an equation inside a ``jax.jit`` called in a
    module's code records none of the module's scopes itself. The casting engine reads the
    region of a nested equation the same way, so :func:`mpjax.casting.regions.innermost` of
    ``scopes`` is the region whose policy it ran under. ``backward`` says whether the
    equation computes a gradient: it, or an equation enclosing it, lies in a ``transpose``.
    """
    for eqn in jaxpr.eqns:
        own = jax_compat.scope_names(eqn)
        # The casting engine binds a nested jaxpr's equations again under the scopes of the
        # equation that holds it, so they may record those scopes themselves: counted once.
        names = own if scopes and own[: len(scopes)] == scopes else (*scopes, *own)
        in_backward = backward or jax_compat.is_backward(eqn)
        yield eqn, context, names, in_backward
        for sub in jax_compat.sub_jaxprs(eqn):
            yield from walk_jaxpr(sub, (*context, eqn.primitive.name), names, in_backward)


def is_array(leaf: Any) -> bool:
    """Whether a leaf of a function's arguments is traced: an array or a
    ``jax.ShapeDtypeStruct`` (the other leaves are passed as static values)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def call_on_leaves(
    fn: Callable[..., Any], args: tuple, kwargs: dict, keep: Callable[[int, Any], bool]
) -> tuple[Callable[[list], Any], list]:
    """``fn(*args, **kwargs)`` as a function of the leaves of ``(args, kwargs)`` for which
    ``keep(index, leaf)`` holds, and those leaves: the other leaves reach ``fn`` as they are,
    static values for a trace of the returned function."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    chosen = [i for i, leaf in enumerate(leaves) if keep(i, leaf)]

    def call(values: list) -> Any:
        merged = list(leaves)
        for i, value in zip(chosen, values):
            merged[i] = value
        call_args, call_kwargs = jax.tree.unflatten(tree, merged)
        return fn(*call_args, **call_kwargs)

    return call, [leaves[i] for i in chosen]


def _traced_equations(
    fn: Callable[..., Any], args: tuple, kwargs: dict
) -> Iterator[tuple[Any, tuple[str, ...], tuple[str, ...], bool]]:
    top = (
        tuple(isinstance(a, (float, complex)) for a in args),
        {name: isinstance(a, (float, complex)) for name, a in kwargs.items()},
    )
    scalar = jax.tree.leaves(
        jax.tree.map(lambda flag, arg: jax.tree.map(lambda _: flag, arg), top, (args, kwargs))
    )
    call, traced = call_on_leaves(fn, args, kwargs, lambda i, leaf: is_array(leaf) or scalar[i])
    closed = jax.make_jaxpr(call)(traced)
    yield from walk_jaxpr(closed.jaxpr)


def gradient_jaxpr(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The closed jaxpr of the gradient of the sum of ``fn``'s floating outputs with respect
    to the floating array leaves of its arguments: forward and backward, nothing computed.
    Other arrays are traced without a gradient; leaves that are not arrays are static."""
    call, traced = call_on_leaves(fn, args, kwargs, lambda i, leaf: is_array(leaf))
    floating = [i for i, leaf in enumerate(traced) if is_floating(leaf)]

    def loss(wide: list) -> jax.Array:
        leaves = list(traced)
        for i, leaf in zip(floating, wide):
            leaves[i] = leaf
        outs = [x for x in jax.tree.leaves(call(leaves)) if is_floating(x)]
        return sum((jnp.sum(x.astype(jnp.float32)) for x in outs), jnp.zeros((), jnp.float32))

    return jax.make_jaxpr(jax.grad(loss))([traced[i] for i in floating])


def iter_equations(
    fn: Callable[..., Any], *args, **kwargs
) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """Yields ``(equation, context)`` for every equation of ``fn``'s jaxpr, nested ones included.

    ``context`` names the enclosing higher-order primitives, outermost first. Arrays and
    ``jax.ShapeDtypeStruct`` are traced, and so is an argument that is a Python float, as
    ``jax.jit`` traces them; other leaves are passed to ``fn`` as they are, static, as
    ``eqx.filter_jit`` treats them (the activation function, ``inference`` flag or dropout
    rate an Equinox module holds).
    """
    for eqn, context, _, _ in _traced_equations(fn, args, kwargs):
        yield eqn, context


def matmul_info(
    eqn: Any, context: tuple[str, ...], scopes: tuple[str, ...], backward: bool
) -> MatmulInfo:
    """The :class:`MatmulInfo` of a matmul or convolution equation, as :func:`walk_jaxpr`
    yields it with its ``context``, ``scopes`` and ``backward``."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    region = innermost(scopes)
    f32 = _F32 in (lhs.dtype, rhs.dtype) and jax_compat.takes_precision(eqn)
    block_format = None
    if eqn.primitive.name == jax_compat.BLOCK_SCALED_MATMUL:
        scales = np.dtype(eqn.invars[2].aval.dtype).name
        block_format = _BLOCK_FORMATS.get((np.dtype(lhs.dtype).name, scales), "block-scaled")
    return MatmulInfo(
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
        f32_precision=jax_compat.precision_name(eqn) if f32 else None,
        block_format=block_format,
        policy=None if region is None else region.policy,
        backward=backward,
        user_scopes=tuple(
            name for name in scopes if not is_region(name) and not grouped_scope.fullmatch(name)
        ),
        grouped=eqn.params["form"] if eqn.primitive.name == "grouped_matmul" else None,
    )


def _matmuls(
    fn: Callable[..., Any], primitives: frozenset[str], args: tuple, kwargs: dict
) -> MatmulReport:
    return MatmulReport(
        matmul_info(eqn, context, scopes, backward)
        for eqn, context, scopes, backward in _traced_equations(fn, args, kwargs)
        if eqn.primitive.name in primitives
    )


def _refuse_uncurried(name: str, option: str, args: tuple, kwargs: dict) -> None:
    """Refuses example arguments passed with ``fn`` (``name(fn, *args)``): the inspection is
    curried, so that none of ``fn``'s own keywords is taken for ``option``."""
    if args or kwargs:
        raise TypeError(
            f"{name} takes the function alone and returns a function of its arguments: call "
            f"{name}(fn)(*args, **kwargs) (and {name}(fn, {option}=...)(*args, **kwargs) for "
            f"the option), not {name}(fn, *args, **kwargs)."
        )


def inspect_matmuls(
    fn: Callable[..., Any],
    /,
    *args: Any,
    primitives: frozenset[str] = MATMUL_PRIMITIVES,
    **kwargs: Any,
) -> Callable[..., MatmulReport]:
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

    Raises:
      TypeError: for a ``fn`` that is not callable, ``primitives`` that are not names, and
        example arguments passed with ``fn`` (``inspect_matmuls(fn, x)``; the curried form
        keeps every keyword for ``fn``).

    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    >>> report = inspect_matmuls(jnp.dot)(x, w)
    >>> [(m.lhs_dtype.name, m.rhs_dtype.name, m.out_dtype.name) for m in report]
    [('bfloat16', 'bfloat16', 'bfloat16')]
    """
    check_function("inspect_matmuls", fn)
    if not isinstance(primitives, (frozenset, set, tuple, list)) or not all(
        isinstance(name, str) for name in primitives
    ):
        raise TypeError(
            "inspect_matmuls(..., primitives=...) takes a set of primitive names (for example "
            f"mpjax.inspection.matmuls.MATMUL_PRIMITIVES), got {primitives!r}."
        )
    primitives = frozenset(primitives)
    _refuse_uncurried("inspect_matmuls", "primitives", args, kwargs)

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


def hlo_op_counts(
    fn: Callable[..., Any],
    /,
    *args: Any,
    compiled: bool = True,
    **kwargs: Any,
) -> Callable[..., collections.Counter]:
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

    Raises:
      TypeError: for a ``fn`` that is not callable or a ``compiled`` that is not a bool, here
        rather than when the returned function is called, and for example arguments passed
        with ``fn`` (``hlo_op_counts(fn, x)``; the curried form keeps every keyword for
        ``fn``).

    >>> import jax.numpy as jnp
    >>> hlo_op_counts(jnp.sin, compiled=False)(jnp.ones(3))["sine"]
    1
    """
    check_function("hlo_op_counts", fn)
    if not isinstance(compiled, (bool, np.bool_)):
        raise TypeError(
            f"hlo_op_counts(..., compiled=...) must be a bool (True: the optimized HLO, False: "
            f"the HLO JAX emits), got {compiled!r} of type {type(compiled).__name__}."
        )
    _refuse_uncurried("hlo_op_counts", "compiled", args, kwargs)

    def counts(*args: Any, **kwargs: Any) -> collections.Counter:
        return _hlo_op_counts(fn, compiled, args, kwargs)

    return counts


# One HLO instruction: ``[ROOT] name = type[dims]{layout} opcode(operands), attributes``.
_HLO_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>[a-z][a-z0-9]*)\[[^\]]*\]\S*\s+"
    r"(?P<op>[a-z][a-z0-9\-_]*)\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_HLO_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_HLO_CALLEE = re.compile(r"to_apply=%?(?P<name>[\w.\-]+)")
# What XLA's GPU GEMM rewriter lets stand between a dequantization and the dot.
_COMMUTING = frozenset(
    {"bitcast", "broadcast", "copy", "dynamic-slice", "pad", "reshape", "slice", "transpose"}
)


@dataclasses.dataclass(frozen=True)
class HloOperand:
    """One operand of an HLO ``dot`` as XLA's GPU compiler will see it.

    Attributes:
      dtype: the operand's HLO element type (``"bf16"``, ``"f8e4m3fn"``).
      fp8: the 8-bit type the operand is (``"f8e4m3fn"``, ``"f8e5m2"``), or is dequantized
        from: ``convert(fp8 value)`` (times a scale), possibly behind layout ops. None for
        any other operand.
      scaled: whether that dequantization multiplies by a broadcast scalar scale (False for an
        operand that is fp8 itself: its scale is applied to the dot's output).
    """

    dtype: str
    fp8: str | None
    scaled: bool


@dataclasses.dataclass(frozen=True)
class HloDot:
    """One ``dot`` of a function's HLO: its result type and its two operands.

    ``fp8`` is True when both operands are fp8 values: of a float8 type themselves, or scaled
    dequantizations of one (``convert(q) * scale``). ``direct`` is True when both are of a
    float8 type: XLA compiles such a dot to an fp8 GEMM on Hopper and Ada GPUs (cuBLASLt's or
    Triton's) whatever its GEMM flags, as :mod:`mpjax.fp8` writes its matmuls. A dot of
    dequantized operands becomes an fp8 GEMM only with XLA's Triton GEMMs off; with its default
    flags it runs in the wider type.
    """

    name: str
    computation: str
    out_dtype: str
    lhs: HloOperand
    rhs: HloOperand

    @property
    def fp8(self) -> bool:
        return all(o.fp8 is not None and (o.scaled or o.dtype == o.fp8) for o in self._operands)

    @property
    def direct(self) -> bool:
        return all(o.dtype.startswith("f8") for o in self._operands)

    @property
    def _operands(self) -> tuple[HloOperand, HloOperand]:
        return (self.lhs, self.rhs)


class HloDotReport(tuple):
    """A tuple of :class:`HloDot` whose ``str`` is a table."""

    def __str__(self) -> str:
        def side(o: HloOperand) -> str:
            if o.fp8 is None or o.fp8 == o.dtype:
                return o.dtype
            return f"{o.dtype}({o.fp8}{'*scale' if o.scaled else ''})"

        rows = [(d.computation, d.name, side(d.lhs), side(d.rhs), d.out_dtype) for d in self]
        if not rows:
            return "no dots"
        return format_table(("computation", "dot", "lhs", "rhs", "out"), rows)


@dataclasses.dataclass(frozen=True)
class _Instruction:
    type: str
    op: str
    operands: tuple[str, ...]
    callee: str | None


def _parse_hlo(text: str) -> dict[str, dict[str, _Instruction]]:
    computations: dict[str, dict[str, _Instruction]] = {}
    current: dict[str, _Instruction] | None = None
    for line in text.splitlines():
        match = _HLO_INSTRUCTION.match(line)
        if match and current is not None:
            # Operands are "%name" or, in some versions, "type[dims]{layout} %name".
            names = tuple(
                part.split()[-1].lstrip("%")
                for part in re.split(r",\s*(?![^\[\{]*[\]\}])", match["operands"])
                if part.strip()
            )
            callee = _HLO_CALLEE.search(match["attrs"])
            current[match["name"]] = _Instruction(
                match["type"], match["op"], names, callee["name"] if callee else None
            )
            continue
        header = _HLO_COMPUTATION.match(line)
        if header and "=" not in line.split("{")[0]:
            current = computations.setdefault(header["name"], {})
    return computations


def _operand(
    computations: dict[str, dict[str, _Instruction]], computation: str, name: str
) -> HloOperand:
    instructions = computations[computation]
    dtype = instructions[name].type
    if dtype.startswith("f8"):
        return HloOperand(dtype, dtype, False)
    seen = set()
    while name in instructions and name not in seen:
        seen.add(name)
        inst = instructions[name]
        if inst.op in _COMMUTING and inst.operands:
            name = inst.operands[0]
            continue
        if inst.op == "multiply" and len(inst.operands) == 2:
            for value, scale in (inst.operands, inst.operands[::-1]):
                source = instructions.get(value)
                factor = instructions.get(scale)
                if (
                    source is not None
                    and source.op == "convert"
                    and instructions[source.operands[0]].type.startswith("f8")
                    and factor is not None
                    and factor.op == "broadcast"
                ):
                    return HloOperand(dtype, instructions[source.operands[0]].type, True)
        if inst.op == "convert" and instructions[inst.operands[0]].type.startswith("f8"):
            return HloOperand(dtype, instructions[inst.operands[0]].type, False)
        break
    return HloOperand(dtype, None, False)


def _hlo_dots(fn: Callable[..., Any], args: tuple, kwargs: dict) -> HloDotReport:
    text = jax.jit(fn).lower(*args, **kwargs).as_text(dialect="hlo")
    computations = _parse_hlo(text)
    dots = []
    for computation, instructions in computations.items():
        for name, inst in instructions.items():
            if inst.op != "dot":
                continue
            lhs, rhs = (_operand(computations, computation, o) for o in inst.operands[:2])
            dots.append(HloDot(name, computation, inst.type, lhs, rhs))
    return HloDotReport(dots)


def hlo_dots(fn: Callable[..., Any], /) -> Callable[..., HloDotReport]:
    """Lists the ``dot`` instructions of ``jax.jit(fn)``'s HLO and what feeds their operands;
    curried like ``jax.make_jaxpr``: ``hlo_dots(fn)(*args, **kwargs)``.

    It reads the HLO JAX emits, before XLA optimizes it: the program XLA's GPU compiler starts
    from. A dot whose operands are both fp8 values (``HloDot.fp8``) multiplies fp8 values:
    directly, operands of a float8 type (``HloDot.direct``), which XLA compiles to an fp8
    GEMM on Hopper and Ada GPUs, or as scaled dequantizations, ``convert(fp8 value) *
    broadcast(scale)`` (possibly behind reshapes, transposes and other layout ops), which XLA's
    default flags run in the wider type. Use it to check that the matmuls of an fp8 policy
    (:mod:`mpjax.fp8`) are written in fp8, forward and backward; :func:`mpjax.plan` shows
    what a GPU compile makes of them.

    Returns:
      A function that takes example arguments of ``fn``, lowers ``jax.jit(fn)`` for them and
      returns an :class:`HloDotReport` (a tuple of :class:`HloDot`).

    >>> import jax.numpy as jnp
    >>> from mpjax import fp8
    >>> x, w = jnp.ones((4, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.bfloat16)
    >>> [d.fp8 for d in hlo_dots(lambda x, w: x @ w)(x, w)]
    [False]
    >>> dots = hlo_dots(lambda x, w: fp8.dot_general(x, w, (((1,), (0,)), ((), ()))))(x, w)
    >>> [(d.fp8, d.lhs.dtype, d.rhs.dtype, d.out_dtype) for d in dots]
    [(True, 'f8e4m3fn', 'f8e4m3fn', 'f32')]
    """

    check_function("hlo_dots", fn)

    def report(*args: Any, **kwargs: Any) -> HloDotReport:
        return _hlo_dots(fn, args, kwargs)

    return report
