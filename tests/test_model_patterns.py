"""Third-party model patterns under ``mixed_bfloat16``, through the wrappers and autocast.

Each model here is written the way authors of Flax model libraries write theirs, never aware
of mpjax: a linen ``Einsum`` module whose ``dtype`` field is the *param* dtype, NNX layers that
hold raw ``nnx.Param``s and call ``jnp.einsum`` with no ``dtype`` attribute, a mixture of
experts with integer routing, a head that decodes with another module's embedding table,
attention and norms that switch to f32 by hand, integer dots in mask arithmetic, and scanned,
rematerialized blocks. For each, under ``linen.apply_policy`` / ``nnx.set_policy`` and under
``mpjax.autocast``:

- every floating matmul of the forward pass and of the gradient (w.r.t. params and floating
  inputs) has bf16 operands, and the integer dots stay integer;
- gradients w.r.t. the params are f32, with the params' structure;
- outputs are f32, with the f32 model's structure, within 5% of it;
- the wrappers store the f32 model's params, in f32, and never change their values.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mixed_precision_checks import (
    POLICY,
    assert_floating_matmuls_bf16,
    assert_grads_f32_like_params,
    assert_integer_dots_stay_integer,
    assert_linen_wrapper_init_is_f32_and_unchanged,
    assert_nnx_wrapper_keeps_params_f32_and_bit_identical,
    assert_output_close_to_f32,
    fan_in_normal,
    key,
    linen_subjects,
    nnx_subjects,
    normal,
)

import mpjax

# Every pattern under every property: a sweep, like tests/test_third_party.py; the default
# command leaves it out (mpjax.linen, mpjax.nnx and mpjax.autocast have tests of their own).
pytestmark = pytest.mark.slow

B, T, D, HEADS, HEAD_DIM, FF, VOCAB = 2, 8, 16, 2, 8, 32, 32
EXPERTS, TOP_K, LAYERS = 4, 2, 2


def segment_ids(seed=3):
    """Packed sequences: two segments per row (int32), the mask's integer input."""
    ids = jnp.ones((B, T), jnp.int32)
    return ids.at[:, T // 2 + seed % 2 :].set(2)


def token_ids(seed=4):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (B, T)), jnp.int32)


def attention_mask(segments):
    """Causal mask within segments; the pair count is an integer einsum, as in packed-data
    code that counts tokens shared by two positions."""
    same = jax.nn.one_hot(segments, 3, dtype=jnp.int32)  # (B, T, 3)
    pairs = jnp.einsum("btk,bsk->bts", same, same)  # integer dot
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    return (pairs > 0) & causal[None]


# --- (a) linen: an Einsum module whose dtype is the param dtype. ------------------------------


class Einsum(nn.Module):
    """``dtype`` is the dtype the weight is created in (not a compute dtype)."""

    shape: tuple[int, ...]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
        w = self.param(
            "w", nn.initializers.lecun_normal(in_axis=-2, out_axis=-1), self.shape, self.dtype
        )
        return jnp.einsum(eqn, x, w)


class RMSNorm(nn.Module):
    """Statistics in f32 by hand, result back in the input dtype."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return (x32 * jax.lax.rsqrt(var + 1e-6) * (1 + scale)).astype(x.dtype)


class Attention(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, mask):
        q = Einsum((D, HEADS, HEAD_DIM), self.dtype, name="q")("BTD,DNH->BTNH", x)
        k, v = Einsum((2, D, HEADS, HEAD_DIM), self.dtype, name="kv")("BSD,CDNH->CBSNH", x)
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * HEAD_DIM**-0.5
        logits = jnp.where(mask[:, None], logits.astype(jnp.float32), -1e9)  # f32 by hand
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
        return Einsum((HEADS, HEAD_DIM, D), self.dtype, name="o")("BTNH,NHD->BTD", out)


class GatedMLP(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        gate, up = Einsum((2, D, FF), self.dtype, name="gating")("BTD,GDF->GBTF", x)
        return Einsum((FF, D), self.dtype, name="down")("BTF,FD->BTD", nn.gelu(gate) * up)


class Block(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, mask):
        x = x + Attention(self.dtype, name="attn")(RMSNorm(name="pre_attn_norm")(x), mask)
        return x + GatedMLP(self.dtype, name="mlp")(RMSNorm(name="pre_mlp_norm")(x))


class EinsumTransformer(nn.Module):
    """Float inputs (B, T, D) and int segment ids; two blocks, then an Einsum head."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, segments):
        mask = attention_mask(segments)
        for i in range(LAYERS):
            x = Block(self.dtype, name=f"layer_{i}")(x, mask)
        return Einsum((D, VOCAB), self.dtype, name="head")(
            "BTD,DV->BTV", RMSNorm(name="final_norm")(x)
        )


