"""Flax NNX integration: run an existing, unmodified ``nnx.Module`` under a policy or rules.

:func:`set_policy` configures the model **in place** (and returns None); nothing is copied
and no wrapper module is added, so ``nnx.state``, ``nnx.split``, checkpoints and
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` see exactly the paths and Variables they saw before.
It resolves a policy for every module (``rules.resolve(path, module)``, paths are the
``/``-joined attribute names of the graph, e.g. ``"blocks/0/attn"``, the root is ``""``) and:

- casts every module's stored ``nnx.Param`` values to the resolved param dtype (a no-op for
  the default f32; bf16 storage is possible);
- sets the matched rule's attributes on the modules that have them;
- gives every module a class of its own: a same-named subclass of its class whose ``__call__``
  runs the original one inside the module's precision region (:mod:`mpjax.casting.regions`) and casts
  its outputs to the output dtype where a policy region ends (at the root, and at a module
  whose policy differs from its parent's).

Called from outside, a wrapped module's ``__call__`` runs through mpjax's casting engine
(:mod:`mpjax.autocast`): the module, and the NNX objects among its arguments, are split into
their state, the call is traced and evaluated operation by operation under the region of each
module it calls, and the updated state (RNG counters, batch statistics, sown values) is written
back. Every matmul runs in the compute dtype of the region it is in, forward and backward,
whatever the module's attributes say and whoever owns the Params it reads; norms' statistics,
softmax and losses run in f32. The stored Params are only read: ``nnx.Optimizer`` always
updates the f32 values, and gradients come back in the param dtype because the casts are part
of the differentiated computation.

Under a policy that runs fp8 matmuls with delayed scaling, :func:`init_fp8_state` gives the
model the state of each such matmul, an :class:`Fp8State` Variable whose gradient is the next
state (:mod:`mpjax.fp8`).

Why not a wrapper module: it would prefix every state path (checkpoints of the wrapped and
unwrapped model would differ) and would only intercept the root call. Why not a cast-on-read
``Param`` subclass: ``nnx.Optimizer`` writes the low-precision value it reads back into the
master copy.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

try:
    import flax.linen as nn
    from flax import nnx
except ImportError as error:
    raise ImportError(
        'mpjax.nnx needs Flax, which is not installed. Install it with: pip install "mpjax[flax]"'
    ) from error

from mpjax import jax_compat
from mpjax.casting import regions
from mpjax.casting.engine import (
    fp8_state_in_regions,
    run_in_regions,
    run_in_regions_with_fp8_state,
)
from mpjax.casting.trace_context import model_rules, tracing
from mpjax.inspection.describe import Runner, register_argument_model, register_describer
from mpjax.inspection.report import ModuleRow, PrecisionReport, RegionDtypes, dtypes_by_region
from mpjax.optim.loss_scaling_readers import check_argnums, make_scaled_value_and_grad
from mpjax.policy import Policy, PolicyLike, is_floating
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

__all__ = [
    "FP8_ATTRIBUTE",
    "Fp8State",
    "init_fp8_state",
    "scaled_value_and_grad",
    "set_policy",
]

register_norm_rules("nnx", nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm)
register_embedding_rules("nnx", nnx.Embed)

# Containers hold modules and Params for the module that uses them; they own nothing themselves.
_CONTAINERS = (nnx.List, nnx.Dict)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a module's ``__call__`` does around the original one (hashable: it lives on the
    module's class, so it travels through ``nnx.split``/``nnx.merge`` and ``nnx.jit``)."""

    policy: Policy
    path: str
    cast_output: bool
    # On the root only: what describe() reports. Left out of the hash so that rules holding
    # unhashable attribute values still work; equality still tells rule sets apart.
    rules: Rules | None = dataclasses.field(default=None, hash=False)


@dataclasses.dataclass
class _Node:
    """One module of the graph, found by :func:`_walk`."""

    path: str
    module: nnx.Module
    parent: str | None  # path of the enclosing module (containers skipped); None at the root
    params: list[tuple[str, nnx.Variable]] = dataclasses.field(default_factory=list)


# The linen function that does what each function of this module does.
_LINEN_NAMES = {"set_policy": "apply_policy"}


