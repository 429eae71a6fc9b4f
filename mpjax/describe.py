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

from mpjax.autocast import describe_autocast, is_autocast
from mpjax.report import Report

# The options describe() takes, in the order its signature lists them.
_OPTIONS = ("rules", "variables", "rngs", "method")


@dataclasses.dataclass(frozen=True)
class _Describer:
    kind: str
    matches: Callable[[Any], bool]
    build: Callable[..., Callable[..., Report]]
    options: frozenset[str]


_describers: list[_Describer] = []
# Top-level packages whose classes a describer was registered for ("flax").
_packages: set[str] = set()


def register_describer(
    target: type | Callable[[Any], bool],
    build: Callable[..., Callable[..., Report]],
    *,
    kind: str,
    options: tuple[str, ...] = (),
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
    _describers.append(_Describer(kind, matches, build, frozenset(options)))


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
      decided it, the params it owns and the dtypes its matmuls ran in, forward and backward.
    - An NNX module, with a policy applied or with ``rules``: the same report, one row per
      module; called without inputs, ``describe(model)()`` does not trace the model and the
      table has no matmul column.
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
    path    type       params   compute   output    rule                             #params  bytes  matmuls ran in
    ------  ---------  -------  --------  --------  -------------------------------  -------  -----  --------------
    <root>  MLP        float32  bfloat16  float32   default                                0    0 B  -
    norm    LayerNorm  float32  float32   bfloat16  builtin: linen.LayerNorm in f32        6   24 B  -
    out     Dense      float32  bfloat16  float32   default                                8   32 B  3x bf16,bf16
    ------  ---------  -------  --------  --------  -------------------------------  -------  -----  --------------
    total                                                                                 14   56 B
    >>> report = describe(mpjax.autocast(lambda x: jnp.exp(x)))(jnp.ones(2))
    >>> report.to_dict()["rows"][0]["ran"]
    ['f32']
    """
    given = {"rules": rules, "variables": variables, "rngs": rngs, "method": method}
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
                f"describe() got {', '.join(f'`{name}`' for name in wrong)}, which does not "
                f"apply to {describer.kind} ({type(target).__name__}); {takes}."
            )
        if method is not None and not (isinstance(method, str) or callable(method)):
            raise TypeError(
                "describe(method=...) must be a method name (str) or a function, as for "
                f"Module.apply; got {method!r} of type {type(method).__name__}."
            )
        if variables is not None and not isinstance(variables, Mapping):
            raise TypeError(
                "describe(variables=...) must be the dict of collections init returns "
                f"({{'params': ...}}); got {variables!r} of type {type(variables).__name__}."
            )
        return describer.build(target, **{name: given[name] for name in describer.options})
    text = repr(target)
    got = (
        f"{text} of type {type(target).__name__}"
        if len(text) <= 80 and "\n" not in text
        else f"a {type(target).__name__}"
    )
    raise TypeError(f"describe() takes {_kinds()}; got {got}." + _flax_hint(target))


register_describer(is_autocast, describe_autocast, kind="a function made by mpjax.autocast")
