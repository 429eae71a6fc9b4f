"""What the casting engine is tracing now, and what the code being traced can ask of it.

Each engine trace in progress on a thread has its :class:`Settings`: the default policy, the
user's rules and op categories, the precision regions resolved so far, and the warnings given.
Code the engine traces asks here whether it is traced by the engine (:func:`tracing`: a wrapped
Flax or Equinox module then only opens its region) and in which compute dtype it will run
(:func:`traced_compute_dtype`: fused attention, whose implementation depends on it). Observers
(:func:`observing`) receive the values each engine run computes: the precision monitor's hook.
A wrapped model asks :func:`model_rules` which rules to run under as it starts to run, so that
:func:`running_models` sees the models a function runs and may run them under other rules: the
precision doctor's way to find, or replace, the policy of a model it is not given directly.

:func:`trace` traces a function to the jaxpr the engine evaluates, with its settings in effect,
deciding which argument leaves are traced and which are static values, and caching the result
per function (:class:`TraceCache`); :func:`abstractly` runs a function on abstract values.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import jax
import numpy as np

from mpjax import jax_compat as compat
from mpjax.casting.regions import Region, innermost
from mpjax.policy import Policy
from mpjax.rules import Rule, Rules

__all__ = [
    "AutocastWarning",
    "Settings",
    "TraceCache",
    "Traced",
    "abstractly",
    "forward_only",
    "in_forward_only",
    "in_per_device",
    "per_device",
    "ModelsRun",
    "Observer",
    "model_rules",
    "observers",
    "observing",
    "running_models",
    "unobserved",
    "trace",
    "traced_compute_dtype",
    "tracing",
]


class AutocastWarning(UserWarning):
    """Warned once per autocast function for each primitive it does not know, and for each
    region (module) that calls host code autocast cannot reach."""


class _Tracing(threading.local):
    def __init__(self) -> None:
        # The settings of each engine trace in progress on this thread, innermost last.
        self.settings: list[Settings] = []
        # The observers (see observing()) of the engine runs traced now, innermost last; none
        # while unobserved() is open.
        self.observers: list[Observer] = []
        self.unobserved = 0
        self.forward_only = 0  # see forward_only()
        self.per_device = 0  # see per_device()
        # The running_models() records open on this thread, innermost last.
        self.models: list[ModelsRun] = []


_tracing = _Tracing()


def tracing() -> bool:
    """Whether the casting engine is tracing a function on this thread right now.

    The Flax integrations check it: a wrapped module called while the engine traces only opens
    its precision region; called outside, it starts the engine itself.
    """
    return bool(_tracing.settings)


class Observer(Protocol):
    """What :func:`observing` hands the values of the engine runs to."""

    def tap(self, module: str, values: list) -> list:
        """Called with the floating outputs of each first-order equation as it is evaluated,
        and the path of the region it ran in; returns what the rest of the jaxpr uses instead
        (the same values, through an identity whose derivative measures their gradients, say)."""
        ...

    def values(self, values: dict[str, list]) -> None:
        """Called at the end of each jaxpr the engine evaluates with what :meth:`tap` returned,
        by module path."""
        ...


@contextlib.contextmanager
def observing(observer: Observer):
    """While open, every engine run traced on this thread hands ``observer`` the values it
    computes: each first-order equation's floating outputs go through ``observer.tap(module
    path, outputs)`` as they are computed, and at the end of each jaxpr the engine evaluates
    (the function, and each body of a loop, ``jit``, ``remat`` or custom derivative inside),
    ``observer.values({module path: [outputs]})`` gets them all, by the path of the region they
    ran in. The values belong to the trace of that jaxpr: the observer reduces them there (and
    sends the results out with ``jax.debug.callback``, say).

    Nested functions that autocast caches are not reused while observing, nor left behind.
    """
    _tracing.observers.append(observer)
    try:
        yield
    finally:
        _tracing.observers.pop()


def traced_compute_dtype() -> np.dtype | None:
    """The compute dtype the engine will run the code being traced right now in: that of the
    innermost precision region around it (or of the rule or policy of its path), or None
    outside an engine trace and inside :func:`mpjax.full_precision`.

    Most operations are traced in the model's own dtypes and cast later, when the engine
    evaluates them. An operation whose *implementation* depends on the dtype (fused attention,
    which cuDNN runs only in bf16/f16) asks here while it is traced, and is traced in the
    compute dtype from the start. Inside a nested ``jax.jit``, ``scan`` or ``checkpoint`` of
    the traced function JAX starts a fresh name stack, so only regions opened inside it (those
    of the modules of a wrapped Flax model) are seen there.
    """
    if not _tracing.settings:
        return None
    policy = _tracing.settings[-1].region(compat.current_scope_names()).policy
    return None if policy is None else np.dtype(policy.compute_dtype)


def observers() -> list[Observer]:
    """The observers (:func:`observing`) open on this thread, innermost last (none inside
    :func:`unobserved`). An observed run builds its own nested functions rather than reuse, or
    leave behind, ones that observe elsewhere."""
    return [] if _tracing.unobserved else _tracing.observers


@contextlib.contextmanager
def _opened(flag: str) -> Iterator[None]:
    """Counts ``flag`` of this thread's tracing state up while open (they nest)."""
    setattr(_tracing, flag, getattr(_tracing, flag) + 1)
    try:
        yield
    finally:
        setattr(_tracing, flag, getattr(_tracing, flag) - 1)


