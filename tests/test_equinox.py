"""mpjax.equinox: unmodified Equinox models, every eqx.nn layer family, under a policy or rules.

Matmul dtypes forward and backward, and the dtypes norms compute in, are read from the jaxpr;
outputs are compared with the f32 model within what bf16 rounding over the model's reduction
lengths allows (tests/tolerances.py).
"""

from __future__ import annotations

import functools
import inspect
import io
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mixed_precision_checks import assert_norm_computes_in_f32_alone, key, normal
from tolerances import assert_close_in_norm, tolerance

import mpjax
from mpjax import jax_compat
from mpjax.casting.regions import innermost
from mpjax.inspection.matmuls import iter_equations

eqx = pytest.importorskip("equinox")
mpe = pytest.importorskip("mpjax.equinox")

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
POLICY = "mixed_bfloat16"
D, T = 16, 6


def keys(n: int, seed: int = 0):
    return jax.random.split(key(seed), n)


def _floating(x) -> bool:
    return eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def loss_of(call):
    """A scalar loss of the floating outputs of ``call(model, *inputs)``."""

    def loss(model, *inputs):
        leaves = [x for x in jax.tree.leaves(call(model, *inputs)) if _floating(x)]
        return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves)

    return loss


def _call(model, *inputs):
    return model(*inputs)


def matmuls(model, *inputs, call=_call):
    """(forward, backward) matmul reports of ``call(model, *inputs)`` and of its filter_grad."""
    forward = mpjax.inspect_matmuls(call)(model, *inputs)
    backward = mpjax.inspect_matmuls(eqx.filter_grad(loss_of(call)))(model, *inputs)
    return forward, backward


def assert_matmuls(model, *inputs, expected=None, call=_call, dtype=BF16):
    """Every matmul forward and backward runs ``dtype`` x ``dtype`` (or, by region path, the
    dtype ``expected`` gives); returns the regions they ran in."""
    seen = set()
    for name, report in zip(("forward", "backward"), matmuls(model, *inputs, call=call)):
        assert report, f"{name}: no matmul\n{report}"
        for m in report:
            want = dtype if expected is None else expected(m.region)
            assert m.operand_dtypes == (want, want), f"{name}: {m.region}\n{report}"
            seen.add(m.region)
    return seen


def region_dtypes(fn, *args):
    """{region path: dtypes of the floating inputs of its equations}, casts, calls and
    cotangent sums left out: a cast into a region takes the caller's dtype in, a call (a jitted
    helper such as a norm's) takes its arguments as they come and is read equation by equation,
    and the backward pass sums the cotangents of an input the region uses twice in the input's
    dtype, the caller's."""
    found: dict[str, set] = {}
    for eqn, _ in iter_equations(fn, *args):
        if eqn.primitive.name in ("convert_element_type", "name", "jit", "pjit", "add_any"):
            continue
        region = innermost(jax_compat.scope_names(eqn))
        path = None if region is None else region.path
        for v in eqn.invars:
            aval = getattr(v, "aval", None)
            if aval is not None and jnp.issubdtype(aval.dtype, jnp.floating):
                found.setdefault(path, set()).add(np.dtype(aval.dtype))
    return found


def assert_close_to_f32(wrapped, reference, *inputs, reduction_length, call=_call):
    out = eqx.filter_jit(call)(wrapped, *inputs)
    ref = eqx.filter_jit(call)(reference, *inputs)
    rtol = tolerance(BF16, reduction_length)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        if _floating(b):
            assert a.dtype == b.dtype == F32
            assert_close_in_norm(a, b, rtol, "mixed vs f32")
            assert not np.array_equal(a, b), "identical to the f32 model: nothing ran in bf16"


# --- Models. ------------------------------------------------------------------------------------


