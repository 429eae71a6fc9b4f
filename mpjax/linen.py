"""Flax linen: apply a precision policy or rules to an existing, unmodified linen module.

``apply_policy(model, "mixed_bfloat16")`` returns a copy of ``model`` whose class is a thin
subclass of the original (same name, same fields, same parameter tree). Its ``init`` and
``apply``, and any method of it called another way (on a ``bind`` result, or as a submodule of
an unwrapped parent, through a Flax lifted transformation), run through mpjax's casting engine,
:mod:`mpjax.autocast`. While the engine traces the model, a :func:`flax.linen.intercept_methods`
interceptor sees every method call of every module below the wrapped one and, for each module,

1. resolves its policy with ``rules.resolve(path, module)``, ``path`` being the module's path
   relative to the wrapped root (``"Block_0/attn/query"``; the root is ``""``);
2. opens the module's precision region (:mod:`mpjax.casting.regions`) around the call. The engine then
   casts at the operations: every matmul and convolution of the module runs in its compute
   dtype, forward and backward, norms' statistics and softmax in f32, whatever the module's own
   ``dtype`` attribute means (for some third-party modules it is the *parameter* dtype), and
   whoever owns the params it reads (a tied output head reads the embedding's table);
3. makes the module create its params in the policy's param dtype (stored values are never
   replaced, so gradients come back in the param dtype) and sets the matched rule's
   attributes on it;
4. casts its outputs to the output dtype where the policy's region ends: at the wrapped root,
   and at a module whose policy differs from the policy of the module that called it.

Under a policy that runs fp8 matmuls with delayed scaling, ``init`` also returns the state of
each such matmul as the :data:`FP8_COLLECTION` (``"fp8"``) collection, and ``apply`` takes it
back; its gradient is the next state (:mod:`mpjax.fp8`).

The modules being configured are the throwaway copies Flax binds for each ``init``/``apply``
call, never the user's instances, so nothing outside the call changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, overload

import jax
import numpy as np

try:
    import flax.linen as nn
    from flax import errors as flax_errors
    from flax import nnx
    from flax.core import lift
    from flax.linen import transforms as nn_transforms
except ImportError as error:
    raise ImportError(
        'mpjax.linen needs Flax, which is not installed. Install it with: pip install "mpjax[flax]"'
    ) from error

from mpjax.casting import regions
from mpjax.casting.engine import (
    run_in_regions,
    run_in_regions_finding_fp8_state,
    run_in_regions_with_fp8_state,
)
from mpjax.casting.trace_context import model_rules
from mpjax.inspection.describe import Runner, register_describer
from mpjax.inspection.report import (
    ModuleRow,
    PrecisionReport,
    RegionDtypes,
    dtypes_by_region,
    eval_shape_of,
)
from mpjax.policy import Policy, PolicyLike, cast_floating
from mpjax.rules import (
    Resolution,
    Rules,
    RulesLike,
    RuleWarning,
    as_rules,
    check_unmatched,
    register_embedding_rules,
    register_norm_rules,
)

__all__ = ["FP8_COLLECTION", "apply_policy"]

FP8_COLLECTION = "fp8"
"""The variable collection that holds the delayed-scaling fp8 state of a wrapped model. Its
``init`` adds it when a policy scales fp8 with delayed scaling, its ``apply`` reads it, and the
gradient with respect to it is the next state (:func:`mpjax.fp8.delayed_dot_general`)."""

register_norm_rules("linen", nn.LayerNorm, nn.RMSNorm, nn.BatchNorm, nn.GroupNorm)
register_embedding_rules("linen", nn.Embed)

_RESOLUTION = "_mpjax_resolution"  # instance-dict key marking a configured bound module


@dataclasses.dataclass
class _Call:
    """One outermost call of a wrapped root: what its interceptor needs and what it saw."""

    rules: Rules
    root_path: tuple[str, ...]
    seen: dict[str, tuple[type, Resolution]] = dataclasses.field(default_factory=dict)
    policies: list[Policy] = dataclasses.field(default_factory=list)


class _ActiveCalls(threading.local):
    def __init__(self):
        self.stack: list[tuple[_WrapperState, _Call]] = []


# Innermost wrapped root last. Only the innermost root's interceptor acts, so a wrapped model
# nested in another keeps its own rules.
_active = _ActiveCalls()


class _WrapperState:
    """Per wrapped class: its rules, the modules its last call saw, and whether problems with
    its rules were already warned about (once per wrap, not every step)."""

    def __init__(self, rules: Rules):
        self.rules = rules
        self.seen: dict[str, tuple[type, Resolution]] = {}
        self._warned = False

    def warn_once(self, seen: dict[str, tuple[type, Resolution]]) -> None:
        """Refuses rules that matched no module the call ran (every call until they match),
        then warns once of shadowed ones."""
        if self._warned:
            return
        modules = [(path, cls) for path, (cls, _) in seen.items()]
        root = seen[""][0].__name__ if "" in seen else "the model"
        check_unmatched(
            self.rules,
            modules,
            where="mpjax.linen.apply_policy()",
            what=f"module the {root} ran in its first call",
            syntax="Linen paths join submodule names with '/' from the wrapped module "
            "('Block_0/Dense_1'), not with '.'.",
            listing="mpjax.describe(model, variables=variables)(x) lists every module path.",
        )
        self._warned = True
        for problem in self.rules.problems(modules, unmatched=False):
            warnings.warn(problem, RuleWarning, stacklevel=2)


def _relative_path(module: nn.Module, root: tuple[str, ...]) -> str | None:
    if module.scope is None:  # unbound: under no root
        return None
    path = tuple(module.scope.path)
    if path[: len(root)] != root:
        return None
    return "/".join(path[len(root) :])


def _fields(module: nn.Module) -> set[str]:
    return {f.name for f in dataclasses.fields(module)}


@overload
def _init_in(dtype: np.dtype, init_fn: Callable[..., Any]) -> Callable[..., Any]: ...
@overload
def _init_in(dtype: np.dtype, init_fn: None) -> None: ...
def _init_in(dtype: np.dtype, init_fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Wraps an initializer so the stored value is created in ``dtype``."""
    if init_fn is None:
        return None

    def init(*args, **kwargs):
        return cast_floating(init_fn(*args, **kwargs), dtype)

    return init


