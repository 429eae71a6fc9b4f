"""Rules: which precision policy applies to which module.

A :class:`Rules` value is an ordered list of :class:`Rule` entries plus a default policy. Each
rule has a key saying *where* it applies, a module path glob (``"decoder/*/mlp*"``), a compiled
regular expression (``re.compile(r"block_\\d+/attn")``, matched in full) or a module class
(subclasses match too, unlike Haiku's ``set_policy``), and says *what* applies there: a policy,
or a function of the default policy, plus optional module attributes to set (for example
``precision="highest"``). The first matching rule wins; modules no rule matches use the
default.

Built-in rules come after the user's. The integrations register them when they are imported
(:func:`register_builtin_rule`): :mod:`mpjax.linen` and :mod:`mpjax.nnx` make their
normalization layers keep f32 parameters and compute their statistics in f32, returning the
compute dtype. This module knows no module library: it matches classes it is given.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import fnmatch
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union, cast

import jax.numpy as jnp
import numpy as np

from mpjax.policy import Policy, PolicyLike, get_policy

RuleKey = Union[str, "re.Pattern[str]", type]
RuleValue = PolicyLike | Callable[[Policy], Policy] | None


def _policy_argument(value: Any, argument: str) -> Policy:
    """``get_policy(value)``, its ``TypeError`` naming the caller's ``argument``."""
    try:
        return get_policy(cast(PolicyLike, value))
    except TypeError:
        raise TypeError(
            f"{argument} must be a policy: a Policy, a jmp.Policy, a dtype, or a string such as "
            f"'mixed_bfloat16' or 'p=f32,c=bf16,o=f32'; got {value!r} of type "
            f"{type(value).__name__}."
        ) from None


def _key_text(key: RuleKey) -> str:
    if isinstance(key, type):
        return f"{key.__module__}.{key.__qualname__}"
    if isinstance(key, re.Pattern):
        return f"re:{key.pattern}"
    return key


