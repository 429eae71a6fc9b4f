"""Equinox integration: run an existing, unmodified ``eqx.Module`` under a policy or rules.

:func:`apply_policy` (or the :class:`MixedPrecision` constructor) returns a new module, as
everything in Equinox does: a :class:`MixedPrecision` ``eqx.Module`` whose one dynamic field,
``model``, is your model with its floating-point arrays stored in the param dtype of their
module's policy (a no-op for the default f32), and whose static ``rules`` say which policy each
module runs under. It is an ordinary pytree: ``eqx.filter_jit``, ``eqx.filter_grad``,
``eqx.partition``/``combine``, ``eqx.nn.inference_mode``, ``jax.vmap`` and
``eqx.tree_serialise_leaves`` see the model's own leaves in the model's own order (a checkpoint
of the wrapped model is one of the unwrapped model).

Module paths are written as Equinox users write them: the attribute names and indices from the
root, ``"layers[2].attn"`` (the root is ``""``). A rule's string key is a glob over that path in
which ``*`` and ``?`` are the only wildcards and brackets are literal indices
(``"layers[*].attn"``); a compiled regular expression or a module class works as everywhere in
:class:`mpjax.Rules`. Equinox's norms (``LayerNorm``, ``RMSNorm``, ``GroupNorm``,
``BatchNorm``) keep f32 params and statistics by the built-in rules, and the casting engine
runs softmax, exp/log and reductions in f32 wherever they are.

Calling the wrapped module runs the model through mpjax's casting engine
(:mod:`mpjax.autocast`): the call is traced with each submodule's ``__call__`` opening the
precision region of its path (:mod:`mpjax.casting.regions`), and evaluated operation by operation under
the region it is in. Every matmul and convolution runs in its region's compute dtype, forward
and backward, whatever dtypes the model's code asks for; a region whose policy differs from its
caller's casts its floating outputs to its output dtype, and the root casts the model's outputs
to the root policy's output dtype (``eqx.nn.State`` is returned as computed). The stored arrays
are only read: gradients come back in the param dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

try:
    import equinox as eqx
except ImportError as error:
    raise ImportError(
        'mpjax.equinox needs Equinox, which is not installed. Install it with: pip install "mpjax[equinox]"'
    ) from error

from mpjax.casting import regions
from mpjax.casting.engine import run_in_regions
from mpjax.casting.trace_context import model_rules, tracing
from mpjax.inspection.describe import Runner, register_argument_model, register_describer
from mpjax.inspection.report import ModuleRow, PrecisionReport, RegionDtypes, dtypes_by_region
from mpjax.optim.loss_scaling_readers import make_scaled_value_and_grad
from mpjax.policy import Policy, PolicyLike, cast_floating
from mpjax.rules import (
    Rules,
    RulesLike,
    RuleWarning,
    as_rules,
    check_unmatched,
    register_embedding_rules,
    register_norm_rules,
)

__all__ = ["MixedPrecision", "apply_policy", "filter_value_and_grad", "module_paths"]

register_norm_rules("equinox", eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.BatchNorm, eqx.nn.GroupNorm)
register_embedding_rules("equinox", eqx.nn.Embedding)


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def _is_state(x: Any) -> bool:
    return isinstance(x, eqx.nn.State)


def _base_class(module: eqx.Module) -> type:
    return getattr(type(module), "_mpjax_base", type(module))


def _child_path(parent: str, name: str, keys: tuple) -> str:
    return (f"{parent}.{name}" if parent else name) + jax.tree_util.keystr(keys)


def _rebuild(
    module: eqx.Module,
    path: str,
    on_module: Callable[[str, eqx.Module, dict[str, Any]], eqx.Module],
    on_leaf: Callable[[str, eqx.Module, Any], Any],
) -> eqx.Module:
    """``module`` with every submodule and every leaf of its dynamic fields replaced, bottom
    up: ``on_leaf(path, owner, leaf)`` for the leaves a module holds directly (outside its
    submodules), then ``on_module(path, module, new_fields)`` for each module."""
    fields = {}
    for field in dataclasses.fields(module):
        if field.metadata.get("static", False) or field.name not in vars(module):
            continue

        def child(keys, value, name=field.name):
            if _is_module(value):
                return _rebuild(value, _child_path(path, name, keys), on_module, on_leaf)
            return on_leaf(path, module, value)

        fields[field.name] = jax.tree_util.tree_map_with_path(
            child, vars(module)[field.name], is_leaf=_is_module
        )
    return on_module(path, module, fields)


def _replace(module: eqx.Module, fields: dict[str, Any], cls: type | None = None) -> eqx.Module:
    """A copy of ``module`` (of class ``cls``, by default its own) with ``fields`` set; like
    Equinox's own unflattening, no ``__init__`` runs."""
    new: eqx.Module = object.__new__(cls or type(module))
    for name, value in {**vars(module), **fields}.items():
        object.__setattr__(new, name, value)
    return new