def unobserved() -> contextlib.AbstractContextManager[None]:
    """While open, the engine runs traced on this thread are not observed: for the rules of
    custom derivatives, whose values are tangents and cotangents (which an observer's
    reductions and taps must not touch: JAX transposes what a JVP rule computes from its
    tangents), not values the model computes."""
    return _opened("unobserved")


def forward_only() -> contextlib.AbstractContextManager[None]:
    """While open, the engine runs traced on this thread bind no custom VJPs (see
    :mod:`mpjax.casting.gradient_reduction`): for what only forward mode differentiates or
    what JAX transposes as it is, a while loop's body and a custom JVP rule's tangents."""
    return _opened("forward_only")


def in_forward_only() -> bool:
    """Whether :func:`forward_only` is open on this thread."""
    return _tracing.forward_only > 0


def per_device() -> contextlib.AbstractContextManager[None]:
    """While open, the engine runs traced on this thread are tracing a ``jax.shard_map`` body,
    where custom VJPs get no symbolic zeros."""
    return _opened("per_device")


def in_per_device() -> bool:
    """Whether :func:`per_device` is open on this thread."""
    return _tracing.per_device > 0


@dataclasses.dataclass
class ModelsRun:
    """What :func:`running_models` records: the models wrapped with a policy that ran.

    Attributes:
      rules: the rules every wrapped model runs under while the record is open, or None for
        each its own.
      seen: each wrapped model that started to run, as its class name and its own rules.
    """

    rules: Rules | None
    seen: list[tuple[str, Rules]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def running_models(rules: Rules | None = None):
    """While open, each model wrapped with a policy (:func:`mpjax.linen.apply_policy`,
    :func:`mpjax.nnx.set_policy`, :func:`mpjax.equinox.apply_policy`) that starts to run on this
    thread is recorded in the :class:`ModelsRun` yielded, and runs under ``rules`` instead of its
    own when they are given."""
    record = ModelsRun(rules)
    _tracing.models.append(record)
    try:
        yield record
    finally:
        _tracing.models.pop()


def model_rules(name: str, own: Rules) -> Rules:
    """The rules a wrapped model runs under, asked by the integrations as it starts to run:
    ``own``, unless :func:`running_models` is open with other rules; recorded there with the
    model's class ``name``."""
    if not _tracing.models:
        return own
    record = _tracing.models[-1]
    record.seen.append((name, own))
    return own if record.rules is None else record.rules


@dataclasses.dataclass
class Settings:
    """What one ``autocast(fn, ...)`` call decided; shared by all its traces."""

    policy: Policy
    categories: Mapping[str, str]
    rules: tuple[Rule, ...]
    warned: set = dataclasses.field(default_factory=set)
    regions: dict = dataclasses.field(default_factory=dict)

    def region(self, path: tuple[str, ...]) -> Region:
        """The region of the scope ``path``: its policy (None inside :func:`full_precision`)
        and the module path it names.

        The innermost precision region around the equation wins (the region of a module of a
        wrapped Flax model, or :func:`full_precision`). Elsewhere a rule applies where its key
        matches the path or one of its ancestors (``"head"`` covers ``"head/dense"``); the
        first rule in order wins; else the default policy.
        """
        if path not in self.regions:
            self.regions[path] = self._resolve(path)
        return self.regions[path]

    def _resolve(self, path: tuple[str, ...]) -> Region:
        found = innermost(path)
        if found is not None:
            return found
        prefixes = ["/".join(path[:k]) for k in range(len(path) + 1)]
        for rule in self.rules:
            if any(rule.matches(p, object) for p in prefixes):
                return Region(rule.policy_for(self.policy), "/".join(path))
        return Region(self.policy, "/".join(path))

    def warn_callback(self, name: str, region: Region) -> None:
        where = region.path or "<root>"
        if (name, where) in self.warned:
            return
        self.warned.add((name, where))
        warnings.warn(
            f"mpjax: {where!r} calls host code ({name}), which autocast cannot reach: the host "
            "function gets its inputs in the dtypes the model was traced with, and any matmul "
            "in it runs in those dtypes. Move the matmuls out of the callback, or wrap the "
            "callback's inputs in an explicit cast if it should see the compute dtype.",
            AutocastWarning,
            stacklevel=5,
        )

    def warn_delayed(self, where: str, higher_order: str) -> None:
        if ("delayed", where) in self.warned:
            return
        self.warned.add(("delayed", where))
        warnings.warn(
            f"mpjax: a matmul in {where or '<root>'!r} runs inside {higher_order!r}, where "
            "delayed fp8 scaling cannot carry its state: it runs with current scaling "
            "instead. Only matmuls at the top level, in jit, scan and remat get delayed scaling.",
            AutocastWarning,
            stacklevel=6,
        )

    def warn_unaligned(self, where: str, scaling: str, reason: str) -> None:
        if ("unaligned", where, scaling) in self.warned:
            return
        self.warned.add(("unaligned", where, scaling))
        warnings.warn(
            f"mpjax: a matmul in {where or '<root>'!r} cannot run in {scaling}: {reason}. It "
            "runs in the compute dtype instead (describe() shows it). A matmul traced per "
            "example (inside jax.vmap, as Equinox layers are) has a contraction of 1 in its "
            "weight gradient: autocast the vmapped function instead, so that the batch is in "
            "the matmul.",
            AutocastWarning,
            stacklevel=6,
        )

    def warn_unknown(self, name: str, higher_order: bool) -> None:
        if name in self.warned:
            return
        self.warned.add(name)
        what = "higher-order primitive" if higher_order else "primitive"
        inside = " Its inner computations are not autocast either." if higher_order else ""
        warnings.warn(
            f"mpjax.autocast does not know the {what} {name!r}: it runs in the dtypes the "
            f"function was traced with.{inside} To choose its precision, pass "
            f"categories={{{name!r}: 'promote'}} (or 'lower', 'f32', 'keep', 'original').",
            AutocastWarning,
            stacklevel=5,
        )


# The traced jaxprs an autocast function keeps, least recently used first out.
_CACHE_SIZE = 32


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _is_traced(leaf: Any, trace_scalars: bool) -> bool:
    """Whether an argument leaf is traced: arrays always; Python floats and complex numbers
    with ``trace_scalars`` (as ``jax.jit`` does; ``bool`` and ``int`` stay static)."""
    return _is_array(leaf) or (trace_scalars and isinstance(leaf, (float, complex)))


@dataclasses.dataclass
class Traced:
    closed: Any
    out_tree: Any
    cache: dict


class TraceCache:
    """The traced jaxprs of one autocast function, by argument structure, avals and static
    values (least recently used first out)."""

    def __init__(self, size: int = _CACHE_SIZE):
        self.size = size
        self.entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key):
        if key is None or key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key, value):
        self.entries[key] = value
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)


