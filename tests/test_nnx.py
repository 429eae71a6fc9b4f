"""Flax NNX integration: matmul dtypes read from the jaxpr (forward and backward), f32 norm
statistics and softmax, f32 master params across optax steps, custom Param modules, BatchNorm,
bf16 storage, rule warnings, convert counts against a hand-written bf16 model, the describe
report and bad input."""

import json
import pathlib
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from mixed_precision_checks import assert_norm_computes_in_f32_alone

import mpjax
from mpjax import Policy, Rules, RuleWarning
from mpjax import nnx as mpnnx
from mpjax.inspection.matmuls import iter_equations

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "nnx.md"
F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
D = 8  # model width: tiny shapes keep compile times short


class Block(nnx.Module):
    """A pre-norm transformer block from Flax's stock layers."""

    def __init__(self, rngs, dtype=None, **attention):
        dt = {} if dtype is None else {"dtype": dtype}
        self.ln1 = nnx.LayerNorm(D, rngs=rngs, **dt)
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=D, decode=False, rngs=rngs, **dt, **attention
        )
        self.ln2 = nnx.LayerNorm(D, rngs=rngs, **dt)
        self.fc1 = nnx.Linear(D, 4 * D, rngs=rngs, **dt)
        self.fc2 = nnx.Linear(4 * D, D, rngs=rngs, **dt)

    def __call__(self, x, **attention_kwargs):
        x = x + self.attn(self.ln1(x), **attention_kwargs)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class Dense(nnx.Module):
    """A user module that uses its Params directly in jnp code: no dtype attributes."""

    def __init__(self, din, dout, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) / np.sqrt(din))
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        return x @ self.w[...] + self.b[...]


class ConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.head = Dense(4, 2, rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.bn(self.conv(x)))
        return self.head(h.mean(axis=(1, 2)))


def block(policy="mixed_bfloat16", seed=0, **attention):
    model = Block(nnx.Rngs(seed), **attention)
    if policy is not None:
        mpnnx.set_policy(model, policy)
    return model


def normal(*shape, seed=1):
    # numpy data: eager jax.random calls compile one kernel per shape, which costs seconds here.
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def x_seq():
    return normal(2, 4, D)


def loss(model, x):
    return jnp.mean(model(x) ** 2)


def grad_fn(model, x):
    return nnx.grad(loss)(model, x)


# Compiled once per model structure: eager dispatch of many small ops is what makes tests slow.
run = nnx.jit(lambda model, x: model(x))
grads_of = nnx.jit(grad_fn)


def dtypes_of(report):
    return {(m.lhs_dtype.name, m.rhs_dtype.name) for m in report}


def equations(fn, *args, names):
    """(primitive name, first operand dtype) of every equation named in ``names``."""
    return [
        (e.primitive.name, np.dtype(e.invars[0].aval.dtype))
        for e, _ in iter_equations(fn, *args)
        if e.primitive.name in names
    ]


def adam_update(opt, model, grads):
    # optax's bias correction raises Python float ** int32 under strict promotion (an optax
    # matter, not mpjax's): the optimizer alone runs under standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        opt.update(model, grads)


# --- the transformer block: matmuls, norms, softmax ------------------------------------------


def test_every_block_matmul_forward_and_backward_runs_in_bf16():
    model, x = block(), x_seq()
    forward = mpjax.inspect_matmuls(loss)(model, x)
    backward = mpjax.inspect_matmuls(grad_fn)(model, x)
    assert len(forward) == 8  # q, k, v, logits, weights @ v, out, fc1, fc2
    assert len(backward) == 8 * 3  # each forward matmul and its two transposes
    assert dtypes_of(forward) == dtypes_of(backward) == {("bfloat16", "bfloat16")}


def test_a_user_rule_keeps_one_layer_in_f32():
    rules = Rules({"fc2": "p=f32,c=f32,o=bf16"}, default="mixed_bfloat16")
    model, x = block(rules), x_seq()
    report = mpjax.inspect_matmuls(grad_fn)(model, x)
    # fc2's forward matmul and its two transposes run in f32, every other one in bf16.
    assert report.operand_dtypes() == {("float32", "float32"): 3, ("bfloat16", "bfloat16"): 21}
    f32 = [m for m in report if m.lhs_dtype == F32]
    assert {m.region for m in f32} == {"fc2"} and {m.region for m in report} > {"fc2"}
    assert model.fc2(jnp.ones((1, 4 * D), BF16)).dtype == BF16  # its output dtype