@dataclasses.dataclass(frozen=True)
class _Node:
    """One module of the model, found by :func:`_walk`."""

    path: str
    module: eqx.Module
    parent: str | None  # path of the enclosing module; None at the root
    params: list[Any] = dataclasses.field(default_factory=list)  # the arrays it holds directly


def _walk(model: eqx.Module) -> list[_Node]:
    """The modules of ``model`` in pre-order (a module before its submodules, fields in
    declaration order), each with the floating arrays it holds directly."""
    nodes: list[_Node] = []

    def visit(module: eqx.Module, path: str, parent: str | None) -> None:
        node = _Node(path, module, parent)
        nodes.append(node)
        for field in dataclasses.fields(module):
            if field.metadata.get("static", False) or field.name not in vars(module):
                continue
            flat, _ = jax.tree_util.tree_flatten_with_path(
                vars(module)[field.name], is_leaf=_is_module
            )
            for keys, value in flat:
                if _is_module(value):
                    visit(value, _child_path(path, field.name, keys), path)
                elif _is_param(module, value):
                    node.params.append(value)

    visit(model, "", None)
    return nodes


def _is_param(owner: eqx.Module, leaf: Any) -> bool:
    # A StateIndex's arrays are the initial state (eqx.nn.State), not parameters.
    return eqx.is_inexact_array(leaf) and not isinstance(owner, eqx.nn.StateIndex)


def module_paths(model: eqx.Module) -> list[tuple[str, type]]:
    """The ``(path, class)`` of every module of ``model``, in pre-order: the paths rules match.

    >>> import jax, equinox as eqx
    >>> mlp = eqx.nn.MLP(2, 2, 4, depth=2, key=jax.random.key(0))
    >>> [(path, cls.__name__) for path, cls in module_paths(mlp)]
    [('', 'MLP'), ('layers[0]', 'Linear'), ('layers[1]', 'Linear'), ('layers[2]', 'Linear')]

    Raises:
      TypeError: ``model`` is not an ``eqx.Module`` instance.
    """
    model = _check_model(model, "module_paths")
    return [(n.path, _base_class(n.module)) for n in _walk(model)]


# --- Rules over Equinox paths. ------------------------------------------------------------------


def _glob_pattern(key: str) -> re.Pattern[str]:
    """An Equinox path glob as a regular expression: ``*`` is any text, ``?`` one character,
    everything else literal (so ``[2]`` is an index, not a character class). A leading ``.``
    (``jax.tree_util.keystr``'s spelling) is dropped."""
    key = key[1:] if key.startswith(".") else key
    parts = [".*" if c == "*" else "." if c == "?" else re.escape(c) for c in key]
    return re.compile("".join(parts), re.DOTALL)


@functools.lru_cache(maxsize=256)
def _cached_equinox_rules(rules: Rules) -> Rules:
    return _translate(rules)


def _translate(rules: Rules) -> Rules:
    return rules.with_keys(lambda key: _glob_pattern(key) if isinstance(key, str) else key)


def _equinox_rules(rules: Rules) -> Rules:
    """``rules`` with their string keys matched as Equinox path globs (names unchanged)."""
    try:
        return _cached_equinox_rules(rules)
    except TypeError:  # a rule holds an unhashable attribute value
        return _translate(rules)


