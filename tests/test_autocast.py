"""mpjax.autocast: dtypes read back from the transformed jaxpr/HLO, numerics against f32."""

import functools
import json
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.extend.core import Primitive
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from stock_models import Block, HandWrittenBlock

import mpjax
from mpjax import jax_compat
from mpjax.inspection.matmuls import iter_equations

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
K1, K2, K3 = jax.random.split(jax.random.key(0), 3)
W = jax.random.normal(K1, (8, 8)) / 3
X = jax.random.normal(K2, (4, 8))
BF16_RTOL = 0.05  # a few bf16 roundings (8 mantissa bits) through a small network


def _inputs(fn, *args, primitive):
    """Input dtypes of every ``primitive`` equation of ``fn`` (nested jaxprs included)."""
    return [
        tuple(np.dtype(v.aval.dtype) for v in eqn.invars)
        for eqn, _ in iter_equations(fn, *args)
        if eqn.primitive.name == primitive
    ]


def _assert_bf16_matmuls(report, count=None, gradients=False):
    """bf16 operands everywhere. Results in bf16, except, with ``gradients``, those of the
    backward matmuls that compute the gradient of an f32 value the policy cast down (a param,
    an f32 input): written in the policy's reduce dtype, f32, and at least one of them."""
    assert report, "no matmuls found"
    assert report.operand_dtypes() == {("bfloat16", "bfloat16"): len(report)}, str(report)
    # JAX's default (None) or the compute dtype for a bf16 result: an f32 accumulation type in
    # the forward pass would give the backward pass f32 cotangents, and so f32 x bf16 dots
    # that XLA runs as f32 GEMMs.
    bf16 = [m for m in report if m.out_dtype == BF16]
    assert all(m.preferred_element_type in (None, BF16) for m in bf16), str(report)
    f32 = [m for m in report if m.out_dtype != BF16]
    assert all(m.out_dtype == m.preferred_element_type == F32 for m in f32), str(report)
    assert bool(f32) == gradients, str(report)
    if count is not None:
        assert len(report) == count, str(report)


def _close(a, b, rtol=BF16_RTOL):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


# --- Matmuls in bf16, forward and backward, in every higher-order primitive. ------------------


@jax.custom_jvp
def _sin_matmul(a, w):
    return jnp.sin(a @ w)


@_sin_matmul.defjvp
def _sin_matmul_jvp(primals, tangents):
    (a, w), (da, dw) = primals, tangents
    return _sin_matmul(a, w), jnp.cos(a @ w) * (da @ w + a @ dw)


@jax.custom_vjp
def _tanh_matmul(a, w):
    return jnp.tanh(a @ w)


def _tanh_matmul_fwd(a, w):
    y = jnp.tanh(a @ w)
    return y, (a, w, 1 - y * y)


def _tanh_matmul_bwd(res, g):
    a, w, dy = res
    g = g * dy
    return g @ w.T, a.T @ g


_tanh_matmul.defvjp(_tanh_matmul_fwd, _tanh_matmul_bwd)

_MESH = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))

CASES = {
    "jit": (lambda w, x: jax.jit(lambda a: jnp.sin(a @ w))(x), "jit"),
    "scan": (
        lambda w, x: lax.scan(lambda c, xi: (jnp.tanh(c @ w) + xi, c.sum()), x, jnp.stack([x, x]))[
            0
        ],
        "scan",
    ),
    "fori_loop": (lambda w, x: lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x), "scan"),
    "remat": (jax.checkpoint(lambda w, x: jnp.sin(x @ w)), "checkpoint"),
    "cond": (
        lambda w, x: lax.cond(x.sum() > 0, lambda a: jnp.sin(a @ w), lambda a: a @ w.T, x),
        "cond",
    ),
    "custom_jvp": (lambda w, x: _sin_matmul(x, w), "custom_jvp_call"),
    "custom_vjp": (lambda w, x: _tanh_matmul(x, w), "custom_vjp_call"),
    "shard_map": (
        lambda w, x: jax.shard_map(
            lambda a: jax.nn.relu(a @ w), mesh=_MESH, in_specs=P("d"), out_specs=P("d")
        )(jnp.concatenate([x, x])),
        "shard_map",
    ),
    "nested": (
        lambda w, x: jax.jit(
            lambda x: lax.scan(
                lambda c, _: (jax.checkpoint(lambda c: jax.nn.relu(_tanh_matmul(c, w)))(c), None),
                x,
                None,
                length=2,
            )[0]
        )(x),
        "custom_vjp_call",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matmuls_run_in_bf16_forward_and_backward_inside_higher_order_primitives(case):
    fn, context = CASES[case]
    auto = mpjax.autocast(fn)
    forward = mpjax.inspect_matmuls(auto)(W, X)
    _assert_bf16_matmuls(forward)
    assert all(context in "/".join(m.context) or context == "checkpoint" for m in forward)

    loss = lambda w: jnp.sum(auto(w, X) ** 2)  # noqa: E731
    backward = mpjax.inspect_matmuls(jax.grad(loss))(W)
    # Forward and backward matmuls alike: bf16 operands, never an f32 x bf16 dot. The
    # gradients of the f32 values cast down are written in f32, except where the user's custom
    # derivative rules compute them.
    custom = context.startswith("custom") or case == "nested"
    _assert_bf16_matmuls(backward, gradients=not custom)
    assert len(backward) > len(forward)

    out, grad = auto(W, X), jax.grad(loss)(W)
    assert out.dtype == F32 and grad.dtype == F32
    _close(out, fn(W, X))
    _close(grad, jax.grad(lambda w: jnp.sum(fn(w, X) ** 2))(W), rtol=0.1)


def test_remat_keeps_its_policy_and_prevent_cse():
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    fn = jax.checkpoint(lambda w, x: jnp.sin(x @ w), policy=policy, prevent_cse=False)
    eqns = [
        e
        for e, _ in iter_equations(mpjax.autocast(fn), W, X)
        if e.primitive.name in ("remat2", "checkpoint")
    ]
    assert len(eqns) == 1
    assert eqns[0].params["policy"] is policy and eqns[0].params["prevent_cse"] is False


def test_call_primitives_inside_a_traced_gradient_are_autocast():
    # jax.grad of jax.checkpoint leaves a call primitive in the jaxpr: closed_call, or
    # eval_jaxpr from jax 0.11. Autocast evaluates it inline, as any other call.
    @jax.checkpoint
    def loss(w, x):
        return jnp.sum(lax.scan(lambda c, _: (jnp.sin(c @ w), None), x, None, length=2)[0] ** 2)

    grad = jax.grad(loss)
    called = {e.primitive.name for e, _ in iter_equations(grad, W, X)}
    assert called & jax_compat.CALL_PRIMITIVES, sorted(called)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.AutocastWarning)
        auto = mpjax.autocast(grad)
        report = mpjax.inspect_matmuls(auto)(W, X)
        _close(auto(W, X), grad(W, X), rtol=0.1)
    _assert_bf16_matmuls(report)


