"""In-training collection: the largest magnitude and the non-finite count of the values each
module computes, and of their gradients, measured inside a jitted train step every N steps.

:class:`PrecisionMonitor` jits a train step twice: as it is, for the steps between checks
(nothing measured, nothing sent, no host sync: the same compiled step), and traced with the
casting engine observing (:func:`mpjax.casting.trace_context.observing`), for the check steps: at the end
of each jaxpr the engine evaluates, its modules' values are reduced to an amax and a
non-finite count, sent to the host with ``jax.debug.callback``; and each value goes through an
identity whose derivative reduces the value's gradient the same way and sends it, so that the
backward pass reports per module too (the gradients with respect to each value a module
computes: what the backward pass computes there). (Measuring under a
``lax.cond`` inside one compiled step costs the steps between checks 25-85% on CPU: the
values the reductions read can no longer be fused away.) It sees what runs through the
engine: a model wrapped by :func:`mpjax.linen.apply_policy`, an NNX model with
:func:`mpjax.nnx.set_policy`, a function made by :func:`mpjax.autocast`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax.casting.trace_context import observing
from mpjax.table import format_table


@dataclasses.dataclass(frozen=True)
class ModuleCheck:
    """What one module computed in one pass of one check step.

    Attributes:
      step: the step number.
      module: the module path (``""`` for the root).
      amax: the largest finite magnitude of its values.
      nonfinite: how many of its values were inf or NaN.
      count: how many values it computed.
      backward: False for the values of the forward pass, True for their gradients (what the
        backward pass computes in the module).
    """

    step: int
    module: str
    amax: float
    nonfinite: int
    count: int
    backward: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _reduce(values: list) -> jax.Array:
    """``[amax of the finite magnitudes, non-finite count, count]`` of all the values."""
    values = [x.astype(jnp.float32) for x in values]
    amax = jnp.max(
        jnp.stack(
            [jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), initial=0.0) for x in values]
        )
    )
    nonfinite = jnp.sum(jnp.stack([jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in values]))
    count = sum(int(np.size(x)) for x in values)
    return jnp.stack([amax, nonfinite.astype(jnp.float32), jnp.float32(count)])


# (modules, backward, step number, stats): what the host receives.
_Receive = Callable[[Sequence[str], bool, Any, Any], None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(receive: Callable[[Any, Any], None], number: Any, values: list) -> list:
    """``values``, whose gradients are reduced (:func:`_reduce`) and sent to ``receive`` with
    the step ``number`` when the backward pass computes them."""
    return values


def _tap_forward(receive, number, values):
    return values, number


def _tap_backward(receive, number, gradients):
    jax.debug.callback(receive, number, _reduce(gradients)[None])
    return None, gradients


_tap.defvjp(_tap_forward, _tap_backward)


class _Observer:
    """The monitor's :class:`mpjax.casting.trace_context.Observer` for one traced check step: each
    jaxpr's values by module, reduced and sent in one callback; each module's gradients, sent
    from the backward pass as they are computed."""

    def __init__(self, receive: _Receive, number: jax.Array):
        self._receive = receive
        self._number = number

    def tap(self, module: str, values: list) -> list:
        return _tap(functools.partial(self._receive, (module,), True), self._number, values)

    def values(self, values: dict[str, list]) -> None:
        modules = tuple(values)
        stats = jnp.stack([_reduce(values[m]) for m in modules])
        jax.debug.callback(functools.partial(self._receive, modules, False), self._number, stats)


class PrecisionMonitor:
    """Per-module amax and non-finite counts of a train step, every ``every`` steps.

    Args:
      every: check every this many steps (the steps whose number is a multiple of it).

    Raises:
      ValueError: if ``every`` is not a positive int.

    >>> import jax, jax.numpy as jnp, mpjax
    >>> def loss(w, x):
    ...     with jax.named_scope("proj"):
    ...         return jnp.sum(jnp.tanh(x @ w))
    >>> f = mpjax.autocast(loss, "mixed_bfloat16")
    >>> monitor = PrecisionMonitor(every=2)
    >>> step = monitor.wrap(jax.grad(f))
    >>> for i in range(3):
    ...     _ = step(i, jnp.ones((2, 2)), jnp.full((1, 2), 3.0))
    >>> jax.effects_barrier()
    >>> [(c.step, c.amax) for c in monitor.checks if c.module == "proj" and not c.backward]
    [(0, 6.0), (2, 6.0)]
    >>> [(c.module, c.backward, c.amax) for c in monitor.latest()]  # the gradients: sum's ones
    [('proj', False, 6.0), ('proj', True, 1.0)]
    """

    def __init__(self, every: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"PrecisionMonitor(every=...) must be an int >= 1; got {every!r}.")
        self.every = every
        self.checks: list[ModuleCheck] = []
        self._written = 0  # how many checks write() has written

    def wrap(
        self,
        step_fn: Callable[..., Any],
        *,
        donate_argnums: int | Sequence[int] = (),
        jit: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> Callable[..., Any]:
        """``step_fn`` jitted twice, called as ``wrapped(step, *args)``: on a step number that
        is a multiple of ``every``, the version that measures; on the others, the plain
        version, exactly the step as it was (nothing measured, nothing sent, no host sync).

        Pass ``step_fn`` itself, not jitted: the measuring version must trace it.

        Args:
          step_fn: the train step.
          donate_argnums: as for ``jax.jit``, counting ``step_fn``'s arguments.
          jit: what compiles each version, a function of a function: ``eqx.filter_jit`` for a
            step that takes Equinox modules (whose non-array leaves ``jax.jit`` refuses); by
            default ``jax.jit`` with ``donate_argnums``. The measuring version takes the step
            number first, as an int32 array.

        Raises:
          TypeError: if ``step_fn`` or ``jit`` is not callable, or ``donate_argnums`` comes
            with a ``jit`` of one's own (donate through it); when called, for a step number
            that is not a concrete int (inside a trace).
        """
        if not callable(step_fn):
            raise TypeError(
                f"PrecisionMonitor.wrap(step_fn): step_fn must be the train step function; "
                f"got {step_fn!r}."
            )
        if jit is not None and not callable(jit):
            raise TypeError(
                f"PrecisionMonitor.wrap(jit=...) must compile a function (jax.jit, "
                f"eqx.filter_jit); got {jit!r}."
            )
        donated = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        if jit is not None and donated:
            raise TypeError(
                "PrecisionMonitor.wrap(donate_argnums=...) applies to the default jax.jit; "
                "with jit=..., donate through it (the measuring version's arguments start "
                "with the step number)."
            )
        plain: Callable[..., Any]
        measured: Callable[..., Any]
        if jit is None:
            plain = jax.jit(step_fn, donate_argnums=donated)
            measured = jax.jit(
                self.measuring(step_fn), donate_argnums=tuple(i + 1 for i in donated)
            )
        else:
            plain, measured = jit(step_fn), jit(self.measuring(step_fn))

        @functools.wraps(step_fn)
        def wrapped(step, *args):
            try:
                number = int(step)
            except (TypeError, jax.errors.ConcretizationTypeError):
                raise TypeError(
                    "PrecisionMonitor.wrap(...)(step, *args): step must be the step number as "
                    f"an int the host knows, got {step!r}; call the wrapped step from the "
                    "training loop, not inside jax.jit."
                ) from None
            if number % self.every == 0:
                # An array, not a Python int: one compiled version serves every check step.
                return measured(np.int32(number), *args)
            return plain(*args)

        return wrapped

    def measuring(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """The version of ``step_fn`` that measures, ``measuring(step, *args)`` with the step
        number first (traced), to jit and call on check steps with the options of one's own
        (shardings, donation; shift ``donate_argnums`` by one). :meth:`wrap` does it all.

        Raises:
          TypeError: if ``step_fn`` is not callable.
        """
        if not callable(step_fn):
            raise TypeError(
                f"PrecisionMonitor.measuring(step_fn): step_fn must be the train step "
                f"function; got {step_fn!r}."
            )

        @functools.wraps(step_fn)
        def measuring(step, *args):
            with observing(_Observer(self._receive, step)):
                return step_fn(*args)

        # Its name and docs are step_fn's, its signature its own: (step, *args) is what jit
        # wrappers that read signatures (eqx.filter_jit) must bind.
        del measuring.__wrapped__
        return measuring

    def _receive(self, modules: Sequence[str], backward: bool, number: Any, stats: Any) -> None:
        for module, (amax, nonfinite, count) in zip(modules, np.asarray(stats)):
            self.checks.append(
                ModuleCheck(int(number), module, float(amax), int(nonfinite), int(count), backward)
            )

    def latest(self) -> list[ModuleCheck]:
        """The last check, one entry per module and pass (merged over the jaxprs that ran it:
        a module inside a loop or run twice under remat, and over its values), forward first,
        in the order they first ran."""
        if not self.checks:
            return []
        last = max(c.step for c in self.checks)
        merged: dict[tuple[bool, str], ModuleCheck] = {}
        for c in sorted(self.checks, key=lambda c: c.backward):
            if c.step != last:
                continue
            old = merged.get((c.backward, c.module))
            merged[c.backward, c.module] = (
                c
                if old is None
                else dataclasses.replace(
                    old,
                    amax=max(old.amax, c.amax),
                    nonfinite=old.nonfinite + c.nonfinite,
                    count=old.count + c.count,
                )
            )
        return list(merged.values())

    def table(self) -> str:
        """The last check as a text table."""
        rows = [
            (
                c.module or "<root>",
                "backward" if c.backward else "forward",
                f"{c.amax:.4g}",
                str(c.nonfinite),
                f"{c.count:,}",
            )
            for c in self.latest()
        ]
        if not rows:
            return "no check yet"
        return format_table(
            ("module", "pass", "amax", "non-finite", "values"), rows, right=frozenset({2, 3, 4})
        )

    def write(self, path: str | os.PathLike) -> None:
        """Appends the checks received since the last write to ``path`` as JSON lines."""
        with open(path, "a") as f:
            for c in self.checks[self._written :]:
                f.write(json.dumps(c.to_dict()) + "\n")
        self._written = len(self.checks)