def _create_params_in(module: nn.Module, dtype: np.dtype) -> None:
    """Makes ``module`` create its params in ``dtype``. Linen has no param creation hook, so
    the bound module's ``param`` and ``variable`` are shadowed on the instance (Flax's own
    methods still run; existing params are returned as stored)."""
    cls = type(module)

    def param(name, init_fn, *init_args, **init_kwargs):
        return cls.param(module, name, _init_in(dtype, init_fn), *init_args, **init_kwargs)

    def variable(col, name, init_fn=None, *init_args, **init_kwargs):
        if col == "params":
            init_fn = _init_in(dtype, init_fn)
        return cls.variable(module, col, name, init_fn, *init_args, **init_kwargs)

    for method in (param, variable):
        object.__setattr__(module, method.__name__, method)


def _configure(module: nn.Module, path: str, rules: Rules) -> Resolution:
    """Resolves ``module``'s policy and sets it up, once per bound module."""
    resolution = module.__dict__.get(_RESOLUTION)
    if resolution is not None:
        return resolution
    resolution = rules.resolve(path, module)
    fields = _fields(module)
    for name, value in resolution.attributes:
        if name in fields:
            # Bound modules are Flax's per-call copies: setting a field here is what
            # `module.clone(name=value)` would give, without re-running setup on a second copy.
            object.__setattr__(module, name, value)
    _create_params_in(module, resolution.policy.param_dtype)
    object.__setattr__(module, _RESOLUTION, resolution)
    return resolution


def _interceptor(call: _Call):
    def intercept(next_fun, args, kwargs, context):
        module = context.module
        path = _relative_path(module, call.root_path)
        if _active.stack[-1][1] is not call or path is None:
            return next_fun(*args, **kwargs)  # another wrapped root's module, or outside ours
        resolution = _configure(module, path, call.rules)
        call.seen.setdefault(path, (type(module), resolution))
        policy = resolution.policy
        caller = call.policies[-1] if call.policies else None
        call.policies.append(policy)
        try:
            with regions.region(policy, path):
                out = next_fun(*args, **kwargs)
        finally:
            call.policies.pop()
        # The region of a policy ends at the root (no caller) and where the caller's differs.
        return regions.output_boundary(out, policy.output_dtype) if caller != policy else out

    return intercept