def _check_model(model: Any, function: str) -> None:
    if isinstance(model, nnx.Module):
        return
    if isinstance(model, type) and issubclass(model, nnx.Module):
        raise TypeError(
            f"mpjax.nnx.{function}() takes an nnx.Module instance, got the class "
            f"{model.__name__}. Build the model first: {function}({model.__name__}(..., "
            "rngs=nnx.Rngs(0)), policy)."
        )
    if isinstance(model, nn.Module) or (isinstance(model, type) and issubclass(model, nn.Module)):
        raise TypeError(
            f"mpjax.nnx.{function}() takes an nnx.Module, got the linen module "
            f"{getattr(model, '__name__', type(model).__name__)}. Use "
            f"mpjax.linen.{_LINEN_NAMES.get(function, function)}() for linen modules."
        )
    raise TypeError(
        f"mpjax.nnx.{function}() takes an nnx.Module instance as `model`, got {model!r} of "
        f"type {type(model).__name__}."
    )


def _base_class(module: nnx.Module) -> type:
    return getattr(type(module), "_mpjax_base", type(module))


def _walk(model: nnx.Module) -> list[_Node]:
    """Modules of ``model`` in pre-order (shared ones once, at their first path), each with
    the Params it owns directly."""
    entries = list(nnx.iter_graph(model))  # post-order; siblings in the order they are visited
    order = {path: i for i, (path, _) in enumerate(entries)}
    modules = {path: node for path, node in entries if isinstance(node, nnx.Module)}

    def owner(path: tuple) -> tuple | None:
        for end in range(len(path) - 1, -1, -1):
            node = modules.get(path[:end])
            if node is not None and not isinstance(node, _CONTAINERS):
                return path[:end]
        return None

    # Pre-order: an ancestor before its descendants, siblings in visiting order.
    ranked = sorted(modules, key=lambda p: tuple(order[p[:i]] for i in range(1, len(p) + 1)))
    text = {p: "/".join(str(k) for k in p) for p in ranked}
    nodes = {}
    for path in ranked:
        parent = owner(path)
        nodes[path] = _Node(text[path], modules[path], None if parent is None else text[parent])
    for path, node in entries:
        if isinstance(node, nnx.Param) and (where := owner(path)) is not None:
            nodes[where].params.append((str(path[len(where)]), node))
    return list(nodes.values())


def _store(variable: nnx.Variable, dtype: np.dtype) -> None:
    value = variable.get_value()
    if is_floating(value) and value.dtype != dtype:
        value = value.astype(dtype)
        variable.set_raw_value(jax_compat.ref_like(variable.get_raw_value(), value))


def _configure(node: _Node, resolution: Resolution) -> None:
    """Sets the rule's attributes the module has, and the storage dtype of its Params."""
    for name, value in resolution.attributes:
        if name in vars(node.module):
            setattr(node.module, name, value)
    for _, variable in node.params:
        _store(variable, resolution.policy.param_dtype)