def _check_rules(rules: Rules, nodes: list[_Node], function: str, stacklevel: int) -> None:
    """Refuses a user's rule that matches no module (:func:`mpjax.rules.check_unmatched`); warns
    (:class:`mpjax.RuleWarning`) of one
    that an earlier rule shadows; refuses delayed fp8 scaling, whose state Equinox cannot carry
    yet."""
    modules = [(n.path, _base_class(n.module)) for n in nodes]
    matching = _equinox_rules(rules)
    check_unmatched(
        matching,
        modules,
        where=f"mpjax.equinox.{function}()",
        what=f"module of the {type(nodes[0].module).__name__}",
        syntax="Equinox paths join attribute names with '.' and write indices in brackets "
        "('layers[2].attn'), not with '/'.",
        listing="mpjax.equinox.module_paths(model) lists them with their classes.",
    )
    for problem in matching.problems(modules, unmatched=False):
        warnings.warn(problem, RuleWarning, stacklevel=stacklevel + 1)
    if rules.scales_fp8_delayed():
        raise ValueError(
            f"mpjax.equinox.{function}(): delayed fp8 scaling keeps a state per matmul, which "
            "mpjax.equinox does not carry yet; use current scaling ('mixed_bfloat16_fp8', or "
            "fp8=current in a policy string)."
        )


# --- The wrapped call. --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a module's ``__call__`` does around the original one (hashable: it is a class
    attribute of the module's stand-in class, so it survives Equinox's flatten/unflatten, as
    in ``lax.scan`` over stacked layers)."""

    policy: Policy
    path: str
    cast_output: bool


def _output_boundary(out: Any, dtype: np.dtype) -> Any:
    """Marks ``out``'s floating arrays as a region's outputs, leaving ``eqx.nn.State`` alone:
    the state a layer returns keeps its dtypes."""
    return jax.tree.map(
        lambda x: x if _is_state(x) else regions.output_boundary(x, dtype), out, is_leaf=_is_state
    )


def _region_call(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        plan: _Plan = type(self)._mpjax_plan
        with regions.region(plan.policy, plan.path):
            out = original(self, *args, **kwargs)
        return _output_boundary(out, plan.policy.output_dtype) if plan.cast_output else out

    return __call__


@functools.cache
def _region_class(base: type, plan: _Plan) -> type:
    """A same-named subclass of ``base`` whose ``__call__`` runs the original in ``plan``'s
    region; it exists only inside the engine's trace of a call."""
    namespace = {
        "_mpjax_base": base,
        "_mpjax_plan": plan,
        "__call__": _region_call(base.__call__),
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
    }
    return type(base)(base.__name__, (base,), namespace)


def _in_regions(model: eqx.Module, rules: Rules, root_policy: Policy | None) -> eqx.Module:
    """A copy of ``model`` in which every module with a ``__call__`` opens its region; the
    caller runs under ``root_policy`` (None: a caller that opens no region, so the root's
    outputs are cast to its output dtype)."""
    matching = _equinox_rules(rules)
    # The policy of each region opened, by path; the caller opens the root's.
    opened: dict[str | None, Policy | None] = {None: root_policy}
    plans: dict[str, _Plan] = {}
    parents: dict[str | None, str | None] = {}
    for node in _walk(model):  # pre-order: a module's callers come first
        parents[node.path] = node.parent
        caller = node.parent
        while caller not in opened:
            caller = parents[caller]
        if "__call__" in dir(_base_class(node.module)):
            policy = matching.resolve(node.path, _base_class(node.module)).policy
            opened[node.path] = policy
            plans[node.path] = _Plan(policy, node.path, opened[caller] != policy)

    def on_module(path, module, fields):
        plan = plans.get(path)
        cls = None if plan is None else _region_class(_base_class(module), plan)
        return _replace(module, fields, cls)

    return _rebuild(model, "", on_module, lambda path, owner, leaf: leaf)


