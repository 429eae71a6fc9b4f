"""Flax linen integration: apply_policy on unmodified modules, read back from the jaxpr/HLO;
describe() tables."""

import functools
import json
import pathlib
import re
import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from stock_models import Block, HandWrittenBlock

import mpjax
import mpjax.linen as mpl
from mpjax import Rules
from mpjax.inspection.matmuls import iter_equations

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
VOCAB, DIM, SEQ = 16, 16, 4
KEY = jax.random.key(0)


# --- Models: stock Flax layers and third-party-style code, none of them aware of mpjax. ------


class Scale(nn.Module):
    """The hard case: a module that calls ``self.param`` and does its math in jnp."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], x.shape[-1]))
        g = self.param("g", nn.initializers.ones, (x.shape[-1],))
        return (x @ w) * g


class LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, DIM, name="embed")(ids)
        x = Block(name="block")(x)
        x = Scale(name="scale")(nn.RMSNorm(name="norm")(x))
        return nn.DenseGeneral(VOCAB, name="head")(x)


@pytest.fixture(scope="module")
def lm():
    ids = jax.random.randint(jax.random.key(1), (2, SEQ), 0, VOCAB)
    wrapped = mpl.apply_policy(LM(), "mixed_bfloat16")
    variables = jax.jit(wrapped.init)(KEY, ids)
    return wrapped, variables, ids


def _loss(model, ids):
    def loss(params):
        logits = model.apply({"params": params}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

    return loss


def _forward_and_backward(model, params, x):
    """The matmuls of the forward pass, and of the gradient w.r.t. params and input."""
    fwd = mpjax.inspect_matmuls(lambda p: model.apply({"params": p}, x))(params)
    loss = lambda p, x: model.apply({"params": p}, x).sum()  # noqa: E731
    bwd = mpjax.inspect_matmuls(jax.grad(loss, argnums=(0, 1)))(params, x)
    return fwd, bwd


def _init(model, *args, **kwargs):
    """The model's variables, abstractly: dtype checks and jaxpr reading need no numbers."""
    return jax.eval_shape(functools.partial(model.init, **kwargs), KEY, *args)


def _dtypes(tree):
    return {leaf.dtype for leaf in jax.tree.leaves(tree)}


def _equations(fn, *args, primitive):
    """(input dtypes, name stack) of every ``primitive`` equation, nested jaxprs included."""
    return [
        ({np.dtype(v.aval.dtype) for v in eqn.invars}, str(eqn.source_info.name_stack))
        for eqn, _ in iter_equations(fn, *args)
        if eqn.primitive.name == primitive
    ]


# --- A language model of stock layers: matmuls, rules, norms, softmax, attention. --------------


def test_every_matmul_forward_and_backward_runs_in_bf16(lm):
    model, variables, ids = lm
    report = mpjax.inspect_matmuls(jax.grad(_loss(model, ids)))(variables["params"])
    # q, k, v, scores, weights x values, out, up, down, scale, head: 10 forward, 2 backward each.
    assert len(report) == 10 + 2 * 10
    assert report.operand_dtypes() == {("bfloat16", "bfloat16"): len(report)}, str(report)


def test_a_user_rule_keeps_the_head_in_f32(lm):
    _, variables, ids = lm
    rules = Rules({"head": "float32"}, default="mixed_bfloat16")
    model = mpl.apply_policy(LM(), rules)
    report = mpjax.inspect_matmuls(jax.grad(_loss(model, ids)))(variables["params"])
    head = [m for m in report if m.region == "head"]
    assert len(head) == 3  # forward, and the two gradients
    assert {m.operand_dtypes for m in head} == {(F32, F32)}
    assert {m.operand_dtypes for m in report if m not in head} == {(BF16, BF16)}
    assert jax.eval_shape(model.apply, variables, ids).dtype == F32


def test_norm_statistics_run_in_f32(lm):
    model, variables, ids = lm
    fn = jax.grad(_loss(model, ids))
    for primitive in ("reduce_sum", "rsqrt"):
        found = [
            d
            for d, scope in _equations(fn, variables["params"], primitive=primitive)
            if scope.endswith(("/ln1", "/ln2", "/norm"))
        ]
        assert found and all(d == {F32} for d in found), (primitive, found)


def test_attention_softmax_runs_in_f32(lm):
    model, variables, ids = lm
    fn = jax.grad(_loss(model, ids))
    for primitive in ("reduce_max", "exp"):
        found = _equations(fn, variables["params"], primitive=primitive)
        attn = [d for d, scope in found if "/attn" in scope]
        assert len(attn) == 1 and attn[0] == {F32}, found
    # The weights go back to bf16 after the f32 softmax: both attention dots stay bf16.
    forward = mpjax.inspect_matmuls(lambda p: model.apply({"params": p}, ids))(variables["params"])
    dots = [m for m in forward if "/attn/..." in m.scope]
    assert [m.operand_dtypes for m in dots] == [(BF16, BF16)] * 2