def test_norm_statistics_and_softmax_run_in_f32_and_norms_return_bf16():
    model, x = block(), x_seq()
    found = equations(loss, model, x, names={"reduce_sum", "reduce_max", "exp", "rsqrt"})
    names = [n for n, _ in found]
    assert names.count("rsqrt") == 2 and names.count("exp") == 1 and "reduce_max" in names
    assert {dt for _, dt in found} == {F32}
    assert run(model.ln1, x).dtype == BF16 and model.ln1.scale[...].dtype == F32


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")  # Flax's own deprecation
def test_softmax_stays_f32_on_the_dropout_and_sow_path():
    model, x = block(dropout_rate=0.1), x_seq()

    def train_loss(model, x):
        return jnp.mean(model(x, deterministic=False, sow_weights=True) ** 2)

    assert equations(train_loss, model, x, names={"exp"}) == [("exp", F32)]
    nnx.jit(lambda m, x: m(x, deterministic=False, sow_weights=True))(model, x)
    (weights,) = model.attn.attention_weights.get_value()
    assert weights.dtype == F32 and weights.shape == (2, 2, 4, 4)  # the f32 softmax's output
    # Why the built-in rule is needed: Flax's own dropout path runs softmax in bf16.
    hand = Block(nnx.Rngs(0), dtype=jnp.bfloat16, dropout_rate=0.1)
    with jax.numpy_dtype_promotion("standard"):
        assert equations(train_loss, hand, x, names={"exp"}) == [("exp", BF16)]


def test_a_users_own_attention_function_is_kept_and_cast_at_its_matmuls():
    calls = []

    def my_attention(q, k, v, **kwargs):
        calls.append(q.dtype)
        return nnx.dot_product_attention(q, k, v, **kwargs)

    model, x = block(attention_fn=my_attention), x_seq()
    assert model.attn.attention_fn is my_attention and block().attn.attention_fn is (
        nnx.dot_product_attention
    )  # set_policy changes no function of a module
    report = mpjax.inspect_matmuls(grad_fn)(model, x)
    assert calls and dtypes_of(report) == {("bfloat16", "bfloat16")}


# --- training: f32 masters, jit, optimizer, outputs --------------------------------------------


@pytest.mark.slow
def test_grads_and_params_stay_f32_and_follow_the_f32_update_across_adam_steps():
    model, reference, x = block(), block(), x_seq()
    tx = optax.adam(1e-2)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(model, opt, x):
        traces.append(1)
        grads = nnx.grad(loss)(model, x)
        adam_update(opt, model, grads)
        return grads

    # The reference applies the same gradients with optax to an f32 pytree, outside NNX.
    graphdef, ref_params, rest = nnx.split(reference, nnx.Param, ...)

    @jax.jit
    def ref_step(params, state, x):
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest), x))(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

    ref_state = tx.init(ref_params)
    for _ in range(4):
        grads = step(model, opt, x)
        ref_params, ref_state = ref_step(ref_params, ref_state, x)
    assert len(traces) == 1  # no retrace after the first step
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {F32}  # the param dtype
    params = nnx.state(model, nnx.Param)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {F32}
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), params, ref_params
    )
    kernel = np.asarray(model.fc1.kernel[...])
    rounded = np.asarray(jnp.asarray(kernel, BF16).astype(F32))
    assert np.mean(kernel == rounded) < 0.1  # real f32 values, not bf16 ones stored in f32


def test_output_matches_the_f32_model_within_bf16_tolerance():
    x = x_seq()
    ours, theirs = run(block(), x), run(block(policy=None), x)
    assert ours.dtype == F32
    np.testing.assert_allclose(ours, theirs, rtol=5e-2, atol=5e-2)
    assert not np.allclose(ours, theirs, rtol=1e-5, atol=1e-5)  # it really ran in bf16


def test_state_paths_checkpoints_and_split_merge_are_unchanged():
    model, plain, x = block(), block(policy=None), x_seq()
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(nnx.state(plain))
    assert isinstance(model.fc1, nnx.Linear) and type(model.fc1).__name__ == "Linear"
    assert type(model).__name__ == "Block" and isinstance(model, Block)
    nnx.update(plain, nnx.state(model))  # a checkpoint of one loads into the other
    graphdef, state = nnx.split(model)
    out = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    np.testing.assert_array_equal(out, run(model, x))
    assert out.dtype == F32 and jax.jit(lambda x: model(x))(x).dtype == F32