def _stored(model: eqx.Module, rules: Rules) -> eqx.Module:
    """``model`` with each module's floating arrays in its policy's param dtype and the rule's
    attributes set on the modules that have them."""
    matching = _equinox_rules(rules)

    def on_leaf(path, owner, leaf):
        if not _is_param(owner, leaf):
            return leaf
        dtype = matching.resolve(path, _base_class(owner)).policy.param_dtype
        return cast_floating(leaf, dtype)

    def on_module(path, module, fields):
        names = {f.name for f in dataclasses.fields(module)}
        for name, value in matching.resolve(path, _base_class(module)).attributes:
            if name in names:
                fields[name] = value
        return _replace(module, fields)

    return _rebuild(model, "", on_module, on_leaf)


def _check_model(model: Any, function: str) -> eqx.Module:
    """The Equinox model ``model`` is or wraps; a TypeError naming what it is otherwise."""
    if isinstance(model, MixedPrecision):
        return model.model
    if isinstance(model, eqx.Module):
        return model
    if isinstance(model, type) and issubclass(model, eqx.Module):
        raise TypeError(
            f"mpjax.equinox.{function}() takes an eqx.Module instance as `model`, got the "
            f"class {model.__name__}. Build the model first: {function}({model.__name__}(..., "
            "key=jax.random.key(0)), policy)."
        )
    cls = model if isinstance(model, type) else type(model)
    if any(c.__module__.split(".")[0] == "flax" for c in cls.__mro__):
        raise TypeError(
            f"mpjax.equinox.{function}() takes an eqx.Module as `model`, got the Flax module "
            f"{cls.__name__}. Use mpjax.linen.apply_policy() for linen modules and "
            "mpjax.nnx.set_policy() for NNX modules."
        )
    text = repr(model)
    got = text if len(text) <= 80 and "\n" not in text else f"a {type(model).__name__}"
    raise TypeError(
        f"mpjax.equinox.{function}() takes an eqx.Module instance as `model`, got {got} of "
        f"type {type(model).__name__}."
    )