def test_while_loop_matmuls_run_in_bf16_and_carries_keep_their_dtype():
    def fn(w, x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))

    auto = mpjax.autocast(fn)
    report = mpjax.inspect_matmuls(auto)(W, X)
    _assert_bf16_matmuls(report, count=1)
    assert report[0].context == ("while",)
    (loop,) = [e for e, _ in iter_equations(auto, W, X) if e.primitive.name == "while"]
    assert [np.dtype(v.aval.dtype) for v in loop.outvars] == [np.dtype(jnp.int32), F32]
    count, out = auto(W, X)
    assert int(count) == 3 and count.dtype == jnp.int32
    _close(out, fn(W, X)[1])
    # Forward-mode differentiation goes through the loop (reverse mode is JAX's limit).
    tangent = jax.jvp(lambda w: auto(w, X)[1], (W,), (jnp.ones_like(W),))[1]
    _close(tangent, jax.jvp(lambda w: fn(w, X)[1], (W,), (jnp.ones_like(W),))[1], rtol=0.1)


def test_custom_rules_stay_custom():
    calls = []

    @jax.custom_vjp
    def clip_gradient(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        calls.append(g.dtype)
        return (jnp.clip(g, -1e-3, 1e-3),)

    clip_gradient.defvjp(fwd, bwd)
    grad = jax.grad(lambda w: mpjax.autocast(lambda w: clip_gradient(X @ w).sum())(w))(W)
    assert calls and grad.dtype == F32
    # The custom bwd clipped the cotangent of ones to 1e-3: the gradient is X.T @ 1e-3.
    _close(grad, X.T @ jnp.full((4, 8), 1e-3))


# --- f32 pieces: softmax, log-softmax, logsumexp, norms, losses. -----------------------------


@pytest.mark.parametrize(
    "fn",
    [jax.nn.softmax, jax.nn.log_softmax, jax.scipy.special.logsumexp],
    ids=["softmax", "log_softmax", "logsumexp"],
)
def test_softmax_logsoftmax_and_logsumexp_run_in_f32_on_bf16_logits(fn):
    auto = mpjax.autocast(lambda w, x: fn(x @ w))
    for name in ("reduce_max", "exp", "reduce_sum"):
        found = _inputs(auto, W, X, primitive=name)
        assert found and all(d == F32 for dts in found for d in dts), (name, found)
    if fn is not jax.nn.softmax:
        assert all(d == F32 for dts in _inputs(auto, W, X, primitive="log") for d in dts)
    _close(auto(W, X), fn(X @ W), rtol=0.02)
    grads = _inputs(jax.grad(lambda w: auto(w, X).sum()), W, primitive="exp")
    assert grads and all(d == F32 for dts in grads for d in dts)


def test_cross_entropy_pieces_run_in_f32_and_integer_labels_are_untouched():
    labels = jnp.array([1, 0, 3, 7])

    def loss(w, x, labels):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()

    auto = mpjax.autocast(loss)
    for name in ("exp", "log", "reduce_sum", "reduce_max"):
        found = _inputs(auto, W, X, labels, primitive=name)
        assert found and all(d == F32 for dts in found for d in dts), (name, found)
    assert not any(
        np.dtype(v.aval.dtype) != np.dtype(jnp.int32)
        for e, _ in iter_equations(auto, W, X, labels)
        if e.primitive.name == "convert_element_type"
        for v in e.invars
        if not jnp.issubdtype(v.aval.dtype, jnp.floating)
    )
    _close(auto(W, X, labels), loss(W, X, labels), rtol=0.02)


def test_layer_norm_statistics_run_in_f32_flax_and_hand_written():
    def layer_norm(x):
        mean = x.mean(-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + 1e-6)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm(name="ln")(nn.Dense(8, name="proj")(x))

    variables = Net().init(K3, X)
    flax_fn = mpjax.autocast(Net().apply)
    jnp_fn = mpjax.autocast(lambda w, x: layer_norm(x @ w))
    for fn, args in ((flax_fn, (variables, X)), (jnp_fn, (W, X))):
        for name in ("reduce_sum", "rsqrt"):
            found = _inputs(fn, *args, primitive=name)
            assert found and all(d == F32 for dts in found for d in dts), (name, found)
    _close(flax_fn(variables, X), Net().apply(variables, X))
    _close(jnp_fn(W, X), layer_norm(X @ W))


# --- Integers, booleans, PRNG keys; weak scalars; outputs. ------------------------------------


def test_integers_booleans_and_prng_keys_are_untouched():
    def fn(w, x, key, idx):
        noise = jax.random.normal(key, x.shape)
        h = (x + noise) @ w
        best = jnp.argmax(h, axis=-1)
        mask = h > 0
        return h[idx], best, mask.sum(), jax.random.split(key), noise

    args = (W, X, K3, jnp.array([2, 0]))
    auto = mpjax.autocast(fn)

    # Autocast adds float casts only: the converts from or to integers, bools and keys are the
    # function's own.
    def non_float_converts(fn):
        return sorted(
            (str(e.invars[0].aval.dtype), str(e.params["new_dtype"]))
            for e, _ in iter_equations(fn, *args)
            if e.primitive.name == "convert_element_type"
            and not (
                jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)
                and jnp.issubdtype(e.params["new_dtype"], jnp.floating)
            )
        )

    assert non_float_converts(auto) == non_float_converts(fn)
    keys = [
        v.aval.dtype
        for e, _ in iter_equations(auto, *args)
        for v in e.invars
        if jnp.issubdtype(v.aval.dtype, jax.dtypes.prng_key)
    ]
    assert keys and all(str(k) == str(K3.dtype) for k in keys)
    out, ref = auto(*args), fn(*args)
    assert [o.dtype for o in jax.tree.leaves(out)] == [r.dtype for r in jax.tree.leaves(ref)]
    np.testing.assert_array_equal(jax.random.key_data(out[3]), jax.random.key_data(ref[3]))
    np.testing.assert_array_equal(out[4], ref[4])  # random numbers: generated as traced, in f32
    _close(out[0], ref[0])


