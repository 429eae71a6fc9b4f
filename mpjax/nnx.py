"""Flax NNX integration: run an existing, unmodified ``nnx.Module`` under a policy or rules.

:func:`apply_policy` configures the model **in place** and returns it; nothing is copied and no
wrapper module is added, so ``nnx.state``, ``nnx.split``, checkpoints and
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` see exactly the paths and Variables they saw before.
It resolves a policy for every module (``rules.resolve(path, module)``, paths are the
``/``-joined attribute names of the graph, e.g. ``"blocks/0/attn"``, the root is ``""``) and:

- casts every module's stored ``nnx.Param`` values to the resolved param dtype (a no-op for
  the default f32; bf16 storage is possible);
- sets ``dtype`` (compute) and ``param_dtype`` on modules that have both attributes, which is
  how Flax's own layers (``Linear``, ``LinearGeneral``, ``Conv``, ``Embed``,
  ``MultiHeadAttention``, the norms, ...) cast their params at use, plus the matched rule's
  attributes (the built-in rule gives ``MultiHeadAttention`` an f32-softmax ``attention_fn``);
- gives the modules that need more a class of their own: a subclass of their class, with the
  same name, whose ``__call__`` casts floating inputs to the compute dtype, runs the original
  ``__call__`` and casts outputs to the output dtype where a policy region ends. Custom
  modules (no ``dtype``/``param_dtype`` attributes) that own Params also see those Params cast to
  the compute dtype during the call: the call runs with fresh ``Param`` copies holding the cast
  values in place of the stored ones, which are put back afterwards. The stored master Params
  are never written, so ``nnx.Optimizer`` always updates the f32 values, and gradients come
  back in the param dtype because the cast is part of the differentiated computation.

Outputs are cast to a module's ``output_dtype`` where its policy region ends: at the root and at
any module whose policy differs from its parent's (for example a norm under the built-in rule,
which computes in f32 and hands the compute dtype back). Inside a region activations stay in
the compute dtype, as with layers written by hand with ``dtype=jnp.bfloat16``, so a wrapped
model compiles to no more converts than the hand-written one.

Why not a wrapper module: it would prefix every state path (checkpoints of the wrapped and
unwrapped model would differ) and would only intercept the root call. Why not a cast-on-read
``Param`` subclass: ``nnx.Optimizer`` writes the low-precision value it reads back into the
master copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import warnings
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from mpjax.policy import Policy, PolicyLike, cast_floating
from mpjax.report import ModuleRow, PrecisionReport
from mpjax.rules import Resolution, Rules, RuleWarning, as_rules

__all__ = ["apply_policy", "describe", "f32_softmax_attention"]

# Containers hold modules and Params for the module that uses them; they own nothing themselves.
_CONTAINERS = (nnx.List, nnx.Dict)

# A built-in rule's attribute replaces Flax's default only, never a function the user chose.
_STOCK_DEFAULTS = {"attention_fn": nnx.dot_product_attention}


def f32_softmax_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype: Any = nnx_dtypes.promote_dtype,
    is_causal: bool = False,
) -> jax.Array:
    """Dot-product attention whose softmax runs in f32; a drop-in ``attention_fn`` for NNX.

    Takes the arguments of ``nnx.dot_product_attention``. Both matmuls run in the compute dtype
    (``dtype``, or the inputs' dtype) and return it; the logits are cast to f32 for the mask,
    bias and softmax, and the weights cast back. Unlike ``nnx.dot_product_attention``, it never
    takes the ``jax.nn.dot_product_attention`` fast path: that path asks for f32 logits with
    ``preferred_element_type``, whose transpose runs an f32 x bf16 matmul in the backward pass.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)  # [batch, length, heads, depth]
    >>> f32_softmax_attention(q, q, q).dtype
    dtype(bfloat16)
    """
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    dtype = query.dtype
    q_heads, kv_heads = query.shape[-2], key.shape[-2]
    if q_heads % kv_heads:
        raise ValueError(
            f"Query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})."
        )
    if q_heads != kv_heads:  # Grouped-query attention: each key/value head serves a group.
        key = jnp.repeat(key, q_heads // kv_heads, axis=-2)
        value = jnp.repeat(value, q_heads // kv_heads, axis=-2)
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    logits = logits.astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    masks = [] if mask is None else [mask]
    if is_causal:
        causal = jnp.tril(jnp.ones(logits.shape[-2:], jnp.bool_))
        masks.append(jnp.broadcast_to(causal, logits.shape if mask is None else mask.shape))
    if masks:
        keep = nnx.combine_masks(*masks, dtype=jnp.bool_)
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits).astype(dtype)
    if module is not None:
        module.sow(nnx.Intermediate, "attention_weights", weights)
    if not deterministic and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        shape = weights.shape
        if broadcast_dropout:  # The same dropout mask for every batch element and head.
            shape = (1,) * (weights.ndim - 2) + weights.shape[-2:]
        kept = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (kept.astype(dtype) / jnp.asarray(keep_prob, dtype))
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a module's ``__call__`` does around the original one (hashable: it lives on the
    module's class, so it travels through ``nnx.split``/``nnx.merge`` and ``nnx.jit``)."""

    policy: Policy
    cast_output: bool
    param_attributes: tuple[str, ...]  # attributes holding Params to cast at use
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