def test_applying_again_replaces_the_policy():
    model, x = block(), x_seq()
    mpnnx.set_policy(model, "float32")
    assert type(model).__mro__[1] is Block and type(model.fc1).__mro__[1] is nnx.Linear
    assert dtypes_of(mpjax.inspect_matmuls(loss)(model, x)) == {("float32", "float32")}


def test_set_policy_configures_in_place_and_returns_none():
    model, x = Block(nnx.Rngs(0)), x_seq()
    assert mpnnx.set_policy(model, "mixed_bfloat16") is None
    assert type(model).__mro__[1] is Block
    assert dtypes_of(mpjax.inspect_matmuls(loss)(model, x)) == {("bfloat16", "bfloat16")}


@pytest.mark.parametrize("name", ["apply_policy", "describe"])
def test_the_unreleased_aliases_are_gone(name):
    # One name per concept: set_policy configures a model, mpjax.describe reports one.
    assert name not in mpnnx.__all__ and not hasattr(mpnnx, name)


@pytest.mark.parametrize("spec", [{"fc2": "mixed_bfloat16"}, [("fc2", "mixed_bfloat16")]])
def test_set_policy_and_linen_apply_policy_take_the_same_rule_forms(spec):
    model, x = Block(nnx.Rngs(0)), x_seq()
    mpnnx.set_policy(model, spec)  # Rules(spec): default float32, fc2 in bf16
    report = mpjax.inspect_matmuls(grad_fn)(model, x)
    assert {m.region for m in report if m.lhs_dtype == BF16} == {"fc2"}
    assert report.operand_dtypes() == {("bfloat16", "bfloat16"): 3, ("float32", "float32"): 21}
    wrapped = mpjax.linen.apply_policy(nn.Dense(3), spec)
    assert type(wrapped)._mpjax_state.rules == mpjax.as_rules(spec) == Rules(spec)


@pytest.mark.parametrize("spec", [3, None, {1.5}])
def test_set_policy_and_linen_apply_policy_reject_the_same_forms_alike(spec):
    with pytest.raises(TypeError) as nnx_error:
        mpnnx.set_policy(Dense(2, 2, nnx.Rngs(0)), spec)
    with pytest.raises(TypeError) as linen_error:
        mpjax.linen.apply_policy(nn.Dense(2), spec)
    assert str(nnx_error.value) == str(linen_error.value)
    assert str(nnx_error.value).startswith("`policy_or_rules` must be mpjax.Rules, a policy")


class WithF32Head(nnx.Module):
    """A model whose head asks for f32 through Flax's own attributes."""

    def __init__(self, rngs):
        self.body = nnx.Linear(D, D, rngs=rngs)
        self.head = nnx.Linear(D, 2, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.body(x)))


def test_the_policy_wins_over_a_modules_own_dtype_attributes():
    model, x = WithF32Head(nnx.Rngs(0)), x_seq()
    mpnnx.set_policy(model, "mixed_bfloat16")
    forward = mpjax.inspect_matmuls(loss)(model, x)
    backward = mpjax.inspect_matmuls(grad_fn)(model, x)
    # Backward: both forward matmuls, both kernel gradients, the input gradient of the head.
    assert {m.region for m in forward} == {"body", "head"} and len(backward) == 5
    assert dtypes_of(forward) == dtypes_of(backward) == {("bfloat16", "bfloat16")}


def test_a_rule_for_its_path_keeps_a_module_in_f32():
    model, x = WithF32Head(nnx.Rngs(0)), x_seq()
    mpnnx.set_policy(model, Rules({"head": "float32"}, default="mixed_bfloat16"))
    report = mpjax.inspect_matmuls(grad_fn)(model, x)
    assert {m.region for m in report if m.lhs_dtype == F32} == {"head"}
    assert report.operand_dtypes() == {("float32", "float32"): 3, ("bfloat16", "bfloat16"): 2}


def test_full_precision_around_a_submodule_call_keeps_it_in_f32():
    class Model(WithF32Head):
        def __call__(self, x):
            h = jax.nn.relu(self.body(x))
            with mpjax.full_precision():
                return self.head(h)

    model, x = Model(nnx.Rngs(0)), x_seq()
    mpnnx.set_policy(model, "mixed_bfloat16")
    report = mpjax.inspect_matmuls(grad_fn)(model, x)
    assert {(m.region, m.lhs_dtype.name) for m in report} == {
        ("head", "float32"),
        ("body", "bfloat16"),
    }


# --- the other stock layers, the custom module, BatchNorm, storage -----------------------------