@contextlib.contextmanager
def _policy_call(state: _WrapperState, root_path: tuple[str, ...], name: str, report: bool):
    """Runs the body under ``state``'s rules (or those :func:`mpjax.casting.trace_context.model_rules`
    gives the model ``name`` instead), for the modules at or below ``root_path``; yields the
    rules."""
    rules = model_rules(name, state.rules)
    call = _Call(rules, root_path)
    _active.stack.append((state, call))
    try:
        with nn.intercept_methods(_interceptor(call)):
            yield rules
    finally:
        _active.stack.pop()
    if report and rules is state.rules:
        state.seen = call.seen
        state.warn_once(call.seen)


def _lifted_engine(fn: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """The casting engine as a Flax lifted transformation (as ``flax.core.lift.checkpoint``
    is ``jax.checkpoint``): the scope's variables and RNGs go in and out as arrays."""

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
        def run(variable_groups, rng_groups, *args, **kwargs):
            scope = scope_fn(variable_groups, rng_groups)
            y = fn(scope, *args, **kwargs)
            return y, repack_fn(scope)

        return run_in_regions(run, policy, variable_groups, rng_groups, *args, **kwargs)

    return lift.pack(inner, (True,), (True,), (True,), name="mpjax", enable_kwargs=True)


if TYPE_CHECKING:  # the mixin always precedes a linen module class in the MRO
    _MixinBase = nn.Module
else:
    _MixinBase = object


class _PolicyMixin(_MixinBase):
    """The methods of the subclass :func:`apply_policy` makes; ``_mpjax_state`` is per class."""

    _mpjax_state: ClassVar[_WrapperState]

    def _mpjax_active(self) -> bool:
        return bool(_active.stack) and _active.stack[-1][0] is type(self)._mpjax_state

    def _mpjax_run(self, fn: Callable[..., Any], *args, fp8: Any = None):
        state = type(self)._mpjax_state
        with _policy_call(state, (), type(self).__name__, report=True) as rules:
            if fp8 is None:
                return run_in_regions(fn, rules.default, *args)
            return run_in_regions_with_fp8_state(fn, rules.default, fp8, *args)

    # A top-level init/apply runs entirely through the engine, so functions passed as
    # `method=` that reach into submodules (`lambda m, x: m.encoder(x)`) are covered too.
    def init_with_output(self, rngs, *args, **kwargs):
        if self._mpjax_active():
            return super().init_with_output(rngs, *args, **kwargs)
        init = super().init_with_output
        state = type(self)._mpjax_state
        if not state.rules.scales_fp8_delayed():
            return self._mpjax_run(lambda r, a, k: init(r, *a, **k), rngs, args, kwargs)
        # Init runs the fp8 matmuls with current scaling and creates their delayed state.
        with _policy_call(state, (), type(self).__name__, report=True) as rules:
            (out, variables), fp8 = run_in_regions_finding_fp8_state(
                lambda r, a, k: init(r, *a, **k), rules.default, rngs, args, kwargs
            )
        return out, {**variables, FP8_COLLECTION: fp8}

    def apply(self, variables, *args, **kwargs):
        if self._mpjax_active():
            return super().apply(variables, *args, **kwargs)
        if not isinstance(variables, Mapping):
            raise TypeError(
                f"{type(self).__name__}.apply(variables, ...): variables must be the dict of "
                "collections init returns ({'params': ...}), got "
                f"{variables!r} of type {type(variables).__name__}."
            )
        apply = super().apply
        fp8 = variables.get(FP8_COLLECTION)
        if fp8 is not None:
            variables = {k: v for k, v in variables.items() if k != FP8_COLLECTION}
        return self._mpjax_run(lambda v, a, k: apply(v, *a, **k), variables, args, kwargs, fp8=fp8)

    def _call_wrapped_method(self, fun, args, kwargs):
        # Used as a submodule or bound, the wrapped module's methods (setup included) enter
        # here. Overriding Flax's method dispatcher also covers Flax's own functions passed to
        # `apply(method=nn.Embed.attend)`, which would bypass an override of `attend`.
        # Unbound (no scope, nothing to trace), Flax answers as for the unwrapped module.
        if self._mpjax_active() or fun.__name__ == "setup" or self.scope is None:
            return super()._call_wrapped_method(fun, args, kwargs)
        state = type(self)._mpjax_state
        with _policy_call(state, tuple(self.scope.path), type(self).__name__, True) as rules:
            lifted = nn_transforms.decorator_lift_transform(
                functools.partial(_lifted_engine, policy=rules.default), fun
            )
            return lifted(self, *args, **kwargs)


def _wrap_class(cls: type, rules: Rules) -> type:
    cls = getattr(cls, "_mpjax_original", cls)  # wrapping again replaces the rules
    # Same name and qualname: linen auto-names submodules after their class ("Dense_0"), so a
    # wrapped model has the unwrapped model's parameter tree and the same variables fit both.
    namespace = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_mpjax_state": _WrapperState(rules),
        "_mpjax_original": cls,
    }
    return type(cls.__name__, (_PolicyMixin, cls), namespace)