def test_a_user_attention_fn_is_called_and_its_matmuls_run_in_bf16():
    calls = []

    def my_attention(query, key, value, **kwargs):
        calls.append(query.dtype)
        return nn.dot_product_attention(query, key, value, **kwargs)

    x = jnp.ones((2, SEQ, DIM))
    model = mpl.apply_policy(Block(attention_fn=my_attention), "mixed_bfloat16")
    variables = _init(model, x)
    fwd = mpjax.inspect_matmuls(lambda v: model.apply(v, x))(variables)
    assert calls and set(calls) == {F32}  # the model is traced in its own dtypes...
    attn = [m for m in fwd if m.region == "attn"]
    assert len(attn) == 2 and {m.operand_dtypes for m in attn} == {(BF16, BF16)}  # ...cast at ops


@pytest.mark.slow
def test_params_are_created_in_f32_and_stay_f32_across_adam_steps(lm):
    model, variables, ids = lm
    params = variables["params"]
    assert _dtypes(params) == {F32}
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(_loss(model, ids))(params)
        with jax.numpy_dtype_promotion("standard"):  # optax's adam is not strict-promotion clean
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    opt_state = tx.init(params)
    losses = []
    for _ in range(4):
        params, opt_state, loss, grads = step(params, opt_state)
        losses.append(float(loss))
        assert _dtypes(params) == _dtypes(grads) == {F32}
        assert _dtypes(opt_state) == {F32, np.dtype(np.int32)}  # adam's mu, nu and count
    assert losses[-1] < losses[0]
    assert step._cache_size() == 1  # no retrace
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, variables["params"])
    assert all(jax.tree.leaves(moved))


def test_output_matches_the_f32_model_within_bf16_tolerance(lm):
    model, variables, ids = lm
    out = jax.jit(model.apply)(variables, ids)
    ref = jax.jit(LM().apply)(variables, ids)  # the unwrapped model, same variables
    assert out.dtype == ref.dtype == F32
    scale = float(jnp.abs(ref).max())
    np.testing.assert_allclose(out, ref, atol=0.03 * scale)
    assert not np.array_equal(out, ref)  # it did run in bf16


def test_wrapped_model_has_the_unwrapped_parameter_tree(lm):
    _, variables, ids = lm
    plain = jax.eval_shape(LM().init, jax.random.key(0), ids)
    assert jax.tree.structure(plain) == jax.tree.structure(variables)


