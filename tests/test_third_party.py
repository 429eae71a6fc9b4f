"""Real models from PyPI packages under ``mixed_bfloat16``, unmodified (``pip install
-e ".[third-party]"``; each test is skipped when its package is missing).

The same properties as ``test_model_patterns.py``: every floating matmul forward and backward
in bf16, f32 params and gradients, outputs f32 and within 5% of the f32 model. Flax models go
through ``linen.apply_policy`` / ``nnx.set_policy`` and ``mpjax.autocast``; the Equinox models
through ``mpjax.autocast``. Tiny random configurations, nothing downloaded.

These packages are not written for strict dtype promotion (Flax's ``combine_masks``, which the
transformers models call, ands a bool mask with an int32 one), so the tests run them under JAX's
default, standard promotion, as their users do; a silent upcast to f32 would show up as an f32
matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mixed_precision_checks import (
    POLICY,
    Subject,
    assert_floating_matmuls_bf16,
    assert_grads_f32_like_params,
    assert_linen_wrapper_init_is_f32_and_unchanged,
    assert_nnx_wrapper_keeps_params_f32_and_bit_identical,
    assert_output_close_to_f32,
    key,
    linen_subjects,
    nnx_subjects,
    normal,
)

import mpjax

pytestmark = [pytest.mark.third_party, pytest.mark.slow]  # a minute of compiles in all

B, T, VOCAB = 2, 8, 64


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def token_ids():
    return jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (B, T)), jnp.int32)


# --- Linen: transformers' Flax models and nano-moe-jax. ----------------------------------------


def _transformers_module(model_class: str, config_class: str, **config):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_class)(vocab_size=VOCAB, **config)
    # _do_init=False: the module only, no params built at construction.
    return getattr(transformers, model_class)(config, input_shape=(1, T), _do_init=False).module


def gpt2():
    """GPT-2: its tied head applies a Dense to ``self.transformer.variables[...]["wte"]``."""
    module = _transformers_module(
        "FlaxGPT2LMHeadModel", "GPT2Config", n_positions=16, n_embd=16, n_layer=2, n_head=2
    )
    ids = token_ids()
    inputs = (ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(T), (B, T)))
    return module, inputs, {"return_dict": False}


def llama():
    """Llama: RMSNorm in f32 by hand, rotary embeddings, grouped-query attention."""
    module = _transformers_module(
        "FlaxLlamaForCausalLM",
        "LlamaConfig",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    ids = token_ids()
    inputs = (ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(T), (B, T)))
    return module, inputs, {"return_dict": False}


def nano_moe():
    """NanoMoE: top-k routing over per-expert Dense layers, a one-hot load-balancing loss."""
    nano = pytest.importorskip("nano_moe")
    config = nano.NanoMoEConfig(
        vocab_size=VOCAB,
        n_layers=2,
        n_heads=2,
        d_model=16,
        d_ff=32,
        n_experts=4,
        top_k=2,
        block_size=T,
    )
    return nano.NanoMoE(config), (token_ids(),), {}


LINEN = {"transformers_gpt2": gpt2, "transformers_llama": llama, "nano_moe": nano_moe}


# --- NNX: mamba2-jax. ---------------------------------------------------------------------------


def mamba2():
    """Mamba2: tied head ``h @ self.backbone.embedder.embedding[:].T``, a depthwise conv that
    reads its child ``nnx.Conv``'s kernel, RMSNorm and residual stream in f32 by hand."""
    mamba2_jax = pytest.importorskip("mamba2_jax")
    config = mamba2_jax.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        state_size=8,
        head_dim=8,
        chunk_size=4,
        num_hidden_layers=2,
    )
    return lambda: mamba2_jax.Mamba2ForCausalLM(config, rngs=nnx.Rngs(key())), (token_ids(),)


NNX = {"mamba2": mamba2}


# --- Equinox: autocast only. --------------------------------------------------------------------


def _equinox_subject(model, x) -> Subject:
    eqx = pytest.importorskip("equinox")
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def reference(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    return Subject(
        mpjax.autocast(reference, POLICY), jax.jit(reference), params, (x,), grad_inputs=(0,)
    )


def equinox_mlp():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(16, 8, 32, depth=2, activation=jax.nn.gelu, key=jax.random.key(1))
    return _equinox_subject(mlp, normal(B * T, 16, seed=1))


def equinox_transformer():
    """A pre-norm block from Equinox's own layers: LayerNorm, MultiheadAttention, Linear."""
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(16), eqx.nn.LayerNorm(16)
            self.attn = eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=k1)
            self.up, self.down = eqx.nn.Linear(16, 32, key=k2), eqx.nn.Linear(32, 16, key=k3)

        def __call__(self, x):  # (T, 16)
            y = jax.vmap(self.norm1)(x)
            x = x + self.attn(y, y, y)
            y = jax.vmap(self.up)(jax.vmap(self.norm2)(x))
            return x + jax.vmap(self.down)(jax.nn.gelu(y))

    return _equinox_subject(Block(jax.random.key(2)), normal(B, T, 16, seed=2))


EQUINOX = {"equinox_mlp": equinox_mlp, "equinox_transformer": equinox_transformer}

# --- Subjects and tests. ------------------------------------------------------------------------

FLAX_CASES = [(case, mode) for case in (*LINEN, *NNX) for mode in ("wrapper", "autocast")]
CASES = [*FLAX_CASES, *((case, "autocast") for case in EQUINOX)]
IDS = [f"{case}-{mode}" for case, mode in CASES]


@functools.cache
def subjects(case: str) -> dict[str, Subject]:
    if case in EQUINOX:
        return {"autocast": EQUINOX[case]()}
    if case in LINEN:
        module, inputs, kwargs = LINEN[case]()
        wrapped = mpjax.linen.apply_policy(module, POLICY)
        return linen_subjects(module, wrapped, inputs, **kwargs)
    build, inputs = NNX[case]()
    return nnx_subjects(build, inputs)


def subject(case: str, mode: str) -> Subject:
    return subjects(case)[mode]


@pytest.mark.parametrize("case, mode", CASES, ids=IDS)
def test_every_floating_matmul_runs_bf16_forward_and_backward(case, mode):
    assert_floating_matmuls_bf16(subject(case, mode), routers_in_f32=mode == "wrapper")


@pytest.mark.parametrize("case, mode", CASES, ids=IDS)
def test_output_is_f32_and_close_to_the_f32_model(case, mode):
    assert_output_close_to_f32(subject(case, mode))


@pytest.mark.parametrize("case, mode", CASES, ids=IDS)
def test_param_gradients_are_f32_with_the_params_structure(case, mode):
    assert_grads_f32_like_params(subject(case, mode))


@pytest.mark.parametrize("case", list(LINEN))
def test_linen_wrapper_inits_the_f32_models_params(case):
    module, inputs, kwargs = LINEN[case]()
    wrapped = mpjax.linen.apply_policy(module, POLICY)
    expected = subject(case, "wrapper").params
    assert_linen_wrapper_init_is_f32_and_unchanged(wrapped, inputs, expected, **kwargs)


@pytest.mark.parametrize("case", list(NNX))
def test_nnx_wrapper_keeps_the_params_f32_and_bit_identical(case):
    build, inputs = NNX[case]()
    assert_nnx_wrapper_keeps_params_f32_and_bit_identical(build, inputs)
