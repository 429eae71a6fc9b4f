"""Lookups of a parameter under a policy: rows in the compute dtype, the table's gradient
accumulated in the policy's reduce dtype.

Flax's own ``nn.Embed(dtype=bf16)`` casts the table to bf16 and gathers from it; JAX then
differentiates the gather into a scatter-add into a bf16 table: the most expensive kernel of a
GPT step on a GPU, and a gradient accumulated in bf16 (a frequent token's row sums thousands of
cotangents). Under mpjax's embedding rules the rows also come from the table in the compute
dtype (the same rows as cast after the lookup, and what a sharded table then sends between
devices), but the scatter-add of the gradient accumulates in the reduce dtype, f32 under
``mixed_bfloat16``. Under autocast (whose policy returns f32) the gather reads the f32 table.
Read from the jaxpr of the gradient: compiled CPU HLO upcasts bf16 scatters, so it would hide a
bf16 scatter that a GPU runs.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax
from mpjax.inspection.matmuls import iter_equations

VOCAB, DIM, SEQ = 50, 16, 8
F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
IDS = jnp.arange(2 * SEQ, dtype=jnp.int32).reshape(2, SEQ) % VOCAB


def _lookups(grad_fn, *args):
    """(gathers, scatter-adds, converts of a whole table) of the gradient's jaxpr, as
    (operand dtype, operand shape) pairs."""
    gathers, scatters, table_converts = [], [], []
    for eqn, _ in iter_equations(grad_fn, *args):
        name = eqn.primitive.name
        operand = eqn.invars[0].aval
        seen = (np.dtype(operand.dtype), tuple(operand.shape))
        if name == "gather":
            gathers.append(seen)
        elif name in ("scatter-add", "scatter_add"):
            scatters.append(seen)
        elif name == "convert_element_type" and tuple(operand.shape) == (VOCAB, DIM):
            table_converts.append((seen, np.dtype(eqn.outvars[0].aval.dtype)))
    return gathers, scatters, table_converts


class LinenLM(nn.Module):
    tied: bool = False

    @nn.compact
    def __call__(self, ids):
        wte = nn.Embed(VOCAB, DIM, name="wte")
        wpe = self.param("wpe", nn.initializers.normal(0.02), (SEQ, DIM))
        h = wte(ids) + wpe[: ids.shape[-1]]  # position embeddings as a slice
        h = nn.Dense(DIM, name="fc")(h)
        return wte.attend(h) if self.tied else nn.Dense(VOCAB, name="head")(h)


def _check(gathers, scatters, table_converts):
    assert gathers == [(BF16, (VOCAB, DIM))], gathers
    assert scatters == [(F32, (VOCAB, DIM))], scatters
    # The table is read in bf16 (by the lookup, and a tied decoding matmul); its gradient
    # accumulates in f32, and nothing converts the f32 gradient table down.
    assert ((F32, (VOCAB, DIM)), BF16) in table_converts, table_converts


@pytest.mark.parametrize("tied", [False, True])
def test_linen_embedding_gathers_bf16_rows_and_accumulates_in_f32(tied):
    model = mpjax.linen.apply_policy(LinenLM(tied=tied), "mixed_bfloat16")
    variables = jax.jit(model.init)(jax.random.key(0), IDS)
    grad_fn = jax.grad(lambda v: model.apply(v, IDS).astype(jnp.float32).sum())
    _check(*_lookups(grad_fn, variables))
    grads = jax.eval_shape(grad_fn, variables)
    assert grads["params"]["wte"]["embedding"].dtype == F32


def test_linen_tied_decoding_still_runs_in_the_compute_dtype():
    model = mpjax.linen.apply_policy(LinenLM(tied=True), "mixed_bfloat16")
    variables = model.init(jax.random.key(0), IDS)
    grad_fn = jax.grad(lambda v: model.apply(v, IDS).astype(jnp.float32).sum())
    dtypes = mpjax.inspect_matmuls(grad_fn)(variables).operand_dtypes()
    assert set(dtypes) == {("bfloat16", "bfloat16")}, dtypes


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.wte = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.fc = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, ids):
        h = self.fc(self.wte(ids))
        return self.wte.attend(h)


def test_nnx_embedding_gathers_bf16_rows_and_accumulates_in_f32():
    model = NnxLM(nnx.Rngs(0))
    mpjax.nnx.set_policy(model, "mixed_bfloat16")
    grad_fn = nnx.grad(lambda m: m(IDS).astype(jnp.float32).sum())
    _check(*_lookups(grad_fn, model))
    assert nnx.jit(grad_fn)(model).wte.embedding[...].dtype == F32


def test_autocast_take_and_indexing_read_the_f32_table():
    def lm(params, ids):
        h = jnp.take(params["wte"], ids, axis=0) + params["wte"][ids]  # two lookup spellings
        return (h @ params["w"]).sum()

    params = {
        "wte": jnp.ones((VOCAB, DIM)) / DIM,
        "w": jnp.ones((DIM, DIM)),
    }
    grad_fn = jax.grad(mpjax.autocast(lm))
    gathers, scatters, table_converts = _lookups(grad_fn, params, IDS)
    assert gathers == [(F32, (VOCAB, DIM))] * 2, gathers
    assert scatters and all(s == (F32, (VOCAB, DIM)) for s in scatters), scatters
    assert not [c for c in table_converts if c[1] == BF16], table_converts
    assert grad_fn(params, IDS)["wte"].dtype == F32


def test_the_check_catches_a_table_cast_whole_before_the_lookup():
    # Flax's own bf16 Embed casts the whole table, then gathers: what the tests above rule out.
    embed = nn.Embed(VOCAB, DIM, dtype=jnp.bfloat16)
    variables = embed.init(jax.random.key(0), IDS)
    grad_fn = jax.grad(lambda v: embed.apply(v, IDS).astype(jnp.float32).sum())
    gathers, scatters, table_converts = _lookups(grad_fn, variables)
    assert gathers == [(BF16, (VOCAB, DIM))] and scatters == [(BF16, (VOCAB, DIM))]
    assert ((F32, (VOCAB, DIM)), BF16) in table_converts


# The built-in embedding rules: rows come out in the compute dtype, as from Flax's
# nn.Embed(dtype=bf16), so what is added to them (a position table, the blocks' outputs) runs
# in it; the gather still reads the f32 table, and its gradient accumulates in f32.


def _add_operand_dtypes(apply, *args):
    """The operand dtypes of each add of two ``[2, SEQ, DIM]`` activations in the forward
    jaxpr, in order."""
    return [
        (eqn.invars[0].aval.dtype, eqn.invars[1].aval.dtype)
        for eqn, _ in iter_equations(apply, *args)
        if eqn.primitive.name == "add" and eqn.outvars[0].aval.shape == (2, SEQ, DIM)
    ]


class LinenResidual(nn.Module):
    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, DIM, name="wte")(ids)
        return h + nn.Dense(DIM, name="fc")(h)  # a residual connection


def test_linen_embedding_rows_and_the_residual_stream_run_in_the_compute_dtype():
    model = mpjax.linen.apply_policy(LinenResidual(), "mixed_bfloat16")
    variables = model.init(jax.random.key(0), IDS)
    adds = _add_operand_dtypes(lambda v: model.apply(v, IDS), variables)
    # The bias add, then the residual add: both of bf16 values.
    assert adds[-1] == (BF16, BF16), adds
    report = mpjax.describe(model, variables=variables)(IDS)
    (row,) = [r for r in report.rows if r.path == "wte"]
    assert row.rule == "builtin: linen.Embed rows in the compute dtype"
    grad_fn = jax.grad(lambda v: model.apply(v, IDS).astype(jnp.float32).sum())
    _check(*_lookups(grad_fn, variables))
    # Without the built-in rules, the rows stay f32 and so does the residual add.
    plain = mpjax.linen.apply_policy(
        LinenResidual(), mpjax.Rules(default="mixed_bfloat16", builtins=False)
    )
    adds = _add_operand_dtypes(lambda v: plain.apply(v, IDS), variables)
    assert adds[-1] == (F32, F32), adds


def test_nnx_embedding_rows_run_in_the_compute_dtype():
    model = NnxLM(nnx.Rngs(0))
    mpjax.nnx.set_policy(model, "mixed_bfloat16")
    rows = model.wte(IDS)
    assert rows.dtype == BF16
    # The table's rows, rounded to bf16 once: cast before the lookup or after, the same.
    np.testing.assert_array_equal(rows, model.wte.embedding[...][IDS].astype(BF16))


def test_equinox_embedding_rows_run_in_the_compute_dtype():
    eqx = pytest.importorskip("equinox")
    embed = eqx.nn.Embedding(VOCAB, DIM, key=jax.random.key(0))
    wrapped = mpjax.equinox.apply_policy(embed, "mixed_bfloat16")
    out = jax.vmap(wrapped)(IDS[0])
    assert out.dtype == BF16 and out.shape == (SEQ, DIM)
    grads = jax.grad(lambda m: jax.vmap(m)(IDS[0]).astype(jnp.float32).sum())(wrapped)
    assert jax.tree.leaves(grads)[0].dtype == F32


def test_embedding_policy_keeps_the_table_and_returns_rows_in_the_compute_dtype():
    assert mpjax.embedding_policy("mixed_float16") == mpjax.get_policy("p=f32,c=f16,o=f16")
    assert mpjax.embedding_policy("float32") == mpjax.get_policy("float32")
    with pytest.raises(TypeError, match=r"embedding_policy\(default\): default"):
        mpjax.embedding_policy(3)