# --- Each kind of module. ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer, x",
    [
        (nn.Dense(4), jnp.ones((2, 3))),
        (nn.DenseGeneral((2, 2), axis=(-2, -1)), jnp.ones((2, 3, 4))),
        (nn.Conv(4, (3, 3)), jnp.ones((1, 5, 5, 2))),
        (nn.MultiHeadDotProductAttention(num_heads=2), jnp.ones((2, 3, 4))),
        (Scale(), jnp.ones((2, 3))),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_layer_runs_in_bf16_keeps_f32_params_and_grads(layer, x):
    model = mpl.apply_policy(layer, "mixed_bfloat16")
    variables = _init(model, x)
    params = variables["params"]
    fwd, bwd = _forward_and_backward(model, params, x)
    assert fwd and {m.operand_dtypes for m in fwd + bwd} == {(BF16, BF16)}
    assert len(bwd) == 3 * len(fwd)
    assert _dtypes(params) == {F32}
    assert jax.eval_shape(model.apply, variables, x).dtype == F32
    grads = jax.eval_shape(jax.grad(lambda p: model.apply({"params": p}, x).sum()), params)
    assert _dtypes(grads) == {F32}


def test_embed_lookup_gathers_bf16_rows_and_attend_runs_in_bf16():
    model = mpl.apply_policy(nn.Embed(VOCAB, DIM), "mixed_bfloat16")
    ids = jnp.arange(3)
    variables = _init(model, ids)
    assert variables["params"]["embedding"].dtype == F32
    # The built-in embedding rule returns the rows in the compute dtype, read from the table
    # in it (what a sharded table sends); the table's gradient, a scatter-add, accumulates in
    # the reduce dtype, f32 (tests/test_lookups.py).
    gathers = _equations(lambda v: model.apply(v, ids), variables, primitive="gather")
    converts = [
        (eqn.invars[0].aval.shape, np.dtype(eqn.outvars[0].aval.dtype))
        for eqn, _ in iter_equations(lambda v: model.apply(v, ids), variables)
        if eqn.primitive.name == "convert_element_type"
    ]
    assert [d for d, _ in gathers] == [{BF16, np.dtype(jnp.int32)}]
    assert converts == [((VOCAB, DIM), BF16)], converts
    assert jax.eval_shape(model.apply, variables, ids).dtype == BF16
    query = jnp.ones((2, DIM))
    for method in ("attend", nn.Embed.attend):  # by name or as Flax's own function
        fwd = mpjax.inspect_matmuls(lambda v: model.apply(v, query, method=method))(variables)  # noqa: B023
        assert [m.operand_dtypes for m in fwd] == [(BF16, BF16)]
        assert (
            jax.eval_shape(functools.partial(model.apply, method=method), variables, query).dtype
            == BF16
        )
    # Under Rules without the built-in rules, the root's policy returns the rows in f32.
    plain = mpl.apply_policy(
        nn.Embed(VOCAB, DIM), mpjax.Rules(default="mixed_bfloat16", builtins=False)
    )
    assert jax.eval_shape(plain.apply, variables, ids).dtype == F32


def test_custom_module_reads_params_cast_by_param_get_variable_and_variable():
    class Reads(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.ones, (3, 3))
            v = self.variable("params", "v", jnp.ones, (3, 3)).value
            u = self.get_variable("params", "w")
            return x @ w + x @ v + x @ u

    model = mpl.apply_policy(Reads(), "mixed_bfloat16")
    x = jnp.ones((2, 3))
    params = _init(model, x)["params"]
    assert _dtypes(params) == {F32}
    fwd, bwd = _forward_and_backward(model, params, x)
    assert len(fwd) == 3 and {m.operand_dtypes for m in fwd + bwd} == {(BF16, BF16)}
    grads = jax.eval_shape(jax.grad(lambda p: model.apply({"params": p}, x).sum()), params)
    assert _dtypes(grads) == {F32}


def test_layer_norm_rms_norm_and_batch_norm_keep_f32_params_and_stats():
    class Convnet(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Conv(4, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.RMSNorm()(nn.LayerNorm()(x))

    model = mpl.apply_policy(Convnet(), "mixed_bfloat16")
    x = jax.random.normal(jax.random.key(1), (2, 5, 5, 2))
    variables = jax.jit(functools.partial(model.init, train=False))(KEY, x)
    assert _dtypes(variables) == {F32}
    out, updated = jax.jit(functools.partial(model.apply, train=True, mutable=["batch_stats"]))(
        variables, x
    )
    assert out.dtype == F32 and _dtypes(updated) == {F32}
    before, after = variables["batch_stats"]["BatchNorm_0"], updated["batch_stats"]["BatchNorm_0"]
    assert not np.allclose(before["mean"], after["mean"])
    fn = lambda v: model.apply(v, x, train=True, mutable=["batch_stats"])[0]  # noqa: E731
    convs = mpjax.inspect_matmuls(fn)(variables)
    assert [m.operand_dtypes for m in convs] == [(BF16, BF16)]
    stats = [d for d, scope in _equations(fn, variables, primitive="reduce_sum")]
    assert len(stats) == 5 and all(d == {F32} for d in stats)  # mean, mean square; RMS: one


# --- Lifted transforms, sharing, setup. --------------------------------------------------------


class ScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return Scale()(nn.Dense(DIM)(x)), None


class WithSetup(nn.Module):
    def setup(self):
        self.dense = nn.Dense(DIM)
        self.scale = Scale()
        self.gain = self.param("gain", nn.initializers.ones, (DIM,))

    def __call__(self, x):
        return self.scale(self.dense(x)) * self.gain


class Transformed(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.scan(ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)(
            name="scan"
        )(x, None)[0]
        x = nn.remat(Scale)(name="remat")(x)
        x = nn.vmap(Scale, variable_axes={"params": 0}, split_rngs={"params": True})(name="vmap")(x)
        shared = nn.Dense(DIM, name="shared")
        x = shared(shared(x))
        return WithSetup(name="setup")(x)


@pytest.fixture(scope="module")
def transformed():
    model = mpl.apply_policy(Transformed(), "mixed_bfloat16")
    x = jax.random.normal(jax.random.key(1), (2, DIM))
    return model, _init(model, x), x


def test_scan_remat_vmap_shared_and_setup_modules_run_in_bf16(transformed):
    model, variables, x = transformed
    fwd, bwd = _forward_and_backward(model, variables["params"], x)
    # scan's body (traced once), remat, vmap, shared twice, setup's two.
    assert len(fwd) == 8 and len(bwd) > 2 * len(fwd)
    assert {m.operand_dtypes for m in fwd + bwd} == {(BF16, BF16)}
    contexts = {c for m in bwd for c in m.context}
    assert {"scan", "remat2"} <= contexts
    assert _dtypes(variables) == {F32}
    assert variables["params"]["scan"]["Dense_0"]["kernel"].shape == (2, DIM, DIM)
    assert set(variables["params"]["setup"]) == {"dense", "scale", "gain"}
    grads = jax.eval_shape(
        jax.grad(lambda p: model.apply({"params": p}, x).sum()), variables["params"]
    )
    assert _dtypes(grads) == {F32}


def test_transformed_modules_are_resolved_at_their_paths(transformed):
    model, variables, x = transformed
    report = mpjax.describe(model)(x)
    assert [r.path for r in report.rows] == [
        "",
        "scan",
        "scan/Dense_0",
        "scan/Scale_0",
        "remat",
        "vmap",
        "shared",
        "setup",
        "setup/dense",
        "setup/scale",
    ]
    assert report.row("scan").param_count == 0
    assert report.row("scan/Dense_0").param_count == 2 * (DIM * DIM + DIM)
    assert report.row("setup").param_count == DIM


def test_a_rule_on_a_path_inside_scan_applies_there(transformed):
    _, variables, x = transformed
    model = mpl.apply_policy(
        Transformed(), Rules({"scan/Dense_0": "float32"}, default="mixed_bfloat16")
    )
    fwd = mpjax.inspect_matmuls(lambda v: model.apply(v, x))(variables)
    assert [m.operand_dtypes for m in fwd].count((F32, F32)) == 1
    assert jax.eval_shape(model.apply, variables, x).dtype == F32


# --- bf16 storage. -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy, output", [("bfloat16", BF16), ("p=bf16,c=bf16,o=f32", F32)])
def test_bf16_storage_creates_bf16_params_except_norms_and_grads_follow(lm, policy, output):
    _, _, ids = lm
    model = mpl.apply_policy(LM(), policy)
    params = _init(model, ids)["params"]
    norms = {"ln1", "ln2"}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = {k.key for k in path}
        assert leaf.dtype == (F32 if names & (norms | {"norm"}) else BF16), path
    loss = lambda p: model.apply({"params": p}, ids).astype(F32).sum()  # noqa: E731
    grads = jax.eval_shape(jax.grad(loss), params)
    assert jax.tree.map(lambda p: p.dtype, params) == jax.tree.map(lambda g: g.dtype, grads)
    assert jax.eval_shape(model.apply, {"params": params}, ids).dtype == output


# --- Regions, nesting, wrapping forms. ---------------------------------------------------------


def test_a_wrapped_class_is_a_submodule_with_its_own_rules_inside_a_wrapped_model():
    F32Dense = mpl.apply_policy(nn.Dense, "float32")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(F32Dense(4)(nn.Dense(4)(x)))

    model = mpl.apply_policy(Net(), "mixed_bfloat16")
    x = jnp.ones((2, 4))
    params = _init(model, x)["params"]
    assert set(params) == {"Dense_0", "Dense_1", "Dense_2"}  # same auto-names as unwrapped
    fwd, bwd = _forward_and_backward(model, params, x)
    assert [m.operand_dtypes for m in fwd] == [(BF16, BF16), (F32, F32), (BF16, BF16)]
    assert jax.eval_shape(model.apply, {"params": params}, x).dtype == F32


def test_the_model_is_traced_in_its_own_dtypes_and_cast_at_the_operations():
    seen = []

    class Probe(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(4, name="dense")(x)
            seen.append(y.dtype)
            return y

    model = mpl.apply_policy(Probe(), "mixed_bfloat16")
    x = jnp.ones((2, 4))
    variables = _init(model, x)
    out = jax.eval_shape(model.apply, variables, x)
    # The module's code sees f32 (init and apply); the dot ran in bf16; the root returns f32.
    assert seen == [F32, F32] and out.dtype == F32
    (dot,) = mpjax.inspect_matmuls(lambda v: model.apply(v, x))(variables)
    assert dot.operand_dtypes == (BF16, BF16) and dot.region == "dense"


class WithF32Head(nn.Module):
    """A model whose head asks for f32 through Flax's own attributes."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(4, name="body")(x))
        return nn.Dense(2, dtype=jnp.float32, param_dtype=jnp.float32, name="head")(h)


def test_the_policy_wins_over_a_modules_own_dtype_attributes():
    model = mpl.apply_policy(WithF32Head(), "mixed_bfloat16")
    x = jnp.ones((2, 4))
    params = _init(model, x)["params"]
    fwd, bwd = _forward_and_backward(model, params, x)
    assert {m.region for m in fwd} == {"body", "head"}
    assert len(bwd) == 6  # each forward matmul and its two transposes
    assert {m.operand_dtypes for m in fwd + bwd} == {(BF16, BF16)}


def test_a_rule_for_its_path_keeps_a_module_with_dtype_f32_in_f32():
    model = mpl.apply_policy(WithF32Head(), Rules({"head": "float32"}, default="mixed_bfloat16"))
    x = jnp.ones((2, 4))
    fwd, bwd = _forward_and_backward(model, _init(model, x)["params"], x)
    assert {(m.region, m.operand_dtypes) for m in fwd + bwd} == {
        ("head", (F32, F32)),
        ("body", (BF16, BF16)),
    }
    assert sum(m.region == "head" for m in bwd) == 3


def test_full_precision_around_a_modules_code_keeps_it_in_f32():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4, name="body")(x)
            with mpjax.full_precision():
                return nn.Dense(2, name="head")(h)

    model = mpl.apply_policy(Model(), "mixed_bfloat16")
    x = jnp.ones((2, 4))
    fwd, bwd = _forward_and_backward(model, _init(model, x)["params"], x)
    assert {(m.region, m.operand_dtypes) for m in fwd} == {
        ("head", (F32, F32)),
        ("body", (BF16, BF16)),
    }
    assert {m.operand_dtypes for m in bwd if m.region == "head"} == {(F32, F32)}


def test_wrapped_model_works_as_a_submodule_of_an_unwrapped_one_under_jit():
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(mpl.apply_policy(Block, "mixed_bfloat16")(name="inner")(x))

    x = jnp.ones((2, SEQ, DIM))
    variables = jax.eval_shape(jax.jit(Outer().init), KEY, x)
    fwd = mpjax.inspect_matmuls(jax.jit(Outer().apply))(variables, x)
    inner = [m for m in fwd if "/inner/" in m.scope]
    assert len(inner) == 8 and {m.operand_dtypes for m in inner} == {(BF16, BF16)}
    assert fwd[-1].operand_dtypes == (F32, F32)  # Outer's own Dense, outside the policy


def test_the_users_module_is_left_unchanged():
    dense = nn.Dense(4)
    model = mpl.apply_policy(dense, "bfloat16")
    x = jnp.ones((1, 2))
    jax.eval_shape(model.apply, _init(model, x), x)
    assert dense.dtype is None and dense.param_dtype == jnp.float32
    assert model.dtype is None  # the configured copies are Flax's bound ones
    assert isinstance(model, nn.Dense) and type(model).__name__ == "Dense"


def test_an_unbound_wrapped_module_behaves_as_the_unbound_module():
    class WithHelper(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

        def double(self, x):
            return x * 2

    wrapped = mpl.apply_policy(WithHelper(), "mixed_bfloat16")
    np.testing.assert_array_equal(wrapped.double(jnp.ones(2)), jnp.full(2, 2.0))
    with pytest.raises(flax.errors.CallCompactUnboundModuleError):
        wrapped(jnp.ones(2))


def test_wrapping_again_replaces_the_rules():
    model = mpl.apply_policy(mpl.apply_policy(nn.Dense(4), "float32"), "mixed_bfloat16")
    x = jnp.ones((1, 2))
    params = _init(model, x)["params"]
    fwd = mpjax.inspect_matmuls(lambda p: model.apply({"params": p}, x))(params)
    assert [m.operand_dtypes for m in fwd] == [(BF16, BF16)]


# --- Rule problems. ----------------------------------------------------------------------------


def test_a_shadowed_rule_warns_exactly_once():
    rules = Rules([("up", None), (nn.Dense, None)], default="mixed_bfloat16")
    model = mpl.apply_policy(Block(), rules)
    x = jnp.ones((1, SEQ, DIM))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        variables = _init(model, x)
        jax.eval_shape(model.apply, variables, x)
        jax.jit(model.apply).lower(variables, x)
    messages = [str(w.message) for w in caught if issubclass(w.category, mpjax.RuleWarning)]
    assert messages == [
        "rule 'flax.linen.linear.Dense' is ambiguous at 'up': rule 'up' comes first and wins "
        "there.",
    ]


@pytest.mark.parametrize(
    "key, closest", [("donw", "'down'"), ("attn.query", "'attn/query'"), ("upp", "'up'")]
)
def test_a_rule_that_matches_no_module_is_an_error_naming_the_closest_paths(key, closest):
    model = mpl.apply_policy(Block(), Rules({key: "float32"}, default="mixed_bfloat16"))
    x = jnp.ones((1, SEQ, DIM))
    with pytest.raises(ValueError, match="matches no module") as error:
        _init(model, x)
    message = str(error.value)
    assert f"rule {key!r}" in message and f"closest paths: {closest}" in message
    assert "'/'" in message and "allow_unmatched=True" in message
    # Still refused at the next call: the mistake is never silent.
    with pytest.raises(ValueError, match="matches no module"):
        _init(model, x)


def test_allow_unmatched_accepts_a_rule_for_a_module_the_call_does_not_run():
    rules = Rules({"decoder/*": "float32"}, default="mixed_bfloat16", allow_unmatched=True)
    model = mpl.apply_policy(Block(), rules)
    x = jnp.ones((1, SEQ, DIM))
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.RuleWarning)
        variables = _init(model, x)
        assert jax.eval_shape(model.apply, variables, x).shape == x.shape


# --- The cost: no more converts than the same model written with dtype=jnp.bfloat16. -----------


def _train_step_converts(model, x):
    params = _init(model, x)["params"]
    tx = optax.adam(1e-3)

    def step(params, opt_state):
        def loss(p):
            return jnp.mean(jnp.square(model.apply({"params": p}, x).astype(jnp.float32)))

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return mpjax.hlo_op_counts(step)(params, jax.eval_shape(tx.init, params))["convert"]


@pytest.mark.slow
def test_wrapped_train_step_has_no_more_converts_than_hand_written_bf16():
    x = jax.random.normal(jax.random.key(1), (2, SEQ, DIM))
    # Flax's norms are not strict-promotion clean with dtype=bf16, nor is optax's adam: compare
    # both models under standard promotion, on the same backend.
    with jax.numpy_dtype_promotion("standard"):
        wrapped = _train_step_converts(mpl.apply_policy(Block(), "mixed_bfloat16"), x)
        by_hand = _train_step_converts(HandWrittenBlock(dtype=jnp.bfloat16), x)
    assert 0 < wrapped <= by_hand, (wrapped, by_hand)


# --- describe(). -------------------------------------------------------------------------------


class Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="proj")(x)
        x = nn.LayerNorm(name="norm")(x)
        return Scale(name="scale")(x)


def test_describe_returns_the_table_and_prints_nothing(capsys):
    rules = Rules(
        {"scale": "float32", "decoder": "float16"}, default="mixed_bfloat16", allow_unmatched=True
    )
    report = mpjax.describe(mpl.apply_policy(Tiny(), rules))(jnp.ones((1, 3)))
    expected = [
        "path    type       params   compute   output    rule                             #params  bytes  ops ran in  matmuls ran in",
        "------  ---------  -------  --------  --------  -------------------------------  -------  -----  ----------  ------------------",
        "<root>  Tiny       float32  bfloat16  float32   default                                0    0 B  -           -",
        "proj    Dense      float32  bfloat16  float32   default                               16   64 B  bf16 f32    3x bf16,bf16",
        "norm    LayerNorm  float32  float32   bfloat16  builtin: linen.LayerNorm in f32        8   32 B  f32         -",
        "scale   Scale      float32  float32   float32   scale                                 20   80 B  f32         3x f32,f32@highest",
        "------  ---------  -------  --------  --------  -------------------------------  -------  -----  ----------  ------------------",
        "total                                                                                 44  176 B",
        "warning: rule 'decoder' matches no module.",
    ]
    assert capsys.readouterr().out == ""
    assert report.table().splitlines() == expected and str(report) == report.table()
    again = mpjax.describe(Tiny(), rules=rules)(jnp.ones((1, 3)))  # wrapped by describe
    assert again == report


@pytest.mark.parametrize("spec", ["fp16", "f16", "float16", "half"])
def test_describe_says_that_fp16_is_pure_float16_and_names_amp(spec):
    note = (
        "note: 'fp16', 'f16', 'float16' and 'half' mean pure float16: float16 params, compute "
        "and output. AMP (PyTorch's autocast to float16) is 'mixed_float16' (p=f32,c=f16,o=f32)."
    )
    report = mpjax.describe(mpl.apply_policy(Tiny(), spec))(jnp.ones((1, 3)))
    assert report.table().splitlines()[-1] == note
    assert report.to_dict()["notes"] == [note.removeprefix("note: ")]
    amp = mpjax.describe(mpl.apply_policy(Tiny(), "mixed_float16"))(jnp.ones((1, 3)))
    assert "note:" not in amp.table() and amp.to_dict()["notes"] == []


def test_describe_to_dict_is_plain_json():
    report = mpjax.describe(Tiny(), rules="mixed_bfloat16")(jnp.ones((1, 3)))
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    # How many operations ran in each dtype depends on how the JAX version writes the jaxpr.
    computes = data["rows"][1].pop("computes")
    assert [dtype for dtype, _ in computes] == ["bf16", "f32"]
    assert all(type(count) is int and count > 0 for _, count in computes)
    assert data["rows"][1] == {
        "path": "proj",
        "type": "Dense",
        "policy": {
            "param_dtype": "float32",
            "compute_dtype": "bfloat16",
            "output_dtype": "float32",
            "f32_matmul_precision": "highest",
        },
        "rule": "default",
        "param_count": 16,
        "param_bytes": 64,
        "matmuls": [["bf16,bf16", 3]],
    }
    assert data["problems"] == [] and data["matmuls_traced"] is True
    assert (data["total_params"], data["total_bytes"]) == (44, 176)


class DenseThenNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm(name="norm")(nn.Dense(4, name="dense")(x))


def _ops_ran_in(report: mpjax.PrecisionReport) -> dict[str, str]:
    """The "ops ran in" cells of ``report``'s table, by the rows' first column."""
    header, _, *lines = report.table().splitlines()
    start, end = header.index("ops ran in"), header.index("matmuls ran in")
    return {line.split()[0]: line[start:end].strip() for line in lines[: len(report.rows)]}


def test_describe_shows_every_dtype_a_modules_operations_computed_in():
    # Under mixed_float16 the norm a rule keeps in float32 receives the Dense's float16 output:
    # every operation of its region, forward and backward, computes in float32 (a float16
    # input squared in float16 overflows from 256), while the Dense computes in float16.
    report = mpjax.describe(mpl.apply_policy(DenseThenNorm(), "mixed_float16"))(jnp.ones((2, 3)))
    norm, dense = report.row("norm"), report.row("dense")
    assert norm.policy.compute_dtype == jnp.float32 and norm.matmuls == ()
    assert [dtype for dtype, _ in norm.computes] == ["f32"]
    assert "f16" in dict(dense.computes) and dense.matmuls == (("f16,f16", 3),)
    assert report.row("").computes == ()  # the root's own code computes nothing
    assert _ops_ran_in(report) == {"<root>": "-", "dense": "f16 f32", "norm": "f32"}
    assert report.to_dict()["rows"][2]["computes"] == [["f32", dict(norm.computes)["f32"]]]


def test_describe_leaves_the_gradients_sum_of_a_residual_to_its_caller():
    # The residual stream feeds the norm and skips it: JAX sums its two gradients in float16
    # under the norm's scope, which is the stream's arithmetic, not the norm's.
    class Residual(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4, name="dense")(x)
            return h + nn.LayerNorm(name="norm")(h)

    report = mpjax.describe(mpl.apply_policy(Residual(), "mixed_float16"))(jnp.ones((2, 3)))
    assert [dtype for dtype, _ in report.row("norm").computes] == ["f32"]


def test_describe_counts_a_function_jitted_in_a_module_for_that_module():
    # The equations of a nested jaxpr record none of the scopes around it: the module's region
    # is the one around the jit, where the engine ran them.
    class Projected(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.ones, (3, 3))
            return jax.jit(lambda x, w: jnp.tanh(x @ w))(x, w)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Projected(name="proj")(x)

    report = mpjax.describe(mpl.apply_policy(Net(), "mixed_bfloat16"))(jnp.ones((2, 3)))
    assert report.row("proj").matmuls == (("bf16,bf16", 3),)
    assert "bf16" in dict(report.row("proj").computes)
    assert report.row("").matmuls == report.row("").computes == ()


def test_describe_passes_every_keyword_to_the_model():
    class Keywords(nn.Module):  # keywords named like describe's options and old print_table
        @nn.compact
        def __call__(self, x, *, rules, print_table, mask):
            x = nn.Dense(4, name="proj")(x) * mask
            return nn.Dense(2, name="extra")(x) if rules == "extra" and print_table else x

    model = mpl.apply_policy(Keywords(), "mixed_bfloat16")
    x, mask = jnp.ones((1, 3)), jax.ShapeDtypeStruct((1, 4), jnp.float32)  # an abstract array
    report = mpjax.describe(model)(x, rules="extra", print_table=True, mask=mask)
    assert [r.path for r in report.rows] == ["", "proj", "extra"]
    report = mpjax.describe(model)(x, rules="none", print_table=True, mask=mask)
    assert [r.path for r in report.rows] == ["", "proj"]


def test_describe_method_and_rngs_options():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(4, name="proj")(x))

        def project(self, x):
            return x

    model = mpl.apply_policy(Net(), "mixed_bfloat16")
    x = jnp.ones((1, 3))
    report = mpjax.describe(
        model, rngs={"params": jax.random.key(1), "dropout": jax.random.key(2)}
    )(x)
    assert report.row("proj").matmuls == (("bf16,bf16", 3),)
    variables = jax.eval_shape(
        model.init, {"params": jax.random.key(0), "dropout": jax.random.key(0)}, x
    )
    report = mpjax.describe(model, variables=variables, method="project")(x)
    assert [r.path for r in report.rows] == [""]  # project calls no submodule


def test_describe_counts_given_variables_in_their_stored_dtype():
    model = mpl.apply_policy(Tiny(), "bfloat16")
    x = jax.ShapeDtypeStruct((1, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    report = mpjax.describe(model, variables=variables)(x)
    assert [(r.path, r.param_count, r.param_bytes) for r in report.rows] == [
        ("", 0, 0),
        ("proj", 16, 32),
        ("norm", 8, 32),
        ("scale", 20, 40),
    ]
    unwrapped = mpjax.describe(Tiny(), rules="bfloat16")(x)
    assert unwrapped.rows == report.rows


def test_the_unreleased_describe_alias_is_gone():
    # One name per concept: mpjax.describe(model, rules=...)(*inputs) reports a linen model.
    assert "describe" not in mpl.__all__ and not hasattr(mpl, "describe")


# --- Bad input. --------------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    with pytest.raises(TypeError, match=r"`module`; got 42"):
        mpl.apply_policy(42, "mixed_bfloat16")
    with pytest.raises(TypeError, match=r"mpjax\.nnx\.set_policy"):
        mpl.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    with pytest.raises(ValueError, match=r"Unknown policy 'mixed_bf16'"):
        mpl.apply_policy(nn.Dense(2), "mixed_bf16")
    with pytest.raises(TypeError, match=r"`policy_or_rules` must be mpjax.Rules, .*got 3\.5"):
        mpl.apply_policy(nn.Dense(2), 3.5)
    bound = nn.Dense(2).bind({"params": {}})
    with pytest.raises(ValueError, match=r"(?s)already bound.*apply_policy\(nn\.Dense, rules\)"):
        mpl.apply_policy(bound, "mixed_bfloat16")
    # describe() checks the model and options when called, before any inputs.
    with pytest.raises(ValueError, match=r"unwrapped Dense: pass `rules=`"):
        mpjax.describe(nn.Dense(2))
    with pytest.raises(ValueError, match=r"already wrapped"):
        mpjax.describe(mpl.apply_policy(nn.Dense(2), "bf16"), rules="f32")
    with pytest.raises(TypeError, match=r"got the class Dense\. Pass an instance"):
        mpjax.describe(nn.Dense, rules="f32")
    with pytest.raises(TypeError, match=r"describe\(method=...\) must be a method name .*got 3"):
        mpjax.describe(nn.Dense(2), rules="f32", method=3)
    with pytest.raises(TypeError, match=r"describe\(variables=...\) must be the dict .*got 3"):
        mpjax.describe(nn.Dense(2), rules="f32", variables=3)


@pytest.mark.parametrize("variables", [None, 3, [{"params": {}}]])
def test_apply_of_a_wrapped_model_names_variables_that_are_not_a_dict(variables):
    model = mpl.apply_policy(nn.Dense(2), "mixed_bfloat16")
    with pytest.raises(TypeError, match=r"Dense.apply\(variables, ...\): variables must be the"):
        model.apply(variables, jnp.ones((1, 3)))


@pytest.mark.slow
def test_the_linen_guides_example_runs_and_prints_its_table(capsys):
    guide = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "linen.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", guide, re.S))
    table = re.search(r"```text\n(.*?)```", guide, re.S).group(1)
    exec(compile(code, "docs/linen.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "float32 {dtype('float32')}"
    assert printed[1] == "Counter({('bfloat16', 'bfloat16'): 21, ('float32', 'float32'): 3})"
    assert printed[2:] == table.splitlines()


def test_a_method_reaching_into_a_submodule_runs_under_the_rules():
    class Net(nn.Module):
        def setup(self):
            self.encoder = nn.Dense(4)

        def __call__(self, x):
            return self.encoder(x)

    model = mpl.apply_policy(Net(), "mixed_bfloat16")
    x = jnp.ones((2, 3))
    variables = _init(model, x)
    fwd = mpjax.inspect_matmuls(lambda v: model.apply(v, x, method=lambda m, x: m.encoder(x)))(
        variables
    )
    assert [m.operand_dtypes for m in fwd] == [(BF16, BF16)]