def test_custom_module_params_are_cast_at_use_and_never_overwritten():
    model = Dense(4, 3, nnx.Rngs(0))
    mpnnx.set_policy(model, "mixed_bfloat16")
    stored, x = model.w, jnp.ones((2, 4))
    report = mpjax.inspect_matmuls(grad_fn)(model, x)
    assert len(report) == 2 and dtypes_of(report) == {("bfloat16", "bfloat16")}  # x @ w, dw
    grads = grad_fn(model, x)
    assert grads["w"][...].dtype == F32 and grads["b"][...].dtype == F32
    out = model(x)
    assert out.dtype == F32 and model.w is stored and model.w[...].dtype == F32
    assert jax.jit(lambda x: model(x))(x).dtype == F32  # plain jit over a closed-over model
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for _ in range(3):
        nnx.jit(lambda m, o: o.update(m, nnx.grad(loss)(m, x)))(model, opt)
    assert model.w[...].dtype == F32 and model.w is stored


def test_params_in_a_list_are_cast_at_use():
    class Stack(nnx.Module):
        def __init__(self):
            self.ws = nnx.List([nnx.Param(jnp.ones((4, 4))), nnx.Param(jnp.ones((4, 2)))])

        def __call__(self, x):
            return x @ self.ws[0][...] @ self.ws[1][...]

    model = Stack()
    mpnnx.set_policy(model, "mixed_bfloat16")
    report = mpjax.inspect_matmuls(grad_fn)(model, jnp.ones((1, 4)))
    assert len(report) == 5 and dtypes_of(report) == {("bfloat16", "bfloat16")}
    assert {v.dtype for v in jax.tree.leaves(nnx.state(model))} == {F32}


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.dense = Dense(D, D, rngs)
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.dense(self.ln(x)))