def test_weak_scalars_adapt_to_bf16_instead_of_widening_it():
    auto = mpjax.autocast(lambda w, x: jnp.tanh(jnp.maximum(x @ w * 2.0 + 1, jnp.full_like(x, -3))))
    assert _inputs(auto, W, X, primitive="mul") == [(BF16, BF16)]
    assert _inputs(auto, W, X, primitive="max") == [(BF16, BF16)]  # full_like: a constant
    assert _inputs(auto, W, X, primitive="tanh") == [(BF16,)]


@pytest.mark.parametrize(
    "policy, dtype",
    [("mixed_bfloat16", F32), ("c=bf16", BF16), ("mixed_float16", F32), ("float32", F32)],
)
def test_floating_outputs_take_the_output_dtype_and_matmuls_the_compute_dtype(policy, dtype):
    auto = mpjax.autocast(lambda w, x: (x @ w, jnp.argmax(x, -1)), policy)
    out, idx = auto(W, X)
    assert out.dtype == dtype and idx.dtype == jnp.int32
    compute = mpjax.get_policy(policy).compute_dtype
    assert {m.lhs_dtype for m in mpjax.inspect_matmuls(auto)(W, X)} == {compute}


# --- Composition. ------------------------------------------------------------------------------


def _mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


MLP_PARAMS = {"w1": W, "b1": jnp.zeros(8), "w2": W.T, "b2": jnp.ones(8)}