class Block(eqx.Module):
    """A pre-norm transformer block, optionally with rotary embeddings on the heads."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.RMSNorm
    mlp: eqx.nn.MLP
    rope: eqx.nn.RotaryPositionalEmbedding | None

    def __init__(self, key, rope=False):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(D), eqx.nn.RMSNorm(D)
        self.attn = eqx.nn.MultiheadAttention(2, D, key=k1)
        self.mlp = eqx.nn.MLP(D, D, 2 * D, depth=1, activation=jax.nn.gelu, key=k2)
        self.rope = eqx.nn.RotaryPositionalEmbedding(D // 2) if rope else None

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        process = None
        if self.rope is not None:

            def process(q, k, v):
                rotate = jax.vmap(self.rope, in_axes=1, out_axes=1)
                return rotate(q), rotate(k), v

        x = x + self.attn(h, h, h, process_heads=process)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    layers: tuple
    head: eqx.nn.Linear

    def __init__(self, key, n_layers=2, vocab=32, rope=False):
        ks = jax.random.split(key, n_layers + 2)
        self.embed = eqx.nn.Embedding(vocab, D, key=ks[0])
        self.layers = tuple(Block(k, rope) for k in ks[1:-1])
        self.head = eqx.nn.Linear(D, vocab, key=ks[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for layer in self.layers:
            x = layer(x)
        return jax.vmap(self.head)(x)


@functools.cache
def transformer(seed: int = 0, n_layers: int = 2, rope: bool = False) -> Transformer:
    """A Transformer, initialized in one compiled program (eager init compiles each op) and
    shared by the tests (modules are immutable)."""
    return eqx.filter_jit(lambda k: Transformer(k, n_layers, rope=rope))(key(seed))


def tokens(seed=0, vocab=32):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, T), jnp.int32)


# The reduction lengths a logit of Transformer goes through (tests/tolerances.py): per block a
# LayerNorm, q/k/v projections, scores (head size), softmax and values (T), the output
# projection, an RMSNorm and the MLP (D, then 2D); then the head.
TRANSFORMER_REDUCTION = 2 * (D + D + D // 2 + T + T + D + D + D + 2 * D) + D


# --- The wrapper. -------------------------------------------------------------------------------


def test_paths_are_written_as_equinox_users_write_them():
    model = transformer()
    paths = dict(mpe.module_paths(model))
    assert paths[""] is Transformer
    assert paths["layers[1].attn.query_proj"] is eqx.nn.Linear
    assert paths["layers[0].mlp.layers[1]"] is eqx.nn.Linear
    assert paths["layers[0].norm2"] is eqx.nn.RMSNorm


def test_a_transformer_runs_every_matmul_bf16_and_norms_f32_forward_and_backward():
    model = transformer()
    wrapped = mpe.apply_policy(model, POLICY)
    assert isinstance(wrapped, eqx.Module) and wrapped.model is not model
    x = tokens()
    regions = assert_matmuls(wrapped, x)
    assert {"layers[0].attn.query_proj", "layers[1].attn", "layers[1].mlp.layers[1]", "head"} <= (
        regions
    )
    grad = eqx.filter_grad(loss_of(_call))
    for name, fn in (("forward", _call), ("backward", grad)):
        found = region_dtypes(fn, wrapped, x)
        for norm in ("layers[0].norm1", "layers[1].norm2"):
            assert found[norm] == {F32}, (name, norm, found[norm])
        assert BF16 in found["layers[0].mlp.layers[0]"], (name, found["layers[0].mlp.layers[0]"])
    assert_close_to_f32(wrapped, model, x, reduction_length=TRANSFORMER_REDUCTION)


def test_norm_statistics_and_softmax_run_in_f32_and_a_norm_returns_the_compute_dtype():
    for policy in (POLICY, "p=f32,c=bf16,o=bf16"):
        wrapped = mpe.apply_policy(transformer(), policy)
        for fn in (_call, eqx.filter_grad(loss_of(_call))):
            found = [
                (e.primitive.name, np.dtype(e.invars[0].aval.dtype))
                for e, _ in iter_equations(fn, wrapped, tokens())
                if e.primitive.name in ("rsqrt", "exp", "reduce_max")
            ]
            names = [name for name, _ in found]
            assert names.count("rsqrt") >= 4 and "exp" in names and "reduce_max" in names
            assert {dtype for _, dtype in found} == {F32}, (policy, found)
    for norm in (eqx.nn.LayerNorm(D), eqx.nn.RMSNorm(D)):
        wrapped = mpe.apply_policy(norm, POLICY)
        assert wrapped(normal(D)).dtype == BF16 and wrapped.model.weight.dtype == F32


@pytest.mark.slow  # compiles a model
def test_rotary_attention_runs_bf16_matmuls_and_stays_close():
    model = transformer(1, n_layers=1, rope=True)
    wrapped = mpe.apply_policy(model, POLICY)
    regions = assert_matmuls(wrapped, tokens())
    assert "layers[0].attn" in regions
    assert_close_to_f32(wrapped, model, tokens(), reduction_length=TRANSFORMER_REDUCTION)


def test_params_stay_f32_and_gradients_come_back_f32_in_the_models_structure():
    model = transformer()
    wrapped = mpe.apply_policy(model, POLICY)
    params = eqx.filter(wrapped, eqx.is_inexact_array)
    same = jax.tree.map(np.array_equal, params.model, eqx.filter(model, eqx.is_inexact_array))
    assert all(jax.tree.leaves(same))
    grads = eqx.filter_eval_shape(eqx.filter_grad(loss_of(_call)), wrapped, tokens())
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}


def test_bf16_storage_keeps_norms_f32_and_grads_in_the_storage_dtype():
    wrapped = mpe.apply_policy(transformer(), "bfloat16")
    stored = {
        path: {x.dtype for x in jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array))}
        for path, m in (
            ("qproj", wrapped.model.layers[0].attn.query_proj),
            ("norm", wrapped.model.layers[0].norm1),
            ("embed", wrapped.model.embed),
        )
    }
    assert stored == {"qproj": {BF16}, "norm": {F32}, "embed": {BF16}}
    grads = eqx.filter_eval_shape(eqx.filter_grad(loss_of(_call)), wrapped, tokens())
    assert grads.model.layers[0].attn.query_proj.weight.dtype == BF16
    assert grads.model.layers[0].norm1.weight.dtype == F32
    assert eqx.filter_eval_shape(wrapped, tokens()).dtype == BF16


@pytest.mark.slow
def test_path_and_class_rules_with_brackets_literal():
    model = transformer()
    rules = mpjax.Rules(
        {"layers[1].mlp*": "float32", eqx.nn.Embedding: "float32", "head": "mixed_float16"},
        default=POLICY,
    )
    wrapped = mpe.apply_policy(model, rules)

    def expected(region):
        if region.startswith("layers[1].mlp"):
            return F32
        return F16 if region == "head" else BF16

    regions = assert_matmuls(wrapped, tokens(), expected=expected)
    assert {"layers[1].mlp.layers[0]", "layers[0].mlp.layers[0]", "head"} <= regions
    report = mpjax.describe(wrapped)()
    rows = {row.path: row for row in report.rows}
    assert rows["embed"].policy == mpjax.get_policy("float32")
    assert rows["layers[1].mlp"].rule == "layers[1].mlp*"
    assert rows["layers[0].mlp"].rule == "default"
    assert rows["layers[0].norm1"].rule == "builtin: equinox.LayerNorm in f32"
    # A regular expression works as elsewhere; a leading "." (keystr's spelling) is accepted.
    wrapped = mpe.apply_policy(model, mpjax.Rules({".head": "float32"}, default=POLICY))
    assert assert_matmuls(wrapped, tokens(), expected=lambda r: F32 if r == "head" else BF16)
    pattern = re.compile(r"layers\[\d\]\.attn\..*_proj")
    wrapped = mpe.apply_policy(model, mpjax.Rules({pattern: "float32"}, default=POLICY))
    assert_matmuls(
        wrapped, tokens(), expected=lambda r: F32 if pattern.fullmatch(r or "") else BF16
    )


@pytest.mark.slow
def test_a_region_under_another_policy_casts_its_outputs():
    model = eqx.nn.MLP(4, 4, 8, depth=2, key=key())
    wrapped = mpe.apply_policy(model, mpjax.Rules({"layers[1]": "bfloat16"}, default="float32"))
    forward, _ = matmuls(wrapped, normal(4))
    by_region = {m.region: m for m in forward}
    # layers[1] returns bf16 (its output dtype); layers[2], back in f32, computes in f32.
    assert by_region["layers[1]"].operand_dtypes == (BF16, BF16)
    assert by_region["layers[2]"].operand_dtypes == (F32, F32)
    assert wrapped(normal(4)).dtype == F32


# --- Every eqx.nn layer family. -----------------------------------------------------------------


def test_linear_and_mlp():
    mlp = eqx.nn.MLP(D, 4, 32, depth=2, key=key())
    wrapped = mpe.apply_policy(mlp, POLICY)
    x = normal(8, D)
    call = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    assert assert_matmuls(wrapped, x, call=call) == {"layers[0]", "layers[1]", "layers[2]"}
    assert_close_to_f32(wrapped, mlp, x, reduction_length=D + 64, call=call)
    linear = eqx.nn.Linear(D, 4, key=key())
    assert assert_matmuls(mpe.apply_policy(linear, POLICY), normal(D)) == {""}


@pytest.mark.slow
def test_convolutions():
    class ConvNet(eqx.Module):
        conv: eqx.nn.Conv2d
        transpose: eqx.nn.ConvTranspose1d
        norm: eqx.nn.GroupNorm

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(3, 4, kernel_size=3, padding=1, key=k1)
            self.norm = eqx.nn.GroupNorm(2, 4)
            self.transpose = eqx.nn.ConvTranspose1d(4, 2, kernel_size=3, key=k2)

        def __call__(self, x):
            h = self.norm(jax.nn.relu(self.conv(x)))
            return self.transpose(h.mean(axis=-1))

    model = ConvNet(key())
    wrapped = mpe.apply_policy(model, POLICY)
    x = normal(3, 8, 8)
    assert assert_matmuls(wrapped, x) == {"conv", "transpose"}
    for fn in (_call, eqx.filter_grad(loss_of(_call))):
        assert region_dtypes(fn, wrapped, x)["norm"] == {F32}
    assert_close_to_f32(wrapped, model, x, reduction_length=27 + 4 + 8 + 12)


@pytest.mark.slow
def test_embedding_reads_bf16_rows_and_its_gradient_is_f32():
    model = transformer(n_layers=1)
    wrapped = mpe.apply_policy(model, POLICY)
    found = region_dtypes(_call, wrapped, tokens())
    # The lookup takes the stored f32 table and gathers its rows from it cast to bf16 (what a
    # sliced table sends); its gradient accumulates in f32, the reduce dtype.
    assert found["embed"] == {F32, BF16}
    grads = eqx.filter_jit(eqx.filter_grad(loss_of(_call)))(wrapped, tokens())
    assert grads.model.embed.weight.dtype == F32
    used = np.unique(np.asarray(tokens()))
    assert np.all(np.asarray(grads.model.embed.weight)[used] != 0)


@pytest.mark.slow
def test_batch_norm_with_state_updates_f32_statistics_and_inference_mode_reads_them():
    class Net(eqx.Module):
        linear: eqx.nn.Linear
        bn: eqx.nn.BatchNorm

        def __init__(self, key):
            self.linear = eqx.nn.Linear(D, 8, key=key)
            # Equinox 0.13 added `mode` (and warns without it); 0.12 has only the EMA one.
            modes = inspect.signature(eqx.nn.BatchNorm).parameters
            mode = {"mode": "batch"} if "mode" in modes else {}
            self.bn = eqx.nn.BatchNorm(8, axis_name="batch", **mode)

        def __call__(self, x, state):
            return self.bn(self.linear(x), state)

    model, state = eqx.nn.make_with_state(Net)(key())
    wrapped = mpe.apply_policy(model, POLICY)
    x = normal(8, D)
    batched = jax.vmap(_call, in_axes=(None, 0, None), out_axes=(0, None), axis_name="batch")

    def loss(model, x, state):
        out, state = batched(model, x, state)
        return jnp.mean(out**2), state

    for report in (
        mpjax.inspect_matmuls(batched)(wrapped, x, state),
        mpjax.inspect_matmuls(eqx.filter_grad(loss, has_aux=True))(wrapped, x, state),
    ):
        assert {(m.region, m.operand_dtypes) for m in report} == {("linear", (BF16, BF16))}
    assert region_dtypes(batched, wrapped, x, state)["bn"] == {F32}
    out, new_state = eqx.filter_jit(batched)(wrapped, x, state)
    ref, ref_state = eqx.filter_jit(batched)(model, x, state)
    assert out.dtype == F32
    assert_close_in_norm(out, ref, tolerance(BF16, D + 8))
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
        assert a.dtype == b.dtype
        assert_close_in_norm(a, b, tolerance(BF16, D + 8))
    assert not all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state))
    )
    # inference_mode reaches the wrapped model's BatchNorm: it reads the running statistics
    # and leaves the state alone.
    inference = eqx.nn.inference_mode(wrapped)
    assert inference.model.bn.inference
    out, same = eqx.filter_jit(jax.vmap(_call, in_axes=(None, 0, None), out_axes=(0, None)))(
        inference, x, new_state
    )
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(new_state))
    )


@pytest.mark.slow
def test_a_constant_output_comes_back_as_an_array_as_from_the_model_itself():
    """A layer may return a constant (Equinox 0.12's BatchNorm stores jnp.array(False) in its
    state): it stays an array, which eqx.filter_jit returns as an output, not a static value."""

    class Flagged(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x):
            return self.linear(x), jnp.array(False), jnp.zeros(2)

    wrapped = mpe.apply_policy(Flagged(eqx.nn.Linear(D, 2, key=key())), POLICY)
    for call in (wrapped, eqx.filter_jit(wrapped)):
        _, flag, zeros = call(normal(D))
        assert isinstance(flag, jax.Array) and flag.dtype == np.bool_ and not flag
        assert isinstance(zeros, jax.Array) and zeros.dtype == F32


@pytest.mark.slow
def test_dropout_draws_from_the_key_and_inference_mode_turns_it_off():
    class Net(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __call__(self, x, *, key=None):
            return self.dropout(self.linear(x), key=key)

    model = Net(eqx.nn.Linear(D, 32, key=key()), eqx.nn.Dropout(0.5))
    wrapped = mpe.apply_policy(model, POLICY)
    x, k = normal(D), jax.random.key(3)
    out = eqx.filter_jit(lambda m, x, k: m(x, key=k))(wrapped, x, k)
    ref = eqx.filter_jit(lambda m, x, k: m(x, key=k))(model, x, k)
    np.testing.assert_array_equal(out == 0, ref == 0)  # the same draws: the same units dropped
    assert 0 < int(jnp.sum(out == 0)) < 32
    assert_matmuls(wrapped, x, k, call=lambda m, x, k: m(x, key=k))
    off = eqx.nn.inference_mode(wrapped)
    assert int(jnp.sum(off(x) == 0)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["GRUCell", pytest.param("LSTMCell", marks=pytest.mark.slow)])
def test_recurrent_cells_in_a_scan(cell):
    class RNN(eqx.Module):
        cell: eqx.Module
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.cell = getattr(eqx.nn, cell)(D, 8, key=k1)
            self.head = eqx.nn.Linear(8, 2, key=k2)

        def __call__(self, xs):
            state = jnp.zeros(8) if cell == "GRUCell" else (jnp.zeros(8), jnp.zeros(8))

            def step(state, x):
                state = self.cell(x, state)
                return state, None

            state, _ = jax.lax.scan(step, state, xs)
            return self.head(state if cell == "GRUCell" else state[0])

    model = RNN(key())
    wrapped = mpe.apply_policy(model, POLICY)
    xs = normal(T, D)
    forward, backward = matmuls(wrapped, xs)
    for report in (forward, backward):
        assert {m.operand_dtypes for m in report} == {(BF16, BF16)}, report
        assert any("scan" in m.context and m.region == "cell" for m in report), report
    assert_close_to_f32(wrapped, model, xs, reduction_length=T * (D + 8) + 8)


@pytest.mark.slow  # compiles a model
def test_fp8_matmuls_with_current_scaling():
    wrapped = mpe.apply_policy(eqx.nn.MLP(D, D, 32, depth=1, key=key()), "mixed_bfloat16_fp8")
    forward = mpjax.inspect_matmuls(wrapped)(normal(D))
    e4m3 = np.dtype(jnp.float8_e4m3fn)
    assert [m.operand_dtypes for m in forward] == [(e4m3, e4m3)] * 2
    assert wrapped(normal(D)).dtype == F32


# --- Equinox's transformations. -----------------------------------------------------------------


@pytest.mark.slow
def test_partition_combine_vmap_and_filter_vmap():
    model = transformer(n_layers=1)
    wrapped = mpe.apply_policy(model, POLICY)
    params, static = eqx.partition(wrapped, eqx.is_inexact_array)
    batch = jnp.stack([tokens(0), tokens(1)])

    @eqx.filter_jit
    def run(params, batch):
        return jax.vmap(eqx.combine(params, static))(batch)

    out = run(params, batch)
    assert out.dtype == F32 and out.shape == (2, T, 32)
    np.testing.assert_array_equal(out, eqx.filter_jit(eqx.filter_vmap(wrapped))(batch))
    forward = mpjax.inspect_matmuls(run)(params, batch)
    assert forward and {m.operand_dtypes for m in forward} == {(BF16, BF16)}


@pytest.mark.slow  # compiles a model
def test_data_parallel_under_shard_map():
    model = transformer(n_layers=1)
    wrapped = mpe.apply_policy(model, POLICY)
    params, static = eqx.partition(wrapped, eqx.is_inexact_array)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    batch = jnp.stack([tokens(seed) for seed in range(8)])

    def per_device(params, batch):
        return jax.vmap(eqx.combine(params, static))(batch)

    sharded = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    )
    report = mpjax.inspect_matmuls(sharded)(params, batch)
    assert report and {m.operand_dtypes for m in report} == {(BF16, BF16)}
    assert all("shard_map" in m.context for m in report)
    out = sharded(params, batch)
    ref = eqx.filter_jit(per_device)(params, batch)
    assert_close_in_norm(out, ref, tolerance(BF16, TRANSFORMER_REDUCTION))


@pytest.mark.slow
def test_scan_over_stacked_layers_keeps_their_region():
    """Equinox's idiom for deep models: one layer's parameters stacked, a lax.scan over them
    (the layer is flattened and rebuilt inside the scan body)."""

    class Deep(eqx.Module):
        layers: eqx.nn.Linear  # stacked: leading axis 3

        def __init__(self, key):
            self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(keys(3))

        def __call__(self, x):
            params, static = eqx.partition(self.layers, eqx.is_array)

            def step(x, layer_params):
                return jnp.tanh(eqx.combine(layer_params, static)(x)), None

            return jax.lax.scan(step, x, params)[0]

    wrapped = mpe.apply_policy(Deep(key()), mpjax.Rules({"layers": "float16"}, default=POLICY))
    assert assert_matmuls(wrapped, normal(D), dtype=F16) == {"layers"}


@pytest.mark.slow  # compiles a model
def test_a_wrapped_model_serialises_like_the_unwrapped_one():
    model = transformer()
    wrapped = mpe.apply_policy(model, POLICY)
    a, b = io.BytesIO(), io.BytesIO()
    eqx.tree_serialise_leaves(a, wrapped)
    eqx.tree_serialise_leaves(b, model)
    assert a.getvalue() == b.getvalue()
    restored = eqx.tree_deserialise_leaves(
        io.BytesIO(a.getvalue()), mpe.apply_policy(transformer(5), POLICY)
    )
    same = jax.tree.map(
        np.array_equal, eqx.filter(restored, eqx.is_array), eqx.filter(wrapped, eqx.is_array)
    )
    assert all(jax.tree.leaves(same))


def test_call_runs_another_method_under_the_policy():
    class Encoder(eqx.Module):
        linear: eqx.nn.Linear

        def encode(self, x):
            return self.linear(x) @ self.linear.weight

        def __call__(self, x):
            return self.linear(x)

    wrapped = mpe.apply_policy(Encoder(eqx.nn.Linear(D, D, key=key())), POLICY)
    report = mpjax.inspect_matmuls(lambda m, x: m.call(Encoder.encode, x))(wrapped, normal(D))
    assert {(m.region, m.operand_dtypes) for m in report} == {
        ("linear", (BF16, BF16)),
        ("", (BF16, BF16)),
    }
    with pytest.raises(TypeError, match="fn must be a function of the model"):
        wrapped.call("encode", normal(D))


def test_rewrapping_replaces_the_rules_and_autocast_around_the_model_opens_its_regions():
    wrapped = mpe.apply_policy(eqx.nn.MLP(4, 4, 8, depth=1, key=key()), POLICY)
    again = mpe.apply_policy(wrapped, "float32")
    assert isinstance(again.model, eqx.nn.MLP)
    assert assert_matmuls(again, normal(4), dtype=F32)
    outer = mpjax.autocast(lambda m, x: m(x) @ jnp.ones((4, 4)), "float16")
    report = mpjax.inspect_matmuls(outer)(wrapped, normal(4))
    by_region = {m.region: m.operand_dtypes for m in report}
    assert by_region["layers[0]"] == (BF16, BF16)  # the model's regions win inside it
    assert by_region[None] == (F16, F16)  # the outer function's own matmul


# --- Reports. -----------------------------------------------------------------------------------


def test_describe_lists_modules_with_equinox_paths_and_matmuls():
    model = transformer(n_layers=1)
    report = mpjax.describe(mpe.apply_policy(model, POLICY))(tokens())
    rows = {row.path: row for row in report.rows}
    assert list(rows)[:3] == ["", "embed", "layers[0]"]
    assert rows["layers[0].attn.query_proj"].matmuls == (("bf16,bf16", 3),)
    assert rows["layers[0].norm1"].policy == mpjax.norm_policy(POLICY)
    assert rows["head"].param_count == D * 32 + 32
    assert report.total_params == sum(
        x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    )
    # An unwrapped model with rules: what they would do, and the problems they have.
    rules = mpjax.Rules({"head": "float32", "he*": "float16"}, default=POLICY)
    report = mpjax.describe(model, rules=rules)()
    assert {row.path: row.rule for row in report.rows}["head"] == "head"
    assert report.problems == (
        "rule 'he*' is ambiguous at 'head': rule 'head' comes first and wins there.",
    )
    assert "layers[0].attn.query_proj" in str(report)


def test_describe_shows_that_a_norm_kept_in_f32_computes_in_f32_alone():
    # Under mixed_float16 the norm receives the Linear's float16 output: every operation of its
    # region, forward and backward, computes in float32, the Linear's in float16.
    class DenseThenNorm(eqx.Module):
        dense: eqx.nn.Linear
        norm: eqx.nn.LayerNorm

        def __call__(self, x):
            return self.norm(self.dense(x))

    model = DenseThenNorm(eqx.nn.Linear(3, D, key=key()), eqx.nn.LayerNorm(D))
    report = mpjax.describe(mpe.apply_policy(model, "mixed_float16"))(normal(3))
    assert_norm_computes_in_f32_alone(report)


def test_inspect_matmuls_names_equinox_regions():
    wrapped = mpe.apply_policy(eqx.nn.MLP(4, 2, 8, depth=1, key=key()), POLICY)
    report = mpjax.inspect_matmuls(wrapped)(normal(4))
    assert [(m.region, m.lhs_dtype) for m in report] == [("layers[0]", BF16), ("layers[1]", BF16)]


@pytest.mark.slow
def test_the_precision_doctor_names_equinox_paths_and_its_rules_fix_the_overflow():
    mlp = eqx.nn.MLP(8, 1, 8, depth=1, key=key())
    # 8 * 100 * 3000 = 2.4e6: past float16's 65504 in the first layer's matmul.
    mlp = eqx.tree_at(lambda m: m.layers[0].weight, mlp, jnp.full((8, 8), 3000.0))
    x = jnp.full(8, 100.0)
    report = mpjax.diagnose(mpe.apply_policy(mlp, "mixed_float16"))(x)
    assert (report.birth.module, report.birth.primitive) == ("layers[0]", "dot_general")
    assert "layers[0]" in [r.key for r in report.rules.rules if not r.builtin]
    assert mpjax.diagnose(mpe.apply_policy(mlp, report.rules))(x).birth is None


def test_the_precision_monitor_measures_each_equinox_modules_values_and_gradients():
    mlp = mpe.apply_policy(eqx.nn.MLP(4, 1, 8, depth=1, key=key()), "mixed_bfloat16")
    monitor = mpjax.PrecisionMonitor(every=1)
    step = monitor.wrap(eqx.filter_grad(lambda m, x: jnp.sum(m(x))), jit=eqx.filter_jit)
    grads = step(0, mlp, jnp.ones(4))
    jax.effects_barrier()
    rows = {(c.module, c.backward): c for c in monitor.latest()}
    assert {("layers[0]", False), ("layers[0]", True), ("layers[1]", True)} <= set(rows)
    # The sum's gradient reaches layers[1]'s output as 1 and its weight as layers[0]'s output:
    # the bfloat16 weight's gradient is part of the module's backward values.
    weight_grad = np.abs(np.asarray(grads.model.layers[1].weight)).max()
    assert rows["layers[1]", True].amax == pytest.approx(max(1.0, weight_grad), rel=1e-2)


# --- Bad input. ---------------------------------------------------------------------------------


def test_bad_input_gets_a_clear_error_at_the_call():
    mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=key())
    with pytest.raises(TypeError, match=r"takes an eqx.Module instance as `model`, got \{'w'"):
        mpe.apply_policy({"w": jnp.ones(2)}, POLICY)
    with pytest.raises(TypeError, match="got the class MLP. Build the model first"):
        mpe.apply_policy(eqx.nn.MLP, POLICY)
    with pytest.raises(
        ValueError, match=r"rule 'layers\[7\]' matches no module of the MLP.*'layers\[0\]'"
    ):
        mpe.apply_policy(mlp, {"layers[7]": "float32"})
    with pytest.raises(ValueError, match=r"closest paths: 'layers\[0\]'.*not with '/'"):
        mpe.apply_policy(mlp, {"layers/0": "float32"})
    allowed = mpjax.Rules({"layers/0": "float32"}, allow_unmatched=True)
    assert mpe.apply_policy(mlp, allowed)(jnp.ones(4)).shape == (2,)
    with pytest.raises(ValueError, match="param_dtype float8_e4m3fn is too narrow"):
        mpe.apply_policy(mlp, "p=float8_e4m3fn,c=bf16,o=f32")
    with pytest.raises(ValueError, match="delayed fp8 scaling"):
        mpe.apply_policy(mlp, "p=f32,c=bf16,o=f32,fp8=delayed;history=4")
    with pytest.raises(TypeError, match="`policy_or_rules` must be mpjax.Rules"):
        mpe.apply_policy(mlp, 3.5)
    with pytest.raises(ValueError, match="has no policy applied"):
        mpjax.describe(mlp)
    with pytest.raises(TypeError, match="takes an eqx.Module as `model`, got the Flax module"):
        nnx = pytest.importorskip("flax.nnx")
        mpe.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), POLICY)


def test_a_shadowed_rule_warns():
    mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=key())
    with pytest.warns(mpjax.RuleWarning, match="rule 'layers\\[\\*\\]' is ambiguous"):
        mpe.apply_policy(mlp, {"layers[0]": "float32", "layers[*]": "float16"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpe.apply_policy(mlp, {"layers[0]": "float32"})


@pytest.mark.slow  # a subprocess
def test_mpjax_imports_without_equinox_and_says_how_to_get_mpjax_equinox():
    code = (
        "import sys\nsys.modules['equinox'] = None\nimport mpjax\n"
        "assert 'equinox' not in mpjax.__all__\n"
        "try:\n    mpjax.equinox\nexcept ImportError as error:\n    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=pathlib.Path(__file__).resolve().parents[1],
        check=True,
    )
    assert 'pip install "mpjax[equinox]"' in result.stdout, result.stdout + result.stderr


def test_a_float32_policy_runs_every_matmul_at_highest_forward_and_backward():
    model = eqx.nn.MLP(4, 3, 8, 2, key=key(0))
    for policy, expected in [("float32", {"highest"}), ("mixed_bfloat16", {None})]:
        forward, backward = matmuls(mpe.apply_policy(model, policy), normal(4))
        assert {m.f32_precision for m in (*forward, *backward)} == expected
        assert len(forward) == 3 and len(backward) >= 5