class ScannedStack(nnx.Module):
    """Three layers created with nnx.vmap and run with nnx.scan + nnx.remat, plus a root Param."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Layer(rngs)

        self.layers = make(rngs)
        self.w = nnx.Param(jnp.ones((D, D)) / D)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def body(x, layer):
            return layer(x)

        return body(x, self.layers) @ self.w[...]


def test_scan_remat_vmap_stacks_and_rng_counters_work():
    model = ScannedStack(nnx.Rngs(0, dropout=1))
    mpnnx.set_policy(model, "mixed_bfloat16")
    x = normal(2, D)
    report = mpjax.inspect_matmuls(grad_fn)(model, x)
    assert report.operand_dtypes() == {("bfloat16", "bfloat16"): 6}
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx.jit(lambda m, o, x: o.update(m, nnx.grad(loss)(m, x)))
    step(model, opt, x)
    step(model, opt, x)
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}
    np.testing.assert_array_equal(model.layers.drop.rngs.count[...], [2, 2, 2])


def test_batchnorm_keeps_f32_running_stats_and_updates_them_in_train_mode():
    model = ConvNet(nnx.Rngs(0))
    mpnnx.set_policy(model, "mixed_bfloat16")
    x = normal(2, 6, 6, 3, seed=2)
    report = mpjax.inspect_matmuls(grad_fn)(model, x)
    assert {m.primitive for m in report} == {"conv_general_dilated", "dot_general"}
    assert dtypes_of(report) == {("bfloat16", "bfloat16")}
    before = model.bn.mean[...]
    run(model, x)
    after = model.bn.mean[...]
    assert after.dtype == F32 and model.bn.var[...].dtype == F32
    assert not np.allclose(before, after)  # train mode updated the running mean
    assert equations(loss, model, x, names={"rsqrt"}) == [("rsqrt", F32)]
    model.eval()
    run(model, x)
    np.testing.assert_array_equal(model.bn.mean[...], after)


def test_embed_attend_linear_general_and_rmsnorm_run_in_bf16():
    class TiedLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(11, D, rngs=rngs)
            self.proj = nnx.LinearGeneral(D, (2, 4), rngs=rngs)
            self.norm = nnx.RMSNorm(D, rngs=rngs)

        def __call__(self, tokens):
            h = self.proj(self.embed(tokens)).reshape(tokens.shape + (D,))
            return self.embed.attend(self.norm(h))

    model = TiedLM(nnx.Rngs(0))
    mpnnx.set_policy(model, "mixed_bfloat16")
    tokens = jnp.array([[1, 2, 3], [4, 5, 10]])
    report = mpjax.inspect_matmuls(grad_fn)(model, tokens)
    assert len(report) == 6 and dtypes_of(report) == {("bfloat16", "bfloat16")}
    # The lookup gathers rows of the f32 table (no cast of the whole table) and returns them
    # in the compute dtype (the built-in embedding rule); attend is bf16.
    assert run(model, tokens).dtype == F32 and run(model.embed, tokens).dtype == BF16
    assert equations(loss, model, tokens, names={"rsqrt"}) == [("rsqrt", F32)]
    grads = grads_of(model, tokens)
    assert grads["embed"]["embedding"][...].dtype == F32


def test_bf16_param_storage():
    model = ConvNet(nnx.Rngs(0))
    mpnnx.set_policy(model, "p=bf16,c=bf16,o=f32")
    x = normal(2, 6, 6, 3, seed=2)
    assert model.conv.kernel[...].dtype == BF16 and model.head.w[...].dtype == BF16
    assert model.bn.scale[...].dtype == F32 and model.bn.mean[...].dtype == F32  # norm rule
    assert run(model, x).dtype == F32
    grads = grads_of(model, x)
    assert grads["conv"]["kernel"][...].dtype == BF16 and grads["bn"]["scale"][...].dtype == F32


# --- loss scaling with nnx.Optimizer ---------------------------------------------------------


@pytest.mark.slow
def test_scaled_value_and_grad_trains_with_an_nnx_optimizer_and_skips_overflow():
    model = block("mixed_float16")
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    tx = mpjax.loss_scaling(inner, mpjax.DynamicLossScale(2.0**10, growth_interval=2))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, traces = x_seq(), []

    @nnx.jit
    def step(model, opt, x):
        traces.append(1)
        loss_value, grads = mpnnx.scaled_value_and_grad(loss)(opt.opt_state, model, x)
        adam_update(opt, model, grads)
        return loss_value

    # The gradients are those of the loss times the scale, as loss_scaling expects.
    value, grads = mpnnx.scaled_value_and_grad(loss)(opt.opt_state, model, x)
    ref_value, ref_grads = nnx.value_and_grad(loss)(model, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    jax.tree.map(
        lambda g, r: np.testing.assert_allclose(g, 2.0**10 * r, rtol=2e-2, atol=1e-3),
        grads,
        ref_grads,
    )
    losses = [float(step(model, opt, x)) for _ in range(4)]
    info = mpjax.loss_scaling_info(opt.opt_state)
    assert losses[-1] < losses[0] and len(traces) == 1
    assert (float(info.loss_scale), bool(info.applied), int(info.skipped_steps)) == (4096, True, 0)
    params, inner_state = nnx.state(model, nnx.Param), opt.opt_state.inner_state
    params, inner_state = jax.tree.map(jnp.copy, (params, inner_state))
    step(model, opt, x.at[0, 0, 0].set(jnp.inf))  # the forward pass overflows: skipped
    info = mpjax.loss_scaling_info(opt.opt_state)
    assert (float(info.loss_scale), bool(info.applied), int(info.skipped_steps)) == (2048, False, 1)
    assert len(traces) == 1
    for a, b in zip(
        jax.tree.leaves((params, inner_state)),
        jax.tree.leaves((nnx.state(model, nnx.Param), opt.opt_state.inner_state)),
    ):
        np.testing.assert_array_equal(a, b)  # params and Adam's count and moments unchanged


def test_readers_of_an_nnx_optimizer_state_give_plain_arrays_and_field_names():
    model = block()
    opt = nnx.Optimizer(model, mpjax.loss_scaling(optax.adam(1e-3)), wrt=nnx.Param)
    for state in (opt.opt_state, opt):  # the optimizer's state, or the optimizer itself
        info = mpjax.loss_scaling_info(state)
        for value in info:
            assert isinstance(value, jax.Array) and not isinstance(value, nnx.Variable)
        assert info.loss_scale.dtype == F32 and float(info.loss_scale) == 2.0**15
        mpjax.check_overflow(state)
    report = mpjax.memory_report(nnx.state(model, nnx.Param), opt.opt_state)
    parts = {row.part for row in report.rows}
    assert {"params", "mu", "nu", "count", "loss_scale"} <= parts and "value" not in parts
    assert report.part_bytes("mu") == report.part_bytes("nu") == report.param_bytes


class Wide(nnx.Module):
    """A linear layer whose kernel (256 x 256) is large enough for quantized moments."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(256, 256, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_an_nnx_optimizer_keeps_quantized_moments_and_steps_as_optax_does():
    """nnx.Optimizer boxes each state array in a Variable: the quantized moments keep their
    codes and absmaxes through it, and its steps are those of the same transformation run by
    optax on a plain pytree (compiled apart, so up to float32 rounding: a code may land on its
    neighbour)."""
    model = Wide(nnx.Rngs(0))
    tx = mpjax.quantized_state(optax.adam(1e-2), "dynamic8")
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (8, 256))

    def wide_loss(model, x):
        return jnp.mean(jnp.square(model(x) - 1.0))

    @nnx.jit
    def step(model, opt, x):
        grads = nnx.grad(wide_loss)(model, x)
        adam_update(opt, model, grads)

    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(jnp.copy, nnx.to_pure_dict(params))

    @jax.jit
    def ref_step(params, state, x):
        def ref_loss(p):
            return wide_loss(nnx.merge(graphdef, p), x)

        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update(jax.grad(ref_loss)(params), state, params)
            return optax.apply_updates(params, updates), state

    ref_state = tx.init(params)
    for _ in range(3):
        step(model, opt, x)
        params, ref_state = ref_step(params, ref_state, x)
    adam = opt.opt_state.inner_state[0]
    kernel_mu, bias_mu = adam.mu["linear"]["kernel"], adam.mu["linear"]["bias"]
    assert isinstance(kernel_mu, mpjax.QuantizedArray) and kernel_mu.signed
    assert np.dtype(kernel_mu.codes.dtype) == np.uint8 and kernel_mu.codes.shape == (256, 256)
    assert not isinstance(bias_mu, mpjax.QuantizedArray)  # 256 elements stay f32
    ref_mu = ref_state.inner_state[0].mu["linear"]["kernel"]
    codes, ref_codes = (np.asarray(c[...], np.int32) for c in (kernel_mu.codes, ref_mu.codes))
    assert np.all(np.abs(codes - ref_codes) <= 1) and np.mean(codes == ref_codes) > 0.99
    np.testing.assert_allclose(kernel_mu.absmax[...], ref_mu.absmax, rtol=1e-5)
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # A code on its neighbour moves Adam's step by up to the map's widest gap, 1.4% of the
    # normalized moment, of the learning rate's 1e-2: three steps stay within 1e-3.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-3), got, params)
    report = mpjax.memory_report(nnx.state(model, nnx.Param), opt.opt_state)
    assert report.part_bytes("mu") == 256 * 256 + 256 * 4 + 256 * 4  # codes, absmaxes, bias