def test_python_floats_are_traced_like_jit_traces_them_ints_and_bools_stay_static():
    traces = []

    def fn(w, x, scale, n, relu):
        y = (x @ w) * scale
        return (jax.nn.relu(y) if relu else y), jnp.zeros((n,)) + scale

    def counted(w, x, scale, n, relu):
        traces.append(n)  # runs once per trace
        return fn(w, x, scale, n, relu)

    auto = mpjax.autocast(counted)
    (a, za), (b, zb) = auto(W, X, 0.1, 3, True), auto(W, X, 0.2, 3, True)
    assert traces == [3]  # one trace for both float values
    assert a.dtype == b.dtype == F32 and za.shape == (3,)
    np.testing.assert_array_equal(b, 2 * a)  # bf16(0.2) is 2 * bf16(0.1): the same roundings
    np.testing.assert_array_equal(zb, np.full(3, 0.2, np.float32))
    # Dtype promotion is that of the Python number: bit for bit what a closed-over 0.1 gives.
    closed = mpjax.autocast(lambda w, x: fn(w, x, 0.1, 3, True))(W, X)
    np.testing.assert_array_equal(a, closed[0])
    # An int is a shape and a bool a Python branch: both static, a new value traces again.
    (c, zc), (d, _) = auto(W, X, 0.1, 5, True), auto(W, X, 0.1, 5, False)
    assert traces == [3, 5, 5] and zc.shape == (5,)
    np.testing.assert_array_equal(c, a)
    assert (np.asarray(d) < 0).any() and not (np.asarray(c) < 0).any()
    complex_traces = []

    def rotate(x, c):
        complex_traces.append(1)
        return jnp.abs(x.astype(jnp.complex64) * c)

    rotated = mpjax.autocast(rotate)
    np.testing.assert_array_equal(rotated(X, 1j), jnp.abs(X))
    np.testing.assert_array_equal(rotated(X, -1j), jnp.abs(X))
    assert len(complex_traces) == 1 and traces == [3, 5, 5]  # complex numbers are traced too
    # The scale multiplies the bf16 matmul output in bf16, as a closed-over 0.1 would.
    assert _inputs(lambda s: auto(W, X, s, 3, True), 0.1, primitive="mul") == [(BF16, BF16)]


def test_jit_grad_vmap_of_autocast_and_no_retrace():
    traces = []

    def mlp(params, x):
        traces.append(1)
        return _mlp(params, x)

    auto = mpjax.autocast(mlp)
    step = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(auto(p, x) ** 2)))
    (loss, grads), _ = step(MLP_PARAMS, X), step(MLP_PARAMS, X + 1)
    assert len(traces) == 1  # one trace of mlp for the jitted step, none on the second call
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}  # grads in the param dtype
    ref_loss, ref_grads = jax.value_and_grad(lambda p: jnp.mean(_mlp(p, X) ** 2))(MLP_PARAMS)
    _close(loss, ref_loss)
    jax.tree.map(lambda a, b: _close(a, b, rtol=0.1), grads, ref_grads)
    assert step._cache_size() == 1

    batched = jax.vmap(auto, in_axes=(None, 0))(MLP_PARAMS, X[:, None])
    assert batched.shape == (4, 1, 8) and batched.dtype == F32
    _close(batched[:, 0], _mlp(MLP_PARAMS, X))
    _assert_bf16_matmuls(
        mpjax.inspect_matmuls(
            jax.grad(lambda p: jax.vmap(auto, in_axes=(None, 0))(p, X[:, None]).sum())
        )(MLP_PARAMS),
        gradients=True,
    )


def test_gradients_match_finite_differences():
    fn = mpjax.autocast(lambda p, x: jnp.mean(jax.nn.softmax(_mlp(p, x)) ** 2))
    grad = jax.grad(fn)(MLP_PARAMS, X)["b2"]
    eps = 1e-2
    for i in (0, 3):
        up = dict(MLP_PARAMS, b2=MLP_PARAMS["b2"].at[i].add(eps))
        down = dict(MLP_PARAMS, b2=MLP_PARAMS["b2"].at[i].add(-eps))
        fd = (fn(up, X) - fn(down, X)) / (2 * eps)  # f32 is enough: the output is f32
        np.testing.assert_allclose(grad[i], fd, rtol=0.2, atol=2e-4)


def test_flax_linen_apply_needs_no_change():
    class Classifier(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2)(x)
            return nn.Dense(4)(nn.gelu(nn.Dense(16)(x)).mean(1))

    model, x = Classifier(), jax.random.normal(K2, (2, 4, 8))
    variables = jax.jit(model.init)(K3, x)
    auto = mpjax.autocast(model.apply)
    loss = lambda v: jnp.sum(auto(v, x) ** 2)  # noqa: E731
    # q, k, v, scores, weights x values, out, two Dense: 8 forward, 2 backward each.
    _assert_bf16_matmuls(
        mpjax.inspect_matmuls(jax.grad(loss))(variables), count=8 * 3, gradients=True
    )
    grads = jax.eval_shape(jax.grad(loss), variables)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    _close(jax.jit(auto)(variables, x), jax.jit(model.apply)(variables, x))


def test_nnx_module_call_and_split_merge_need_no_change():
    model = nnx.Sequential(
        nnx.Linear(8, 16, rngs=nnx.Rngs(0)),
        nnx.gelu,
        nnx.LayerNorm(16, rngs=nnx.Rngs(1)),
        nnx.Linear(16, 8, rngs=nnx.Rngs(2)),
    )
    out = mpjax.autocast(model)(X)  # the module itself: its params are read as constants
    assert out.dtype == F32
    _close(out, model(X))
    _assert_bf16_matmuls(mpjax.inspect_matmuls(mpjax.autocast(model))(X), count=2)

    graphdef, state = nnx.split(model)
    auto = mpjax.autocast(lambda state, x: nnx.merge(graphdef, state)(x))
    loss = lambda s: jnp.mean(auto(s, X) ** 2)  # noqa: E731
    # 2 forward; backward 2 for the last layer, 1 for the first (x needs no gradient).
    _assert_bf16_matmuls(mpjax.inspect_matmuls(jax.grad(loss))(state), count=2 + 3, gradients=True)
    assert {g.dtype for g in jax.tree.leaves(jax.eval_shape(jax.grad(loss), state))} == {F32}