def _is_nnx_object(x: Any) -> bool:
    return isinstance(x, (nnx.Pytree, nnx.Variable))


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where an NNX object passed as an argument goes back in (it travels as state)."""

    index: int


class Fp8State(nnx.Variable):
    """The delayed-scaling fp8 state of a model: a dict of :class:`mpjax.fp8.Fp8Meta` by
    matmul, made by :func:`init_fp8_state` as the model's ``mpjax_fp8`` attribute.

    The gradient with respect to it is the next state: differentiate with respect to
    ``nnx.Any(nnx.Param, Fp8State)`` and ``nnx.update`` the model with the ``Fp8State`` part
    of the gradients (not through the optimizer).
    """


FP8_ATTRIBUTE = "mpjax_fp8"


def init_fp8_state(model: nnx.Module, *args, **kwargs) -> None:
    """Gives ``model`` the delayed-scaling state of its fp8 matmuls, **in place**: an
    :class:`Fp8State` attribute ``mpjax_fp8``, one :class:`mpjax.fp8.Fp8Meta` per matmul
    that ``model(*args, **kwargs)`` runs in fp8 under a delayed-scaling policy.

    The example arguments are only traced (nothing is computed). Call it after
    :func:`set_policy` and before training; afterwards ``model(...)`` uses the state, and
    a train step carries it::

        diff = nnx.DiffState(0, nnx.Any(nnx.Param, mpjax.nnx.Fp8State))
        grads = nnx.grad(loss, argnums=diff)(model, batch)
        param_grads, fp8 = nnx.split_state(grads, nnx.Param, mpjax.nnx.Fp8State)
        optimizer.update(model, param_grads)
        nnx.update(model, fp8)  # the gradient of the state is the next state

    Raises:
      TypeError: if ``model`` is not an ``nnx.Module`` instance.
      ValueError: if no policy was set on ``model``, or its policy and rules run no matmul in
        fp8 with delayed scaling (there would be no state to carry).
    """
    _check_model(model, "init_fp8_state")
    plan = getattr(type(model), "_mpjax_plan", None)
    if plan is None:
        raise ValueError(
            "init_fp8_state(model, ...) needs a policy set on the model first: "
            "mpjax.nnx.set_policy(model, policy_or_rules)."
        )
    if plan.rules is not None and not plan.rules.scales_fp8_delayed():
        raise ValueError(
            f"init_fp8_state(model, ...): the model's policy ({plan.rules.default}) and rules "
            "run no matmul in fp8 with delayed scaling, so there is no state to create. Set "
            "a delayed recipe first, e.g. set_policy(model, "
            "'p=f32,c=bf16,o=f32,fp8=delayed;history=16')."
        )
    run, state, leaves, _ = _split_call(model, args, kwargs)
    fp8 = fp8_state_in_regions(run, plan.policy, state, leaves)
    setattr(model, FP8_ATTRIBUTE, Fp8State(fp8))


def _split_call(module: nnx.Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` as a function of state, as ``nnx.jit`` calls a function:
    the module and the NNX objects among the arguments (``rngs``, other modules) are split
    into state and merged inside the trace. Returns the function, the state, the other
    argument leaves and the split nodes."""
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=_is_nnx_object)
    objects = [leaf for leaf in leaves if _is_nnx_object(leaf)]
    slots = iter(range(1, len(objects) + 1))
    leaves = [_Slot(next(slots)) if _is_nnx_object(leaf) else leaf for leaf in leaves]
    nodes = (module, *objects)
    graphdef, state = nnx.split(nodes)

    def run(state, leaves):
        merged = nnx.merge(graphdef, state)
        leaves = [merged[x.index] if isinstance(x, _Slot) else x for x in leaves]
        call_args, call_kwargs = jax.tree.unflatten(tree, leaves)
        return merged[0](*call_args, **call_kwargs), nnx.state(merged)

    return run, state, leaves, nodes


def _through_engine(module: nnx.Module, policy: Policy, args: tuple, kwargs: dict) -> Any:
    """Calls ``module(*args, **kwargs)`` through the casting engine and writes back the state
    the call updated; the delayed fp8 state, if the module has one, goes to the engine."""
    run, state, leaves, nodes = _split_call(module, args, kwargs)
    fp8 = getattr(module, FP8_ATTRIBUTE, None)
    if isinstance(fp8, Fp8State):
        out, new_state = run_in_regions_with_fp8_state(run, policy, _raw(fp8), state, leaves)
    else:
        out, new_state = run_in_regions(run, policy, state, leaves)
    # Write back only what the call changed: a Variable returned untouched comes back as the
    # very array that went in, and writing it anyway would fail under a trace the model was
    # not created in (a closed-over model under jax.jit), where the call itself mutated nothing.
    before = {path: _raw(v) for path, v in nnx.to_flat_state(state)}
    changed = [
        (path, v)
        for path, v in nnx.to_flat_state(new_state)
        if path not in before or _raw(v) is not before[path]
    ]
    if changed:
        nnx.update(nodes, nnx.from_flat_state(changed))
    return out


def _raw(variable: Any) -> Any:
    return variable.get_raw_value() if isinstance(variable, nnx.Variable) else variable