def apply_policy(module: nn.Module | type, policy_or_rules: RulesLike):
    """Returns a copy of an unmodified linen module (or class) that runs under a policy or rules.

    Linen modules are immutable, so ``module`` itself is left as it was and the wrapped copy
    is returned (:func:`mpjax.nnx.set_policy` configures an NNX model in place instead).

    Every module below the wrapped one (submodules defined in ``setup`` or ``@nn.compact``,
    shared modules, modules inside ``nn.scan``, ``nn.remat``, ``nn.vmap``...) resolves its policy
    with ``rules.resolve(path, module)``, ``path`` being its ``/``-joined path relative to the
    wrapped module (``""`` for the wrapped module itself). Then

    - ``init`` creates every param in its module's ``param_dtype``;
    - ``apply`` runs each module's operations under its policy, through mpjax's casting engine
      (:func:`mpjax.autocast`'s op categories): matmuls, convolutions and attention in the
      ``compute_dtype`` forward and backward, whatever the module's attributes say (its own
      ``dtype`` field is not consulted: for some third-party modules it means the parameter
      dtype); exp, log, powers, reductions, and so softmax, norms and losses, in f32;
      elementwise ops in the dtype of their inputs. A matmul runs under the policy of the
      module that computes it, whoever owns the params it reads (a tied output head reading
      the embedding table runs under the head's policy). Stored params are never replaced, so
      gradients come back in the param dtype;
    - outputs are cast to the ``output_dtype`` where the policy's region ends: at the wrapped
      module and at modules whose policy differs from their caller's;
    - a rule's ``attributes`` are set on the modules it matches that have those fields.

    What a policy overrides: every module runs under the policy of its region, whatever its
    own ``dtype`` and ``param_dtype`` fields say (they are never consulted:
    ``nn.Dense(4, dtype=jnp.float32)`` in a bf16 model computes in bf16), and so does any code
    a module calls, a user's ``attention_fn`` included. To keep a module in f32, say so: a rule
    for its path or class (``{"head": "float32"}``), or :func:`mpjax.full_precision` around
    the code.

    A computation the engine cannot reach is warned about with the module's path
    (:class:`mpjax.AutocastWarning`): a host callback gets its inputs in the traced dtypes.
    Code inside :func:`mpjax.full_precision` runs as written.

    A user's rule that matches no module the first call (usually ``init``) ran is an error
    (``ValueError``, naming the closest paths), raised after that call and every call until one
    matches; ``Rules(..., allow_unmatched=True)`` accepts rules for modules that only some
    calls run. Rules that match only modules an earlier rule claims are warned about once
    (:class:`mpjax.RuleWarning`).

    Args:
      module: a linen module instance that is not bound or attached to a parent yet, or a
        module class. A class gives a subclass with the same name and fields whose instances
        are wrapped: use it to wrap a submodule inside another module
        (``apply_policy(nn.Dense, "float32")(features)``). Wrapping a wrapped module replaces
        its rules.
      policy_or_rules: a :class:`mpjax.Rules`; anything :func:`mpjax.get_policy` accepts (the
        default policy, with the built-in rules: norms in f32); or a mapping or list of rules
        (``Rules(policy_or_rules)``): the same forms :func:`mpjax.nnx.set_policy` takes.

    Returns:
      A module of a subclass of ``type(module)`` with the same fields and parameter tree, or,
      for a class, that subclass. Use it as the original: ``init``, ``apply``, ``bind``, as a
      submodule, under ``jax.jit`` and ``jax.grad``.

    Raises:
      TypeError: if ``module`` is not a linen module or module class, or ``policy_or_rules`` is
        not a policy or rules.
      ValueError: if ``module`` is already bound or attached to a parent, or the policy string
        is invalid.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, mpjax
    >>> model = apply_policy(nn.Dense(4), "mixed_bfloat16")
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> variables["params"]["kernel"].dtype, model.apply(variables, x).dtype
    (dtype('float32'), dtype('float32'))
    >>> [m.operand_dtypes for m in mpjax.inspect_matmuls(model.apply)(variables, x)]
    [(dtype(bfloat16), dtype(bfloat16))]
    """
    rules = as_rules(policy_or_rules)
    if isinstance(module, type) and issubclass(module, nn.Module):
        return _wrap_class(module, rules)
    if not isinstance(module, nn.Module):
        raise TypeError(
            "apply_policy() takes a flax.linen Module instance or class as `module`; got "
            f"{module!r} of type {type(module).__name__}."
            + (" For flax.nnx modules use mpjax.nnx.set_policy." if _is_nnx(module) else "")
        )
    if module.scope is not None:
        raise ValueError(
            f"apply_policy() got a {type(module).__name__} that is already bound or attached to "
            "a parent module, so its scope can no longer change. Either\n"
            "  1. wrap the module before binding it: apply_policy(model, rules).init(...), or\n"
            "  2. inside a parent module, wrap the class: apply_policy(nn.Dense, rules)(4)(x)."
        )
    cls = _wrap_class(type(module), rules)
    attrs = {f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.init}
    # An orphan, like `module.clone()`: a parent's setup adopts it when assigned to an attribute.
    attrs["parent"] = None
    return cls(**attrs)