def test_jitted_train_step_with_loss_scaling_and_mixed_float16():
    policy = mpjax.get_policy("mixed_float16")
    auto = mpjax.autocast(_mlp, policy)
    tx = mpjax.loss_scaling(optax.adam(1e-2), "dynamic" if policy.needs_loss_scaling else "none")
    y = jnp.sin(X)

    def loss_fn(params):
        return jnp.mean((auto(params, X) - y) ** 2)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: mpjax.scale_loss(loss_fn(p), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    grad = jax.grad(lambda p: mpjax.scale_loss(loss_fn(p), tx.init(p)))
    report = mpjax.inspect_matmuls(grad)(MLP_PARAMS)
    assert report.operand_dtypes() == {("float16", "float16"): len(report)} and len(report) == 5
    params, opt_state = MLP_PARAMS, tx.init(MLP_PARAMS)
    first = loss_fn(params)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam is not strict-promotion clean
        for _ in range(20):
            params, opt_state, _ = step(params, opt_state)
    assert {p.dtype for p in jax.tree.leaves(params)} == {F32}
    assert int(opt_state.applied) == 1 and float(loss_fn(params)) < 0.5 * float(first)


# --- Unknown primitives, regions, categories, errors. --------------------------------------


def _double_primitive():
    prim = Primitive("mpjax_test_double")
    prim.def_impl(lambda x: np.asarray(x) * 2)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    return prim


def test_unknown_primitive_runs_in_its_traced_dtype_and_warns_once():
    double = _double_primitive()
    auto = mpjax.autocast(lambda w, x: double.bind(x @ w) @ w)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = _inputs(auto, W, X, primitive="mpjax_test_double")
        out = auto(W, X)
        auto(W, X[:2])
    assert found == [(F32,)]  # the bf16 matmul result is cast back to the traced f32
    messages = [str(w.message) for w in caught if issubclass(w.category, mpjax.AutocastWarning)]
    assert len(messages) == 1 and "mpjax_test_double" in messages[0], messages
    _close(out, 2 * (X @ W) @ W)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a category silences it and applies
        quiet = mpjax.autocast(
            lambda w, x: double.bind(x @ w), categories={"mpjax_test_double": "keep"}
        )
        assert _inputs(quiet, W, X, primitive="mpjax_test_double") == [(BF16,)]


def test_full_precision_region_keeps_its_matmuls_f32_even_in_nested_jit():
    def fn(w, x):
        h = jnp.tanh(x @ w)
        with mpjax.full_precision():
            h = jax.jit(lambda h: jax.nn.relu(h @ w))(h)
        return h @ w

    report = mpjax.inspect_matmuls(mpjax.autocast(fn))(W, X)
    assert [(m.lhs_dtype, m.rhs_dtype, m.out_dtype) for m in report] == [
        (BF16, BF16, BF16),
        (F32, F32, F32),
        (BF16, BF16, BF16),
    ]
    backward = mpjax.inspect_matmuls(jax.grad(lambda w: mpjax.autocast(fn)(w, X).sum()))(W)
    # bf16: 2 forward, 2 + 1 backward (the first matmul's x needs no gradient); f32: 1 + 2.
    assert backward.operand_dtypes() == {("bfloat16", "bfloat16"): 5, ("float32", "float32"): 3}


def test_scope_rules_give_regions_their_own_policy():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="head")(nn.Dense(8, name="body")(x))

    variables = Net().init(K3, X)
    auto = mpjax.autocast(Net().apply, rules={"*/head": "float32"})
    report = mpjax.inspect_matmuls(auto)(variables, X)
    assert {m.scope: m.lhs_dtype for m in report} == {"Net/body": BF16, "Net/head": F32}

    def fn(w, x):
        with jax.named_scope("attn"):
            x = jax.jit(lambda x: x @ w)(x)  # a region covers what it calls
        return x @ w

    rules = mpjax.Rules({"attn": "float32"}, default="mixed_float16")
    found = [m.lhs_dtype for m in mpjax.inspect_matmuls(mpjax.autocast(fn, rules=rules))(W, X)]
    assert found == [F32, F16]


def test_autocast_wins_over_a_modules_dtype_and_a_rule_or_full_precision_opts_out():
    class Net(nn.Module):
        full_precision_head: bool = False

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8, name="body")(x)
            head = nn.Dense(8, dtype=jnp.float32, param_dtype=jnp.float32, name="head")
            if self.full_precision_head:
                with mpjax.full_precision():
                    return head(h)
            return head(h)

    variables = Net().init(K3, X)

    def matmuls(auto):
        loss = lambda v: auto(v, X).sum()  # noqa: E731
        return {
            (m.scope.rsplit("/", 1)[-1], m.operand_dtypes)
            for m in mpjax.inspect_matmuls(jax.grad(loss))(variables)
        }

    assert matmuls(mpjax.autocast(Net().apply)) == {("body", (BF16, BF16)), ("head", (BF16, BF16))}
    opted_out = {("body", (BF16, BF16)), ("head", (F32, F32))}
    assert matmuls(mpjax.autocast(Net().apply, rules={"*/head": "float32"})) == opted_out
    assert matmuls(mpjax.autocast(Net(full_precision_head=True).apply)) == opted_out


