"""``mpjax.describe``: one entry point for the precision report of anything mpjax runs.

:func:`describe` knows no model library itself. What it can describe is registered with
:func:`register_describer`: functions made by :func:`mpjax.autocast` here, linen modules by
:mod:`mpjax.linen` and NNX modules by :mod:`mpjax.nnx` when they are imported (importing
:mod:`mpjax` imports them). So this module sits below the Flax integrations, which import it to
register, and imports only the casting engine and the report types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from mpjax.autocast import autocast_runner, describe_autocast, is_autocast
from mpjax.inspection.report import Report
from mpjax.rules import Rules, reported_as, reporting_as

# The options describe() takes, in the order its signature lists them.
_OPTIONS = ("rules", "variables", "rngs", "method")


@dataclasses.dataclass(frozen=True)
class Runner:
    """A target (model or function) as functions of its inputs that run it under any rules:
    what :func:`mpjax.diagnose` runs side by side under a policy and in float32.

    Attributes:
      rules: the rules the target runs under as it is (None if it has none: an unwrapped model).
      under: ``under(rules)`` is a function that runs the target under ``rules``; it takes the
        arguments ``arguments`` makes.
      arguments: ``arguments(inputs, kwargs)`` gives the ``(args, kwargs)`` of ``under(rules)``
        for the inputs the target takes (a linen model's variables go first, initialized from
        the inputs when not given; an NNX model's state).
      as_is: for a target whose rules are those of the wrapped models it runs (a function of
        a model), the target as it runs: each wrapped model under its own rules (run inside
        :func:`mpjax.casting.trace_context.running_models`, it shows them), the code around them in
        float32. None for the others.
    """

    rules: Rules | None
    under: Callable[[Rules], Callable[..., Any]]
    arguments: Callable[[tuple, dict], tuple[tuple, dict]]
    as_is: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class _Describer:
    kind: str
    matches: Callable[[Any], bool]
    build: Callable[..., Callable[..., Report]]
    options: frozenset[str]
    runner: Callable[..., Runner] | None


_describers: list[_Describer] = []
# What a function's arguments may hold that runs under rules: (is such a model, under).
_argument_models: list[tuple[Callable[[Any], bool], Callable[[Any, Rules], Any]]] = []
# Top-level packages whose classes a describer was registered for ("flax").
_packages: set[str] = set()


def register_describer(
    target: type | Callable[[Any], bool],
    build: Callable[..., Callable[..., Report]],
    *,
    kind: str,
    options: tuple[str, ...] = (),
    runner: Callable[..., Runner] | None = None,
) -> None:
    """Teaches :func:`describe` a kind of target. For integrations: :mod:`mpjax.linen` and
    :mod:`mpjax.nnx` call it when imported.

    Args:
      target: a class (its instances and subclasses are described) or a predicate on the
        target.
      build: called as ``build(target, **options)`` with the options of ``options`` (None where
        the user gave none); returns the function of the example inputs that makes the report.
        It checks the target and options and raises there, at the ``describe`` call.
      kind: what the target is, for error messages: ``"a flax.linen module"``.
      options: the names among ``rules``, ``variables``, ``rngs``, ``method`` that apply to
        this kind; :func:`describe` rejects the others with a TypeError.
      runner: called as ``runner(target, **options)`` like ``build``; returns the
        :class:`Runner` of the target, for :func:`mpjax.diagnose`. None where the kind cannot
        be run that way.

    Raises:
      ValueError: if an option is not one :func:`describe` takes.
    """
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ValueError(
            f"register_describer(options=...) got {sorted(unknown)}; describe() takes only "
            f"{list(_OPTIONS)}."
        )
    matches: Callable[[Any], bool]
    if isinstance(target, type):
        cls = target
        _packages.add(cls.__module__.split(".")[0])

        def is_instance(value: Any) -> bool:
            return isinstance(value, cls) or (isinstance(value, type) and issubclass(value, cls))

        matches = is_instance
    else:
        matches = target
    _describers.append(_Describer(kind, matches, build, frozenset(options), runner))


def register_argument_model(
    matches: Callable[[Any], bool], under: Callable[[Any, Rules], Any]
) -> None:
    """Teaches :func:`function_runner` a kind of model that a function takes as an argument
    (``loss_fn(model, x, y)``). For integrations: :mod:`mpjax.nnx` and :mod:`mpjax.equinox`
    call it when imported.

    Args:
      matches: whether an argument leaf (or subtree) is such a model.
      under: ``under(model, rules)`` is the model that runs under ``rules``, its modules in
        their regions, for the function to call as it calls ``model`` (``model`` itself is
        left as it is).
    """
    _argument_models.append((matches, under))


def _models_under(tree: Any, rules: Rules) -> Any:
    """``tree`` with each model :func:`register_argument_model` knows under ``rules``."""

    def kind(leaf: Any) -> Callable[[Any, Rules], Any] | None:
        return next((under for matches, under in _argument_models if matches(leaf)), None)

    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda leaf: kind(leaf) is not None)
    moved = []
    for leaf in leaves:
        under = kind(leaf)
        moved.append(leaf if under is None else under(leaf, rules))
    return jax.tree.unflatten(treedef, moved)


def _flax_hint(target: Any) -> str:
    cls = target if isinstance(target, type) else type(target)
    from_flax = any(c.__module__.split(".")[0] == "flax" for c in cls.__mro__)
    if from_flax and "flax" not in _packages:
        return (
            " Flax modules are described once mpjax.linen (linen) or mpjax.nnx (NNX) is "
            "imported: `import mpjax.linen`."
        )
    return ""


def _kinds() -> str:
    kinds = [d.kind for d in _describers]
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def describe(
    target: Any,
    *,
    rules: Any = None,
    variables: Any = None,
    rngs: Any = None,
    method: Any = None,
) -> Callable[..., Report]:
    """The precision report of a model or function mpjax runs, curried like ``jax.make_jaxpr``:
    ``describe(target, ...)(*example_inputs)``.

    ``describe(target)`` returns a function that takes the example inputs exactly as the model
    or function takes them (arrays or ``jax.ShapeDtypeStruct``, keywords included), traces it
    abstractly (nothing is computed) and returns the report. Nothing is printed: ``print`` the
    report for its table, or use its ``table()`` and ``to_dict()``.

    - A linen module, wrapped by :func:`mpjax.linen.apply_policy` or unwrapped with ``rules``:
      its ``init`` (or ``apply`` with ``variables``) is traced with the inputs, and the
      :class:`mpjax.PrecisionReport` lists each module called with its policy, the rule that
      decided it, the params it owns and the dtypes its operations and its matmuls ran in,
      forward and backward.
    - An NNX module, with a policy applied or with ``rules``: the same report, one row per
      module; called without inputs, ``describe(model)()`` does not trace the model and the
      table has neither column of the dtypes that ran.
    - A function made by :func:`mpjax.autocast`: an :class:`mpjax.AutocastReport`, one row per
      scope, primitive, category and dtypes, traced and run.

    Args:
      target: the model or autocast function.
      rules: rules or a policy for a linen or NNX module that has none applied (for an NNX
        module with a policy applied, reports what these rules would do, without changing it).
      variables: for a linen module, its variables (arrays or ``jax.ShapeDtypeStruct``) to
        report instead of initializing.
      rngs: for a linen module, the PRNG key or ``{name: key}`` dict for ``init`` (defaults to
        ``jax.random.key(0)``).
      method: for a linen module, the method to trace, as for ``Module.init``/``Module.apply``.

    Returns:
      A function of the example inputs that returns the report (:class:`mpjax.PrecisionReport`
      or :class:`mpjax.AutocastReport`).

    Raises:
      TypeError: if ``target`` is not something described (the message lists what is), an
        option does not apply to its kind (``variables`` for an NNX module), ``method`` is
        neither a name nor a function, or ``variables`` is not a dict.
      ValueError: if the target cannot be described with these options (an unwrapped linen
        module without ``rules``, a wrapped one with them).

    >>> import jax.numpy as jnp, flax.linen as nn, mpjax
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(2, name="out")(nn.LayerNorm(name="norm")(x))
    >>> model = mpjax.linen.apply_policy(MLP(), "mixed_bfloat16")
    >>> print(describe(model)(jnp.ones((1, 3))))
    path    type       params   compute   output    rule                             #params  bytes  ops ran in  matmuls ran in
    ------  ---------  -------  --------  --------  -------------------------------  -------  -----  ----------  --------------
    <root>  MLP        float32  bfloat16  float32   default                                0    0 B  -           -
    norm    LayerNorm  float32  float32   bfloat16  builtin: linen.LayerNorm in f32        6   24 B  f32         -
    out     Dense      float32  bfloat16  float32   default                                8   32 B  bf16 f32    3x bf16,bf16
    ------  ---------  -------  --------  --------  -------------------------------  -------  -----  ----------  --------------
    total                                                                                 14   56 B
    >>> report = describe(mpjax.autocast(lambda x: jnp.exp(x)))(jnp.ones(2))
    >>> report.to_dict()["rows"][0]["ran"]
    ['f32']
    """
    given = {"rules": rules, "variables": variables, "rngs": rngs, "method": method}
    describer = _describer(target, given, "describe")
    if describer is None:
        raise TypeError(f"describe() takes {_kinds()}; got {_got(target)}." + _flax_hint(target))
    with reported_as("mpjax.describe()"):
        report = describer.build(target, **{name: given[name] for name in describer.options})
    return reporting_as("mpjax.describe()", report)


def _got(target: Any) -> str:
    text = repr(target)
    if len(text) <= 80 and "\n" not in text:
        return f"{text} of type {type(target).__name__}"
    return f"a {type(target).__name__}"


def _describer(target: Any, given: Mapping[str, Any], caller: str) -> _Describer | None:
    """The describer of ``target``, once the options ``given`` are checked for it (None for a
    target no describer takes)."""
    for describer in _describers:
        if not describer.matches(target):
            continue
        wrong = [
            name for name in _OPTIONS if given[name] is not None and name not in describer.options
        ]
        if wrong:
            takes = (
                f"it takes only {', '.join(o for o in _OPTIONS if o in describer.options)}"
                if describer.options
                else "it takes none"
            )
            raise TypeError(
                f"{caller}() got {', '.join(f'`{name}`' for name in wrong)}, which does not "
                f"apply to {describer.kind} ({type(target).__name__}); {takes}."
            )
        method = given["method"]
        if method is not None and not (isinstance(method, str) or callable(method)):
            raise TypeError(
                f"{caller}(method=...) must be a method name (str) or a function, as for "
                f"Module.apply; got {method!r} of type {type(method).__name__}."
            )
        variables = given["variables"]
        if variables is not None and not isinstance(variables, Mapping):
            raise TypeError(
                f"{caller}(variables=...) must be the dict of collections init returns "
                f"({{'params': ...}}); got {variables!r} of type {type(variables).__name__}."
            )
        return describer
    return None


def runner_of(
    target: Any, caller: str, *, variables: Any = None, rngs: Any = None, method: Any = None
) -> Runner:
    """The :class:`Runner` of a target :func:`describe` takes, or of any other function (which
    runs through :func:`mpjax.autocast` under the rules given).

    Raises:
      TypeError: naming ``caller``, for an option that does not apply to the target's kind, a
        target that is neither described nor callable, or a kind that cannot be run.
    """
    given = {"rules": None, "variables": variables, "rngs": rngs, "method": method}
    describer = _describer(target, given, caller)
    if describer is None:
        if isinstance(target, type) or not callable(target):
            raise TypeError(
                f"{caller}() takes a function or {_kinds()}; got {_got(target)}."
                + _flax_hint(target)
            )
        wrong = [name for name in ("variables", "rngs", "method") if given[name] is not None]
        if wrong:
            raise TypeError(
                f"{caller}() got {', '.join(f'`{name}`' for name in wrong)}, which only apply "
                "to a flax.linen module; a function takes its inputs as they are."
            )
        return function_runner(target)
    if describer.runner is None:
        raise TypeError(f"{caller}() cannot run {describer.kind} ({type(target).__name__}).")
    options = {name: given[name] for name in describer.options if name != "rules"}
    return describer.runner(target, **options)


def function_runner(fn: Callable[..., Any]) -> Runner:
    """The :class:`Runner` of a function: it runs through :func:`mpjax.autocast`, its
    arguments' leaves that are not arrays held static (a Python float included, as
    ``eqx.filter_jit`` holds it), and the models among its arguments (Equinox, NNX) under the
    same rules, their modules in their regions. A function not made by :func:`mpjax.autocast`
    has no rules of its own: those of the wrapped models it runs, shown by :attr:`Runner.as_is`.
    """
    rules, under = autocast_runner(fn)

    def with_models(rules: Rules) -> Callable[..., Any]:
        run = under(rules)

        def call(*args, **kwargs):
            args, kwargs = _models_under((args, kwargs), rules)
            return run(*args, **kwargs)

        return call

    as_is = under(Rules(builtins=False)) if rules is None else None
    return Runner(rules, with_models, lambda inputs, kwargs: (inputs, kwargs), as_is)


register_describer(
    is_autocast,
    describe_autocast,
    kind="a function made by mpjax.autocast",
    runner=function_runner,
)