def _is_nnx(value: Any) -> bool:
    return isinstance(value, nnx.Module)


def _owned_params(params: Any, path: str, module_paths: set[str]) -> list[Any]:
    """The param leaves stored at ``path`` that belong to no submodule."""
    node = params
    for name in filter(None, path.split("/")):
        node = node.get(name, {}) if isinstance(node, Mapping) else {}
    if not isinstance(node, Mapping):
        return []
    prefix = f"{path}/" if path else ""
    return [
        leaf
        for name, value in node.items()
        if f"{prefix}{name}" not in module_paths
        for leaf in jax.tree.leaves(value)
    ]


def _report_of(
    model: nn.Module,
    *,
    rules: Rules | PolicyLike | None,
    variables: Any,
    rngs: Any,
    method: Callable[..., Any] | str | None,
) -> Callable[..., PrecisionReport]:
    """:func:`mpjax.describe` of a linen module.

    The model is traced abstractly with ``jax.eval_shape`` (nothing is allocated or computed):
    ``model.init(rngs, *args, **kwargs)``, or ``model.apply(variables, *args, **kwargs)`` when
    ``variables`` are given. Each module called gets a row: its path, class name, resolved
    policy, the rule that decided it, the number and bytes of the params it owns directly
    (not its submodules'), as stored, the floating dtypes its operations computed in and the
    operand dtypes of the matmuls and convolutions that ran in it, forward and backward, read
    from the jaxpr of the wrapped model's gradient (so a matmul that stayed f32, or a norm whose
    statistics were computed in bf16, shows). Problems with the rules are listed under the
    table.

    Args:
      model: a model returned by :func:`apply_policy`, or an unwrapped module with ``rules``.
      rules: rules or a policy for an unwrapped ``model``; must be None for a wrapped one.
      variables: the model's variables (arrays or ``jax.ShapeDtypeStruct``) to count instead of
        initializing; the params of a bf16-stored model count 2 bytes each.
      rngs: the PRNG key or ``{name: key}`` dict for ``init`` and ``apply``; defaults to
        ``jax.random.key(0)``.
      method: the method to trace, as for ``Module.init``/``Module.apply``.

    Returns:
      A function of the method's arguments (arrays or ``jax.ShapeDtypeStruct``, and static
      values such as ``deterministic=True``) that returns a :class:`mpjax.PrecisionReport`.

    Raises:
      TypeError: if ``model`` is not a linen module.
      ValueError: if ``model`` is wrapped and ``rules`` is given, or unwrapped and it is not.
    """
    model = _wrapped_for_report(model, rules)
    state: _WrapperState = type(model)._mpjax_state  # type: ignore[attr-defined]

    def report(*args, **kwargs) -> PrecisionReport:
        keys = jax.random.key(0) if rngs is None else rngs
        known = variables
        if known is None:
            init = functools.partial(model.init, keys, method=method)
            known = eval_shape_of(init, *args, **kwargs)

        def apply(variables, *args, **kwargs):
            return model.apply(variables, *args, method=method, rngs=keys, mutable=True, **kwargs)

        ran = dtypes_by_region(apply, known, *args, **kwargs)
        params = nn.meta.unbox(known).get("params", {}) if isinstance(known, Mapping) else {}
        seen = state.seen
        rows = []
        for path, (module_type, resolution) in seen.items():
            leaves = _owned_params(params, path, set(seen))
            region = ran.get(path, RegionDtypes())
            rows.append(
                ModuleRow(
                    path=path,
                    type_name=module_type.__name__,
                    policy=resolution.policy,
                    rule=resolution.rule_name,
                    param_count=sum(int(np.prod(leaf.shape)) for leaf in leaves),
                    param_bytes=sum(
                        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves
                    ),
                    matmuls=region.matmuls,
                    computes=region.computes,
                )
            )
        problems = state.rules.problems((path, cls) for path, (cls, _) in seen.items())
        return PrecisionReport(tuple(rows), tuple(problems))

    return report