def _check_model(model: Any, function: str) -> None:
    if isinstance(model, nnx.Module):
        return
    if isinstance(model, type) and issubclass(model, nnx.Module):
        raise TypeError(
            f"mpjax.nnx.{function}() takes an nnx.Module instance, got the class "
            f"{model.__name__}. Build the model first: {function}({model.__name__}(..., "
            "rngs=nnx.Rngs(0)), policy)."
        )
    import flax.linen as nn  # Deferred: only to give linen users the right pointer.

    if isinstance(model, nn.Module) or (isinstance(model, type) and issubclass(model, nn.Module)):
        raise TypeError(
            f"mpjax.nnx.{function}() takes an nnx.Module, got the linen module "
            f"{getattr(model, '__name__', type(model).__name__)}. Use "
            f"mpjax.linen.{function}() for linen modules."
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


def _is_stock(module: nnx.Module) -> bool:
    """Whether the module casts its own params at use, as Flax's layers do."""
    attributes = vars(module)
    return "dtype" in attributes and "param_dtype" in attributes


def _is_floating(value: Any) -> bool:
    return hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)


def _store(variable: nnx.Variable, dtype: np.dtype) -> None:
    value = variable.get_value()
    if _is_floating(value) and value.dtype != dtype:
        value = value.astype(dtype)
        variable.set_raw_value(jax.new_ref(value) if variable.ref else value)


def _configure(node: _Node, resolution: Resolution) -> None:
    """Sets the stock dtype attributes and the rule's attributes, and the storage dtype."""
    module, policy = node.module, resolution.policy
    if _is_stock(module):
        module.dtype = policy.compute_dtype
        module.param_dtype = policy.param_dtype
    builtin = resolution.rule is not None and resolution.rule.builtin
    for name, value in resolution.attributes:
        if name not in vars(module):
            continue
        default = _STOCK_DEFAULTS.get(name, getattr(module, name))
        if builtin and getattr(module, name) is not default:
            continue
        setattr(module, name, value)
    for _, variable in node.params:
        _store(variable, policy.param_dtype)


def _is_nnx_object(x: Any) -> bool:
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def _cast(tree: Any, dtype: np.dtype) -> Any:
    """Casts floating array leaves; NNX objects passed along (``rngs``, modules) stay whole."""
    return jax.tree.map(lambda x: x if _is_nnx_object(x) else cast_floating(x, dtype), tree,
                        is_leaf=_is_nnx_object)


def _cast_param(variable: Any, dtype: np.dtype) -> Any:
    if not isinstance(variable, nnx.Param):
        return variable
    value = variable.get_value()
    if not _is_floating(value) or value.dtype == dtype:
        return variable
    return variable.copy(value.astype(dtype))


def _owned_leaf(x: Any) -> bool:
    return isinstance(x, nnx.Variable) or (
        isinstance(x, nnx.Module) and not isinstance(x, _CONTAINERS))


@contextlib.contextmanager
def _params_cast(module: nnx.Module, names: tuple[str, ...], dtype: np.dtype) -> Iterator[None]:
    """Swaps the module's Param attributes for cast copies for the duration of a call.

    ``object.__setattr__`` skips NNX's trace-level check on the module: the swap is undone
    before the call returns, so nothing traced outlives it.
    """
    stored = {name: vars(module)[name] for name in names}
    cast = {name: jax.tree.map(functools.partial(_cast_param, dtype=dtype), value,
                               is_leaf=_owned_leaf)
            for name, value in stored.items()}
    for name, value in cast.items():
        object.__setattr__(module, name, value)
    try:
        yield
    finally:
        for name, value in stored.items():
            if vars(module).get(name) is cast[name]:  # Keep what the call itself assigned.
                object.__setattr__(module, name, value)


