"""``mpjax.diagnose``: where a model's numbers leave a dtype's range under a policy, where
precision is lost, where a non-finite value is born, and what to do about it.

The target runs under the policy as one jaxpr (forward and, for a loss, backward), and that
jaxpr is evaluated twice side by side, equation by equation, as it runs and exactly in
float32 (:mod:`mpjax.doctor.side_by_side`, which says what is measured). The measures of each batch
become a :class:`mpjax.doctor.diagnosis_report.DiagnosisReport` (ranges per module and per
primitive, the precision lost per module, the first non-finite birth), with the
recommendations of :mod:`mpjax.doctor.recommendations`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax.casting.trace_context import running_models
from mpjax.doctor.diagnosis_report import Birth, DiagnosisReport, ErrorRow, RangeRow
from mpjax.doctor.range_stats import DTYPES, RangeStats, check_dtypes
from mpjax.doctor.recommendations import (
    float16_gradients,
    fp8_fitness,
    keep_in_float32,
    loss_scale_advice,
    routing_changes,
)
from mpjax.doctor.side_by_side import STRUCTURAL, Evaluation, Kernels, to_exact
from mpjax.inspection.describe import Runner, runner_of
from mpjax.inspection.report import unflatten_with
from mpjax.policy import is_floating
from mpjax.rules import (
    Rules,
    RulesLike,
    UnmatchedRuleError,
    as_rules,
    reported_as,
    router_policy,
)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


@dataclasses.dataclass
class _Trace:
    """The jaxpr of the target under the policy for one input structure, the kernels its
    evaluations share, and the latest evaluation (what it measured where)."""

    closed: Any
    backward: bool
    floating: list[int]  # the positions of the differentiated leaves among the array leaves
    rules: Rules  # those it runs under: the doctor's, or those of the models it runs
    kernels: Kernels = dataclasses.field(default_factory=Kernels)
    evaluation: Evaluation = dataclasses.field(init=False)  # set by each evaluate

    def evaluate(self, array_leaves: list, compare: bool) -> dict[str, np.ndarray]:
        # The jaxpr takes the floating leaves (differentiated), then all the array leaves.
        flat = [array_leaves[i] for i in self.floating] + list(array_leaves)
        evaluation = Evaluation(compare, self.kernels)
        evaluation.run(self.closed, [to_exact(x) for x in flat], flat)
        self.evaluation = evaluation
        return evaluation.assemble()


class Doctor:
    """What :func:`diagnose` returns: call it with the target's inputs for the report of one
    batch, or use :meth:`over` for several batches (needed to judge fp8 fitness)."""

    def __init__(self, runner, rules, loss, dtypes, max_error, compare, name):
        self._runner = runner
        self._rules = rules  # None: those of the wrapped models the target runs
        self._loss = loss
        self._dtypes = dtypes
        self._max_error = max_error
        self._compare = compare
        self._name = name
        self._traces: dict[Any, _Trace] = {}

    def __repr__(self) -> str:
        under = "its models' policy" if self._rules is None else str(self._rules.default)
        return (
            f"<Doctor of {self._name} under {under}: call it with {self._name}'s inputs, "
            "doctor(*inputs), for the report, or doctor.over(batches) for several>"
        )

    def __call__(self, *inputs, **kwargs) -> DiagnosisReport:
        return self.over([(inputs, kwargs)])

    def over(self, batches: Iterable[Any]) -> DiagnosisReport:
        """The report over several batches: ranges of all of them, the first birth, the
        largest errors, and the fp8 fitness from how each matmul's amax moves between them.

        Args:
          batches: each a tuple of the target's positional inputs, or an ``(args, kwargs)``
            pair of a tuple and a dict.
        """
        results = []
        prefix: tuple | None = None
        for batch in batches:
            if (
                isinstance(batch, tuple)
                and len(batch) == 2
                and isinstance(batch[0], tuple)
                and isinstance(batch[1], Mapping)
            ):
                inputs, kwargs = batch
            else:
                inputs, kwargs = (batch if isinstance(batch, tuple) else (batch,)), {}
            if prefix is None:
                args, kwargs = self._runner.arguments(tuple(inputs), dict(kwargs))
                prefix = args[: len(args) - len(inputs)]
            else:
                args = (*prefix, *inputs)
            with reported_as("mpjax.diagnose()"):
                results.append(self._run(args, kwargs))
        if not results:
            raise ValueError("diagnose(...).over(batches): batches is empty; give at least one.")
        return _report(results, results[0][0].rules, self._dtypes, self._max_error)

    def _run(self, args: tuple, kwargs: dict) -> tuple[_Trace, dict[str, np.ndarray]]:
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        static = tuple((i, leaf) for i, leaf in enumerate(leaves) if not _is_array(leaf))
        key: Any = (tree, static, tuple(jax.typeof(leaves[i]) for i in dynamic))
        try:
            hash(key)
        except TypeError:
            key = None
        trace = self._traces.get(key) if key is not None else None
        if trace is None:
            trace = self._trace(leaves, tree, dynamic)
            if key is not None:
                self._traces[key] = trace
        return trace, trace.evaluate([leaves[i] for i in dynamic], self._compare)

    def _trace(self, leaves, tree, dynamic) -> _Trace:
        floating = [i for i in dynamic if is_floating(leaves[i])]
        loss = self._loss
        fn = self._runner.as_is
        rules = self._rules

        def value(float_leaves, array_leaves):
            call_args, call_kwargs = unflatten_with(
                tree, leaves, (dynamic, array_leaves), (floating, float_leaves)
            )
            if self._rules is None:  # each wrapped model under its own
                out = fn(*call_args, **call_kwargs)
            else:  # every wrapped model the target runs under the rules diagnosed
                with running_models(rules):
                    out = fn(*call_args, **call_kwargs)
            return out if loss is None else loss(out)

        float_leaves = [leaves[i] for i in floating]
        array_leaves = [leaves[i] for i in dynamic]

        def shape_of() -> Any:
            try:
                return jax.eval_shape(value, float_leaves, array_leaves)
            except UnmatchedRuleError:  # the rules' fault, not the inputs': it says so itself
                raise
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"diagnose(...)(*inputs): {self._name} cannot run on these inputs: {error}"
                ) from error

        if rules is None:  # as it runs: the rules of the wrapped models it runs are its own
            with running_models() as ran:
                shape = shape_of()
            rules = _found_rules(ran.seen, self._name)
        else:
            fn = self._runner.under(rules)
            shape = shape_of()
        backward = (
            isinstance(shape, jax.ShapeDtypeStruct) and shape.shape == () and is_floating(shape)
        )
        if loss is not None and not backward:
            raise ValueError(
                f"diagnose(loss=...) must return a floating scalar (the loss); it returned {shape}."
            )

        def step(float_leaves, array_leaves):
            if not backward:
                return value(float_leaves, array_leaves)
            return jax.value_and_grad(value)(float_leaves, array_leaves)

        closed = jax.make_jaxpr(step)(float_leaves, array_leaves)
        return _Trace(closed, backward, [dynamic.index(i) for i in floating], rules)


def _found_rules(seen: list[tuple[str, Rules]], name: str) -> Rules:
    """The one set of rules of the wrapped models a target ran; a ValueError if there are none
    or several."""
    distinct: list[tuple[str, Rules]] = []
    for model, rules in seen:
        if all(rules != other for _, other in distinct):
            distinct.append((model, rules))
    if len(distinct) == 1:
        return distinct[0][1]
    if not distinct:
        raise ValueError(
            f"diagnose() needs policy=... for {name}: it has no policy of its own and runs no "
            f'model wrapped with one. Pass it, e.g. diagnose({name}, policy="mixed_bfloat16") '
            "(a policy name, a Policy or mpjax.Rules), or run a model wrapped by "
            "mpjax.linen.apply_policy, mpjax.nnx.set_policy or mpjax.equinox.apply_policy."
        )
    models = "; ".join(f"{model} under {_rules_text(rules)}" for model, rules in distinct)
    raise ValueError(
        f"diagnose() found models wrapped with different rules in {name}: {models}. Pass "
        "policy=... (a policy name, a Policy or mpjax.Rules) to diagnose them all under one."
    )


def _rules_text(rules: Rules) -> str:
    keys = [str(getattr(r.key, "__name__", r.key)) for r in rules.rules if not r.builtin]
    return str(rules.default) + (f" with rules for {', '.join(keys)}" if keys else "")


def _report(results, rules: Rules, dtypes, max_error) -> DiagnosisReport:
    trace = results[0][0]
    ev = trace.evaluation
    sites = ev.sites
    indices = ev.indices()
    # Ranges: every batch's values together, by module and by primitive.
    by_module: dict[tuple[str, bool], list] = collections.defaultdict(list)
    by_op: dict[tuple[str, bool], list] = collections.defaultdict(list)
    per_site: dict[int, list[RangeStats]] = collections.defaultdict(list)
    for _, values in results:
        for row, index in enumerate(indices["ranges"]):
            stats = RangeStats.from_summary(
                values["range_counts"][row], values["range_extremes"][row]
            )
            site = sites[index]
            if site.primitive not in STRUCTURAL:  # a gradient's cast: for the loss scale
                by_module[site.module, site.backward].append((site.dtype, stats))
                by_op[site.primitive, site.backward].append((site.dtype, stats))
            per_site[index].append(stats)
    modules = tuple(RangeRow.of(m, b, parts) for (m, b), parts in by_module.items())
    ops = tuple(RangeRow.of(p, b, parts) for (p, b), parts in by_op.items())
    birth = _birth(results, sites, indices["births"])
    errors = _errors(results, sites, indices["errors"])
    # The ranges of the module rows, as the policy runs them, decide what is kept in float32
    # (a gradient's cast overflows at a birth or under a loss scale, not in a row).
    in_rows = {i: p for i, p in per_site.items() if sites[i].primitive not in STRUCTURAL}
    reasons, keep = keep_in_float32(in_rows, sites, birth, errors, max_error)
    routing = routing_changes(results, sites, ev.routing)
    routers: list[str] = list(
        dict.fromkeys(
            r.logits_module
            for r in routing
            if r.recommend and r.logits_module is not None and r.logits_module not in keep
        )
    )
    recommended = None
    if keep or routers:
        recommended = rules
        f32 = (
            rules.default.with_compute_dtype(jnp.float32)
            .with_fp8(None)
            .with_f32_matmul_precision("highest")
        )
        for path in reversed(keep):
            # The root's own operations run under the default policy, which no rule replaces.
            if path:
                recommended = recommended.with_rule(path, f32)
            else:
                recommended = recommended.with_default(f32)
        for path in routers:
            recommended = recommended.with_rule(path, router_policy(rules.default))
    reasons += [r.why for r in routing if r.recommend and r.logits_module in routers]
    keep += routers
    gradients = float16_gradients(per_site, sites)
    loss_scale = loss_scale_advice(gradients) if gradients is not None else None
    fp8 = fp8_fitness(results, sites, indices["dots"])
    return DiagnosisReport(
        policy=rules,
        dtypes=dtypes,
        batches=len(results),
        modules=modules,
        ops=ops,
        errors=errors,
        birth=birth,
        rules=recommended,
        reasons=tuple(reasons),
        loss_scale=loss_scale,
        fp8=fp8,
        keep=tuple(keep),
        max_error=max_error,
        routing=routing,
    )


def _birth(results, sites, indices) -> Birth | None:
    for batch, (_, values) in enumerate(results):
        for row, index in enumerate(indices):
            out_bad, in_bad = values["births"][row]
            if out_bad > 0 and in_bad == 0:
                s = sites[index]
                return Birth(
                    s.module, s.primitive, s.location, s.backward, s.dtype, int(out_bad), batch
                )
    return None


def _errors(results, sites, indices) -> tuple[ErrorRow, ...]:
    worst: dict[str, ErrorRow] = {}
    for _, values in results:
        for row, index in enumerate(indices):
            local, accumulated = (float(v) for v in values["errors"][row])
            s = sites[index]
            old = worst.get(s.module)
            if old is None:
                worst[s.module] = ErrorRow(s.module, local, s.primitive, s.location, accumulated)
                continue
            if local > old.local:
                old = dataclasses.replace(
                    old, local=local, primitive=s.primitive, location=s.location
                )
            worst[s.module] = dataclasses.replace(
                old, accumulated=max(old.accumulated, accumulated)
            )
    return tuple(worst.values())


def diagnose(
    target: Any,
    *early: Any,
    policy: RulesLike | None = None,
    loss: Callable[[Any], Any] | None = None,
    variables: Any = None,
    rngs: Any = None,
    method: Any = None,
    dtypes: Sequence[Any] = DTYPES,
    max_error: float = 0.05,
    compare: bool = True,
) -> Doctor:
    """The precision doctor, curried like :func:`mpjax.describe`:
    ``diagnose(target, policy=...)(*inputs)`` returns a
    :class:`~mpjax.doctor.diagnosis_report.DiagnosisReport`.

    The target runs under the policy, forward and, when it returns a scalar (or ``loss`` makes
    one of its output), backward with respect to every floating input (a linen model's
    variables, an NNX model's state, a function's array arguments), and side by side in
    float32. The report gives, per module and per primitive, the ranges of the values of the
    float32 run (largest and smallest nonzero magnitude, log2 histogram, and the shares that
    would overflow, become subnormal or flush to zero in each of ``dtypes``); per module, the
    relative error that enters there under the policy; the first operation whose inputs are
    finite and whose output is not; and recommendations: :class:`mpjax.Rules` that keep the
    modules that overflow or lose too much in float32, the loss scales that keep float16
    gradients in range, and which matmuls are fit for fp8 (with :meth:`Doctor.over` several
    batches).

    The target may be the function a user trains with, such as ``loss_fn(model, x, y)``
    that vmaps the model over the batch: it runs through :func:`mpjax.autocast` with the
    leaves of its arguments that are not arrays held static (as ``eqx.filter_jit`` holds a
    module's float fields), the Equinox and NNX models among its arguments under the policy
    (copies: the arguments are left as they are), and the report names their own paths
    (``blocks[0].attn``, ``blocks/0/proj``); a linen model it applies (a function of
    ``variables``) runs under the policy if it is wrapped, with its paths (``Block_0/mlp``;
    the layers of ``nn.scan`` under their scanned names).

    Args:
      target: a function (run through :func:`mpjax.autocast`, as above), a function made by
        :func:`mpjax.autocast`, a linen module (wrapped by :func:`mpjax.linen.apply_policy`
        or not), an NNX module (with a policy set or not) or an Equinox module (wrapped by
        :func:`mpjax.equinox.apply_policy` or not).
      policy: the policy or :class:`mpjax.Rules` to diagnose; every model the target runs,
        wrapped or not, runs under it. By default those of the target: a wrapped model's, an
        autocast function's, or for any other function those of the wrapped models it runs,
        found as they run (one policy, or the call raises): the function then runs as it is,
        each wrapped model under its own rules and the code around them in float32.
      loss: a function of the target's output that returns the loss, to diagnose the backward
        pass of a target that does not return a scalar.
      variables, rngs, method: for a linen module, as for :func:`mpjax.describe` (the
        variables are initialized from the inputs when not given).
      dtypes: the dtypes whose range is reported, among ``float16``, ``bfloat16``,
        ``float8_e4m3fn`` and ``float8_e5m2``.
      max_error: a module whose operations make a larger relative error than this on exact
        inputs is recommended to stay in float32.
      compare: measure the precision lost (runs each forward operation once more); False
        gives the ranges, the birth and the recommendations from them alone, faster.

    Returns:
      A :class:`Doctor`: call it with the target's inputs as the target takes them (a linen
      model's variables go to ``variables=``, not with the inputs).

    Raises:
      TypeError: for a target that is neither a function nor a model mpjax runs, an option
        that does not apply to it, or inputs given here rather than to the :class:`Doctor`;
        when called, a linen model's variables given as its first input.
      ValueError: for a dtype it does not measure, no policy for a model that has none, a
        negative ``max_error``; when called, inputs that the target cannot run on (inputs of
        a shape a linen model's variables do not fit included), or a function without
        ``policy=`` that runs no wrapped model or several under different rules.

    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     with jax.named_scope("gram"):
    ...         g = x @ x.T  # 8 * 100**2: past float16's 65504
    ...     return jnp.sum(jnp.tanh(g))
    >>> report = diagnose(f, policy="mixed_float16")(jnp.full((4, 8), 100.0))
    >>> print(report.birth.module, report.birth.primitive, report.birth.dtype)
    gram dot_general float16
    >>> [rule.key for rule in report.rules.rules if not rule.builtin]
    ['gram']
    """
    if early:
        raise TypeError(
            f"diagnose(target, ...) takes only the target and its options; it got "
            f"{len(early)} more positional argument(s). The inputs come in a second call, as "
            "for jax.make_jaxpr: diagnose(target, policy=...)(*inputs); a linen model's "
            "variables go to diagnose(model, variables=...)(*inputs)."
        )
    dtypes = check_dtypes(dtypes, "diagnose")
    if not isinstance(max_error, int | float) or max_error < 0:
        raise ValueError(f"diagnose(max_error=...) must be a number >= 0; got {max_error!r}.")
    if not isinstance(compare, bool):
        raise TypeError(f"diagnose(compare=...) must be a bool; got {compare!r}.")
    if loss is not None and not callable(loss):
        raise TypeError(
            f"diagnose(loss=...) must be a function of the target's output; got {loss!r}."
        )
    with reported_as("mpjax.diagnose()"):
        runner: Runner = runner_of(
            target, "diagnose", variables=variables, rngs=rngs, method=method
        )
    name = getattr(target, "__name__", None) or type(target).__name__
    if policy is None:
        if runner.rules is None and runner.as_is is None:
            raise ValueError(
                f"diagnose() needs policy=... for this {type(target).__name__}, which has no "
                f'policy of its own: diagnose(model, policy="mixed_bfloat16") (a policy '
                "name, a Policy or mpjax.Rules), or the model wrapped with a policy."
            )
        rules = runner.rules
    else:
        rules = as_rules(policy, "policy")
    return Doctor(runner, rules, loss, dtypes, float(max_error), compare, name)