# --- (d) linen: the same blocks under nn.scan and nn.remat. -----------------------------------


class ScanBlock(Block):
    """A block as a scan body: (carry, broadcast mask) -> (carry, None)."""

    def __call__(self, x, mask):
        return super().__call__(x, mask), None


class ScannedEinsumTransformer(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, segments):
        mask = attention_mask(segments)
        stack = nn.scan(
            nn.remat(ScanBlock),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=LAYERS,
        )
        x, _ = stack(self.dtype, name="layers")(x, mask)
        return Einsum((D, VOCAB), self.dtype, name="head")(
            "BTD,DV->BTV", RMSNorm(name="final_norm")(x)
        )


# --- (b) NNX: raw Params, jnp.einsum, no dtype attribute; mixture of experts. -----------------


class Norm(nnx.Module):
    def __init__(self, dim):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return (x32 * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])).astype(x.dtype)


class MoE(nnx.Module):
    """Top-k routing on f32 router logits; one-hot dispatch and integer expert counts."""

    def __init__(self, rngs: nnx.Rngs):
        self.router = nnx.Param(fan_in_normal(rngs, D, EXPERTS))
        self.w_in = nnx.Param(fan_in_normal(rngs, EXPERTS, D, FF))
        self.w_out = nnx.Param(fan_in_normal(rngs, EXPERTS, FF, D))

    def __call__(self, x):
        logits = jnp.einsum("btd,de->bte", x, self.router[...]).astype(jnp.float32)
        top_logits, top_experts = jax.lax.top_k(logits, TOP_K)
        gates = jax.nn.softmax(top_logits, axis=-1)  # (b, t, k), f32
        dispatch = jax.nn.one_hot(top_experts, EXPERTS, dtype=jnp.int32)  # (b, t, k, e)
        tokens_per_expert = jnp.einsum("btke,bt->e", dispatch, jnp.ones(x.shape[:2], jnp.int32))
        combine = jnp.einsum("btk,btke->bte", gates, dispatch.astype(gates.dtype))
        h = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, self.w_in[...]))
        y = jnp.einsum("btef,efd->bted", h, self.w_out[...])
        out = jnp.einsum("bted,bte->btd", y, combine.astype(y.dtype))
        # Switch-style load balancing: token fraction x mean router probability per expert.
        fraction = tokens_per_expert.astype(jnp.float32) / (x.shape[0] * x.shape[1] * TOP_K)
        mean_prob = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=(0, 1))
        return out, EXPERTS * jnp.sum(fraction * mean_prob)


class MoEBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = Norm(D)
        self.moe = MoE(rngs)

    def __call__(self, x):
        y, aux = self.moe(self.norm(x))
        return x + y, aux


class MoEStack(nnx.Module):
    """Float inputs (B, T, D); layers in a Python loop or stacked under nnx.scan + nnx.remat."""

    def __init__(self, rngs: nnx.Rngs, scan: bool):
        self.scan = scan
        if scan:

            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs):
                return MoEBlock(rngs)

            self.layers = stacked(rngs)
        else:
            self.layers = nnx.List([MoEBlock(rngs) for _ in range(LAYERS)])
        self.out = nnx.Param(fan_in_normal(rngs, D, D))

    def __call__(self, x):
        if self.scan:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
            @nnx.remat
            def body(x, layer):
                return layer(x)

            x, aux = body(x, self.layers)
            aux = jnp.sum(aux)
        else:
            aux = jnp.zeros((), jnp.float32)
            for layer in self.layers:
                x, layer_aux = layer(x)
                aux = aux + layer_aux
        return {"out": jnp.einsum("btd,de->bte", x, self.out[...]), "aux_loss": aux}


# --- (c) NNX: tied decode through another module's embedding table. ---------------------------


class Embedder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, D)))

    def encode(self, ids):
        return self.embedding[...][ids] * math.sqrt(D)

    def decode(self, x):
        return x @ self.embedding[...].T