class MixedPrecision(eqx.Module):
    """An Equinox model run under a policy or rules: see the module docstring.

    ``MixedPrecision(model, policy_or_rules)`` is :func:`apply_policy`. Call it as you call
    ``model``; call another method, or any function of the model, with :meth:`call`. The
    wrapped model is the field ``model`` (``wrapped.model``, for ``eqx.tree_at`` and friends).

    Args:
      model: an ``eqx.Module`` instance (a :class:`MixedPrecision` is re-wrapped: its
        ``model`` gets the new rules).
      policy_or_rules: a :class:`mpjax.Rules`, anything :func:`mpjax.get_policy` accepts (the
        default policy, with the built-in rules), or a mapping or list of rules, as for
        :func:`mpjax.linen.apply_policy`.

    Raises:
      TypeError: ``model`` is not an ``eqx.Module`` instance, or ``policy_or_rules`` is none of
        the forms above.
      ValueError: the policy cannot be parsed (fp8 params included: a storage dtype is at
        least 16 bits), a user's rule matches no module of ``model``, or a policy asks for
        delayed fp8 scaling.

    Warns:
      RuleWarning: for a rule that an earlier rule shadows wherever it matches.
    """

    model: eqx.Module
    rules: Rules = eqx.field(static=True)

    def __init__(self, model: eqx.Module, policy_or_rules: RulesLike, *, _stacklevel: int = 2):
        model = _check_model(model, "MixedPrecision")
        rules = as_rules(policy_or_rules)
        _check_rules(rules, _walk(model), "apply_policy", _stacklevel + 1)
        self.model = _stored(model, rules)
        self.rules = rules

    @property
    def policy(self) -> Policy:
        """The default policy, the root's unless a rule matches the root."""
        return _root_policy(self.model, self.rules)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)`` under the policy and rules."""
        return self.call(_call_model, *args, **kwargs)

    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(model, *args, **kwargs)`` under the policy and rules: for a method other than
        ``__call__`` (``wrapped.call(Model.encode, x)``) or any function of the model. The
        root's own code runs in the root's region.

        Raises:
          TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(
                "MixedPrecision.call(fn, ...): fn must be a function of the model, such as "
                f"Model.encode or lambda model, x: model.encode(x); got {fn!r}."
            )
        rules = model_rules(type(self.model).__name__, self.rules)
        policy = _root_policy(self.model, rules)
        if tracing():  # inside another engine trace: just open the regions
            return _call_in_regions(fn, self.model, rules, policy, args, kwargs)
        return run_in_regions(_call_in_regions, policy, fn, self.model, rules, policy, args, kwargs)


def _root_policy(model: eqx.Module, rules: Rules) -> Policy:
    return _equinox_rules(rules).resolve("", _base_class(model)).policy


def _call_model(model, *args, **kwargs):
    return model(*args, **kwargs)


def _call_in_regions(fn, model, rules, policy, args, kwargs):
    with regions.region(policy, ""):
        out = fn(_in_regions(model, rules, policy), *args, **kwargs)
    return _output_boundary(out, policy.output_dtype)


def apply_policy(model: eqx.Module, policy_or_rules: RulesLike) -> MixedPrecision:
    """Returns ``model`` run under a policy or rules, as a new :class:`MixedPrecision` module.

    The model is not changed (Equinox modules are immutable); its floating arrays are copied
    into the param dtypes where those differ. Everything the model's code computes runs through
    the casting engine: a module's own ``dtype`` attributes are not consulted (an
    ``eqx.nn.Linear(..., dtype=jnp.float32)`` in a bf16 model computes in bf16). To keep a
    module in f32, say so with a rule for its path or class (``{"head": "float32"}``), or
    :func:`mpjax.full_precision` around the code.

    Args:
      model: an ``eqx.Module`` instance.
      policy_or_rules: a :class:`mpjax.Rules`, a policy, or a mapping or list of rules; string
        keys are Equinox path globs (``"layers[*].attn"``).

    Returns:
      The :class:`MixedPrecision` module.

    Raises:
      TypeError, ValueError: as :class:`MixedPrecision`.

    Warns:
      RuleWarning: for a rule that an earlier rule shadows wherever it matches.

    >>> import jax, jax.numpy as jnp, equinox as eqx, mpjax
    >>> mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=jax.random.key(0))
    >>> model = apply_policy(mlp, mpjax.Rules({"layers[1]": "float32"}, default="mixed_bfloat16"))
    >>> [(m.region, m.lhs_dtype.name) for m in mpjax.inspect_matmuls(model)(jnp.ones(4))]
    [('layers[0]', 'bfloat16'), ('layers[1]', 'float32')]
    """
    return MixedPrecision(model, policy_or_rules, _stacklevel=3)


# --- Training. ----------------------------------------------------------------------------------


def _eqx_value_and_grad(fun: Callable[..., Any], argnums: Any, has_aux: bool):
    del argnums  # Equinox differentiates the first argument, filtered
    return eqx.filter_value_and_grad(fun, has_aux=has_aux)


def filter_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``eqx.filter_value_and_grad`` of the loss times the loss scale: the gradients an optax
    optimizer wrapped by :func:`mpjax.loss_scaling` expects, so the scale cannot be forgotten.

    The returned function takes the optimizer state first, then ``fun``'s arguments exactly
    (the model first: its floating arrays are differentiated, as ``eqx.filter_value_and_grad``
    does), and returns the loss unscaled with the gradients of the scaled loss. Hand those to
    ``tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))`` unchanged: it
    unscales them, skips the step if any is inf or NaN, then updates. Without loss scaling in
    the optimizer state it is ``eqx.filter_value_and_grad``. It works under ``eqx.filter_jit``.

    Args:
      fun: the loss function, ``fun(model, *args, **kwargs)``; it returns a floating-point
        scalar of at least 16 bits, or ``(loss, aux)`` with ``has_aux``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function ``(opt_state, model, *args, **kwargs) -> (loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux``.

    Raises:
      TypeError, ValueError: as :func:`mpjax.scaled_value_and_grad`.

    >>> import jax, jax.numpy as jnp, equinox as eqx, optax, mpjax
    >>> model = apply_policy(eqx.nn.Linear(2, 1, key=jax.random.key(0)), "mixed_float16")
    >>> tx = mpjax.loss_scaling(optax.sgd(0.1), "static:1024")
    >>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    >>> loss_fn = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
    >>> loss, grads = filter_value_and_grad(loss_fn)(opt_state, model, jnp.ones((4, 2)))
    >>> params = eqx.filter(model, eqx.is_inexact_array)
    >>> updates, opt_state = tx.update(grads, opt_state, params)  # unscales, checks, updates
    >>> model = eqx.apply_updates(model, updates)
    >>> bool(mpjax.loss_scaling_info(opt_state).applied)
    True
    """
    return make_scaled_value_and_grad(
        fun, 0, has_aux, _eqx_value_and_grad, "mpjax.equinox.filter_value_and_grad"
    )