def test_the_nnx_state_of_an_optimizer_is_refused_naming_what_to_pass():
    model = block()
    opt = nnx.Optimizer(model, mpjax.loss_scaling(optax.adam(1e-3)), wrt=nnx.Param)
    with pytest.raises(
        TypeError,
        match=r"scale_loss: opt_state\['opt_state'\] holds the fields of a Loss.*"
        r"optimizer\.opt_state",
    ):
        mpjax.scale_loss(jnp.float32(1.0), nnx.state(opt))


def test_nnx_scaled_value_and_grad_rejects_bad_input_naming_it():
    model, x = block(), x_seq()
    opt = nnx.Optimizer(model, mpjax.loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
    name = "mpjax.nnx.scaled_value_and_grad"
    with pytest.raises(TypeError, match=f"{name}.*fun must be the loss function"):
        mpnnx.scaled_value_and_grad(jnp.float32(0.5))  # a loss's value, not the loss
    with pytest.raises(TypeError, match=f"{name}: argnums must be an int or nnx.DiffState"):
        mpnnx.scaled_value_and_grad(loss, argnums="model")
    with pytest.raises(TypeError, match=f"{name}: the loss-scaling state is among .*goes first"):
        mpnnx.scaled_value_and_grad(lambda m, o, x: loss(m, x))(model, opt, x)
    # nnx.DiffState works as for nnx.value_and_grad.
    wrt = nnx.DiffState(0, nnx.Param)
    _, grads = nnx.jit(mpnnx.scaled_value_and_grad(loss, argnums=wrt))(opt.opt_state, model, x)
    assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(model, nnx.Param))


# --- rules, the report, the compiled cost, bad input -------------------------------------------


def test_a_rule_that_matches_no_module_is_an_error_naming_the_closest_paths():
    with pytest.raises(ValueError, match="rule 'haed' matches no module") as error:
        block(Rules({"haed": "float32", "fc1.x": "float32"}, default="mixed_bfloat16"))
    message = str(error.value)
    assert "closest paths: 'attn'" not in message and "'fc1'" in message
    assert "'/'" in message and "allow_unmatched=True" in message
    rules = Rules({"decoder/*": "float32"}, default="mixed_bfloat16", allow_unmatched=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuleWarning)
        model = block(rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuleWarning)
        run(model, x_seq())
        jax.jit(lambda x: model(x))(x_seq())