class TiedLM(nnx.Module):
    """Token ids in, logits out; stock attention and MLP; the head is the embedding table,
    through ``Embedder.decode`` or (``read_table=True``) by reading the Param itself."""

    def __init__(self, rngs: nnx.Rngs, read_table: bool):
        self.read_table = read_table
        self.embedder = Embedder(rngs)
        self.attn_norm = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs)
        self.mlp_norm = Norm(D)
        self.up = nnx.Linear(D, FF, rngs=rngs)
        self.down = nnx.Linear(FF, D, rngs=rngs)
        self.final_norm = Norm(D)

    def __call__(self, ids):
        x = self.embedder.encode(ids) / math.sqrt(D)
        x = x + self.attn(self.attn_norm(x))
        x = x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))
        x = self.final_norm(x)
        if self.read_table:
            return x @ self.embedder.embedding[...].T
        return self.embedder.decode(x)


# --- The cases: one subject per (model, mode). -------------------------------------------------

MODES = ("wrapper", "autocast")


def _linen(model_cls):
    inputs = (normal(B, T, D, seed=1), segment_ids())
    model = model_cls()
    return model, mpjax.linen.apply_policy(model, POLICY), inputs


def _nnx(model_cls, inputs, **kwargs):
    return lambda: model_cls(nnx.Rngs(key()), **kwargs), inputs  # the same values each build


LINEN = {
    "einsum_transformer": lambda: _linen(EinsumTransformer),
    "scanned_remat_einsum_transformer": lambda: _linen(ScannedEinsumTransformer),
}
NNX = {
    "moe_loop": lambda: _nnx(MoEStack, (normal(B, T, D, seed=1),), scan=False),
    "moe_scan_remat": lambda: _nnx(MoEStack, (normal(B, T, D, seed=1),), scan=True),
    "tied_decode_method": lambda: _nnx(TiedLM, (token_ids(),), read_table=False),
    "tied_read_table": lambda: _nnx(TiedLM, (token_ids(),), read_table=True),
}
CASES = [*LINEN, *NNX]
INTEGER_DOTS = [c for c in CASES if not c.startswith("tied")]  # mask pairs, expert counts


@functools.cache
def subjects(case: str):
    if case in LINEN:
        model, wrapped, inputs = LINEN[case]()
        return linen_subjects(model, wrapped, inputs, grad_inputs=(0,))
    build, inputs = NNX[case]()
    grad_inputs = () if case.startswith("tied") else (0,)  # token ids are not differentiable
    return nnx_subjects(build, inputs, grad_inputs=grad_inputs)


def subject(case: str, mode: str):
    return subjects(case)[mode]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_every_floating_matmul_runs_bf16_forward_and_backward(case, mode):
    assert_floating_matmuls_bf16(subject(case, mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", INTEGER_DOTS)
def test_integer_dots_stay_integer(case, mode):
    assert_integer_dots_stay_integer(subject(case, mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_output_is_f32_and_close_to_the_f32_model(case, mode):
    assert_output_close_to_f32(subject(case, mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_param_gradients_are_f32_with_the_params_structure(case, mode):
    assert_grads_f32_like_params(subject(case, mode))


@pytest.mark.parametrize("case", list(LINEN))
def test_linen_wrapper_inits_the_f32_models_params(case):
    _, wrapped, inputs = LINEN[case]()
    assert_linen_wrapper_init_is_f32_and_unchanged(wrapped, inputs, subject(case, "wrapper").params)


@pytest.mark.parametrize("case", list(NNX))
def test_nnx_wrapper_keeps_the_params_f32_and_bit_identical(case):
    build, inputs = NNX[case]()
    grad_inputs = () if case.startswith("tied") else (0,)
    assert_nnx_wrapper_keeps_params_f32_and_bit_identical(build, inputs, grad_inputs)


def test_the_f32_models_have_the_patterns_they_stand_for():
    """The cases exercise what they claim: integer dots, f32 softmax and norm statistics,
    scan and remat bodies, and a head that reads another module's table."""
    forward, _ = _reference_matmuls("einsum_transformer")
    # Per layer q, kv, logits, probs x v, o, gating, down; the head; the integer mask dot.
    assert forward.operand_dtypes() == {
        ("float32", "float32"): 7 * LAYERS + 1,
        ("int32", "int32"): 1,
    }, str(forward)
    scanned, _ = _reference_matmuls("scanned_remat_einsum_transformer")
    contexts = {"/".join(m.context) for m in scanned}
    assert any("scan" in c and ("checkpoint" in c or "remat" in c) for c in contexts), contexts
    moe, _ = _reference_matmuls("moe_scan_remat")
    assert any("scan" in "/".join(m.context) for m in moe)
    tied, _ = _reference_matmuls("tied_read_table")
    assert tied[-1].rhs_shape == (D, VOCAB)


def _reference_matmuls(case):
    return subject(case, "autocast").reference_matmuls