def trace(
    fn,
    settings: Settings,
    traces: TraceCache | None,
    args,
    kwargs,
    trace_scalars: bool = False,
) -> tuple[Traced, list]:
    """The jaxpr of ``fn`` for these arguments (cached in ``traces`` unless None), and the
    arguments it takes: the array leaves, and Python floats and complex numbers if
    ``trace_scalars`` (autocast's rule; the Flax integrations trace at every call anyway and
    keep them static, as the model's own code sees them without mpjax)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic_idx = [i for i, leaf in enumerate(leaves) if _is_traced(leaf, trace_scalars)]
    dynamic = [leaves[i] for i in dynamic_idx]
    static = tuple(
        (i, leaf) for i, leaf in enumerate(leaves) if not _is_traced(leaf, trace_scalars)
    )
    key: Any = (treedef, static, tuple(jax.typeof(x) for x in dynamic))
    try:
        hash(key)
    except TypeError:
        key = None  # an unhashable static value: trace every call
    if traces is None:
        key = None
    traced = None if traces is None else traces.get(key)
    if traced is not None:
        return traced, dynamic
    out_trees = []

    def flat_fn(*values):
        full = list(leaves)
        for i, value in zip(dynamic_idx, values):
            full[i] = value
        call_args, call_kwargs = jax.tree.unflatten(treedef, full)
        out_leaves, out_tree = jax.tree.flatten(fn(*call_args, **call_kwargs))
        out_trees.append(out_tree)
        return out_leaves

    _tracing.settings.append(settings)
    try:
        closed = jax.make_jaxpr(flat_fn)(*dynamic)
    finally:
        _tracing.settings.pop()
    traced = Traced(closed, out_trees[0], {})
    # A jaxpr that closed over tracers of an enclosing trace is only valid inside that trace.
    closes_over_tracers = any(compat.is_tracer(c) for c in closed.consts)
    if traces is not None and key is not None and not closes_over_tracers:
        traces.put(key, traced)
    return traced, dynamic


def abstractly(fn: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
    """``fn(args, kwargs)`` traced under ``jax.eval_shape`` (nothing is computed): arrays and
    ``jax.ShapeDtypeStruct`` leaves become abstract, every other leaf stays a static value."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    arrays = [
        i
        for i, leaf in enumerate(leaves)
        if _is_traced(leaf, True) or isinstance(leaf, jax.ShapeDtypeStruct)
    ]

    def call(array_leaves):
        merged = list(leaves)
        for i, leaf in zip(arrays, array_leaves):
            merged[i] = leaf
        return fn(*jax.tree.unflatten(tree, merged))

    return jax.eval_shape(call, [leaves[i] for i in arrays])