@pytest.mark.slow
def test_wrapped_block_compiles_to_no_more_converts_than_the_hand_written_one():
    x = x_seq()

    def converts(model):
        graphdef, state = nnx.split(model)
        grad = jax.grad(lambda s, x: loss(nnx.merge(graphdef, s), x))
        # Flax's own LayerNorm(dtype=bf16) and attention mix bf16 and f32 operands, which strict
        # promotion rejects: count both models under standard promotion.
        with jax.numpy_dtype_promotion("standard"):
            return mpjax.hlo_op_counts(grad)(state, x)["convert"]

    wrapped = converts(block())
    hand = converts(Block(nnx.Rngs(0), dtype=jnp.bfloat16))
    print(f"converts: wrapped {wrapped}, hand-written {hand}")
    assert 0 < wrapped <= hand, (wrapped, hand)


EXPECTED_TABLE = """\
path    type       params   compute   output    rule                           #params  bytes  ops ran in  matmuls ran in
------  ---------  -------  --------  --------  -----------------------------  -------  -----  ----------  ------------------
<root>  ConvNet    float32  bfloat16  float32   default                              0    0 B  bf16 f32    -
bn      BatchNorm  float32  float32   bfloat16  builtin: nnx.BatchNorm in f32        8   32 B  f32         -
conv    Conv       float32  bfloat16  float32   default                            112  448 B  bf16 f32    3x bf16,bf16
head    Dense      float32  float32   float32   head                                10   40 B  f32         3x f32,f32@highest
------  ---------  -------  --------  --------  -----------------------------  -------  -----  ----------  ------------------
total                                                                              130  520 B
warning: rule 'decoder/*' matches no module."""


def test_describe_returns_the_expected_table_and_prints_nothing(capsys):
    rules = Rules(
        {"head": "float32", "decoder/*": "float32"}, default="mixed_bfloat16", allow_unmatched=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuleWarning)  # allowed: describe lists it, nothing warns
        model = ConvNet(nnx.Rngs(0))
        mpnnx.set_policy(model, rules)
    x = jax.ShapeDtypeStruct((2, 6, 6, 3), jnp.float32)
    report = mpjax.describe(model)(x)  # with inputs: the matmuls that ran, per module
    assert capsys.readouterr().out == ""
    assert report.table() == str(report) == EXPECTED_TABLE
    assert report.row("head").policy == Policy(F32, F32, F32)
    dry = ConvNet(nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dry run changes nothing, so warns about nothing
        assert str(mpjax.describe(dry, rules=rules)(x)) == EXPECTED_TABLE
    assert type(dry.head) is Dense and capsys.readouterr().out == ""
    # Without inputs nothing is traced, and the table has neither column of traced dtypes.
    untraced = mpjax.describe(model)()
    assert not untraced.matmuls_traced
    *table, warning = EXPECTED_TABLE.splitlines()
    column = table[0].index("ops ran in")
    assert untraced.table().splitlines() == [line[:column].rstrip() for line in table] + [warning]


def test_describe_to_dict_is_plain_json():
    model = ConvNet(nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((2, 6, 6, 3), jnp.float32)
    data = mpjax.describe(model, rules="mixed_bfloat16")(x).to_dict()
    assert json.loads(json.dumps(data)) == data
    # How many operations ran in each dtype depends on how the JAX version writes the jaxpr.
    computes = data["rows"][2].pop("computes")
    assert [dtype for dtype, _ in computes] == ["bf16", "f32"]
    assert all(type(count) is int and count > 0 for _, count in computes)
    assert data["rows"][2] == {
        "path": "conv",
        "type": "Conv",
        "policy": {
            "param_dtype": "float32",
            "compute_dtype": "bfloat16",
            "output_dtype": "float32",
            "f32_matmul_precision": "highest",
        },
        "rule": "default",
        "param_count": 112,
        "param_bytes": 448,
        "matmuls": [["bf16,bf16", 3]],
    }
    assert data["matmuls_traced"] is True and data["total_params"] == 130
    untraced = mpjax.describe(model, rules="mixed_bfloat16")().to_dict()
    assert untraced["matmuls_traced"] is False and untraced["rows"][2]["matmuls"] == []
    assert untraced["rows"][2]["computes"] == []


def test_describe_shows_that_a_norm_kept_in_f32_computes_in_f32_alone():
    # Under mixed_float16 the norm receives the Linear's float16 output: every operation of its
    # region, forward and backward, computes in float32, the Linear's in float16.
    class DenseThenNorm(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(3, D, rngs=rngs)
            self.norm = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.dense(x))

    report = mpjax.describe(DenseThenNorm(nnx.Rngs(0)), rules="mixed_float16")(normal(2, 3))
    assert_norm_computes_in_f32_alone(report)


def test_describe_passes_every_keyword_to_the_model():
    class Keywords(nnx.Module):  # keywords named like describe's options and old print_table
        def __init__(self, rngs):
            self.proj = Dense(D, D, rngs)
            self.extra = Dense(D, D, rngs)

        def __call__(self, x, *, rules, variables, print_table):
            x = self.proj(x) * variables
            return self.extra(x) if rules == "extra" and print_table else x

    model = Keywords(nnx.Rngs(0))
    x, scale = normal(2, D), jax.ShapeDtypeStruct((2, D), jnp.float32)
    describe = mpjax.describe(model, rules="mixed_bfloat16")
    report = describe(x, rules="extra", variables=scale, print_table=True)
    assert report.row("extra").matmuls == report.row("proj").matmuls == (("bf16,bf16", 3),)
    report = describe(x, rules="none", variables=scale, print_table=True)
    assert report.row("extra").matmuls == () and report.row("proj").matmuls


def test_describe_rejects_linen_options_for_nnx_models():
    model = ConvNet(nnx.Rngs(0))
    for option in ("variables", "rngs", "method"):
        with pytest.raises(
            TypeError,
            match=rf"`{option}`, which does not apply to a "
            r"flax\.nnx module \(ConvNet\); it takes only rules",
        ):
            mpjax.describe(model, rules="mixed_bfloat16", **{option: {}})


def test_describe_paths_go_through_lists():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Dense(2, 2, rngs), Dense(2, 2, rngs)])

    report = mpjax.describe(Stack(nnx.Rngs(0)), rules="mixed_bfloat16")()
    assert [(r.path, r.type_name, r.param_count) for r in report.rows] == [
        ("", "Stack", 0),
        ("blocks", "List", 0),
        ("blocks/0", "Dense", 6),
        ("blocks/1", "Dense", 6),
    ]