def _wrapped_for_report(model: Any, rules: RulesLike | None) -> Any:
    if isinstance(model, type):
        raise TypeError(
            f"describe() takes a flax.linen Module instance, got the class {model.__name__}. "
            f"Pass an instance: mpjax.describe({model.__name__}(...), rules=policy)(x)."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"describe() takes a flax.linen Module instance as `model`; got {model!r} of type "
            f"{type(model).__name__}."
        )
    wrapped = isinstance(model, _PolicyMixin)
    if wrapped and rules is not None:
        raise ValueError(
            "describe() got `rules` for a model apply_policy() already wrapped, which has its "
            "own rules. Pass the unwrapped model with `rules`, or the wrapped model alone."
        )
    if wrapped:
        return model
    if rules is None:
        raise ValueError(
            f"describe() got an unwrapped {type(model).__name__}: pass `rules=` (rules or a "
            "policy), or the model returned by mpjax.linen.apply_policy(model, rules)."
        )
    return apply_policy(model, rules)


def _runner_of(
    model: nn.Module, *, variables: Any, rngs: Any, method: Callable[..., Any] | str | None
) -> Runner:
    """The :class:`mpjax.inspection.describe.Runner` of a linen model (wrapped or not): ``under(rules)``
    applies the model wrapped with ``rules`` to its variables, those given or ``model.init``'s
    for the inputs."""
    if isinstance(model, type):
        raise TypeError(
            f"diagnose() takes a flax.linen Module instance, got the class {model.__name__}. "
            f"Pass an instance: mpjax.diagnose({model.__name__}(...), policy=...)(x)."
        )
    wrapped = isinstance(model, _PolicyMixin)
    rules = type(model)._mpjax_state.rules if wrapped else None  # type: ignore[attr-defined]
    keys = jax.random.key(0) if rngs is None else rngs

    def under(rules: Rules) -> Callable[..., Any]:
        model_under = apply_policy(model, rules)

        def apply(variables, *args, **kwargs):
            try:
                return model_under.apply(variables, *args, method=method, rngs=keys, **kwargs)
            except flax_errors.ScopeParamShapeError as error:
                raise ValueError(f"the inputs do not fit the variables: {error}") from error

        return apply

    def arguments(inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        known = variables
        if known is None:
            if inputs and isinstance(inputs[0], Mapping) and "params" in inputs[0]:
                raise TypeError(
                    f"diagnose(model)(*inputs) takes the inputs of {type(model).__name__} as "
                    "its __call__ takes them, not the variables; pass those to diagnose: "
                    "diagnose(model, variables=variables)(*inputs)."
                )
            known = model.init(keys, *inputs, method=method, **kwargs)
        return (known, *inputs), kwargs

    return Runner(rules, under, arguments)


register_describer(
    nn.Module,
    _report_of,
    kind="a flax.linen module",
    options=("rules", "variables", "rngs", "method"),
    runner=_runner_of,
)
