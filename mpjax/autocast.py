"""Autocast: automatic mixed precision for any JAX function, by jaxpr rewriting.

``mpjax.autocast(fn)`` is PyTorch's ``torch.autocast`` as a JAX transformation. It traces ``fn``
to a jaxpr and evaluates it equation by equation, binding each primitive again with its inputs
cast by the primitive's category (:mod:`mpjax.casting.op_categories`): matmuls and convolutions in the
compute dtype, exp/log/reductions in f32, everything else in the dtype of its inputs. Because
the equations are bound inside whatever trace is active, the result composes with ``jax.jit``,
``jax.grad``, ``jax.vmap`` and the rest, and works on Flax, Equinox or plain ``jnp`` code
without changing it.

The evaluation is the casting engine's (:mod:`mpjax.casting.engine`), which the Flax and Equinox
integrations share; this module is the public transform around it: :func:`autocast`, the
delayed-scaling fp8 state of an autocast function (:func:`fp8_state`, :func:`with_fp8_state`),
and what :func:`mpjax.describe` reports of one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from mpjax import fp8
from mpjax import jax_compat as compat
from mpjax.casting.engine import Interpreter, to_output
from mpjax.casting.fp8_sites import DelayedScaling
from mpjax.casting.op_categories import merge_categories
from mpjax.casting.trace_context import Settings, TraceCache, abstractly, observers, trace
from mpjax.policy import PolicyLike, get_policy
from mpjax.rules import Rule, Rules, check_unmatched
from mpjax.table import format_table


@dataclasses.dataclass(frozen=True)
class AutocastRow:
    """One kind of equation autocast evaluated: where, what, and in which dtypes.

    Attributes:
      scope: the ``/``-joined named scopes around it (Flax module paths, ``jax.named_scope``).
      primitive: the primitive's name.
      category: the category it ran under (``"full_precision"`` inside :func:`full_precision`,
        ``"unknown"`` for primitives autocast does not know).
      traced: the dtypes of its inputs as ``fn`` was traced.
      ran: the dtypes of its inputs as autocast ran it.
      count: how many such equations there are.
      f32_precision: for a matmul or convolution that ran with float32 operands, the
        precision they are multiplied at (``Policy.f32_matmul_precision``'s names:
        ``"highest"`` is true float32, ``"default"`` the platform's, one bf16 pass on TPU);
        None for other equations.
    """

    scope: str
    primitive: str
    category: str
    traced: tuple[str, ...]
    ran: tuple[str, ...]
    count: int
    f32_precision: str | None = None


class AutocastReport(tuple):
    """A tuple of :class:`AutocastRow`, made by :func:`mpjax.describe` of an autocast function.

    ``str`` gives :meth:`table`; :meth:`to_dict` gives the rows as plain data.
    """

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        """The rows as a text table, in which ``*`` marks the rows whose inputs ran in other
        dtypes than traced, and ``@`` the precision of float32 matmuls (``f32,f32@highest``)."""
        header = ("scope", "primitive", "category", "traced inputs", "ran in", "count")
        rows = [
            (
                r.scope or "-",
                r.primitive,
                r.category,
                ",".join(r.traced) or "-",
                ("* " if r.traced != r.ran else "")
                + (",".join(r.ran) or "-")
                + ("" if r.f32_precision is None else f"@{r.f32_precision}"),
                str(r.count),
            )
            for r in self
        ]
        if not rows:
            return "no equations"
        return format_table(header, rows)

    def to_dict(self) -> dict[str, Any]:
        """The rows as JSON-serialisable data: ``{"rows": [{"scope": ..., "primitive": ...,
        "category": ..., "traced": ["bf16", ...], "ran": [...], "count": 3, "f32_precision":
        "highest" or None}, ...]}``."""
        return {
            "rows": [
                {
                    "scope": r.scope,
                    "primitive": r.primitive,
                    "category": r.category,
                    "traced": list(r.traced),
                    "ran": list(r.ran),
                    "count": r.count,
                    "f32_precision": r.f32_precision,
                }
                for r in self
            ]
        }


def _settings(fn, policy, rules, categories) -> Settings:
    if not callable(fn):
        raise TypeError(
            f"autocast(fn) needs a callable fn, got {fn!r} of type {type(fn).__name__}. Pass the "
            "function itself: mpjax.autocast(loss_fn), not mpjax.autocast(loss_fn(x))."
        )
    if isinstance(policy, Rules):
        raise TypeError(
            "autocast(fn, policy) got mpjax.Rules as its policy: rules go by keyword, "
            "mpjax.autocast(fn, rules=rules) (their default is then the policy)."
        )
    if policy is None:
        policy = rules.default if isinstance(rules, Rules) else "mixed_bfloat16"
    try:
        policy = get_policy(policy)
    except (TypeError, ValueError) as error:
        raise type(error)(f"autocast(fn, policy): {error}") from None
    if rules is None:
        user_rules: tuple[Rule, ...] = ()
    else:
        if not isinstance(rules, Rules):
            if not isinstance(rules, (Mapping, list, tuple)):
                raise TypeError(
                    "autocast(rules=...) takes mpjax.Rules, a mapping {scope glob: policy} or a "
                    f"list of rules; got {rules!r} of type {type(rules).__name__}."
                )
            rules = Rules(rules, builtins=False)
        user_rules = tuple(r for r in rules.rules if not r.builtin)
        for rule in user_rules:
            if isinstance(rule.key, type):
                raise ValueError(
                    f"autocast(rules=...): rule {rule.name!r} is keyed by a class, but autocast "
                    "matches named scopes (jax.named_scope, Flax module paths such as "
                    "'Model/head'). Key it by a path glob or a regular expression."
                )
    return Settings(policy, merge_categories(categories), user_rules)


def autocast(
    fn: Callable[..., Any],
    policy: PolicyLike | None = None,
    *,
    rules: Rules | Mapping[str, Any] | Sequence[Any] | None = None,
    categories: Mapping[str, str] | None = None,
) -> Callable[..., Any]:
    """Returns ``fn`` running in mixed precision, with the same signature: ``torch.autocast``
    for JAX.

    ``fn`` is traced to a jaxpr (once per argument structure, shapes, dtypes and static
    values; see below) and evaluated primitive by primitive with inputs cast by category
    (:mod:`mpjax.casting.op_categories`): matmuls, convolutions and attention in the policy's compute
    dtype, forward and backward; exp, log, pow, rsqrt, sums, max, cumulative ops (so softmax,
    log-softmax, logsumexp, norm statistics and losses) in f32; everything else in the dtype of
    its inputs, the widest where they differ. Only floating-point values are cast: integers,
    booleans and PRNG keys are never touched, float64 is never narrowed.

    It recurses into ``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``,
    ``custom_vjp`` and ``shard_map``; custom derivative rules stay the rules (evaluated under
    autocast as well). Loop carries keep the dtypes they were traced with. A primitive it does
    not know runs in its traced dtypes and is reported once with an :class:`AutocastWarning`.

    Floating outputs (f16/bf16/f32, not weakly typed) are cast to ``policy.output_dtype``, so
    with the presets ``fn`` returns f32 as before; gradients with respect to f32 inputs come
    back in f32. The intended use is under ``jax.jit`` (``jax.jit(autocast(f))`` or autocast
    inside a jitted train step): eagerly, every call re-evaluates the jaxpr op by op.

    Which arguments are traced: arrays, and Python floats and complex numbers, which are
    traced as ``jax.jit`` traces them (weakly typed scalars: ``f(x, 0.1)`` then ``f(x, 0.2)``
    reuse one trace, and dtype promotion is what it is for the Python number). Every other
    leaf is a static value, as if closed over: ``bool`` and ``int`` (far more often flags,
    counts and shapes than data: ``deterministic=True``, ``num_heads=4``), strings, ``None``
    and any other object. A new static value traces ``fn`` again; branching on a float
    argument in Python needs it static, so close over it (``functools.partial``) instead.

    Args:
      fn: the function: plain ``jnp`` code, a Flax ``model.apply``, an NNX module call, an
        Equinox model...
      policy: anything :func:`mpjax.get_policy` accepts; its compute dtype is the lower
        precision and its output dtype the dtype of floating outputs. Defaults to
        ``"mixed_bfloat16"`` (or the default of ``rules`` if that is a :class:`mpjax.Rules`).
      rules: regions with their own policy, matched against the named scopes around each
        operation (``jax.named_scope`` names, Flax module paths such as ``"Model/head"``): an
        :class:`mpjax.Rules`, a mapping ``{glob or compiled regex: policy}`` or a list of
        rules. A rule applies where its key matches the scope path or one of its ancestors;
        the first matching rule wins. Only a region's compute dtype matters. A rule that
        matches no scope of the first trace is an error (``ValueError`` naming the closest
        scopes), unless the rules are ``Rules(..., allow_unmatched=True)``.
      categories: ``{primitive name: category}`` overrides of the category table, with
        categories ``"lower"``, ``"f32"``, ``"promote"``, ``"keep"``, ``"original"``.

    Returns:
      A function with ``fn``'s signature.

    Raises:
      TypeError: if ``fn`` is not callable, or ``rules``/``categories`` have the wrong type.
      ValueError: for an unknown policy, category name, or a rule keyed by a class.

    >>> import jax, jax.numpy as jnp, mpjax
    >>> def mlp(w, x):
    ...     return jax.nn.softmax(jnp.tanh(x @ w) @ w)
    >>> w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    >>> autocast(mlp)(w, x).dtype
    dtype('float32')
    >>> mpjax.inspect_matmuls(jax.grad(lambda w: autocast(mlp)(w, x).sum()))(w).operand_dtypes()
    Counter({('bfloat16', 'bfloat16'): 5})
    """
    allow_unmatched = isinstance(rules, Rules) and rules.allow_unmatched
    info = _AutocastFunction(
        fn, _settings(fn, policy, rules, categories), TraceCache(), allow_unmatched=allow_unmatched
    )

    @functools.wraps(fn)
    def autocast_fn(*args, **kwargs):
        return info.call(args, kwargs)

    _autocast_functions[autocast_fn] = info
    return autocast_fn


@dataclasses.dataclass(frozen=True)
class _AutocastFunction:
    """What :func:`describe_autocast` needs of a function :func:`autocast` returned."""

    fn: Callable[..., Any]
    settings: Settings
    traces: TraceCache
    trace_scalars: bool = True  # Python floats traced, as jax.jit does; else held static
    allow_unmatched: bool = False
    checked: list = dataclasses.field(default_factory=list)  # [True] once the rules matched

    def call(self, args, kwargs, delayed: DelayedScaling | None = None, record=None) -> Any:
        """Runs ``fn`` through the engine; a recording or observed run builds its own nested
        functions rather than reuse, or leave behind, ones that record or observe elsewhere."""
        traced, dynamic = trace(
            self.fn, self.settings, self.traces, args, kwargs, trace_scalars=self.trace_scalars
        )
        if self.settings.rules and not self.checked:
            self._check_rules(traced.closed)
        cache = traced.cache if record is None and not observers() else {}
        outs = Interpreter(self.settings, cache, record, delayed).run(traced.closed, dynamic, ())
        policy = self.settings.policy
        outs = [to_output(x, a, policy) for x, a in zip(outs, traced.closed.out_avals)]
        return jax.tree.unflatten(traced.out_tree, outs)

    def _check_rules(self, closed: Any) -> None:
        """Refuses rules that match no scope the first trace ran (every trace until they do)."""
        scopes: set[tuple[str, ...]] = {()}

        def walk(jaxpr: Any, path: tuple[str, ...]) -> None:
            for eqn in jaxpr.eqns:
                at = path + compat.scope_names(eqn)
                scopes.update(at[:k] for k in range(len(at) + 1))
                for sub in compat.sub_jaxprs(eqn):
                    walk(getattr(sub, "jaxpr", sub), at)

        walk(closed.jaxpr, ())
        rules = Rules(self.settings.rules, builtins=False, allow_unmatched=self.allow_unmatched)
        check_unmatched(
            rules,
            [("/".join(s), object) for s in scopes],
            where="mpjax.autocast(rules=...)",
            what=f"scope {getattr(self.fn, '__name__', 'the function')} ran in its first trace",
            syntax="autocast matches the named scopes around each operation, joined with '/' "
            "(jax.named_scope names, Flax module paths such as 'Model/head'); a rule covers "
            "the scopes below the one it matches.",
            listing="print(mpjax.describe(fn)(*args)) lists every scope.",
        )
        self.checked.append(True)


# The functions autocast() returned, to what they wrap. Kept beside them rather than as an
# attribute: functools.wraps copies a function's attributes onto a user's decorator, which would
# then pass for the autocast function it wraps.
_autocast_functions: weakref.WeakKeyDictionary[Callable[..., Any], _AutocastFunction] = (
    weakref.WeakKeyDictionary()
)


def is_autocast(fn: Any) -> bool:
    """Whether ``fn`` is a function returned by :func:`autocast`.

    >>> import jax.numpy as jnp
    >>> is_autocast(autocast(jnp.tanh)), is_autocast(jnp.tanh)
    (True, False)
    """
    try:
        return fn in _autocast_functions
    except TypeError:  # unhashable or not weak-referenceable: not ours
        return False


def _autocast_info(fn: Any, caller: str) -> _AutocastFunction:
    if not is_autocast(fn):
        raise TypeError(
            f"{caller}() takes a function made by mpjax.autocast; got {fn!r}. Wrap it first: "
            f"{caller}(mpjax.autocast(fn, policy), ...)."
        )
    return _autocast_functions[fn]


def fp8_state(fn: Callable[..., Any]) -> Callable[..., dict[str, fp8.Fp8Meta]]:
    """The initial delayed-scaling state of an autocast function; curried like
    ``jax.make_jaxpr``: ``fp8_state(fn)(*args, **kwargs)``.

    Under a policy whose fp8 recipe scales with ``"delayed"`` scaling, every matmul it runs in
    fp8 keeps an :class:`mpjax.fp8.Fp8Meta` (scales and amax history). This traces ``fn`` for
    the example arguments (nothing is computed) and returns the state of each such matmul, by
    site: its scope path and count, inside the scans around it (``"h[scan0]/mlp/fc#0"``,
    stacked along the scan's length). Pass it to :func:`with_fp8_state`; it is a dict of
    arrays, to checkpoint with the params.

    Args:
      fn: a function made by :func:`autocast`.

    Raises:
      TypeError: if ``fn`` was not made by :func:`autocast`.

    >>> import jax, jax.numpy as jnp
    >>> f = autocast(lambda w, x: x @ w, "p=f32,c=bf16,o=f32,fp8=delayed;history=4")
    >>> state = fp8_state(f)(jnp.ones((8, 4)), jnp.ones((2, 8)))
    >>> {site: meta.amax_history.shape for site, meta in state.items()}
    {'#0': (4, 3)}
    """
    info = _autocast_info(fn, "fp8_state")

    def init(*args, **kwargs) -> dict[str, fp8.Fp8Meta]:
        delayed = DelayedScaling(None)
        abstractly(lambda a, k: info.call(a, k, delayed), args, kwargs)
        return delayed.initial_state()

    return init


def with_fp8_state(fn: Callable[..., Any], state: Mapping[str, fp8.Fp8Meta]) -> Callable[..., Any]:
    """``fn`` (an autocast function) running its delayed-scaling fp8 matmuls with ``state``.

    The function has ``fn``'s signature. Differentiate through it with respect to the state as
    well: the gradient with respect to ``state`` is the next state (each matmul's new scales
    and amax history), so one ``jax.grad`` gives the parameter gradients and the state to
    carry to the next step::

        def loss(params, state, x):
            return mpjax.with_fp8_state(f, state)(params, x).mean()

        grads, state = jax.grad(loss, argnums=(0, 1))(params, state, x)

    Outside ``jax.grad`` (evaluation) the state is used and stays as it is.

    Args:
      fn: a function made by :func:`autocast`.
      state: from :func:`fp8_state`, or the previous step's gradient with respect to it.

    Raises:
      TypeError: if ``fn`` was not made by :func:`autocast` or ``state`` is not a mapping.
      ValueError: when called, if ``state`` lacks a matmul ``fn`` runs or has other shapes.
    """
    info = _autocast_info(fn, "with_fp8_state")
    if not isinstance(state, Mapping):
        raise TypeError(
            "with_fp8_state(fn, state): state must be the mapping fp8_state(fn)(*args) "
            f"returned (or its gradient); got {type(state).__name__}."
        )

    @functools.wraps(info.fn)
    def run(*args, **kwargs):
        return info.call(args, kwargs, DelayedScaling(state))

    return run


def autocast_runner(
    fn: Callable[..., Any],
) -> tuple[Rules | None, Callable[[Rules], Callable[..., Any]]]:
    """The rules ``fn`` runs under (None for a function not made by :func:`autocast`), and
    ``under(rules)``: the function it wraps run by autocast under other rules, with the same
    categories. Unlike :func:`autocast`'s, its argument leaves that are not arrays are static
    values (a Python float too, as ``eqx.filter_jit`` holds a module's float fields), and its
    rules keyed by a class are left to the wrapped models it runs (which match classes).

    >>> import jax.numpy as jnp
    >>> rules, under = autocast_runner(autocast(jnp.tanh, "mixed_float16"))
    >>> str(rules.default), under(Rules(default="float32"))(jnp.ones(1)).dtype
    ('p=f32,c=f16,o=f32', dtype('float32'))
    """
    info = _autocast_functions.get(fn) if is_autocast(fn) else None
    wrapped = fn if info is None else info.fn
    categories = None if info is None else info.settings.categories
    rules = None
    if info is not None:
        rules = Rules(
            info.settings.rules,
            default=info.settings.policy,
            builtins=False,
            allow_unmatched=info.allow_unmatched,
        )

    def under(rules: Rules) -> Callable[..., Any]:
        scoped = tuple(r for r in rules.rules if not r.builtin and not isinstance(r.key, type))
        settings = Settings(rules.default, merge_categories(categories), scoped)
        # The rules may name parts of the models the function runs, which match them
        # themselves: the function's own scopes need not.
        run_info = _AutocastFunction(
            wrapped, settings, TraceCache(), trace_scalars=False, allow_unmatched=True
        )

        @functools.wraps(wrapped)
        def run(*args, **kwargs):
            return run_info.call(args, kwargs)

        return run

    return rules, under


def describe_autocast(fn: Callable[..., Any]) -> Callable[..., AutocastReport]:
    """What :func:`autocast` does to each kind of equation of ``fn``; the :func:`mpjax.describe`
    of autocast functions.

    Returns a function that takes ``fn``'s arguments exactly as ``fn`` takes them (arrays or
    ``jax.ShapeDtypeStruct``; other leaves are static values, as when ``fn`` is called), traces
    ``fn`` abstractly (nothing is computed) and returns an
    :class:`AutocastReport`: one row per (scope, primitive, category, traced input dtypes, run
    input dtypes), with a count. Use :func:`mpjax.inspect_matmuls` on the autocast function for
    the matmuls' dtypes, forward and backward.

    Args:
      fn: a function returned by :func:`autocast`.

    Returns:
      A function of ``fn``'s arguments that returns an :class:`AutocastReport`.

    Raises:
      TypeError: if ``fn`` was not made by :func:`autocast`.

    >>> import jax.numpy as jnp
    >>> f = autocast(lambda w, x: jnp.exp(x @ w))
    >>> report = describe_autocast(f)(jnp.ones((2, 2)), jnp.ones((2, 2)))
    >>> [(r.primitive, r.category, r.ran) for r in report]
    [('dot_general', 'lower', ('bf16', 'bf16')), ('exp', 'f32', ('f32',))]
    """
    if not is_autocast(fn):
        raise TypeError(
            f"describe_autocast() takes a function made by mpjax.autocast; got {fn!r}. Wrap it "
            "first: mpjax.describe(mpjax.autocast(fn))(*args)."
        )
    info = _autocast_functions[fn]

    def report(*args, **kwargs) -> AutocastReport:
        record: collections.Counter[
            tuple[str, str, str, tuple[str, ...], tuple[str, ...], str | None]
        ] = collections.Counter()
        # Traced as the autocast function traces its arguments: arrays and Python floats (and
        # shape structs, for an abstract trace) are traced; any other leaf is a static value.
        # Delayed fp8 scaling needs no state to be described: the sites are only traced.
        abstractly(lambda a, k: info.call(a, k, DelayedScaling(None), record), args, kwargs)
        return AutocastReport(AutocastRow(*key[:5], count, key[5]) for key, count in record.items())

    return report