def test_bad_input_raises_errors_naming_the_argument():
    with pytest.raises(TypeError, match="mpjax.linen.apply_policy"):
        mpnnx.set_policy(nn.Dense(3), "mixed_bfloat16")
    with pytest.raises(TypeError, match="nnx.Module instance as `model`, got 3"):
        mpnnx.set_policy(3, "mixed_bfloat16")
    with pytest.raises(TypeError, match="got the class Block"):
        mpnnx.set_policy(Block, "mixed_bfloat16")
    with pytest.raises(ValueError, match="mixed_bfloat61"):
        mpnnx.set_policy(block(policy=None), "mixed_bfloat61")
    with pytest.raises(ValueError, match="no policy applied"):
        mpjax.describe(block(policy=None))
    with pytest.raises(TypeError, match="got the class Block. Build the model first"):
        mpjax.describe(Block)


@pytest.mark.slow
def test_the_nnx_guides_example_runs_and_prints_its_table(capsys):
    guide = GUIDE.read_text()
    code = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    printed = re.search(r"```text\n(.*?)```", guide, re.S).group(1)
    with jax.numpy_dtype_promotion("standard"), warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the guide uses the current API
        exec(compile(code, "docs/nnx.md", "exec"), {})  # optax's adam: standard promotion
    assert capsys.readouterr().out == printed


def test_init_fp8_state_refuses_a_policy_without_delayed_fp8():
    model = block("mixed_bfloat16_fp8")  # current scaling: no state to carry
    with pytest.raises(
        ValueError,
        match=r"init_fp8_state\(model, ...\): the model's policy .*"
        r"run no matmul in fp8 with delayed scaling",
    ):
        mpnnx.init_fp8_state(model, x_seq())


def test_a_float32_policy_runs_every_matmul_at_highest_forward_and_backward():
    for policy, expected in [("float32", {"highest"}), ("mixed_bfloat16", {None})]:
        model, x = block(policy), x_seq()
        report = mpjax.inspect_matmuls(grad_fn)(model, x)
        assert {m.f32_precision for m in report} == expected
        assert len(report) >= 6  # forward and backward