# --- Reports. -----------------------------------------------------------------------------------


def _report_of(model: Any, *, rules: Rules | PolicyLike | None) -> Callable[..., PrecisionReport]:
    """:func:`mpjax.describe` of an Equinox model: one row per module (pre-order, Equinox
    paths), its policy, the rule that decided it, the floating arrays it holds directly and,
    given example inputs, the dtypes its operations and matmuls ran in, forward and backward.

    A :class:`MixedPrecision` is reported under its rules (or under ``rules``, if given, as if
    re-wrapped); an unwrapped model needs ``rules``.
    """
    inner = _check_model(model, "describe")
    if rules is None and not isinstance(model, MixedPrecision):
        raise ValueError(
            f"describe(): the {type(model).__name__} passed has no policy applied. Either wrap "
            "it first (mpjax.describe(mpjax.equinox.apply_policy(model, policy))) or pass the "
            "rules to report: mpjax.describe(model, rules=...)."
        )
    chosen = model.rules if rules is None else as_rules(rules, "rules")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)  # the report lists them itself
        wrapped = MixedPrecision(inner, chosen)

    def report(*args, **kwargs) -> PrecisionReport:
        traced = bool(args or kwargs)
        ran = dtypes_by_region(_call_model, wrapped, *args, **kwargs) if traced else {}
        matching = _equinox_rules(chosen)
        rows = []
        for node in _walk(wrapped.model):
            resolution = matching.resolve(node.path, _base_class(node.module))
            region = ran.get(node.path, RegionDtypes())
            rows.append(
                ModuleRow(
                    path=node.path,
                    type_name=_base_class(node.module).__name__,
                    policy=resolution.policy,
                    rule=resolution.rule_name,
                    param_count=sum(int(np.size(x)) for x in node.params),
                    param_bytes=sum(int(np.size(x)) * x.dtype.itemsize for x in node.params),
                    matmuls=region.matmuls,
                    computes=region.computes,
                )
            )
        problems = matching.problems(module_paths(wrapped.model))
        return PrecisionReport(tuple(rows), tuple(problems), matmuls_traced=traced)

    return report


def _runner_of(model: Any) -> Runner:
    """The :class:`mpjax.inspection.describe.Runner` of an Equinox model, for :func:`mpjax.diagnose`:
    ``under(rules)`` takes the model's floating arrays first (the rest of the model is held
    static) and calls the model wrapped by ``rules``."""
    inner = _check_model(model, "diagnose")
    params, static = eqx.partition(inner, eqx.is_inexact_array)

    def under(rules: Rules) -> Callable[..., Any]:
        def call(params, *args, **kwargs):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuleWarning)  # apply_policy already warned
                wrapped = MixedPrecision(eqx.combine(params, static), rules)
            return wrapped(*args, **kwargs)

        return call

    def arguments(inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (params, *inputs), kwargs

    rules = model.rules if isinstance(model, MixedPrecision) else None
    return Runner(rules, under, arguments)


def _argument_under(model: eqx.Module, rules: Rules) -> eqx.Module:
    """An Equinox model that a function diagnosed under ``rules`` takes as an argument, as it
    runs under them: a :class:`MixedPrecision` as it is (it runs under the rules the doctor
    asks for), any other with its arrays stored and its modules in their regions, of the same
    classes (so that the function may call its methods and read its fields)."""
    if isinstance(model, MixedPrecision):
        return model
    return _in_regions(_stored(model, rules), rules, None)


register_describer(
    eqx.Module, _report_of, kind="an equinox module", options=("rules",), runner=_runner_of
)
register_argument_model(_is_module, _argument_under)
