"""mpjax.PrecisionMonitor: per-module amax and non-finite counts measured inside a jitted
step on check steps only, for autocast functions, linen and NNX models."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import tolerance

import mpjax


def _loss(w, x):
    with jax.named_scope("proj"):
        h = x @ w
    with jax.named_scope("act"):
        return jnp.sum(jnp.tanh(h))


def _callbacks(jaxpr) -> int:
    """How many debug callbacks ``jaxpr`` runs, in its sub-jaxprs too."""
    found = 0
    for eqn in jaxpr.eqns:
        found += eqn.primitive.name == "debug_callback"
        for sub in mpjax.jax_compat.sub_jaxprs(eqn):
            found += _callbacks(getattr(sub, "jaxpr", sub))
    return found


def test_autocast_values_are_measured_on_check_steps_only():
    f = mpjax.autocast(_loss, "mixed_bfloat16")
    monitor = mpjax.PrecisionMonitor(every=3)
    step = monitor.wrap(jax.grad(f))
    w = np.full((4, 2), 0.5, np.float32)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)  # exact in bfloat16
    for i in range(7):
        step(i, w, x)
    jax.effects_barrier()
    assert sorted({c.step for c in monitor.checks}) == [0, 3, 6]
    proj = [c for c in monitor.checks if c.module == "proj" and not c.backward]
    # proj computes x, w in bfloat16 and x @ w: its largest value is the last row's sum, 19.
    assert [c.amax for c in proj] == [float(np.max(x @ w))] * 3
    assert all(c.nonfinite == 0 for c in monitor.checks)
    latest = {(c.module, c.backward): c for c in monitor.latest()}
    assert latest["act", False].amax == pytest.approx(np.sum(np.tanh(x @ w)), rel=1e-2)
    # Backward: the gradients of what proj computes, x @ w (1 - tanh**2, at most 1) and the
    # bfloat16 w (x.T @ that); x is not differentiated. Those of act's tanh and sum are ones.
    dh = 1 - np.tanh(x @ w) ** 2
    assert latest["proj", True].amax == pytest.approx(np.max(np.abs(x.T @ dh)), rel=1e-2)
    assert latest["proj", True].count == dh.size + w.size
    assert latest["act", True].amax == 1.0
    assert [c.backward for c in monitor.latest()] == [False, False, True, True]
    assert "proj" in monitor.table() and "backward" in monitor.table()


def test_the_steps_between_checks_run_the_plain_step():
    f = mpjax.autocast(_loss, "mixed_bfloat16")
    monitor = mpjax.PrecisionMonitor(every=100)
    calls = []

    def step_fn(w, x):
        calls.append("traced")
        return jax.grad(f)(w, x)

    step = monitor.wrap(step_fn)
    w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
    assert _callbacks(jax.make_jaxpr(step_fn)(w, x).jaxpr) == 0
    traced = len(calls)
    for i in range(1, 4):  # steps between checks: the plain step, traced once at most
        step(i, w, x)
    jax.effects_barrier()
    assert monitor.checks == [] and len(calls) - traced <= 1
    step(100, w, x)
    jax.effects_barrier()
    assert {c.step for c in monitor.checks} == {100}
    with pytest.raises(TypeError, match="step must be the step number as an int"):
        jax.jit(step)(jnp.int32(0), w, x)


@jax.custom_vjp
def _clipped(x):
    return jnp.clip(x, -1.0, 1.0)


_clipped.defvjp(lambda x: (_clipped(x), x), lambda x, g: (jnp.where(jnp.abs(x) < 1, g, 0.0),))


def test_custom_derivatives_are_measured_by_their_values_not_their_tangents():
    # relu and softmax have custom JVP rules, _clipped a custom VJP: under jax.grad the rules
    # run, and what they compute from tangents and cotangents is not a value of the model.
    def loss(w, x):
        with jax.named_scope("act"):
            h = jax.nn.relu(x @ w)
        with jax.named_scope("probs"):
            p = jax.nn.softmax(h) + _clipped(h)
        return jnp.sum(p * p)

    monitor = mpjax.PrecisionMonitor(every=1)
    w, x = np.full((4, 2), 0.5, np.float32), np.arange(-6, 6, dtype=np.float32).reshape(3, 4)
    grads = monitor.wrap(jax.grad(mpjax.autocast(loss, "mixed_bfloat16")))(0, w, x)
    jax.effects_barrier()
    np.testing.assert_allclose(grads, jax.grad(loss)(w, x), rtol=tolerance(jnp.bfloat16, 4) * 8)
    rows = {(c.module, c.backward): c for c in monitor.latest()}
    # act computes x @ w and its relu (one operation, by its outputs: neither the rule's
    # tangents nor the primal inside), exactly.
    assert rows["act", False].amax == np.max(np.abs(x @ w))
    assert rows["act", False].count == 2 * (x @ w).size
    assert rows["probs", False].amax >= 1.0 and rows["probs", True].nonfinite == 0


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        mean_square = jnp.einsum("...d,...d->...", x, x)[..., None] / x.shape[-1]
        return x * jax.lax.rsqrt(mean_square + 1e-6)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="out")(RMSNorm(name="norm")(nn.Dense(16, name="up")(x)))


@pytest.mark.slow
def test_a_linen_models_modules_are_measured_and_its_overflow_counted(tmp_path):
    model = mpjax.linen.apply_policy(Net(), "mixed_float16")
    x = jnp.full((2, 4), 100.0)
    variables = model.init(jax.random.key(0), x)
    monitor = mpjax.PrecisionMonitor(every=2)

    def train_step(variables, x):
        return jax.grad(lambda v: jnp.sum(model.apply(v, x)))(variables)

    step = monitor.wrap(train_step)
    for i in range(3):
        step(i, variables, x)
    jax.effects_barrier()
    forward = {c.module: c for c in monitor.latest() if not c.backward}
    assert {"up", "norm", "out"} <= set(forward)
    assert forward["norm"].nonfinite > 0 and forward["up"].nonfinite == 0
    # The gradients of every module's values: the up kernel's among them, cast to float16.
    backward = {c.module: c for c in monitor.latest() if c.backward}
    assert {"up", "norm", "out"} <= set(backward)
    assert backward["up"].count >= variables["params"]["up"]["kernel"].size
    monitor.write(tmp_path / "ranges.jsonl")
    lines = (tmp_path / "ranges.jsonl").read_text().splitlines()
    assert len(lines) == len(monitor.checks) and '"module": "norm"' in "".join(lines)


def test_an_nnx_models_modules_are_measured():
    class Block(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(4, 3, use_bias=False, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return jnp.sum(self.proj(x))

    model = Block()
    mpjax.nnx.set_policy(model, "mixed_bfloat16")
    graphdef, state = nnx.split(model)
    monitor = mpjax.PrecisionMonitor(every=1)

    def train_step(state, x):
        return jax.grad(lambda s: nnx.merge(graphdef, s)(x))(state)

    monitor.wrap(train_step)(0, state, jnp.ones((2, 4)))
    jax.effects_barrier()
    kernel = np.asarray(model.proj.kernel.get_value())
    latest = {(c.module, c.backward): c for c in monitor.latest()}
    expected = max(np.max(np.abs(kernel)), np.max(np.abs(np.ones((2, 4)) @ kernel)))
    assert latest["proj", False].amax == pytest.approx(expected, rel=1e-2)
    # The gradient of the sum: ones for proj's output, x.T @ ones (2 everywhere) for its kernel.
    assert latest["proj", True].amax == 2.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="every"):
        mpjax.PrecisionMonitor(every=0)
    with pytest.raises(TypeError, match="step_fn must be the train step function"):
        mpjax.PrecisionMonitor(every=2).wrap(3)
    with pytest.raises(TypeError, match="jit=...\\) must compile a function"):
        mpjax.PrecisionMonitor(every=2).wrap(jnp.sin, jit="filter_jit")
    with pytest.raises(TypeError, match="with jit=..., donate through it"):
        mpjax.PrecisionMonitor(every=2).wrap(jnp.sin, donate_argnums=0, jit=jax.jit)