@dataclasses.dataclass(frozen=True)
class Rule:
    """One entry of :class:`Rules`: where it applies and what it sets there.

    Args:
      key: a glob over the ``/``-joined module path (``fnmatch`` syntax: ``*`` also crosses
        ``/``), a compiled regular expression matched against the whole path, or a module class
        (instances of subclasses match too).
      policy: the policy there: anything :func:`mpjax.get_policy` accepts, a function from the
        default policy to a policy, or None for the default policy itself.
      attributes: module attributes to set where the rule applies, for modules that have them.
      name: how reports refer to the rule; defaults to the key.
      builtin: True for mpjax's own rules. Only the user's rules are reported when they never
        match, and a built-in rule's attributes replace only Flax's defaults, never a value the
        user chose.
    """

    key: RuleKey
    policy: RuleValue = None
    attributes: tuple[tuple[str, Any], ...] = ()
    name: str = ""
    builtin: bool = False

    if TYPE_CHECKING:  # the generated __init__ also takes a mapping; __post_init__ converts it

        def __init__(
            self,
            key: RuleKey,
            policy: RuleValue = None,
            attributes: Mapping[str, Any] | tuple[tuple[str, Any], ...] = (),
            name: str = "",
            builtin: bool = False,
        ) -> None: ...

    def __post_init__(self):
        if not isinstance(self.key, (str, re.Pattern, type)):
            raise TypeError(
                "Rule key must be a path glob (str), a compiled regular expression or a module "
                f"class; got {self.key!r} of type {type(self.key).__name__}."
            )
        if isinstance(self.key, str) and not self.key.strip():
            raise ValueError("Rule key must not be empty: use '*' to match every module path.")
        if isinstance(self.key, re.Pattern) and not isinstance(self.key.pattern, str):
            raise TypeError(
                f"Rule key {self.key!r} is a bytes regular expression; module paths are str: "
                f"use re.compile({self.key.pattern.decode(errors='replace')!r})."
            )
        if isinstance(self.attributes, Mapping):
            object.__setattr__(self, "attributes", tuple(self.attributes.items()))
        elif not (
            isinstance(self.attributes, tuple)
            and all(isinstance(a, tuple) and len(a) == 2 for a in self.attributes)
        ):
            raise TypeError(
                f"Rule attributes for {_key_text(self.key)!r} must be a mapping of module "
                f"attribute names to values, e.g. {{'attention_fn': fn}}; got "
                f"{self.attributes!r} of type {type(self.attributes).__name__}."
            )
        if not all(isinstance(name, str) for name, _ in self.attributes):
            raise TypeError(
                f"Rule attributes for {_key_text(self.key)!r} must be named by str, got "
                f"{[name for name, _ in self.attributes]!r}."
            )
        if not callable(self.policy) or isinstance(self.policy, type):
            if self.policy is not None:
                # Validate eagerly so a typo fails where the rule is written.
                where = f"Rule policy for {_key_text(self.key)!r}"
                object.__setattr__(self, "policy", _policy_argument(self.policy, where))
        if not isinstance(self.name, str):
            raise TypeError(
                f"Rule name for {_key_text(self.key)!r} must be a str (how reports refer to the "
                f"rule), got {self.name!r} of type {type(self.name).__name__}."
            )
        if not isinstance(self.builtin, bool):
            raise TypeError(
                f"Rule builtin for {_key_text(self.key)!r} must be a bool, got "
                f"{self.builtin!r} of type {type(self.builtin).__name__}."
            )
        if not self.name:
            object.__setattr__(self, "name", _key_text(self.key))

    def matches(self, path: str, module_type: type) -> bool:
        """Whether this rule applies to the module at ``path`` of class ``module_type``."""
        if isinstance(self.key, type):
            return issubclass(module_type, self.key)
        if isinstance(self.key, re.Pattern):
            return self.key.fullmatch(path) is not None
        return fnmatch.fnmatchcase(path, self.key)

    def policy_for(self, default: Policy) -> Policy:
        """The policy this rule gives, given the default policy."""
        if self.policy is None:
            return default
        if isinstance(self.policy, Policy):
            return self.policy
        # __post_init__ turned every other value into a Policy: what is left is a function.
        return get_policy(cast(Callable[[Policy], Any], self.policy)(default))


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What :meth:`Rules.resolve` decided for one module."""

    path: str
    module_type: type
    policy: Policy
    rule: Rule | None
    attributes: tuple[tuple[str, Any], ...]

    @property
    def rule_name(self) -> str:
        return self.rule.name if self.rule is not None else "default"


def norm_policy(default: PolicyLike) -> Policy:
    """Normalization layers: f32 params and statistics, output in the compute dtype.

    The policy function of the built-in norm rules: ``Rules({MyNorm: mpjax.norm_policy})``
    gives a norm of your own the same treatment.

    Args:
      default: the default policy the rule receives (anything :func:`mpjax.get_policy`
        accepts).

    Raises:
      TypeError: if ``default`` is not a policy.

    >>> norm_policy("mixed_bfloat16")
    Policy(param_dtype=float32, compute_dtype=float32, output_dtype=bfloat16)
    """
    default = _policy_argument(default, "norm_policy(default): default")
    f32 = np.dtype(jnp.float32)
    return Policy(f32, f32, default.compute_dtype)


def embedding_policy(default: PolicyLike) -> Policy:
    """Embedding lookups: the table in the param dtype, the rows it returns in the compute
    dtype, as Flax's ``nn.Embed(dtype=...)`` returns them.

    The policy function of the built-in embedding rules: ``Rules({MyEmbed:
    mpjax.embedding_policy})`` gives an embedding of your own the same treatment. The rows are
    gathered from the stored table and cast where the embedding's region ends, so the table's
    gradient, a scatter-add of the rows' cotangents, accumulates in the param dtype. Without
    it, a lookup returns rows in the param dtype (a gather computes nothing to cast), and a
    transformer's residual stream, which starts at those rows, stays float32 through every
    block: an activation twice as wide as the hand-written model's, kept for the backward
    pass and read by every norm. A tied output head (``attend``) still multiplies in the
    compute dtype.

    Args:
      default: the default policy the rule receives (anything :func:`mpjax.get_policy`
        accepts).

    Raises:
      TypeError: if ``default`` is not a policy.

    >>> embedding_policy("mixed_bfloat16")
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=bfloat16)
    """
    default = _policy_argument(default, "embedding_policy(default): default")
    return dataclasses.replace(default, output_dtype=default.compute_dtype)


def router_policy(default: PolicyLike) -> Policy:
    """A mixture of experts' router: its logits' matmul in float32 (at true float32
    precision), its output float32, params as the default stores them.

    The policy of the built-in router rule (``mpjax.rules.ROUTER_PATHS``): the experts a token goes
    to are the top-k of these logits, and a bf16 logit moves in steps of 1/128 of its size, so
    near-ties flip between runs and the load-balancing statistics drift. The softmax or
    sigmoid, the top-k and the auxiliary losses after it take float32 logits in float32 (the
    casting engine runs exp, log and sums in float32 wherever they are). DeepSeek-V3, Qwen and
    Switch Transformers route in float32.

    >>> router_policy("mixed_bfloat16")
    Policy(param_dtype=float32, compute_dtype=float32, output_dtype=float32)
    """
    default = _policy_argument(default, "router_policy(default): default")
    f32 = np.dtype(jnp.float32)
    return Policy(default.param_dtype, f32, f32)


ROUTER_PATHS = re.compile(r"(?i)(?:.*[/.])?(?:router|gate)(?:_\d+)?(?:[/.\[].*)?")
"""The module paths the built-in router rule matches: a module named ``router`` or ``gate``
(any case; Flax's automatic ``Router_0`` too), and everything inside it, in the path syntax of
linen and NNX (``moe/router``) and of Equinox (``layers[0].moe.gate``). Mixtral, Qwen-MoE and
DeepSeek name their routers ``gate``, Llama 4 and gpt-oss ``router``; a gated MLP's projection
is ``gate_proj`` in them, which it leaves alone."""

# mpjax's built-in rules, in registration order. Softmax needs no rule: the casting engine
# runs its exp and sums in f32 wherever it is.
_BUILTIN_RULES: list[Rule] = []


def register_builtin_rule(rule: Rule) -> None:
    """Adds ``rule`` to the built-in rules that every :class:`Rules` made afterwards ends with.

    The integrations call it at import for their own module classes (:mod:`mpjax.linen` and
    :mod:`mpjax.nnx` register their norms with :func:`norm_policy`), so this module imports no
    module library. Registering a rule whose key is already registered replaces that rule in
    place, so importing an integration twice (a reload) changes nothing.

    Args:
      rule: the rule; it is marked ``builtin=True`` (so it is not reported when it matches
        nothing).

    Raises:
      TypeError: if ``rule`` is not a :class:`Rule`.
    """
    if not isinstance(rule, Rule):
        raise TypeError(
            f"register_builtin_rule() takes a Rule as `rule`; got {rule!r} of type "
            f"{type(rule).__name__}."
        )
    rule = dataclasses.replace(rule, builtin=True)
    for i, registered in enumerate(_BUILTIN_RULES):
        if registered.key == rule.key:
            _BUILTIN_RULES[i] = rule
            return
    _BUILTIN_RULES.append(rule)


def register_norm_rules(library: str, *classes: type) -> None:
    """Registers the built-in rule giving each normalization layer class :func:`norm_policy`
    (f32 params and statistics, output in the compute dtype), named for reports after
    ``library`` and the class: ``"builtin: linen.LayerNorm in f32"``."""
    _register_class_rules(library, classes, norm_policy, "in f32")


def register_embedding_rules(library: str, *classes: type) -> None:
    """Registers the built-in rule giving each embedding class :func:`embedding_policy` (rows
    out in the compute dtype), named for reports after ``library`` and the class:
    ``"builtin: linen.Embed rows in the compute dtype"``."""
    _register_class_rules(library, classes, embedding_policy, "rows in the compute dtype")


def _register_class_rules(
    library: str, classes: tuple[type, ...], policy: Callable[[Policy], Policy], what: str
) -> None:
    for cls in classes:
        register_builtin_rule(Rule(cls, policy, name=f"builtin: {library}.{cls.__name__} {what}"))


def builtin_rules() -> tuple[Rule, ...]:
    """The built-in rules registered so far, in registration order."""
    return tuple(_BUILTIN_RULES)


register_builtin_rule(Rule(ROUTER_PATHS, router_policy, name="builtin: MoE router in f32"))


def _as_rule(entry: Any) -> Rule:
    if isinstance(entry, Rule):
        return entry
    if isinstance(entry, tuple) and len(entry) in (2, 3):
        return Rule(*entry)
    raise TypeError(
        "Each rule must be a Rule or a (key, policy) or (key, policy, attributes) tuple; got "
        f"{entry!r}."
    )


@dataclasses.dataclass(frozen=True, init=False)
class Rules:
    """An ordered set of rules plus a default policy; the first matching rule wins.

    Args:
      rules: the user's rules, highest priority first: a mapping ``{key: policy}``, or an
        iterable of :class:`Rule` or ``(key, policy[, attributes])`` tuples.
      default: the policy for modules no rule matches.
      builtins: append mpjax's built-in rules (those the integrations registered: their norms
        in f32) after the user's.
      allow_unmatched: accept rules that match no module. By default a rule that matches
        nothing is an error (``check_unmatched``) when the wrapped model or autocast
        function first runs; set it for rules written for modules that only run in some calls
        (a module used only in training, only in ``apply`` and not in ``init``).

    >>> import flax.linen as nn
    >>> rules = Rules({"head": "float32"}, default="mixed_bfloat16")
    >>> rules.resolve("head", nn.Dense).policy
    Policy(param_dtype=float32, compute_dtype=float32, output_dtype=float32)
    >>> rules.resolve("block_0/norm", nn.LayerNorm).policy
    Policy(param_dtype=float32, compute_dtype=float32, output_dtype=bfloat16)
    >>> rules.resolve("block_0/mlp", nn.Dense).policy
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
    """

    rules: tuple[Rule, ...]
    default: Policy
    allow_unmatched: bool = False

    def __init__(
        self,
        rules: Mapping[RuleKey, RuleValue] | Iterable[Any] = (),
        *,
        default: PolicyLike = "float32",
        builtins: bool = True,
        allow_unmatched: bool = False,
    ):
        if isinstance(rules, (str, bytes)) or not isinstance(rules, (Mapping, Iterable)):
            raise TypeError(
                "Rules(rules): rules must be a mapping {key: policy} or a list of Rule or "
                "(key, policy) / (key, policy, attributes) entries, e.g. "
                f"Rules({{'head': 'float32'}}); got {rules!r} of type {type(rules).__name__}."
            )
        if not isinstance(builtins, bool):
            raise TypeError(
                f"Rules(builtins=...) must be a bool, got {builtins!r} of type "
                f"{type(builtins).__name__}."
            )
        if not isinstance(allow_unmatched, bool):
            raise TypeError(
                f"Rules(allow_unmatched=...) must be a bool, got {allow_unmatched!r} of type "
                f"{type(allow_unmatched).__name__}."
            )
        entries = rules.items() if isinstance(rules, Mapping) else rules
        user = tuple(_as_rule(e) for e in entries)
        keys = [r.key for r in user]
        duplicates = sorted({_key_text(k) for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"Duplicate rule keys: {', '.join(duplicates)}. Give each key once.")
        object.__setattr__(self, "rules", user + (builtin_rules() if builtins else ()))
        object.__setattr__(self, "default", _policy_argument(default, "Rules(default=...)"))
        object.__setattr__(self, "allow_unmatched", allow_unmatched)

    @classmethod
    def _from(cls, rules: tuple[Rule, ...], default: Policy, allow_unmatched: bool) -> Rules:
        new = object.__new__(cls)
        object.__setattr__(new, "rules", rules)
        object.__setattr__(new, "default", default)
        object.__setattr__(new, "allow_unmatched", allow_unmatched)
        return new

    def resolve(self, path: str | Sequence[str], module_type: type | Any) -> Resolution:
        """Returns the policy, rule and attributes for the module at ``path``.

        Args:
          path: the module's path, as a ``/``-joined string or a sequence of names (the root
            module's path is ``""``).
          module_type: the module's class, or the module itself.

        Raises:
          TypeError: for a ``path`` that is neither, or a ``module_type`` of None.
        """
        if not isinstance(path, str) and not (
            isinstance(path, Sequence) and all(isinstance(p, (str, int)) for p in path)
        ):
            raise TypeError(
                "resolve(path, ...): path must be a '/'-joined str ('block_0/mlp', '' for the "
                f"root) or a sequence of names; got {path!r} of type {type(path).__name__}."
            )
        if module_type is None:
            raise TypeError(
                "resolve(..., module_type): module_type must be the module's class or the "
                "module itself, got None."
            )
        path = path if isinstance(path, str) else "/".join(str(p) for p in path)
        module_type = module_type if isinstance(module_type, type) else type(module_type)
        for rule in self.rules:
            if rule.matches(path, module_type):
                return Resolution(
                    path, module_type, rule.policy_for(self.default), rule, rule.attributes
                )
        return Resolution(path, module_type, self.default, None, ())

    def with_rule(
        self,
        key: RuleKey,
        policy: RuleValue = None,
        attributes: Mapping[str, Any] | tuple[tuple[str, Any], ...] = (),
        *,
        first: bool = True,
    ) -> Rules:
        """Returns new rules with a rule for ``key`` added, or replaced in place if ``key`` has one.

        A new rule goes first (highest priority) unless ``first=False``, which puts it after the
        user's rules but before the built-in ones.

        Raises:
          TypeError: for a ``first`` that is not a bool, and what :class:`Rule` raises.
        """
        if not isinstance(first, bool):
            raise TypeError(f"with_rule(first=...) must be a bool, got {first!r}.")
        rule = Rule(key, policy, attributes)
        index = self._index(key)
        if index is not None:
            rules = self.rules[:index] + (rule,) + self.rules[index + 1 :]
        elif first:
            rules = (rule,) + self.rules
        else:
            n_user = sum(not r.builtin for r in self.rules)
            rules = self.rules[:n_user] + (rule,) + self.rules[n_user:]
        return Rules._from(rules, self.default, self.allow_unmatched)

    def with_keys(self, key: Callable[[RuleKey], RuleKey]) -> Rules:
        """Returns the same rules, built-in ones included and in order, with each rule's key
        replaced by ``key(rule.key)``: how an integration reads path strings its own way (a
        user's rule may share a class with a built-in one, as ``{eqx.nn.Embedding: ...}``
        does, which a new :class:`Rules` would refuse as a duplicate)."""
        rules = tuple(dataclasses.replace(r, key=key(r.key)) for r in self.rules)
        return Rules._from(rules, self.default, self.allow_unmatched)

    def without(self, key: RuleKey) -> Rules:
        """Returns new rules without the rule for ``key`` (a user rule or a built-in one)."""
        index = self._index(key)
        if index is None:
            raise ValueError(
                f"No rule has key {_key_text(key)!r}. Keys: "
                f"{', '.join(_key_text(r.key) for r in self.rules) or 'none'}."
            )
        return Rules._from(
            self.rules[:index] + self.rules[index + 1 :], self.default, self.allow_unmatched
        )

    def scales_fp8_delayed(self) -> bool:
        """Whether the default or any rule's policy runs fp8 matmuls with delayed scaling: then
        the integrations create and carry its state."""
        policies = [self.default, *(r.policy_for(self.default) for r in self.rules)]
        return any(p.fp8 is not None and p.fp8.scaling == "delayed" for p in policies)

    def with_default(self, policy: PolicyLike) -> Rules:
        """Returns new rules with another default policy."""
        return Rules._from(
            self.rules, _policy_argument(policy, "with_default(policy)"), self.allow_unmatched
        )

    def _index(self, key: RuleKey) -> int | None:
        for i, rule in enumerate(self.rules):
            if rule.key == key:
                return i
        return None

    def problems(self, modules: Iterable[tuple[str, type]], *, unmatched: bool = True) -> list[str]:
        """Reports the user's rules that never match (unless ``unmatched=False``: the
        integrations refuse those with ``check_unmatched``), or that match a module a rule
        before them already claims (so they never apply there), over the given ``(path,
        class)`` pairs.

        Raises:
          TypeError: if ``modules`` is not an iterable of ``(path, class)`` pairs.
        """
        if isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
            raise TypeError(
                "problems(modules): modules must be an iterable of (path, class) pairs, got "
                f"{modules!r} of type {type(modules).__name__}."
            )
        modules = list(modules)
        for entry in modules:
            if not (
                isinstance(entry, tuple)
                and len(entry) == 2
                and isinstance(entry[0], str)
                and isinstance(entry[1], type)
            ):
                raise TypeError(
                    "problems(modules): each entry must be a (path, class) pair such as "
                    f"('block_0/mlp', nn.Dense), got {entry!r}."
                )
        found = []
        for i, rule in enumerate(self.rules):
            if rule.builtin:
                continue
            hits = [(p, t) for p, t in modules if rule.matches(p, t)]
            if not hits:
                if unmatched:
                    found.append(f"rule {rule.name!r} matches no module.")
                continue
            for path, module_type in hits:
                earlier = next((r for r in self.rules[:i] if r.matches(path, module_type)), None)
                if earlier is not None:
                    found.append(
                        f"rule {rule.name!r} is ambiguous at {path or '<root>'!r}: rule "
                        f"{earlier.name!r} comes first and wins there."
                    )
        return found


RulesLike = Rules | PolicyLike | Mapping[RuleKey, RuleValue] | Sequence[Any]
"""Anything :func:`as_rules` accepts: :class:`Rules`, a policy, or a mapping or list of rules."""


def as_rules(spec: RulesLike, argument: str = "policy_or_rules") -> Rules:
    """Turns every accepted spelling of "a policy or rules" into :class:`Rules`.

    The one place that reads the ``policy_or_rules`` argument of
    :func:`mpjax.linen.apply_policy` and :func:`mpjax.nnx.set_policy`, so both accept the same
    forms with the same errors.

    Args:
      spec: one of

        - a :class:`Rules` (returned as is);
        - anything :func:`mpjax.get_policy` accepts: the default policy, with the built-in
          rules;
        - a mapping ``{key: policy}`` or a list (or tuple) of :class:`Rule` or
          ``(key, policy[, attributes])`` entries: ``Rules(spec)``, whose default policy is
          float32 (use ``Rules(spec, default=...)`` for another).
      argument: the name of the caller's argument, for error messages.

    Returns:
      The rules.

    Raises:
      TypeError: ``spec`` is none of these, or a rule in it is malformed.
      ValueError: a policy string is invalid, or a rule key is given twice.

    >>> as_rules("mixed_bfloat16").default
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
    >>> as_rules({"head": "float32"}).rules[0].name
    'head'
    """
    if isinstance(spec, Rules):
        return spec
    if isinstance(spec, (Mapping, list, tuple)):
        return Rules(spec)
    try:
        policy = get_policy(cast(PolicyLike, spec))
    except TypeError:
        raise TypeError(
            f"`{argument}` must be mpjax.Rules, a policy (a Policy, a jmp.Policy, a dtype, or a "
            "string such as 'mixed_bfloat16' or 'p=f32,c=bf16,o=f32'), or a mapping or list of "
            f"rules such as {{'head': 'float32'}}; got {spec!r} of type {type(spec).__name__}."
        ) from None
    return Rules(default=policy)


# The public call the user made (``"mpjax.describe()"``) while it runs an integration's own
# functions (``mpjax.nnx.set_policy()`` on a copy of the model): rule errors name it.
_PUBLIC_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mpjax_public_call", default=None
)


@contextlib.contextmanager
def reported_as(call: str) -> Iterator[None]:
    """A context in which the errors :func:`check_unmatched` raises name ``call``, the public
    call the user made, instead of the integration function it runs on the user's behalf
    (``mpjax.describe(model, rules=...)`` sets the rules on a copy with
    ``mpjax.nnx.set_policy()``, which the user never called). The outermost call wins.

    >>> with reported_as("mpjax.describe()"):
    ...     try:
    ...         check_unmatched(Rules({"haed": "float32"}), [("head", object)],
    ...                         where="mpjax.nnx.set_policy()", what="module", syntax="",
    ...                         listing="")
    ...     except UnmatchedRuleError as error:
    ...         print(str(error).split(":")[0])
    mpjax.describe()
    """
    if _PUBLIC_CALL.get() is not None:
        yield
        return
    token = _PUBLIC_CALL.set(call)
    try:
        yield
    finally:
        _PUBLIC_CALL.reset(token)


def reporting_as(call: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside :func:`reported_as` ``(call)``: for the functions a public call
    returns (``describe(model)`` returns the function of the inputs that runs the model)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with reported_as(call):
            return fn(*args, **kwargs)

    return run


class UnmatchedRuleError(ValueError):
    """A user's rule matches no module (:func:`check_unmatched`): a ``ValueError`` that code
    running a model on the user's behalf (the precision doctor) passes on as it is."""