def test_category_overrides_apply_per_primitive():
    fn = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
    assert _inputs(mpjax.autocast(fn), W, X, primitive="tanh") == [(BF16,)]
    assert _inputs(mpjax.autocast(fn, categories={"tanh": "f32"}), W, X, primitive="tanh") == [
        (F32,)
    ]
    promoted = mpjax.autocast(fn, categories={"dot_general": "promote"})
    assert {m.lhs_dtype for m in mpjax.inspect_matmuls(promoted)(W, X)} == {F32}
    assert mpjax.DEFAULT_OP_CATEGORIES["dot_general"] == "lower"
    assert mpjax.DEFAULT_OP_CATEGORIES["exp"] == "f32"


def test_bad_arguments_raise_errors_naming_them():
    with pytest.raises(TypeError, match="fn"):
        mpjax.autocast(3)
    with pytest.raises(ValueError, match=r"autocast\(fn, policy\): Unknown policy"):
        mpjax.autocast(jnp.sin, "mixed_bfloat17")
    # Rules given where the policy goes: named as such, not spelled out in the error.
    with pytest.raises(TypeError, match=r"mpjax.autocast\(fn, rules=rules\)") as error:
        mpjax.autocast(jnp.sin, mpjax.Rules({"head": "float32"}))
    assert len(str(error.value)) < 200
    with pytest.raises(ValueError, match="categories.*lower, f32, promote, keep, original"):
        mpjax.autocast(jnp.sin, categories={"tanh": "f64"})
    with pytest.raises(TypeError, match="categories"):
        mpjax.autocast(jnp.sin, categories=["tanh"])
    with pytest.raises(ValueError, match="named scopes"):
        mpjax.autocast(jnp.sin, rules=mpjax.Rules({nn.Dense: "float32"}))
    with pytest.raises(TypeError, match="rules"):
        mpjax.autocast(jnp.sin, rules="head")


def test_report_shows_what_autocast_did(capsys):
    auto = mpjax.autocast(lambda w, x: jax.nn.softmax(x @ w))
    report = mpjax.describe(auto)(W, X)
    assert capsys.readouterr().out == ""
    rows = {(r.primitive, r.category): r for r in report}
    assert rows["dot_general", "lower"].ran == ("bf16", "bf16")
    assert rows["exp", "f32"].ran == ("f32",)
    table = report.table()
    assert str(report) == table and "* bf16,bf16" in table and "reduce_max" in table
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert {
        "scope": "",
        "primitive": "dot_general",
        "category": "lower",
        "traced": ["f32", "f32"],
        "ran": ["bf16", "bf16"],
        "count": 1,
        "f32_precision": None,
    } in data["rows"]
    assert len(data["rows"]) == len(report)


def test_describe_passes_every_keyword_to_the_autocast_function():
    def fn(w, x, *, rules, print_table):  # keywords named like describe's options
        return jnp.tanh(x @ w) * rules if print_table else x

    report = mpjax.describe(mpjax.autocast(fn))(W, X, rules=2.0, print_table=True)
    # The float is traced, as jax.jit traces it, and converted to the product's dtype.
    assert [r.primitive for r in report] == ["dot_general", "tanh", "convert_element_type", "mul"]
    report = mpjax.describe(mpjax.autocast(fn))(W, X, rules=2.0, print_table=False)
    assert list(report) == []


def test_describe_rejects_autocast_functions_it_did_not_make_and_options():
    auto = mpjax.autocast(jnp.sin)
    with pytest.raises(TypeError, match=r"describe\(\) takes .*a function made by mpjax\.autocast"):
        mpjax.describe(jnp.sin)
    # A decorator that copies the autocast function's attributes does not pass for it.
    wrapper = functools.wraps(auto)(lambda x: auto(x) + 1)
    with pytest.raises(TypeError, match=r"describe\(\) takes .*; got "):
        mpjax.describe(wrapper)
    with pytest.raises(
        TypeError,
        match=r"`rules`, which does not apply to a function made by "
        r"mpjax\.autocast \(function\); it takes none",
    ):
        mpjax.describe(auto, rules="float32")


def test_the_unreleased_autocast_report_alias_is_gone():
    # One name per concept: mpjax.describe(fn)(*args) reports an autocast function.
    assert "autocast_report" not in mpjax.__all__
    with pytest.raises(AttributeError, match="autocast_report"):
        mpjax.autocast_report  # noqa: B018
    assert not hasattr(sys.modules["mpjax.autocast"], "autocast_report")


# --- The cost: no more converts than a transformer block written with dtype=jnp.bfloat16. ----


def _train_step(apply, x):
    tx = optax.adam(1e-3)

    def loss(p):
        return jnp.mean(jnp.square(apply({"params": p}, x).astype(jnp.float32)))

    def step(params, opt_state):
        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx, loss


