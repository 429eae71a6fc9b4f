"""Published Equinox models from PyPI, unmodified, wrapped by ``mpjax.equinox`` under
``mixed_bfloat16`` (the third-party extra: ``pip install -e ".[third-party]"``; each test is
skipped when its package is missing): esm2quinox's ESM2 protein language model (a scan over
stacked transformer layers with rotary attention, a filter_jit inside the model, a tied
embedding) and pdequinox's UNet (periodic convolutions, GroupNorm).

The properties of tests/test_third_party.py: every matmul and convolution forward and backward
in bf16 (read from the jaxpr), f32 params and gradients in the model's structure, outputs f32
and within 5% of the f32 model; and the models' norms in f32. Tiny random configurations,
nothing downloaded. Like their users, the tests run them under JAX's standard promotion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mixed_precision_checks import MAX_RELATIVE_ERROR, POLICY, key, normal, relative_errors

import mpjax

pytestmark = [pytest.mark.third_party, pytest.mark.slow]

eqx = pytest.importorskip("equinox")
mpe = pytest.importorskip("mpjax.equinox")

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def esm2():
    esm2quinox = pytest.importorskip("esm2quinox")
    model = esm2quinox.ESM2(
        num_layers=2, embed_size=32, num_heads=2, token_dropout=True, key=key(1)
    )
    tokens = jnp.asarray(esm2quinox.tokenise(["SPIDERMAN", "SP#DERM#N"]))

    def call(model, tokens):
        out = jax.vmap(model)(tokens)
        return out.hidden, out.logits

    norms = ("layers.layer_norm1", "layers.layer_norm2", "layer_norm", "logit_head.layer_norm")
    return model, (tokens,), call, norms


def unet():
    pdequinox = pytest.importorskip("pdequinox")
    model = pdequinox.arch.ClassicUNet(1, 1, 1, hidden_channels=4, num_levels=2, key=key(2))
    x = normal(2, 1, 32, seed=2)
    norms = ("lifting.norm_1", "left_arc_blocks[0][0].norm_2")
    return model, (x,), lambda model, x: jax.vmap(model)(x), norms


MODELS = {"esm2quinox-ESM2": esm2, "pdequinox-ClassicUNet": unet}


def loss_of(call):
    def loss(model, *inputs):
        return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in call(model, *inputs))

    return loss


@pytest.mark.parametrize("name", list(MODELS))
def test_every_matmul_runs_bf16_forward_and_backward_and_norms_stay_f32(name):
    model, inputs, call, norms = MODELS[name]()
    wrapped = mpe.apply_policy(model, POLICY)
    forward = mpjax.inspect_matmuls(call)(wrapped, *inputs)
    backward = mpjax.inspect_matmuls(eqx.filter_grad(loss_of(call)))(wrapped, *inputs)
    for report in (forward, backward):
        assert report, report
        assert {m.operand_dtypes for m in report} == {(BF16, BF16)}, report
    # Each matmul and its transposes (the first layer's input gets no gradient).
    assert 2 * len(forward) < len(backward) <= 3 * len(forward)
    paths = dict(mpe.module_paths(model))
    for norm in norms:
        assert issubclass(paths[norm], (eqx.nn.LayerNorm, eqx.nn.GroupNorm)), norm
    rows = {row.path: row for row in mpjax.describe(wrapped)().rows}
    assert {rows[norm].policy for norm in norms} == {mpjax.norm_policy(POLICY)}


@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_are_f32_and_close_to_the_f32_model_and_grads_f32_like_the_params(name):
    model, inputs, call, _ = MODELS[name]()
    wrapped = mpe.apply_policy(model, POLICY)
    out = eqx.filter_jit(call)(wrapped, *inputs)
    ref = eqx.filter_jit(call)(model, *inputs)
    assert {x.dtype for x in out} == {F32}
    errors = relative_errors(out, ref)
    assert 0 < max(errors) < MAX_RELATIVE_ERROR, errors
    grads = eqx.filter_eval_shape(eqx.filter_grad(loss_of(call)), wrapped, *inputs)
    params = eqx.filter(wrapped, eqx.is_inexact_array)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