def check_unmatched(
    rules: Rules,
    modules: Iterable[tuple[str, type]],
    *,
    where: str,
    what: str,
    syntax: str,
    listing: str,
) -> None:
    """Refuses the user's rules that match none of ``modules``: the one check of the linen,
    NNX and Equinox integrations and of :func:`mpjax.autocast`.

    A rule matching nothing is almost always a typo (``{"haed": "float32"}``) or a path in
    another framework's syntax (``"block1.mlp"`` for linen's ``"block1/mlp"``), and would
    leave that part of the model in the default policy without a word. The error names, for
    each such rule, the closest paths that exist, the caller's path syntax and how to list all
    paths. Nothing is checked when ``rules.allow_unmatched`` is set.

    Args:
      rules: the rules, matched as the caller matches them (names are what the error shows).
      modules: the ``(path, class)`` pairs that exist (for autocast, every scope path and its
        ancestors, with ``object`` as the class).
      where: the caller, as the error starts (``"mpjax.linen.apply_policy()"``), unless a
        public call the user made runs it (:func:`reported_as`): then that call.
      what: what a rule should match (``"module of the MLP"``).
      syntax: a sentence on the caller's path syntax.
      listing: a sentence saying how to list every path.

    Raises:
      UnmatchedRuleError: a ``ValueError`` naming every user rule that matches no module.

    >>> import flax.linen as nn
    >>> try:
    ...     check_unmatched(Rules({"haed": "float32"}), [("head", nn.Dense)], where="f()",
    ...                     what="module of the model", syntax="", listing="")
    ... except ValueError as error:
    ...     print(str(error).split(". ")[0])
    f(): rule 'haed' matches no module of the model (closest paths: 'head')
    """
    if rules.allow_unmatched:
        return
    modules = list(modules)
    paths = sorted({p for p, _ in modules if p})
    classes = sorted({t.__name__ for _, t in modules})
    found = []
    for rule in rules.rules:
        if rule.builtin or any(rule.matches(p, t) for p, t in modules):
            continue
        if isinstance(rule.key, type):
            close = difflib.get_close_matches(rule.key.__name__, classes, n=3, cutoff=0.5)
            what_close = "closest classes"
        else:
            # An integration's translated key (Equinox's globs) keeps the user's text as name.
            text = rule.key if isinstance(rule.key, str) else rule.name.removeprefix("re:")
            close = difflib.get_close_matches(text, paths, n=3, cutoff=0.5)
            what_close = "closest paths"
        hint = f"{what_close}: {', '.join(repr(c) for c in close)}" if close else "no close path"
        found.append(f"rule {rule.name!r} matches no {what} ({hint})")
    if not found:
        return
    shown = ", ".join(repr(p) for p in paths[:12]) + (", ..." if len(paths) > 12 else "")
    where = _PUBLIC_CALL.get() or where
    raise UnmatchedRuleError(
        f"{where}: {'; '.join(found)}. A rule that matches nothing would leave that part in the "
        f"default policy. Paths: {shown or 'only the root'}. {syntax} {listing} For rules "
        "meant for parts that only run in some calls, pass Rules(..., allow_unmatched=True)."
    )


class RuleWarning(UserWarning):
    """Warned when a user's rule is shadowed by an earlier rule (a rule that matches no module
    at all is an error: ``check_unmatched``)."""