def _policy_call(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        plan: _Plan = type(self)._mpjax_plan
        if not tracing():
            return _through_engine(self, plan.policy, args, kwargs)
        own = plan.rules  # set on the root only
        asked = own if own is None else model_rules(type(self).__name__, own)
        if own is not None and asked is not None and asked != own:
            raise ValueError(
                f"The {type(self).__name__} runs under its own rules ({own.default}), "
                f"not the {asked.default} asked for: diagnose(policy=...) runs an NNX model "
                "under other rules when it is the target or an argument of the function, not "
                "when the function closes over it. Pass the model as an argument, or leave out "
                "policy= to diagnose its own."
            )
        with regions.region(plan.policy, plan.path):
            out = original(self, *args, **kwargs)
        return regions.output_boundary(out, plan.policy.output_dtype) if plan.cast_output else out

    return __call__


@functools.cache
def _policy_class(base: type[nnx.Module], plan: _Plan) -> type:
    """A subclass of ``base`` with the same name that runs ``__call__`` under ``plan``."""
    namespace = {
        "_mpjax_base": base,
        "_mpjax_plan": plan,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
    }
    if "__call__" in dir(base):  # dir() of a class leaves out its metaclass's __call__
        namespace["__call__"] = _policy_call(base.__call__)
    return types.new_class(
        base.__name__, (base,), {"pytree": base._pytree__is_pytree}, lambda ns: ns.update(namespace)
    )


def _set_plan(module: nnx.Module, plan: _Plan | None) -> None:
    base = _base_class(module)
    cls = base if plan is None else _policy_class(base, plan)
    if type(module) is not cls:
        object.__setattr__(module, "__class__", cls)


def _resolve(nodes: list[_Node], rules: Rules) -> dict[str, Resolution]:
    return {n.path: rules.resolve(n.path, _base_class(n.module)) for n in nodes}


def _check_rules(model: nnx.Module, nodes: list[_Node], rules: Rules) -> list[tuple[str, type]]:
    """Refuses a user's rule that matches no module of ``model`` (:func:`check_unmatched`);
    returns the ``(path, class)`` of each module, which the rules were checked against."""
    modules = [(n.path, _base_class(n.module)) for n in nodes]
    check_unmatched(
        rules,
        modules,
        where="mpjax.nnx.set_policy()",
        what=f"module of the {type(model).__name__}",
        syntax="NNX paths join attribute names with '/' and write list indices as names "
        "('layers/2/attn').",
        listing="mpjax.describe(model)() lists every module path.",
    )
    return modules


def set_policy(model: nnx.Module, policy_or_rules: RulesLike) -> None:
    """Runs an existing NNX model under a policy or rules, configuring it **in place**.

    Like ``list.sort`` and ``nnx.update``, it mutates ``model`` and returns None: the model
    object you hold is the one that now runs under the policy. (:func:`mpjax.linen.apply_policy`
    returns a new module instead, since linen modules are immutable.)

    See the module docstring for what changes. The model keeps its Variables, state paths and
    checkpoint layout; its modules' classes become same-named subclasses that carry the
    policy, so it survives ``nnx.split``/``nnx.merge``, ``nnx.jit``, ``nnx.grad`` and
    ``nnx.Optimizer``. Setting a policy again replaces the previous one (storage casts stay).

    What a policy overrides: every module runs under the policy of its region, whatever its
    own ``dtype`` and ``param_dtype`` attributes say (they are never consulted:
    ``nnx.Linear(..., dtype=jnp.float32)`` in a bf16 model computes in bf16), and so does any
    code a module calls, a user's ``attention_fn`` included. To keep a module in f32, say so:
    a rule for its path or class (``{"head": "float32"}``), or :func:`mpjax.full_precision`
    around the code.

    The engine starts where a module's ``__call__`` is called from outside: a root method
    other than ``__call__`` (``model.generate(...)``) runs each submodule it calls through the
    engine under the submodule's policy, but its own operations as written; wrap such a
    method with :func:`mpjax.autocast` if it computes matmuls itself. Anything a module calls,
    another module's methods and Params included (a tied head reading the embedding table),
    runs in the calling module's region.

    Args:
      model: an ``nnx.Module`` instance.
      policy_or_rules: a :class:`mpjax.Rules`; anything :func:`mpjax.get_policy` accepts (the
        default policy, with the built-in rules); or a mapping or list of rules
        (``Rules(policy_or_rules)``): the same forms :func:`mpjax.linen.apply_policy` takes.

    Returns:
      None.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module`` instance, or ``policy_or_rules`` is none
        of the forms above.
      ValueError: the policy cannot be parsed, or a user's rule matches no module of ``model`` (the error names the closest
        paths; ``Rules(..., allow_unmatched=True)`` accepts it).

    Warns:
      RuleWarning: for a rule that an earlier rule shadows wherever it matches.

    >>> import jax.numpy as jnp, mpjax
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    >>> set_policy(model, "mixed_bfloat16")
    >>> model.kernel[...].dtype, model(jnp.ones((1, 4))).dtype
    (dtype('float32'), dtype('float32'))
    >>> mpjax.inspect_matmuls(model)(jnp.ones((1, 4))).operand_dtypes()
    Counter({('bfloat16', 'bfloat16'): 1})
    """
    _check_model(model, "set_policy")
    rules = as_rules(policy_or_rules)
    nodes = _walk(model)
    resolved = _resolve(nodes, rules)
    modules = _check_rules(model, nodes, rules)
    for problem in rules.problems(modules, unmatched=False):
        warnings.warn(problem, RuleWarning, stacklevel=2)
    for node in nodes:
        resolution = resolved[node.path]
        _configure(node, resolution)
        policy = resolution.policy
        root = node.parent is None
        boundary = node.parent is None or resolved[node.parent].policy != policy
        _set_plan(node.module, _Plan(policy, node.path, boundary, rules if root else None))


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | nnx.DiffState | tuple[int | nnx.DiffState, ...] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """:func:`mpjax.scaled_value_and_grad` for NNX modules: ``nnx.value_and_grad`` of the loss
    times the loss scale, the gradients an ``nnx.Optimizer`` over :func:`mpjax.loss_scaling`
    expects.

    The returned function takes the optimizer's state first (``optimizer.opt_state``, or the
    ``nnx.Optimizer`` itself), then ``fun``'s arguments exactly, and returns the loss
    unscaled with the gradients of the scaled loss (``nnx.Param`` state, as
    ``nnx.value_and_grad`` gives them). Hand those to ``optimizer.update(model, grads)``
    unchanged. Like ``nnx.value_and_grad``, it writes the modules' updated state (batch
    statistics, RNG counters) back; it works under ``nnx.jit``.

    Args:
      fun: the loss function; it returns a floating-point scalar of at least 16 bits, or
        ``(loss, aux)`` with ``has_aux``.
      argnums: what to differentiate, as for ``nnx.value_and_grad`` (counted in ``fun``'s
        arguments, after the optimizer state): an int, an ``nnx.DiffState``, or a tuple.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function ``(opt_state, *args, **kwargs) -> (loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux``.

    Raises:
      TypeError, ValueError: as :func:`mpjax.scaled_value_and_grad`.

    >>> import jax.numpy as jnp, optax, mpjax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = mpjax.loss_scaling(optax.sgd(0.1), "static:1024")
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
    >>> loss, grads = scaled_value_and_grad(loss_fn)(optimizer.opt_state, model, jnp.ones((4, 2)))
    >>> _ = optimizer.update(model, grads)  # unscales, checks, then updates
    >>> bool(mpjax.loss_scaling_info(optimizer.opt_state).applied)
    True
    """
    where = "mpjax.nnx.scaled_value_and_grad"
    check_argnums(argnums, where, also=(nnx.DiffState,), what=" or nnx.DiffState")
    return make_scaled_value_and_grad(fun, argnums, has_aux, nnx.value_and_grad, where)


def _applied_rules(model: nnx.Module) -> Rules:
    plan = getattr(type(model), "_mpjax_plan", None)
    if plan is None or plan.rules is None:
        raise ValueError(
            f"The {type(model).__name__} passed as `model` has no policy applied. Either call "
            "mpjax.nnx.set_policy(model, policy) first, or pass the rules to report: "
            "mpjax.describe(model, rules=...)."
        )
    return plan.rules


def _report_of(
    model: nnx.Module, *, rules: Rules | PolicyLike | None
) -> Callable[..., PrecisionReport]:
    """:func:`mpjax.describe` of an NNX model: each module's path, type, policy, rule, params
    and, given example inputs, the dtypes its operations and matmuls ran in.

    One row per module in pre-order (the root first, children in attribute-name order,
    shared modules once), with the Params it owns directly (those in ``nnx.List`` /
    ``nnx.Dict`` containers count for the module holding the container), plus the problems
    :meth:`mpjax.Rules.problems` finds. Called with example inputs, ``model(*args, **kwargs)``
    and its gradient are traced (nothing is computed) and each row lists the floating dtypes
    the operations of the module's region computed in and the operand dtypes of its matmuls and
    convolutions, forward and backward; called without, the model is not traced and the report
    has neither column.

    Args:
      model: an ``nnx.Module`` instance.
      rules: the policy or rules to report; by default the ones :func:`set_policy` applied
        to ``model``. Passing them reports what they would do without changing the model.

    Returns:
      A function of ``model``'s call arguments (arrays or ``jax.ShapeDtypeStruct``) that
      returns a :class:`mpjax.PrecisionReport`.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module`` instance.
      ValueError: ``rules`` is None and no policy was applied to ``model``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> report = _report_of(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), rules="mixed_bfloat16")(
    ...     jnp.ones((1, 4)))
    >>> row = report.rows[0]
    >>> print(row.type_name, row.policy, report.total_params, row.matmuls)
    Linear p=f32,c=bf16,o=f32 10 (('bf16,bf16', 3),)
    """
    if isinstance(model, type):
        raise TypeError(
            f"describe() takes an nnx.Module instance, got the class {model.__name__}. Build "
            f"the model first: mpjax.describe({model.__name__}(..., rngs=nnx.Rngs(0)))(x)."
        )
    _check_model(model, "describe")
    if rules is None:
        rules = _applied_rules(model)
    else:
        rules = as_rules(rules)
        _check_rules(model, _walk(model), rules)  # at the call, inputs or none

    def report(*args, **kwargs) -> PrecisionReport:
        traced = bool(args or kwargs)
        nodes = _walk(model)
        resolved = _resolve(nodes, rules)
        ran = _dtypes_by_region(model, rules, args, kwargs) if traced else {}
        rows = []
        for node in nodes:
            values = [v.get_value() for _, v in node.params]
            region = ran.get(node.path, RegionDtypes())
            rows.append(
                ModuleRow(
                    path=node.path,
                    type_name=_base_class(node.module).__name__,
                    policy=resolved[node.path].policy,
                    rule=resolved[node.path].rule_name,
                    param_count=sum(int(np.size(x)) for x in values),
                    param_bytes=sum(int(np.size(x)) * np.dtype(x.dtype).itemsize for x in values),
                    matmuls=region.matmuls,
                    computes=region.computes,
                )
            )
        problems = rules.problems((n.path, _base_class(n.module)) for n in nodes)
        return PrecisionReport(tuple(rows), tuple(problems), matmuls_traced=traced)

    return report


def _dtypes_by_region(
    model: nnx.Module, rules: Rules, args: tuple, kwargs: dict
) -> dict[str, RegionDtypes]:
    """:func:`mpjax.inspection.report.dtypes_by_region` of a copy of ``model`` under ``rules``."""
    copy = nnx.clone(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)  # describe() reports them itself
        set_policy(copy, rules)
    graphdef, state = nnx.split(copy)
    return dtypes_by_region(
        lambda state, *a, **k: nnx.merge(graphdef, state)(*a, **k), state, *args, **kwargs
    )


def _runner_of(model: nnx.Module) -> Runner:
    """The :class:`mpjax.inspection.describe.Runner` of an NNX model: ``under(rules)`` takes the model's
    state and calls a model merged from it with ``rules`` set (``model`` is left as it is)."""
    if isinstance(model, type):
        raise TypeError(
            f"diagnose() takes an nnx.Module instance, got the class {model.__name__}. Build "
            f"the model first: mpjax.diagnose({model.__name__}(..., rngs=nnx.Rngs(0)), "
            "policy=...)(x)."
        )
    _check_model(model, "diagnose")
    plan = getattr(type(model), "_mpjax_plan", None)
    graphdef, _ = nnx.split(model)

    def under(rules: Rules) -> Callable[..., Any]:
        def call(state, *args, **kwargs):
            merged = nnx.merge(graphdef, state)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuleWarning)  # set_policy already warned
                set_policy(merged, rules)
            return merged(*args, **kwargs)

        return call

    def arguments(inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (nnx.state(model), *inputs), kwargs

    return Runner(None if plan is None else plan.rules, under, arguments)


def _argument_under(model: nnx.Module, rules: Rules) -> nnx.Module:
    """A copy of an NNX model that a function diagnosed under ``rules`` takes as an argument,
    with ``rules`` set (``model`` is left as it is)."""
    copy = nnx.merge(*nnx.split(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)  # the doctor's rules, for another model
        set_policy(copy, rules)
    return copy


register_describer(
    nnx.Module, _report_of, kind="a flax.nnx module", options=("rules",), runner=_runner_of
)
register_argument_model(lambda x: isinstance(x, nnx.Module), _argument_under)