@pytest.mark.slow
def test_train_step_has_no_more_converts_than_hand_written_bf16_and_same_matmuls():
    x = jax.random.normal(K2, (2, 4, 16))
    params = jax.eval_shape(Block().init, K3, x)["params"]
    found = {}
    # optax's adam and Flax's bf16 norms are not strict-promotion clean: compare both models
    # under standard promotion, on the same backend.
    with jax.numpy_dtype_promotion("standard"):
        for name, apply in (
            ("autocast", mpjax.autocast(Block().apply)),
            ("by_hand", HandWrittenBlock(dtype=jnp.bfloat16).apply),
        ):
            step, tx, loss = _train_step(apply, x)
            converts = mpjax.hlo_op_counts(step)(params, jax.eval_shape(tx.init, params))
            matmuls = mpjax.inspect_matmuls(jax.grad(loss))(params).operand_dtypes()
            found[name] = converts["convert"], matmuls
    (auto_converts, auto_matmuls), (hand_converts, hand_matmuls) = found.values()
    assert 0 < auto_converts <= hand_converts, found
    assert auto_matmuls == hand_matmuls == {("bfloat16", "bfloat16"): 24}, found


def test_the_guides_autocast_example_runs_and_prints_what_it_says(capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "autocast.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "docs/autocast.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "Counter({('bfloat16', 'bfloat16'): 5})" in printed
    assert "dot_general       lower" in printed


def test_primitives_of_common_models_and_their_gradients_are_all_categorized():
    """Newer JAX versions add primitives (tanh's gradient became one_minus_square in jax 0.12);
    an unknown one would run in its traced dtypes with a warning."""

    def f(w, x):
        h = jax.nn.gelu(x @ w, approximate=True) + jnp.tanh(x @ w) + jnp.log2(jnp.abs(x @ w) + 1)
        h = h + jax.nn.silu(h) + jax.nn.sigmoid(h) + jnp.sqrt(jnp.abs(h)) + jnp.sin(h)
        return jnp.mean(jax.nn.log_softmax(h) + jnp.cumsum(h, -1) + jnp.maximum(h, 0) ** 2)

    w, x = jnp.ones((4, 4)) / 4, jnp.ones((2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.AutocastWarning)
        jax.make_jaxpr(jax.grad(mpjax.autocast(f, "mixed_float16")))(w, x)


def test_a_platform_dependent_cond_stays_platform_dependent():
    """lax.platform_dependent (cuDNN attention's choice) is resolved when lowering: the engine
    re-makes it as one, with each branch autocast, so a CPU compile never lowers the branch
    for CUDA."""

    def gpu_only(x, w):
        return jnp.tanh(x @ w)  # stands for a kernel only a GPU can lower

    def elsewhere(x, w):
        return x @ w

    def fn(x, w):
        return lax.platform_dependent(x, w, cuda=gpu_only, default=elsewhere)

    x, w = jnp.ones((2, 4)), jnp.full((4, 3), 0.5)
    f = mpjax.autocast(fn, "mixed_bfloat16")
    conds = [
        jax_compat.cond_platforms(e)
        for e, _ in iter_equations(f, x, w)
        if e.primitive.name == "cond"
    ]
    assert conds == [(("cuda",), None)]
    report = mpjax.inspect_matmuls(f)(x, w)
    assert len(report) == 2 and set(report.operand_dtypes()) == {("bfloat16", "bfloat16")}
    np.testing.assert_array_equal(jax.jit(f)(x, w), np.full((2, 3), 2.0, np.float32))


# ---------------------------------------------------------------------------------------------
# The precision of float32 matmuls


def _matmul_precisions(fn, *args):
    """(operand dtype names, precision param) of every matmul of ``fn``, read from its jaxpr."""
    return [
        ((eqn.invars[0].aval.dtype.name, eqn.invars[1].aval.dtype.name), eqn.params["precision"])
        for eqn, _ in iter_equations(fn, *args)
        if eqn.primitive.name in ("dot_general", "conv_general_dilated")
    ]


def _grad_of(fn):
    return jax.grad(lambda *args: jnp.sum(fn(*args).astype(jnp.float32)), argnums=(0, 1, 2))


HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


@pytest.mark.parametrize("order", ["grad_of_autocast", "autocast_of_grad"])
def test_f32_matmuls_run_at_highest_forward_and_backward_and_bf16_ones_are_untouched(order):
    def f(x, w, v):
        with mpjax.full_precision():
            y = jnp.tanh(x @ w)  # f32 inside full_precision
        return y @ v  # bf16 under mixed_bfloat16

    x, w, v = jnp.ones((2, 4)), jnp.ones((4, 4)), jnp.ones((4, 3))
    for policy in ["float32", "mixed_bfloat16"]:
        if order == "grad_of_autocast":
            fn = _grad_of(mpjax.autocast(f, policy=policy))
        else:
            fn = mpjax.autocast(_grad_of(f), policy=policy)
        found = _matmul_precisions(fn, x, w, v)
        assert len(found) == 6  # two forward, four backward
        f32 = [p for dtypes, p in found if dtypes == ("float32", "float32")]
        bf16 = [p for dtypes, p in found if dtypes == ("bfloat16", "bfloat16")]
        assert len(f32) + len(bf16) == 6
        assert f32 and all(p == HIGHEST for p in f32)
        assert len(bf16) == (3 if policy == "mixed_bfloat16" else 0)
        assert all(p is None for p in bf16)
    # Without mpjax nothing changes: JAX's default.
    assert {p for _, p in _matmul_precisions(_grad_of(f), x, w, v)} == {None}


@pytest.mark.parametrize(
    "name, dot, conv",
    [
        ("highest", HIGHEST, HIGHEST),
        ("high", (lax.Precision.HIGH,) * 2, (lax.Precision.HIGH,) * 2),
        ("bf16_3x", lax.DotAlgorithmPreset.BF16_BF16_F32_X3, (lax.Precision.HIGH,) * 2),
        ("tf32", lax.DotAlgorithmPreset.TF32_TF32_F32, None),
        ("bf16", lax.DotAlgorithmPreset.BF16_BF16_F32, None),
        ("default", None, None),
    ],
)
def test_each_f32_matmul_precision_is_the_precision_param_of_dots_and_convolutions(name, dot, conv):
    def f(x, w, img, k):
        y = lax.conv_general_dilated(img, k, (1, 1), "SAME")
        return jnp.sum(x @ w) + jnp.sum(y)

    args = jnp.ones((2, 4)), jnp.ones((4, 4)), jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
    policy = mpjax.get_policy("float32").with_f32_matmul_precision(name)
    grad = jax.grad(mpjax.autocast(f, policy=policy), argnums=(0, 1, 2, 3))
    found = [
        (eqn.primitive.name, eqn.params["precision"])
        for eqn, _ in iter_equations(grad, *args)
        if eqn.primitive.name in ("dot_general", "conv_general_dilated")
    ]
    assert sorted(found, key=str) == sorted(
        [("dot_general", dot)] * 3 + [("conv_general_dilated", conv)] * 3, key=str
    )


def test_a_precision_the_code_writes_is_kept_and_precision_default_is_the_default():
    def f(x, w):
        return (
            jnp.dot(x, w, precision=lax.Precision.HIGH)
            + jnp.dot(x, w, precision=lax.DotAlgorithmPreset.DEFAULT)
            + jnp.dot(x, w, precision=lax.Precision.DEFAULT)
        )

    found = _matmul_precisions(
        mpjax.autocast(f, policy="float32"), jnp.ones((2, 2)), jnp.ones((2, 2))
    )
    assert [p for _, p in found] == [
        (lax.Precision.HIGH,) * 2,
        lax.DotAlgorithmPreset.DEFAULT,
        HIGHEST,
    ]


def test_modules_kept_in_f32_by_rules_run_their_matmuls_at_highest_unless_their_policy_says():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, name="body")(x)
            x = nn.LayerNorm(name="norm")(x)
            return nn.Dense(2, name="head")(x)

    x = jnp.ones((3, 4))
    for head, expected in [
        ("float32", HIGHEST),
        ("p=f32,f32_matmul=bf16_3x", lax.DotAlgorithmPreset.BF16_BF16_F32_X3),
    ]:
        model = mpjax.linen.apply_policy(
            Net(), mpjax.Rules({"head": head}, default="mixed_bfloat16")
        )
        variables = model.init(jax.random.key(0), x)
        loss = functools.partial(lambda model, v: jnp.sum(model.apply(v, x)), model)
        found = _matmul_precisions(jax.grad(loss), variables)
        assert [p for d, p in found if d == ("float32", "float32")] == [expected] * 3  # fwd, dW, dx
        assert {p for d, p in found if d == ("bfloat16", "bfloat16")} == {None}


def test_the_autocast_report_shows_the_precision_of_f32_matmuls():
    def f(x, w):
        with mpjax.full_precision():
            y = x @ w
        return jnp.tanh(y @ w)

    x = jnp.ones((4, 4))
    fast = mpjax.get_policy("float32").with_f32_matmul_precision("tf32")
    for policy, ran in [("mixed_bfloat16", None), (fast, "tf32"), ("float32", "highest")]:
        report = mpjax.describe(mpjax.autocast(f, policy))(x, x)
        dots = {r.category: r.f32_precision for r in report if r.primitive == "dot_general"}
        assert dots == {"full_precision": "highest", "lower": ran}
    table = report.table()
    assert "f32,f32@highest" in table and "* " not in table.split("dot_general")[1]
    assert {"tanh"} <= {r.primitive for r in report if r.f32_precision is None}


def test_a_rule_for_a_scope_that_does_not_exist_is_an_error_naming_the_closest():
    def f(w, x):
        with jax.named_scope("encoder"):
            h = x @ w
        with jax.named_scope("head"):
            return h @ w

    w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    for run in (lambda g: g(w, x), lambda g: jax.jit(g)(w, x)):
        with pytest.raises(ValueError, match="rule 'haed' matches no scope") as error:
            run(mpjax.autocast(f, rules={"haed": "float32"}))
        assert "closest paths: 'head'" in str(error.value)
        assert "allow_unmatched=True" in str(error.value)
    allowed = mpjax.Rules({"haed": "float32"}, allow_unmatched=True)
    assert mpjax.autocast(f, "mixed_bfloat16", rules=allowed)(w, x).dtype == jnp.float32
    assert mpjax.autocast(f, rules={"head": "float32"})(w, x).dtype == jnp.float32
