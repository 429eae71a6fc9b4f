"""The casting engine: runs a JAX function with each operation cast by its category and the
policy of the precision region it runs in.

It traces the function to a jaxpr and evaluates it equation by equation, binding each primitive
again with its inputs cast by the primitive's category (:mod:`mpjax.casting.op_categories`): matmuls and
convolutions in the compute dtype, exp/log/reductions in f32, everything else in the dtype of its
inputs. Because the equations are bound inside whatever trace is active, the result composes with
``jax.jit``, ``jax.grad``, ``jax.vmap`` and the rest. Each equation runs under the policy of the
innermost precision region around it (:mod:`mpjax.casting.regions`: the modules of a wrapped Flax or
Equinox model, :func:`mpjax.full_precision`), else of the first rule matching its named scope,
else the default policy.

Higher-order primitives are re-expressed with public APIs around recursively cast sub-jaxprs:
``jax.jit``, ``lax.scan``, ``lax.while_loop``, ``lax.switch``, ``jax.checkpoint``,
``jax.custom_jvp``, ``jax.custom_vjp``, ``jax.shard_map``. What depends on JAX internals
(params of equations, binding conventions, name stacks) lives in :mod:`mpjax.jax_compat`.

Everything that casts runs on this engine: :func:`mpjax.autocast`, the linen, NNX and Equinox
integrations, delayed fp8 scaling, the reports and the precision doctor. Its interface is
``__all__``: the integrations call :func:`run_in_regions` (and its fp8-state forms), and
:mod:`mpjax.autocast` evaluates the jaxprs it traces (:func:`mpjax.casting.trace_context.trace`) with
:class:`Interpreter` and casts their outputs with :func:`to_output`. What a trace in progress
decided, and what traced code may ask of it, is :mod:`mpjax.casting.trace_context`; the delayed fp8
scaling state a run threads through its matmuls is :mod:`mpjax.casting.fp8_sites`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import block_scaled, fp8
from mpjax import jax_compat as compat
from mpjax.casting import custom_rules
from mpjax.casting import gradient_reduction as reduction
from mpjax.casting.fp8_sites import DelayedScaling
from mpjax.casting.op_categories import (
    ELIGIBLE,
    F32,
    KEEP,
    LOWER,
    ORIGINAL,
    PROMOTE,
    bias_adds,
    category_in_region,
    merge_categories,
)
from mpjax.casting.regions import boundary_dtype
from mpjax.casting.trace_context import (
    Settings,
    abstractly,
    forward_only,
    in_forward_only,
    in_per_device,
    observers,
    per_device,
    trace,
    unobserved,
)
from mpjax.policy import DEFAULT_F32_MATMUL_PRECISION, Policy, is_floating, short_dtype_name

__all__ = [
    "Interpreter",
    "fp8_state_in_regions",
    "run_in_regions",
    "run_in_regions_finding_fp8_state",
    "run_in_regions_with_fp8_state",
    "to_output",
]

_F32 = np.dtype(jnp.float32)
# Host code sees the values as traced; a matmul in it is out of autocast's reach.
_CALLBACKS = frozenset({"pure_callback", "io_callback", "ffi_call"})


def _widest(dtypes: Iterable[Any]) -> np.dtype:
    dtypes = [np.dtype(d) for d in dtypes]
    # Explicit promotion, whatever jax_numpy_dtype_promotion says (bf16 + f16 -> f32).
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def _cast_to(x: Any, dtype: Any) -> Any:
    """Casts floating ``x`` to floating ``dtype``; anything else is returned unchanged."""
    aval = jax.typeof(x)
    if is_floating(aval.dtype) and is_floating(dtype) and aval.dtype != dtype:
        return lax.convert_element_type(x, dtype)
    return x


def _dtype_names(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(short_dtype_name(a.dtype) for a in avals)


# Custom derivatives are observed (the precision monitor) as one operation, by their outputs and
# the gradients with respect to them: their primal, rules and backward functions run unobserved
# (a rule's tangents and a backward's cotangents are not values of the model, and which of the
# primal and the rule runs under differentiation differs between JAX versions).
_OBSERVED_WHOLE = frozenset({"custom_jvp_call", "custom_vjp_call"})
# Higher-order primitives whose bodies delayed fp8 scaling cannot thread its state through:
# a loop of unknown length, branches of which one runs, user-defined derivatives, per-device
# bodies. Their matmuls fall back to current scaling.
_OPAQUE_TO_DELAYED = frozenset({"while", "cond", "custom_jvp_call", "custom_vjp_call", "shard_map"})


class _Narrow(NamedTuple):
    """How the report labels a matmul that runs narrower than the compute dtype, and the dtype
    its operands run in."""

    label: str
    dtype: np.dtype


_FP8 = _Narrow("fp8", fp8.E4M3)


class Interpreter:
    """Evaluates jaxprs under autocast, binding every equation into the current trace.

    ``cache`` maps sub-jaxprs to the functions built around them (the jitted function of a
    ``jit`` equation, the traced rules of a custom derivative), so a jaxpr cached by
    :func:`autocast` reuses them and JAX's own caches hit on the next call.
    """

    def __init__(
        self,
        settings: Settings,
        cache: dict,
        record: collections.Counter | None = None,
        delayed: DelayedScaling | None = None,
    ):
        self.settings = settings
        self.cache = cache
        self.record = record
        self.delayed = delayed
        self.handlers: dict[str, Callable[..., list]] = {
            "jit": self._jit,
            "pjit": self._jit,
            "scan": self._scan,
            "while": self._while,
            "cond": self._cond,
            "remat2": self._remat,
            "checkpoint": self._remat,
            "custom_jvp_call": self._custom_jvp,
            "custom_vjp_call": self._custom_vjp,
            "shard_map": self._shard_map,
            **{name: self._inline for name in compat.CALL_PRIMITIVES},
        }

    # --- Evaluation -----------------------------------------------------------------------

    def run(self, closed: Any, args: Sequence[Any], path: tuple[str, ...]) -> list[Any]:
        jaxpr = closed.jaxpr
        env: dict[Any, Any] = {}

        def read(atom):
            return atom.val if compat.is_literal(atom) else env[atom]

        # Constants written in the code (literals, and what is computed from them alone, such
        # as jnp.full_like(x, -inf)) adapt to the other operand like weakly typed values: jnp
        # has already made the 2.0 of ``x * 2.0`` an f32 literal, which must not widen a bf16 x.
        # Weakly typed arguments (a traced Python float) are such constants too: jnp converts
        # the ``s`` of ``x * s`` to a strong f32 at trace time, which must not widen x either.
        constant: set[Any] = {v for v in jaxpr.invars if getattr(v.aval, "weak_type", False)}

        def aval(atom, value):
            aval = atom.aval if compat.is_literal(atom) else jax.typeof(value)
            if compat.is_literal(atom) or atom in constant:
                aval = compat.weakly_typed(aval)
            return aval

        env.update(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        casts: dict[tuple[Any, Any], Any] = {}  # a value cast once serves all its uses
        paths = [path + compat.scope_names(eqn) for eqn in jaxpr.eqns]
        widened = self._widened(jaxpr, paths)
        bias = bias_adds(jaxpr)
        stored = reduction.stored_values(jaxpr)
        observed: dict[str, list] = collections.defaultdict(list)
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(a) for a in eqn.invars]
            avals = [aval(a, x) for a, x in zip(eqn.invars, invals)]
            # Re-open the equation's scopes so reports and nested autocasts see the same names.
            with contextlib.ExitStack() as stack:
                stack.enter_context(compat.traced_at(eqn))
                for name in paths[i][len(path) :]:
                    stack.enter_context(jax.named_scope(name))
                reads = frozenset(
                    k for k, a in enumerate(eqn.invars) if not compat.is_literal(a) and a in stored
                )
                outs = self.equation(
                    eqn, invals, avals, paths[i], casts, i in widened, bias.get(i), reads
                )
            primitive = eqn.primitive.name
            if observers() and (primitive not in self.handlers or primitive in _OBSERVED_WHOLE):
                floats = [k for k, x in enumerate(outs) if is_floating(jax.typeof(x).dtype)]
                if floats:
                    module = self.settings.region(paths[i]).path
                    tapped = observers()[-1].tap(module, [outs[k] for k in floats])
                    outs = list(outs)
                    for k, x in zip(floats, tapped):
                        outs[k] = x
                    observed[module] += tapped
            from_constants = eqn.primitive.name not in self.handlers and all(
                compat.is_literal(a) or a in constant for a in eqn.invars
            )
            for var, out in zip(eqn.outvars, outs):
                if not compat.is_dropvar(var):
                    env[var] = out
                    if from_constants:
                        constant.add(var)
        if observed:
            observers()[-1].values(dict(observed))
        return [read(a) for a in jaxpr.outvars]

    def _widened(self, jaxpr: Any, paths: list[tuple[str, ...]]) -> set[int]:
        """The "promote" equations that run in f32 because all they compute feeds f32 ops.

        PyTorch runs powers, norms, distances and cosine similarity in f32 as whole ops; in JAX
        they are built from elementwise ops (``x * x``, ``a - b``) that feed an f32 reduction
        or power. Run in f16, those elementwise steps overflow before the reduction sees them
        (a matmul output of 400 squared is past f16's 65504). So an elementwise or structural
        equation whose every result is used only by f32 equations (directly, or through other
        such equations) runs in f32 as well. Matmuls and everything used elsewhere keep their
        categories, so this adds no converts where the values stay low precision.
        """
        consumers: dict[Any, list[int]] = collections.defaultdict(list)
        for i, eqn in enumerate(jaxpr.eqns):
            for atom in eqn.invars:
                if not compat.is_literal(atom):
                    consumers[atom].append(i)
        returned = {a for a in jaxpr.outvars if not compat.is_literal(a)}
        in_f32: set[int] = set()
        widened: set[int] = set()
        for i in range(len(jaxpr.eqns) - 1, -1, -1):
            eqn = jaxpr.eqns[i]
            if self.settings.region(paths[i]).policy is None:
                continue  # full precision: nothing is cast
            category = self.settings.categories.get(eqn.primitive.name)
            if category == F32:
                in_f32.add(i)
                continue
            if category != PROMOTE:
                continue
            outs = [v for v in eqn.outvars if not compat.is_dropvar(v)]
            uses = [j for v in outs for j in consumers[v]]
            if outs and uses and not returned.intersection(outs) and in_f32.issuperset(uses):
                in_f32.add(i)
                widened.add(i)
        return widened

    def equation(
        self,
        eqn: Any,
        invals: list,
        avals: list,
        path: tuple[str, ...],
        casts: dict,
        widen: bool = False,
        bias_of: int | None = None,
        stored: frozenset[int] = frozenset(),
    ) -> list:
        name = eqn.primitive.name
        handler = self.handlers.get(name)
        if handler is not None:
            if self.delayed is not None and name in _OPAQUE_TO_DELAYED:
                with self.delayed.hidden(name):
                    return handler(eqn, invals, path)
            return handler(eqn, invals, path)
        checkpoint = compat.checkpoint_name_of(eqn)
        boundary = None if checkpoint is None else boundary_dtype(checkpoint)
        if boundary is not None:  # a region's output: cast, and nothing to bind
            x = invals[0]
            return [_cast_to(x, boundary) if jax.typeof(x).dtype in ELIGIBLE else x]
        region = self.settings.region(path)
        category = self.settings.categories.get(name)
        if category is None:
            self.settings.warn_unknown(name, bool(compat.sub_jaxprs(eqn)))
            category, label = ORIGINAL, "unknown"
        elif region.policy is None:
            category, label = ORIGINAL, "full_precision"
        else:
            if name in _CALLBACKS:
                self.settings.warn_callback(name, region)
            floating = [a.dtype for a in avals if is_floating(a.dtype)]
            category = category_in_region(category, name, region.policy.compute_dtype, floating)
            if widen and category == PROMOTE:
                category = F32
            label = category
        compute = region.policy.compute_dtype if region.policy is not None else None
        if category == PROMOTE and bias_of is not None and avals[bias_of].dtype == compute:
            # A bias added to a matmul's output belongs to the matmul (PyTorch's addmm): run
            # in f32, it would widen the activation that every op after it keeps for the
            # backward pass, a copy in each width of the same value.
            category = label = LOWER
        # Observed (the precision monitor), each cast is tapped: its gradient is measured there.
        tap = functools.partial(observers()[-1].tap, region.path) if observers() else None
        floats = [a.dtype for a in avals if is_floating(a.dtype)]  # a ragged dot's sizes aside
        lowered = category == LOWER and bool(floats) and all(d in ELIGIBLE for d in floats)
        policy = None if in_forward_only() else region.policy
        route = reduction.route(eqn, avals, lowered, policy, bias_of, stored, in_per_device())
        wide = route.wide if route is not None else frozenset()
        label = route.label if route is not None and route.label else label
        invals, params, ran = self._cast_inputs(
            eqn, invals, avals, category, compute, casts, tap, wide
        )
        params = _f32_precision(eqn, params, ran, region.policy)
        dot, narrow = self._fp8_dot(eqn, region, category, compute, ran, path)
        if narrow is not None:
            label = narrow.label
            if dot is not None:
                ran = [jax.ShapeDtypeStruct(a.shape, narrow.dtype) for a in ran]
        if route is not None and route.ran is not None:
            ran = [
                jax.ShapeDtypeStruct(a.shape, route.ran) if is_floating(a.dtype) else a for a in ran
            ]
        if self.record is not None:
            traced = [v.aval for v in eqn.invars]
            precision = _f32_precision_name(eqn, params, ran) if dot is None else None
            key = ("/".join(path), name, label, _dtype_names(traced), _dtype_names(ran), precision)
            self.record[key] += 1
        if dot is not None:
            return [dot(*invals)]
        return route.bind(invals, params) if route else compat.bind_equation(eqn, invals, params)

    def _fp8_dot(
        self, eqn, region, category, compute, ran, path
    ) -> tuple[Callable[..., Any] | None, _Narrow | None]:
        """The fp8 (or block-scaled) matmul that replaces ``eqn``, if its region's policy runs
        matmuls so: a ``dot_general`` lowered to the compute dtype, unbatched unless the recipe
        says, and how the report labels it. A block-scaled recipe whose block does not divide
        the matmul's contractions leaves it in the compute dtype, labelled with the reason."""
        if eqn.primitive.name != "dot_general" or category != LOWER or region.policy is None:
            return None, None
        recipe = region.policy.fp8
        if recipe is None or any(a.dtype != compute for a in ran):
            return None, None
        p = compat.dot_params(eqn)
        if not recipe.applies_to(p.dimension_numbers):
            return None, None
        if recipe.block_scaled:
            lhs, rhs = (a.shape for a in ran)
            reason = block_scaled.unaligned(lhs, rhs, p.dimension_numbers, recipe.scaling)
            if reason is not None:
                self.settings.warn_unaligned("/".join(path), recipe.scaling, reason)
                return None, _Narrow(f"{LOWER} (not {recipe.scaling}: {reason})", compute)
            dot = functools.partial(
                block_scaled.dot_general,
                dimension_numbers=p.dimension_numbers,
                format=recipe.scaling,
                **{name: getattr(recipe, name) for name in fp8.NVFP4_INGREDIENTS},
            )
            return dot, _Narrow(recipe.scaling, block_scaled.FORMATS[recipe.scaling].data)
        if recipe.scaling == "rowwise":
            dot = functools.partial(
                fp8.rowwise_dot_general,
                dimension_numbers=p.dimension_numbers,
                margin=recipe.margin,
            )
            return dot, _Narrow("fp8 rowwise", fp8.E4M3)
        current = functools.partial(
            fp8.dot_general,
            dimension_numbers=p.dimension_numbers,
            recipe=recipe,
            precision=p.precision,
        )
        if recipe.scaling != "delayed":
            return current, _FP8
        delayed = self.delayed
        if delayed is None:
            raise ValueError(
                f"The policy of {region.path or 'the root'!r} ({region.policy}) scales fp8 with "
                "delayed scaling, whose state this call was not given. Use the wrapped model's "
                "own init and apply (linen: the state is the 'fp8' collection of its variables; "
                "NNX: mpjax.nnx.init_fp8_state), or for autocast mpjax.fp8_state(fn)(*args) and "
                "mpjax.with_fp8_state(fn, state)(*args)."
            )
        if delayed.opaque is not None:
            self.settings.warn_delayed("/".join(path), delayed.opaque)
            return current, _FP8
        return delayed.dot(region.path, recipe, current, p.dimension_numbers, p.precision), _FP8

    def _cast_inputs(self, eqn, invals, avals, category, compute, casts, tap=None, wide=()):
        """Casts the floating inputs of a first-order equation by its category, each cast
        through ``tap`` (a function of a list of values, returning them) if given; those in
        ``wide`` are tapped uncast, for a ``gradient_reduction.Route`` to cast.

        Returns the new inputs, the params to bind with, and the avals they run in.
        """
        floats = [i for i, a in enumerate(avals) if is_floating(a.dtype)]
        targets: dict[int, np.dtype] = {}
        lowered = False
        if floats and category == ORIGINAL:
            targets = {
                i: eqn.invars[i].aval.dtype for i in floats if is_floating(eqn.invars[i].aval.dtype)
            }
        elif floats and category != KEEP:
            lowered = category == LOWER and all(avals[i].dtype in ELIGIBLE for i in floats)
            if lowered:
                target = np.dtype(compute)
            else:
                strong = [avals[i].dtype for i in floats if not avals[i].weak_type]
                # Weakly typed inputs adapt to the others; alone, they decide nothing.
                target = _widest(strong) if strong else None
                if target is not None and category == F32:
                    target = _widest([target, _F32])
            if target is not None:
                targets = {i: target for i in floats}
        new = list(invals)
        for i in wide:
            targets[i] = np.dtype(compute)
            if tap is not None:
                new[i] = tap([invals[i]])[0]
        for i, dtype in targets.items():
            if i in wide:
                continue
            if avals[i].dtype != dtype or avals[i].weak_type:
                atom = eqn.invars[i]
                if compat.is_literal(atom):
                    new[i] = lax.convert_element_type(invals[i], dtype)
                    continue
                if (atom, dtype) not in casts:
                    cast = lax.convert_element_type(invals[i], dtype)
                    casts[atom, dtype] = cast if tap is None else tap([cast])[0]
                new[i] = casts[atom, dtype]
        params = self._params(eqn, category, lowered, compute, targets)
        ran = [jax.ShapeDtypeStruct(a.shape, targets.get(i, a.dtype)) for i, a in enumerate(avals)]
        return new, params, ran

    @staticmethod
    def _params(eqn, category, lowered, compute, targets):
        """Params with ``preferred_element_type`` (matmuls, convolutions) matching the inputs.

        Lowered ops take the compute dtype, not f32: with an f32 result JAX's transpose would
        feed f32 cotangents into the backward matmuls, which XLA then runs as f32 GEMMs.
        Elsewhere JAX's default (the operand dtype) follows the new operands, and a
        deliberately wider accumulator written in the function is kept.
        """
        preferred = compat.preferred_element_type(eqn)
        if preferred is None or not is_floating(preferred) or category in (ORIGINAL, KEEP):
            return None
        if lowered:
            new = np.dtype(compute)
        elif not targets:
            return None
        else:
            operand = next(iter(targets.values()))
            traced = _widest(v.aval.dtype for v in eqn.invars[:2])
            new = operand if np.dtype(preferred) == traced else _widest([operand, preferred])
        if new == preferred:
            return None
        return {**eqn.params, "preferred_element_type": new}

    def shapes(self, fn: Callable, args: Sequence[Any]) -> list[Any]:
        """The output avals of ``fn(*args)``, found without recording it in a report."""
        record, self.record = self.record, None
        try:
            return jax.eval_shape(fn, *args)
        finally:
            self.record = record

    def _cached(self, key: Any, anchor: Any, build: Callable[[], Any]) -> Any:
        # ``anchor`` (the object whose id is in ``key``) is kept alive so the id stays unique.
        if key not in self.cache:
            self.cache[key] = (build(), anchor)
        return self.cache[key][0]

    # --- Higher-order primitives ------------------------------------------------------------

    def _inline(self, eqn, invals, path):
        return self.run(compat.call_jaxpr(eqn), invals, path)

    def _jit(self, eqn, invals, path):
        p = compat.jit_params(eqn)
        if self.delayed is not None:  # the state's values belong to this trace: run inline
            return self.run(p.jaxpr, invals, path)

        def build():
            def body(*args):
                return self.run(p.jaxpr, args, path)

            body.__name__ = body.__qualname__ = p.name  # the nested jit keeps its name
            return jax.jit(
                body, donate_argnums=p.donate_argnums, keep_unused=p.keep_unused, inline=p.inline
            )

        fn = self._cached(("jit", id(p.jaxpr), path), p.jaxpr, build)
        return list(fn(*invals))

    def _scan(self, eqn, invals, path):
        """Loop carries keep the dtypes they were traced with, cast at entry and after each
        step, so the loop has a fixed type and its state the precision the code chose."""
        p = compat.scan_params(eqn)
        n_c, n_carry = p.num_consts, p.num_carry
        consts, init, xs = invals[:n_c], invals[n_c : n_c + n_carry], invals[n_c + n_carry :]
        carry_dtypes = [v.aval.dtype for v in eqn.invars[n_c : n_c + n_carry]]

        def fix(carry):
            return [_cast_to(c, d) for c, d in zip(carry, carry_dtypes)]

        delayed = self.delayed
        if delayed is not None and delayed.opaque is None:
            # Each iteration takes its slice of the state of the matmuls inside.
            namespace = delayed.scan_namespace(self.settings.region(path).path)
            metas = delayed.metas
            mine = {k: v for k, v in sorted((metas or {}).items()) if k.startswith(namespace)}
            keys, stacked = list(mine), list(mine.values())

            def body(carry, x):
                x, sliced = x
                inner = None if metas is None else dict(zip(keys, sliced))
                with delayed.level(namespace, inner, p.length):
                    outs = self.run(p.jaxpr, [*consts, *carry, *x], path)
                return fix(outs[:n_carry]), outs[n_carry:]

            carry, ys = lax.scan(
                body,
                fix(init),
                (list(xs), stacked),
                length=p.length,
                reverse=p.reverse,
                unroll=p.unroll,
            )
            return [*carry, *ys]

        def plain_body(carry, x):
            outs = self.run(p.jaxpr, [*consts, *carry, *x], path)
            return fix(outs[:n_carry]), outs[n_carry:]

        carry, ys = lax.scan(
            plain_body, fix(init), list(xs), length=p.length, reverse=p.reverse, unroll=p.unroll
        )
        return [*carry, *ys]

    def _while(self, eqn, invals, path):
        """Like scan: the carries keep their traced dtypes."""
        p = compat.while_params(eqn)
        cond_consts = invals[: p.cond_nconsts]
        body_consts = invals[p.cond_nconsts : p.cond_nconsts + p.body_nconsts]
        init = invals[p.cond_nconsts + p.body_nconsts :]
        carry_dtypes = [v.aval.dtype for v in eqn.invars[p.cond_nconsts + p.body_nconsts :]]

        def fix(carry):
            return [_cast_to(c, d) for c, d in zip(carry, carry_dtypes)]

        def cond(carry):
            return self.run(p.cond_jaxpr, [*cond_consts, *carry], path)[0]

        def body(carry):
            return fix(self.run(p.body_jaxpr, [*body_consts, *carry], path))

        with forward_only():
            return list(lax.while_loop(cond, body, fix(init)))

    def _cond(self, eqn, invals, path):
        """Branches run autocast; each output takes the widest dtype the branches give it."""
        branches = compat.cond_branches(eqn)
        index, operands = invals[0], invals[1:]

        def branch_fn(branch):
            return lambda *ops: self.run(branch, ops, path)

        shapes = [self.shapes(branch_fn(b), operands) for b in branches]
        targets = [
            _widest(s.dtype for s in outs) if is_floating(outs[0].dtype) else None
            for outs in zip(*shapes)
        ]

        def fixed(branch):
            fn = branch_fn(branch)
            return lambda *ops: [
                x if t is None else _cast_to(x, t) for x, t in zip(fn(*ops), targets)
            ]

        platforms = compat.cond_platforms(eqn)
        if platforms is not None:
            # Re-made as lax.platform_dependent, so that each platform still lowers its own
            # branch only (cuDNN attention's custom calls do not lower for the CPU).
            fns = [fixed(b) for b in branches]
            per_platform = {n: fn for fn, names in zip(fns, platforms) if names for n in names}
            default = next((fn for fn, names in zip(fns, platforms) if not names), None)
            return list(lax.platform_dependent(*operands, default=default, **per_platform))
        return list(lax.switch(index, [fixed(b) for b in branches], *operands))

    def _remat(self, eqn, invals, path):
        p = compat.remat_params(eqn)
        fn = jax.checkpoint(
            lambda *args: self.run(p.jaxpr, args, path), prevent_cse=p.prevent_cse, policy=p.policy
        )
        return list(fn(*invals))

    def _shard_map(self, eqn, invals, path):
        p = compat.shard_map_params(eqn)
        fn = jax.shard_map(lambda *args: tuple(self.run(p.jaxpr, args, path)), **p.kwargs)
        with per_device():
            return list(fn(*invals))

    def _custom_call(self, eqn, invals, path):
        """What both custom-derivative rebuilds start from: the autocast primal, the traced
        avals, the indices of floating inputs and outputs, and the primal's output shapes."""
        call = compat.call_jaxpr(eqn)
        in_avals = [v.aval for v in eqn.invars]
        out_avals = [v.aval for v in eqn.outvars]
        fidx = [i for i, a in enumerate(in_avals) if is_floating(a.dtype)]
        oidx = [i for i, a in enumerate(out_avals) if is_floating(a.dtype)]

        def primal(*args):
            with unobserved():  # observed as a whole, by its outputs (see _OBSERVED_WHOLE)
                return self.run(call, args, path)

        return primal, in_avals, out_avals, fidx, oidx, self.shapes(primal, invals)

    def _custom_jvp(self, eqn, invals, path):
        """The primal runs autocast; the user's JVP rule stays the rule.

        The rule is traced at the traced dtypes (``jax.jvp`` of the original equation, which
        calls the custom rule) and evaluated under autocast too, so a rule with matmuls runs
        them in the compute dtype. Its outputs are cast to the primal's dtypes. It is traced
        where it runs, from the types of the values it gets, so shardings and the varying axes
        of ``shard_map`` carry over.
        """
        primal, in_avals, out_avals, fidx, oidx, out_shapes = self._custom_call(eqn, invals, path)
        n_out = len(out_avals)

        def rule(primals, tangents):
            tangents = [tangents[i] for i in fidx]
            avals = [compat.retyped(x, a) for x, a in zip(primals, in_avals)] + [
                compat.retyped(t, in_avals[i]) for t, i in zip(tangents, fidx)
            ]
            rule_jaxpr = self._cached(
                ("jvp", id(eqn), tuple(avals)),
                eqn,
                lambda: custom_rules.trace_jvp_rule(eqn, avals, fidx, oidx),
            )
            with unobserved(), forward_only():  # see _OBSERVED_WHOLE; JAX transposes it
                outs = self.run(rule_jaxpr, [*primals, *tangents], path)
            primals_out = [_cast_to(x, s.dtype) for x, s in zip(outs[:n_out], out_shapes)]
            tangents_out = [custom_rules.float0_zeros(s) for s in out_shapes]
            for i, t in zip(oidx, outs[n_out:]):
                tangents_out[i] = _cast_to(t, out_shapes[i].dtype)
            return primals_out, tangents_out

        fn = jax.custom_jvp(primal)
        fn.defjvp(rule)
        return list(fn(*invals))

    def _custom_vjp(self, eqn, invals, path):
        """The primal, the user's fwd and the user's bwd all run autocast; bwd stays custom.

        fwd and bwd are traced at the traced dtypes (``jax.vjp`` of the original equation: the
        VJP function it returns is a pytree whose leaves are the residuals), where they run, and
        evaluated under autocast. Cotangents are cast to the dtypes of the inputs they belong to.
        """
        primal, in_avals, out_avals, fidx, oidx, out_shapes = self._custom_call(eqn, invals, path)
        n_out = len(out_avals)
        in_dtypes = [jax.typeof(x).dtype for x in invals]
        traced_fwd = []

        def fwd(*args):
            avals = tuple(compat.retyped(x, a) for x, a in zip(args, in_avals))
            fwd_jaxpr, tree = self._cached(
                ("vjp_fwd", id(eqn), avals),
                eqn,
                lambda: custom_rules.trace_vjp_fwd(eqn, avals, fidx),
            )
            traced_fwd.append((fwd_jaxpr, tree))
            with unobserved():  # see _OBSERVED_WHOLE
                outs = self.run(fwd_jaxpr, args, path)
            return [_cast_to(x, s.dtype) for x, s in zip(outs[:n_out], out_shapes)], outs[n_out:]

        def bwd(residuals, cts):
            fwd_jaxpr, tree = traced_fwd[-1]
            cts = [cts[i] for i in oidx]
            avals = (
                *fwd_jaxpr.out_avals[n_out:],
                *(compat.retyped(ct, out_avals[i]) for ct, i in zip(cts, oidx)),
            )
            bwd_jaxpr = self._cached(
                ("vjp_bwd", id(eqn), avals),
                eqn,
                lambda: custom_rules.trace_vjp_bwd(tree, avals, out_avals, oidx),
            )
            with unobserved():  # see _OBSERVED_WHOLE
                cts_in = self.run(bwd_jaxpr, [*residuals, *cts], path)
            result: list[Any] = [None] * len(in_avals)
            for i, ct in zip(fidx, cts_in):
                result[i] = _cast_to(ct, in_dtypes[i])
            return tuple(result)

        fn = jax.custom_vjp(primal)
        fn.defvjp(fwd, bwd)
        return list(fn(*invals))


def _runs_in_f32(eqn: Any, ran: list) -> bool:
    """Whether ``eqn`` is a matmul or convolution whose floating operands run in float32."""
    floats = [a.dtype for a in ran if is_floating(a.dtype)]
    return compat.takes_precision(eqn) and bool(floats) and all(d == _F32 for d in floats)


def _f32_precision_name(eqn: Any, params: dict | None, ran: list) -> str | None:
    """The precision an f32 matmul is bound with (its name in :data:`MATMUL_PRECISIONS`), or
    None for any other equation."""
    return compat.precision_name(eqn, params) if _runs_in_f32(eqn, ran) else None


def _f32_precision(eqn: Any, params: dict | None, ran: list, policy: Policy | None) -> dict | None:
    """``params`` with the precision of ``policy``'s float32 matmuls (``"highest"`` in
    :func:`mpjax.full_precision`, whose ``policy`` is None) when ``eqn`` is a matmul or
    convolution whose floating operands run in float32 and whose code left the precision
    unset; else ``params`` unchanged. Only the matmuls the engine binds get it: the backward
    matmuls JAX derives from them carry the same ``precision`` param."""
    if not _runs_in_f32(eqn, ran) or not compat.precision_left_default(eqn):
        return params
    name = DEFAULT_F32_MATMUL_PRECISION if policy is None else policy.f32_matmul_precision
    return compat.with_precision(eqn, params, name)


def to_output(x: Any, traced_aval: Any, policy: Policy) -> Any:
    aval = jax.typeof(x)
    if (
        aval.dtype in ELIGIBLE
        and traced_aval.dtype in ELIGIBLE
        and not aval.weak_type
        and aval.dtype != policy.output_dtype
    ):
        return lax.convert_element_type(x, policy.output_dtype)
    return x


def run_in_regions(fn: Callable[..., Any], policy: Policy, *args, **kwargs) -> Any:
    """Runs ``fn(*args, **kwargs)`` through the casting engine; the Flax integrations' entry.

    ``policy`` applies outside any precision region; inside, each region's policy (see
    :mod:`mpjax.casting.regions`). ``fn`` is traced under standard dtype promotion, since the dtypes it
    is traced in are only a starting point (a region's outputs cast to its output dtype meet
    f32 values, bf16-stored params meet f32 inputs): the engine decides each operation's dtype.
    Outputs come back as computed, with no cast: the regions cast their own outputs, and state
    returned alongside (updated variables, RNG counters) keeps its dtypes. Nothing is cached:
    the function closes over module state, so it is traced at each call (once per ``jax.jit``
    trace under jit).
    """
    return _run_in_regions(fn, policy, args, kwargs, None)


def _run_in_regions(fn, policy, args, kwargs, delayed: DelayedScaling | None) -> Any:
    settings = Settings(policy, merge_categories(None), ())
    with jax.numpy_dtype_promotion("standard"):
        traced, dynamic = trace(fn, settings, None, args, kwargs)
    outs = Interpreter(settings, traced.cache, delayed=delayed).run(traced.closed, dynamic, ())
    outs = [_as_array(x, a) for x, a in zip(outs, traced.closed.out_avals)]
    return jax.tree.unflatten(traced.out_tree, outs)


def _as_array(x: Any, aval: Any) -> Any:
    """An output that is a constant of the jaxpr (a literal: a Python or numpy scalar, such as
    the ``jnp.array(False)`` a layer stores in its state) as a jax array of its dtype, as the
    model's own code returns it: filtered transformations (``eqx.filter_jit``) would take a
    non-array for a static value."""
    return x if isinstance(x, jax.Array) else jnp.asarray(x, aval.dtype)


def run_in_regions_with_fp8_state(
    fn: Callable[..., Any], policy: Policy, state: Mapping[str, fp8.Fp8Meta], *args, **kwargs
) -> Any:
    """:func:`run_in_regions` whose delayed-scaling fp8 matmuls take their state from
    ``state`` (from :func:`fp8_state_in_regions`; see :func:`with_fp8_state`)."""
    return _run_in_regions(fn, policy, args, kwargs, DelayedScaling(state))


def run_in_regions_finding_fp8_state(
    fn: Callable[..., Any], policy: Policy, *args, **kwargs
) -> tuple[Any, dict[str, fp8.Fp8Meta]]:
    """:func:`run_in_regions`, and the initial state of the delayed-scaling fp8 matmuls it
    ran (with current scaling, having no state yet): what a Flax ``init`` needs."""
    delayed = DelayedScaling(None)
    return _run_in_regions(fn, policy, args, kwargs, delayed), delayed.initial_state()


def fp8_state_in_regions(
    fn: Callable[..., Any], policy: Policy, *args, **kwargs
) -> dict[str, fp8.Fp8Meta]:
    """The initial state of the delayed-scaling fp8 matmuls of ``fn`` run in regions (empty
    when it has none), found by tracing it abstractly for these arguments."""
    delayed = DelayedScaling(None)
    abstractly(lambda a, k: _run_in_regions(fn, policy, a, k, delayed), args, kwargs)
    return delayed.initial_state()