def _policy_call(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        plan: _Plan = type(self)._mpjax_plan
        args, kwargs = _cast((args, kwargs), plan.policy.compute_dtype)
        with _params_cast(self, plan.param_attributes, plan.policy.compute_dtype):
            out = original(self, *args, **kwargs)
        return _cast(out, plan.policy.output_dtype) if plan.cast_output else out

    return __call__


@functools.lru_cache(maxsize=None)
def _policy_class(base: type, plan: _Plan) -> type:
    """A subclass of ``base`` with the same name that runs ``__call__`` under ``plan``."""
    namespace = {"_mpjax_base": base, "_mpjax_plan": plan, "__module__": base.__module__,
                 "__qualname__": base.__qualname__, "__doc__": base.__doc__}
    if "__call__" in dir(base):  # dir() of a class leaves out its metaclass's __call__
        namespace["__call__"] = _policy_call(base.__call__)
    return types.new_class(base.__name__, (base,), {"pytree": base._pytree__is_pytree},
                           lambda ns: ns.update(namespace))


def _set_plan(module: nnx.Module, plan: _Plan | None) -> None:
    base = _base_class(module)
    cls = base if plan is None else _policy_class(base, plan)
    if type(module) is not cls:
        object.__setattr__(module, "__class__", cls)


def _resolve(nodes: list[_Node], rules: Rules) -> dict[str, Resolution]:
    return {n.path: rules.resolve(n.path, _base_class(n.module)) for n in nodes}


def apply_policy(model: nnx.Module, policy_or_rules: Rules | PolicyLike) -> nnx.Module:
    """Runs an existing NNX model under a policy or rules; configures it in place and returns it.

    See the module docstring for what changes. The model keeps its Variables, state paths and
    checkpoint layout; its modules' classes become same-named subclasses that carry the
    policy, so it survives ``nnx.split``/``nnx.merge``, ``nnx.jit``, ``nnx.grad`` and
    ``nnx.Optimizer``. Applying again replaces the previous policy (storage casts stay).

    The policy applies where a module is *called*: a root method other than ``__call__`` runs
    its layers under their policies but does not cast the root's inputs and outputs, and code
    that reads another module's Param directly (``x @ self.embed.embedding[...]``) sees it in
    the storage dtype (use the owner's method, e.g. ``Embed.attend``).

    Args:
      model: an ``nnx.Module`` instance.
      policy_or_rules: a policy (anything :func:`mpjax.get_policy` accepts, applied with the
        built-in rules) or :class:`mpjax.Rules`.

    Returns:
      ``model`` itself.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module`` instance.
      ValueError: the policy cannot be parsed.

    Warns:
      RuleWarning: once per problem :meth:`mpjax.Rules.problems` finds (a rule that matches
        no module, or one an earlier rule shadows).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = apply_policy(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    >>> model.kernel[...].dtype, model.dtype, model(jnp.ones((1, 4))).dtype
    (dtype('float32'), dtype(bfloat16), dtype('float32'))
    """
    _check_model(model, "apply_policy")
    rules = as_rules(policy_or_rules)
    nodes = _walk(model)
    resolved = _resolve(nodes, rules)
    for problem in rules.problems((n.path, _base_class(n.module)) for n in nodes):
        warnings.warn(problem, RuleWarning, stacklevel=2)
    for node in nodes:
        resolution = resolved[node.path]
        _configure(node, resolution)
        policy = resolution.policy
        root = node.parent is None
        boundary = root or resolved[node.parent].policy != policy
        owned = () if _is_stock(node.module) else tuple(sorted({n for n, _ in node.params}))
        if root or boundary or owned:
            _set_plan(node.module, _Plan(policy, boundary, owned, rules if root else None))
        else:
            _set_plan(node.module, None)
    return model


def _applied_rules(model: nnx.Module) -> Rules:
    plan = getattr(type(model), "_mpjax_plan", None)
    if plan is None or plan.rules is None:
        raise ValueError(
            f"The {type(model).__name__} passed as `model` has no policy applied. Either call "
            "mpjax.nnx.apply_policy(model, policy) first, or pass the rules to report: "
            "describe(model, rules)."
        )
    return plan.rules


def describe(model: nnx.Module, rules: Rules | PolicyLike | None = None, *,
             print_table: bool = True) -> PrecisionReport:
    """The precision report of an NNX model: each module's path, type, policy, rule and params.

    One row per module in pre-order (the root first, children in attribute-name order,
    shared modules once), with the Params it owns directly (those in ``nnx.List`` /
    ``nnx.Dict`` containers count for the module holding the container), plus the problems
    :meth:`mpjax.Rules.problems` finds.

    Args:
      model: an ``nnx.Module`` instance.
      rules: the policy or rules to report; by default the ones :func:`apply_policy` applied
        to ``model``. Passing them reports what they would do without changing the model.
      print_table: print the table as well.

    Returns:
      A :class:`mpjax.PrecisionReport`.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module`` instance.
      ValueError: ``rules`` is None and no policy was applied to ``model``.

    >>> from flax import nnx
    >>> report = describe(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16", print_table=False)
    >>> print(report.rows[0].type_name, report.rows[0].policy, report.total_params)
    Linear p=f32,c=bf16,o=f32 10
    """
    _check_model(model, "describe")
    rules = _applied_rules(model) if rules is None else as_rules(rules)
    nodes = _walk(model)
    resolved = _resolve(nodes, rules)
    rows = []
    for node in nodes:
        values = [v.get_value() for _, v in node.params]
        rows.append(ModuleRow(
            path=node.path,
            type_name=_base_class(node.module).__name__,
            policy=resolved[node.path].policy,
            rule=resolved[node.path].rule_name,
            param_count=sum(int(np.size(x)) for x in values),
            param_bytes=sum(int(np.size(x)) * np.dtype(x.dtype).itemsize for x in values),
        ))
    report = PrecisionReport(tuple(rows),
                             tuple(rules.problems((n.path, _base_class(n.module)) for n in nodes)))
    if print_table:
        print(report)
    return report
