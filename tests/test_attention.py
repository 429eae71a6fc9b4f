"""Fused attention (``mpjax.dot_product_attention``): the same function as attention written
out in f32, with causal, padding and bias masks; clear errors for what the fused kernel cannot
do; and routed to Flax's attention layers by a rule, under a policy. Pallas's TPU kernels run
here in Pallas's interpreter, and compile for a TPU on this machine where libtpu is installed
(``MPJAX_REQUIRE_TPU_PLAN`` makes a missing libtpu an error)."""

import functools
import os
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import assert_close_in_norm, tolerance

import mpjax
from mpjax import jax_compat

B, T, S, N, H = 2, 6, 6, 4, 8
BF16 = np.dtype(jnp.bfloat16)


def _qkv(dtype=jnp.float32, kv_heads=N):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, S, kv_heads, H))
    v = jax.random.normal(kv, (B, S, kv_heads, H))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _reference(q, k, v, bias=None, mask=None):
    """Attention written out in float64 with NumPy: softmax(q k^T / sqrt(d) + bias) v."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if mask is not None:
        logits = np.where(np.asarray(mask), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", weights, v)


def _reordered_rtol(q, k):
    """How far two f32 computations of attention may land apart when they add in other orders
    (tests/tolerances.py), in units of the values' size: the scores' sums over the head size
    move each score by ``tolerance(f32, H)`` of ``sum |q_i k_i| / sqrt(H)``, which the softmax
    turns into at most twice that, relative, in each weight; the softmax's sum and the
    weighted values' sum over the keys add ``tolerance(f32, S)`` each."""
    q, k = (np.abs(np.asarray(x, np.float64)) for x in (q, k))
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k).max() / np.sqrt(q.shape[-1])
    weights = 2 * tolerance(np.float32, q.shape[-1]) * scores
    return weights + 2 * tolerance(np.float32, k.shape[1])


def _reordered_atol(q, k, v):
    return _reordered_rtol(q, k) * float(np.abs(np.asarray(v)).max())


# The sums in a row in a block of Dense projections around attention (tests/tolerances.py):
# the projections (over N * H) to the query, key and value and from the heads, and attention.
BLOCK_RTOL = tolerance(np.float32, N * H + H + 2 * S + N * H)


CAUSAL = np.tril(np.ones((T, S), bool))[None, None]
PADDING = np.ones((B, 1, 1, S), bool)
PADDING[1, ..., S - 2 :] = False  # the second sequence is 2 tokens shorter


@pytest.mark.parametrize(
    "case", ["plain", "is_causal", "causal_mask", "padding", "bias", "grouped_query"]
)
def test_matches_attention_written_out_in_f32(case):
    q, k, v = _qkv(kv_heads=2 if case == "grouped_query" else N)
    kwargs, ref = {}, {}
    if case == "is_causal":
        kwargs, ref = {"is_causal": True}, {"mask": CAUSAL}
    elif case == "causal_mask":
        kwargs = ref = {"mask": CAUSAL}
    elif case == "padding":
        kwargs = ref = {"mask": PADDING & CAUSAL}
    elif case == "bias":
        bias = jax.random.normal(jax.random.key(3), (1, N, T, S))
        kwargs = ref = {"bias": bias}
    out = mpjax.dot_product_attention(q, k, v, **kwargs)
    assert out.dtype == jnp.float32 and out.shape == (B, T, N, H)
    np.testing.assert_allclose(out, _reference(q, k, v, **ref), atol=_reordered_atol(q, k, v))


def test_bf16_inputs_stay_within_bf16_error_of_f32():
    q, k, v = _qkv(jnp.bfloat16)
    out = mpjax.dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == BF16
    expected = _reference(q, k, v, mask=CAUSAL)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=3e-2, rtol=3e-2)


def test_inputs_of_mixed_dtypes_meet_in_their_common_dtype_or_dtype():
    q, k, v = _qkv()
    assert mpjax.dot_product_attention(q.astype(jnp.bfloat16), k, v).dtype == jnp.float32
    assert mpjax.dot_product_attention(q, k, v, dtype=jnp.bfloat16).dtype == BF16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dropout_rate": 0.1}, r"no dropout, got dropout_rate=0.1"),
        ({"precision": "highest"}, r"takes no `precision`"),
        ({"qk_attn_weights_einsum": jnp.einsum}, r"got `qk_attn_weights_einsum`"),
        ({"temperature": 2.0}, r"unknown keyword `temperature`"),
    ],
)
def test_what_the_fused_kernel_cannot_do_is_a_clear_error(kwargs, message):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=message):
        mpjax.dot_product_attention(q, k, v, **kwargs)


def test_dropout_in_inference_and_flax_only_options_are_accepted():
    q, k, v = _qkv()
    out = mpjax.dot_product_attention(
        q,
        k,
        v,
        dropout_rate=0.1,
        deterministic=True,
        force_fp32_for_softmax=True,
        einsum_dot_general=None,
    )
    np.testing.assert_allclose(out, _reference(q, k, v), atol=_reordered_atol(q, k, v))


def test_rank_other_than_3_or_4_is_a_clear_error():
    q, k, v = (x[None] for x in _qkv())
    with pytest.raises(ValueError, match=r"rank 4 .* or 3 .*got a query of shape"):
        mpjax.dot_product_attention(q, k, v)


def _spy(calls):
    # functools.wraps keeps the signature: Flax passes an attention_fn only the keywords its
    # signature names.
    @functools.wraps(mpjax.dot_product_attention)
    def attention_fn(*args, **kwargs):
        calls.append(args[0].dtype)
        return mpjax.dot_product_attention(*args, **kwargs)

    return attention_fn


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return nn.MultiHeadDotProductAttention(num_heads=N, name="attn")(x, mask=mask)


def test_a_rule_routes_linen_attention_to_the_fused_path_under_the_policy():
    x = jax.random.normal(jax.random.key(1), (B, T, N * H))
    calls = []
    fused = mpjax.Rules(
        [(nn.MultiHeadDotProductAttention, None, {"attention_fn": _spy(calls)})],
        default="mixed_bfloat16",
    )
    model = mpjax.linen.apply_policy(LinenBlock(), fused)
    variables = model.init(jax.random.key(0), x)
    grad_fn = jax.grad(lambda v: model.apply(v, x).sum())
    dtypes = mpjax.inspect_matmuls(grad_fn)(variables).operand_dtypes()
    assert calls and set(dtypes) == {("bfloat16", "bfloat16")}, dtypes
    # The same model under float32, fused or Flax's own attention: the same function.
    out_fused = mpjax.linen.apply_policy(LinenBlock(), fused.with_default("float32")).apply(
        variables, x
    )
    out_flax = mpjax.linen.apply_policy(LinenBlock(), "float32").apply(variables, x)
    atol = BLOCK_RTOL * np.abs(out_flax).max()
    np.testing.assert_allclose(out_fused, out_flax, rtol=BLOCK_RTOL, atol=atol)


def test_a_rule_routes_nnx_attention_to_the_fused_path_under_the_policy():
    x = jax.random.normal(jax.random.key(1), (B, T, N * H))
    calls = []
    model = nnx.MultiHeadAttention(num_heads=N, in_features=N * H, decode=False, rngs=nnx.Rngs(0))
    reference = model(x, mask=CAUSAL)
    mpjax.nnx.set_policy(
        model,
        mpjax.Rules(
            [(nnx.MultiHeadAttention, None, {"attention_fn": _spy(calls)})], default="float32"
        ),
    )
    atol = BLOCK_RTOL * np.abs(reference).max()
    np.testing.assert_allclose(model(x, mask=CAUSAL), reference, rtol=BLOCK_RTOL, atol=atol)
    assert calls
    mpjax.nnx.set_policy(
        model,
        mpjax.Rules(
            [(nnx.MultiHeadAttention, None, {"attention_fn": _spy(calls)})],
            default="mixed_bfloat16",
        ),
    )
    grad_fn = nnx.grad(lambda m: m(x, mask=CAUSAL).sum())
    dtypes = mpjax.inspect_matmuls(grad_fn)(model).operand_dtypes()
    assert set(dtypes) == {("bfloat16", "bfloat16")}, dtypes


def _written_out(q, k, v):
    """Causal attention as jnp einsums and a softmax, for autodiff to compare against."""
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    logits = jnp.where(CAUSAL, logits, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def test_gradient_matches_attention_written_out():
    q, k, v = _qkv()
    cotangent = jax.random.normal(jax.random.key(5), (B, T, N, H))

    def loss(attention, q, k, v):
        return jnp.vdot(attention(q, k, v), cotangent)

    fused = functools.partial(mpjax.dot_product_attention, is_causal=True)
    got = jax.grad(functools.partial(loss, fused), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, _written_out), argnums=(0, 1, 2))(q, k, v)
    # The backward pass runs the same sums again, transposed: twice the forward bound.
    for name, a, b in zip("qkv", got, want, strict=True):
        assert_close_in_norm(a, b, 2 * _reordered_rtol(q, k), name)


def _bf16_gradient(attention):
    q, k, v = _qkv(jnp.bfloat16)
    return jax.jit(jax.grad(lambda q: attention(q, k, v).astype(jnp.float32).sum()))(q)


def test_bf16_gradient_under_a_policy_compiles_under_strict_promotion():
    """The casting engine runs the backward matmuls in bf16, so strict promotion compiles."""
    assert jax.config.jax_numpy_dtype_promotion == "strict"  # set by conftest.py
    fused = functools.partial(mpjax.dot_product_attention, is_causal=True)
    under_policy = mpjax.autocast(fused, "mixed_bfloat16")
    grad = _bf16_gradient(under_policy)
    q, k, v = _qkv(jnp.bfloat16)
    report = mpjax.inspect_matmuls(
        jax.grad(lambda q: under_policy(q, k, v).astype(jnp.float32).sum())
    )(q)
    assert set(report.operand_dtypes()) == {("bfloat16", "bfloat16")}, str(report)
    want = _bf16_gradient(lambda q, k, v: _written_out(*(x.astype(jnp.float32) for x in (q, k, v))))
    np.testing.assert_allclose(np.asarray(grad, np.float32), want, atol=5e-2, rtol=5e-2)


def test_bf16_gradient_outside_a_policy_compiles_under_standard_promotion():
    """What the module docstring says of JAX's XLA path: its backward mixes an f32 cotangent
    with the bf16 keys, which JAX rejects under strict promotion when it compiles."""
    fused = functools.partial(mpjax.dot_product_attention, is_causal=True)
    # jax.dtypes.TypePromotionError (a ValueError) is public only in newer JAX.
    with pytest.raises(ValueError, match="float32.*bfloat16.*no available implicit"):
        _bf16_gradient(fused)
    with jax.numpy_dtype_promotion("standard"):
        grad = _bf16_gradient(fused)
    want = _bf16_gradient(lambda q, k, v: _written_out(*(x.astype(jnp.float32) for x in (q, k, v))))
    np.testing.assert_allclose(np.asarray(grad, np.float32), want, atol=5e-2, rtol=5e-2)


# --- cuDNN or XLA: chosen per platform when lowering --------------------------------------


def _attention_conds(fn, *args):
    """The platform-dependent conds in ``fn``'s jaxpr, as their branch platforms."""
    found = []
    for eqn, _ in mpjax.inspection.matmuls.iter_equations(fn, *args):
        platforms = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
        if platforms is not None:
            found.append(platforms)
    return found


def _cudnn_available():
    q = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
    return mpjax.attention.cudnn_refusal(q, q, q) is None


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_default_holds_cudnn_for_cuda_and_xla_elsewhere_when_cudnn_takes_the_inputs(dtype):
    """With the CUDA plugin installed cuDNN's kernel is staged for CUDA next to XLA's path;
    lowered for the CPU, only XLA's path is compiled, so the same function runs here."""
    if not _cudnn_available():
        pytest.skip("cuDNN is not installed (the CUDA plugin, mpjax[cuda12]): XLA only")
    q, k, v = _qkv(dtype)
    fn = functools.partial(mpjax.dot_product_attention, is_causal=True)
    assert _attention_conds(fn, q, k, v) == [(("cuda",), None)]
    assert _attention_conds(jax.grad(lambda q: fn(q, k, v).astype(jnp.float32).sum()), q)
    out = jax.jit(fn)(q, k, v)
    want = _reference(q, k, v, mask=CAUSAL)
    rtol = 8 * float(jnp.finfo(dtype).eps)  # inputs and output rounded to dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=rtol, rtol=rtol)


def test_inputs_cudnn_refuses_take_xla_on_every_platform():
    q, k, v = _qkv(jnp.float32)
    assert mpjax.attention.cudnn_refusal(q, k, v) == (
        "cuDNN runs attention in bfloat16 or float16, not float32"
    )
    wide = jax.ShapeDtypeStruct((B, T, N, 136), jnp.bfloat16)
    assert "head sizes of at most 128" in mpjax.attention.cudnn_refusal(wide, wide, wide)
    odd = jax.ShapeDtypeStruct((B, 5, N, 64), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((B, N, 5, 5), jnp.bfloat16)
    assert "even sequence lengths" in mpjax.attention.cudnn_refusal(odd, odd, odd, bias)
    assert _attention_conds(mpjax.dot_product_attention, q, k, v) == []


def test_implementation_can_be_forced_and_is_checked():
    q, k, v = _qkv(jnp.bfloat16)
    forced = functools.partial(mpjax.dot_product_attention, implementation="xla")
    assert _attention_conds(forced, q, k, v) == []
    with pytest.raises(
        ValueError, match="implementation=.*'cudnn', 'pallas' or 'xla'; got 'flash'"
    ):
        mpjax.dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(TypeError, match="arrays for query, key and value; got key=None"):
        mpjax.dot_product_attention(q, None, v)


def test_float16_runs_on_cpu_forward_and_backward_within_float16_error():
    """jax.nn's XLA path asks for f16 x f16 -> f32 logits, which XLA's CPU backend cannot
    compile; mpjax's float16 path computes f16 logits of the scaled query and an f32 softmax."""
    q, k, v = _qkv(jnp.float16)
    fn = jax.jit(functools.partial(mpjax.dot_product_attention, is_causal=True))
    out = fn(q, k, v)
    assert out.dtype == jnp.float16
    rtol = 8 * float(jnp.finfo(jnp.float16).eps)
    want = _reference(q, k, v, mask=CAUSAL)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=rtol, rtol=rtol)
    grad = jax.jit(jax.grad(lambda q: fn(q, k, v).astype(jnp.float32).sum()))(q)
    want_grad = jax.grad(lambda q: fn(q, k, v).astype(jnp.float32).sum())(q.astype(jnp.float32))
    assert grad.dtype == jnp.float16
    scale = float(jnp.abs(want_grad).max())
    np.testing.assert_allclose(grad, want_grad, atol=16 * rtol * scale, rtol=16 * rtol)
    report = mpjax.inspect_matmuls(jax.grad(lambda q: fn(q, k, v).astype(jnp.float32).sum()))(q)
    assert set(report.operand_dtypes()) == {("float16", "float16")}, str(report)


class _Projected(nn.Module):
    """Dense projections that return float32 under a policy, then fused attention."""

    @nn.compact
    def __call__(self, x):
        qkv = nn.Dense(3 * N * H)(x).reshape(*x.shape[:2], 3, N, H)
        y = mpjax.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
        return nn.Dense(N * H)(y.reshape(*x.shape[:2], N * H))


def _attention_dtypes(fn, *args):
    """The dtypes of the query that attention chooses its kernel for while ``fn`` is traced."""
    seen = []
    original = mpjax.attention.cudnn_refusal

    def spy(query, *rest, **kwargs):
        seen.append(np.dtype(query.dtype))
        return original(query, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mpjax.attention, "cudnn_refusal", spy)
        jax.make_jaxpr(lambda *a: fn(*a))(*args)  # a new function: traced, never cached
    return set(seen)


def test_under_a_policy_attention_is_traced_in_the_region_compute_dtype():
    """The Dense layers return float32 (the policy's output dtype); the fused path is traced
    in bfloat16, the compute dtype of its region, so cuDNN can take it on a GPU."""
    x = jax.random.normal(jax.random.key(1), (B, T, N * H))
    model = mpjax.linen.apply_policy(_Projected(), "mixed_bfloat16")
    variables = model.init(jax.random.key(0), x)
    assert _attention_dtypes(lambda v: model.apply(v, x), variables) == {BF16}
    full = mpjax.linen.apply_policy(_Projected(), "float32")
    assert _attention_dtypes(lambda v: full.apply(v, x), variables) == {np.dtype(jnp.float32)}
    q, k, v = _qkv()
    autocast = mpjax.autocast(mpjax.dot_product_attention, "mixed_float16")
    assert _attention_dtypes(autocast, q, k, v) == {np.dtype(jnp.float16)}
    assert _attention_dtypes(mpjax.dot_product_attention, q, k, v) == {np.dtype(jnp.float32)}

    def in_full_precision(q, k, v):
        with mpjax.full_precision():
            return mpjax.dot_product_attention(q, k, v)

    assert _attention_dtypes(mpjax.autocast(in_full_precision), q, k, v) == {np.dtype(jnp.float32)}


# --- Pallas's flash attention on TPUs -------------------------------------------------------

# Pallas's kernels take sequence lengths that are multiples of 128: small, for its interpreter.
PALLAS_T, PALLAS_N = 256, 2


def _pallas_qkv(dtype, head=64):
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, cotangent = (jax.random.normal(kk, (1, PALLAS_T, PALLAS_N, head)) for kk in keys)
    return tuple(x.astype(dtype) for x in (q, k, v, cotangent))


def _forward_and_gradients(q, k, v, cotangent, *, implementation, is_causal):
    fn = functools.partial(
        mpjax.dot_product_attention, is_causal=is_causal, implementation=implementation
    )

    def loss(q, k, v):
        return jnp.vdot(fn(q, k, v).astype(jnp.float32), cotangent.astype(jnp.float32))

    return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize(
    "dtype, is_causal, head",
    [
        (jnp.bfloat16, True, 64),
        (jnp.bfloat16, False, 64),
        (jnp.float32, True, 64),
        (jnp.float32, False, 64),
        (jnp.bfloat16, True, 128),
    ],
)
@pytest.mark.slow
def test_pallas_kernels_match_xla_forward_and_backward_in_the_interpreter(dtype, is_causal, head):
    """Pallas's forward and backward kernels, run by Pallas's TPU interpreter, against XLA's
    composition: the same function, summed in other orders (online softmax over blocks of
    128 keys). For bf16 both round the weights to bf16 for the weighted values and the output:
    half an epsilon each, on each side; in the backward also the scores' gradient: three."""
    q, k, v, cotangent = qkvc = _pallas_qkv(dtype, head)
    run = functools.partial(_forward_and_gradients, is_causal=is_causal)
    # Outside a policy XLA's bf16 backward needs standard promotion (see the bf16 tests above).
    with jax.numpy_dtype_promotion("standard"):
        with jax_compat.pallas_tpu_interpreted():
            out, grads = jax.jit(functools.partial(run, implementation="pallas"))(*qkvc)
        want_out, want_grads = jax.jit(functools.partial(run, implementation="xla"))(*qkvc)
    assert out.dtype == want_out.dtype == np.dtype(dtype)
    rounding = 0.0 if np.dtype(dtype) == np.float32 else float(jnp.finfo(dtype).eps)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    atol = _reordered_atol(*f32) + 2 * rounding * float(jnp.abs(f32[2]).max())
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=atol, rtol=0)
    for name, got, want in zip("qkv", grads, want_grads, strict=True):
        assert got.dtype == np.dtype(dtype)
        assert_close_in_norm(got, want, 2 * _reordered_rtol(*f32[:2]) + 3 * rounding, name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_default_holds_pallas_for_tpus_when_pallas_takes_the_inputs(dtype):
    """Staged for TPUs next to XLA's path (and cuDNN's, where the CUDA plugin is installed),
    forward and backward, for bfloat16 inputs; float32 attention keeps XLA's path, whose
    matmuls run at the policy's float32 precision. Lowered for the CPU, XLA's path runs here."""
    q, k, v, _ = _pallas_qkv(dtype)
    fn = functools.partial(mpjax.dot_product_attention, is_causal=True)
    bf16 = np.dtype(dtype) == BF16
    cuda = [("cuda",)] if _cudnn_available() and bf16 else []
    staged = [(*cuda, ("tpu",), None)] if bf16 else []
    assert _attention_conds(fn, q, k, v) == staged
    with jax.numpy_dtype_promotion("standard"):
        gradient = jax.grad(lambda q: fn(q, k, v).astype(jnp.float32).sum())
        # One for the forward, one for the backward.
        assert _attention_conds(gradient, q) == staged * 2
    with jax.numpy_dtype_promotion("standard"):
        out = jax.jit(fn)(q, k, v)
    want = jax.jit(functools.partial(fn, implementation="xla"))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_inputs_pallas_refuses_take_xla_and_forcing_pallas_on_them_is_a_clear_error():
    q, k, v, _ = _pallas_qkv(jnp.bfloat16)
    refusal = mpjax.attention.pallas_refusal
    f16 = jax.ShapeDtypeStruct(q.shape, jnp.float16)
    assert refusal(f16, f16, f16) == "Pallas runs attention in bfloat16 or float32, not float16"
    mask = jnp.ones((1, 1, PALLAS_T, PALLAS_T), bool)
    assert refusal(q, k, v, mask=mask) == "Pallas takes no boolean mask (only is_causal)"
    assert refusal(q, k, v, bias=mask.astype(q.dtype)) == "Pallas takes no bias"
    assert refusal(q, k[:, :, :1], v[:, :, :1]) == (
        "Pallas takes as many key/value heads as query heads; got 1 and 2"
    )
    short = q[:, :200]
    assert refusal(short, short, short) == (
        "Pallas takes sequence lengths that are multiples of 128; got 200 and 200"
    )
    wide = jax.ShapeDtypeStruct((1, PALLAS_T, PALLAS_N, 192), jnp.bfloat16)
    assert refusal(wide, wide, wide) == (
        "Pallas takes head sizes below 128 or multiples of it; got 192"
    )
    fn = functools.partial(mpjax.dot_product_attention, is_causal=True)
    assert all(("tpu",) not in c for c in _attention_conds(fn, q, k, v, None, mask))
    with pytest.raises(ValueError, match="implementation='pallas'.*no boolean mask"):
        mpjax.dot_product_attention(q, k, v, mask=mask, implementation="pallas")


def test_under_a_policy_the_pallas_kernels_run_in_the_compute_dtype_as_traced():
    """The kernels are traced in the region's compute dtype and autocast keeps them so, as it
    keeps cuDNN's calls, without warning of an unknown higher-order primitive."""
    q, k, v, _ = _pallas_qkv(jnp.float32)
    fused = functools.partial(mpjax.dot_product_attention, is_causal=True, implementation="pallas")
    under_policy = mpjax.autocast(fused, "mixed_bfloat16")
    gradient = jax.grad(lambda q: under_policy(q, k, v).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.AutocastWarning)
        equations = mpjax.inspection.matmuls.iter_equations(gradient, q)
        kernels = [eqn for eqn, _ in equations if eqn.primitive.name == "pallas_call"]
    assert len(kernels) == 3  # forward, dK/dV, dQ
    assert {np.dtype(x.aval.dtype) for e in kernels for x in e.invars[:3]} == {BF16}


# --- Pallas in a sharded step: each device's share, under a shard_map -------------------------

# A batch of 2 and 4 heads over 8 CPU devices: "data" (2) splits the batch, "model" (4) the heads.
SHARDED_SHAPE = (2, PALLAS_T, 4, 64)


def _cpu_mesh(shape, names):
    return jax.sharding.Mesh(np.asarray(jax.devices("cpu")[: np.prod(shape)]).reshape(shape), names)


def _sharded_qkvc(mesh, spec, shape=SHARDED_SHAPE, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(2), 4)
    placed = NamedSharding(mesh, spec)
    return tuple(jax.device_put(jax.random.normal(kk, shape).astype(dtype), placed) for kk in keys)


def _shard_maps(fn, *args):
    """The ``shard_map`` equations of ``fn`` traced (``jax.jit(fn).trace``) on ``args``, as
    their input specs and the number of Pallas kernels inside."""
    walk = mpjax.inspection.matmuls.walk_jaxpr
    with jax.numpy_dtype_promotion("standard"):
        jaxpr = jax.jit(fn).trace(*args).jaxpr.jaxpr
    found = []
    for eqn, *_ in walk(jaxpr):
        if eqn.primitive.name == "shard_map":
            params = jax_compat.shard_map_params(eqn)
            inside = walk(params.jaxpr.jaxpr)
            kernels = sum(e.primitive.name == "pallas_call" for e, *_ in inside)
            found.append((params.kwargs["in_specs"], kernels))
    return found


def test_a_sharded_step_runs_pallas_on_each_devices_share_forward_and_backward():
    """Traced over 8 devices, the batch on "data" and nothing on "model", the kernels the
    default stages for TPUs run under a shard_map that gives each device one sequence and one
    head: "data" splits the batch, "model" what the batch leaves, the heads. The forward
    kernel, and the backward's two (dK/dV, dQ), each in their own shard_map."""
    mesh = _cpu_mesh((2, 4), ("data", "model"))
    q, k, v, _ = _sharded_qkvc(mesh, P("data"))
    fn = functools.partial(mpjax.dot_product_attention, is_causal=True)
    spec = P("data", None, "model", None)
    assert mpjax.attention.pallas_refusal(q, k, v, is_causal=True) is None
    assert _shard_maps(fn, q, k, v) == [((spec,) * 3, 1)]
    gradient = jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    maps = _shard_maps(gradient, q, k, v)
    # The backward's shard_map takes the output's cotangent split as above, and the forward's
    # residuals as JAX splits them (over both axes, on their first): every operand of every
    # shard_map is split over all 8 devices, none gathered whole.
    assert [kernels for _, kernels in maps] == [1, 2] and maps[1][0][0] == spec
    for specs, _ in maps:
        for operand in specs:
            assert set(jax.tree.leaves(tuple(operand))) == {"data", "model"}, maps

    # Inside a shard_map over "data" (each device's sequence already), "model" splits the heads.
    def in_manual_data(q, k, v):
        inner = jax.shard_map(
            fn,
            mesh=jax_compat.traced_mesh(q),
            in_specs=P("data"),
            out_specs=P("data"),
            axis_names={"data"},
            check_vma=False,
        )
        return inner(q, k, v)

    heads = (P(None, None, "model", None),) * 3
    assert _shard_maps(in_manual_data, q, k, v) == [((P("data"),) * 3, 1), (heads, 1)]
    # Unsharded, no shard_map: one device runs the kernel on the whole batch.
    whole = [jnp.asarray(np.asarray(x)) for x in (q, k, v)]
    assert _shard_maps(functools.partial(fn), *whole) == []


def test_a_mesh_axis_that_splits_neither_batch_nor_heads_keeps_xla_attention():
    # 8 devices on one axis, a batch of 2 and 2 heads: each device would compute the same
    # attention. XLA's path partitions it instead; forcing Pallas is a clear error.
    mesh = _cpu_mesh((8,), ("data",))
    q, k, v, _ = _sharded_qkvc(mesh, P(), shape=(2, PALLAS_T, 2, 64))
    refusal = mpjax.attention.pallas_refusal(q, k, v, is_causal=True)
    assert refusal == (
        "Pallas's kernels run on each device's share of the batch and heads (XLA cannot "
        "partition them), and mesh axis 'data' of 8 devices divides neither the batch's 2 "
        "sequences nor the 2 heads left to split"
    )

    def traced(**kwargs):
        fn = functools.partial(mpjax.dot_product_attention, is_causal=True, **kwargs)
        with jax.numpy_dtype_promotion("standard"):
            return jax.jit(fn).trace(q, k, v).jaxpr

    assert (
        "pallas_call" not in str(traced())
        and _shard_maps(functools.partial(mpjax.dot_product_attention, is_causal=True), q, k, v)
        == []
    )
    with pytest.raises(ValueError, match="implementation='pallas'.*mesh axis 'data' of 8"):
        traced(implementation="pallas")


@pytest.mark.slow
@pytest.mark.skipif(
    not jax_compat.pallas_interpreter_runs_sharded(),
    reason=f"Pallas's TPU interpreter hangs under a shard_map on jax {jax.__version__}",
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_sharded_pallas_matches_xla_forward_and_backward_in_the_interpreter(dtype):
    """The kernels on each device's share, run by Pallas's TPU interpreter over 8 CPU devices,
    against XLA's path partitioned by XLA: within the tolerances of the one-device test, the
    function and its gradients gathered whole."""
    mesh = _cpu_mesh((2, 4), ("data", "model"))
    qkvc = _sharded_qkvc(mesh, P("data"), dtype=dtype)
    run = functools.partial(_forward_and_gradients, is_causal=True)
    with jax.numpy_dtype_promotion("standard"):
        with jax_compat.pallas_tpu_interpreted():
            out, grads = jax.jit(functools.partial(run, implementation="pallas"))(*qkvc)
        want_out, want_grads = jax.jit(functools.partial(run, implementation="xla"))(*qkvc)
    assert out.dtype == np.dtype(dtype) and out.sharding.is_equivalent_to(
        NamedSharding(mesh, P("data", None, "model", None)), out.ndim
    )
    rounding = 0.0 if np.dtype(dtype) == np.float32 else float(jnp.finfo(dtype).eps)
    f32 = [np.asarray(x, np.float32) for x in qkvc[:3]]
    atol = _reordered_atol(*f32) + 2 * rounding * float(np.abs(f32[2]).max())
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=atol, rtol=0)
    for name, got, want in zip("qkv", grads, want_grads, strict=True):
        assert got.dtype == np.dtype(dtype)
        assert_close_in_norm(got, want, 2 * _reordered_rtol(*f32[:2]) + 3 * rounding, name)


TPU_REASON = mpjax.plan_unavailable("v5p")


@pytest.mark.skipif(
    TPU_REASON is not None and not os.environ.get("MPJAX_REQUIRE_TPU_PLAN"),
    reason=f"cannot compile for a TPU here: {TPU_REASON}",
)
@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
def test_compiled_for_a_tpu_attention_is_pallas_forward_and_backward(policy):
    """Compiled for a v5p on this machine (no TPU needed), the attention of a forward and
    backward is three Mosaic kernels (Pallas's forward, its dK/dV and its dQ), and no
    ``[batch, heads, T, T]`` score or weight is materialized, as XLA's attention does; outside
    a policy (bf16 inputs) and under one (f32 inputs, traced in bf16)."""
    b, t, n, h = 2, 1024, 4, 64
    scores = f"{b},{n},{t},{t}]"
    pallas = _tpu_hlo((b, t, n, h), policy, implementation=None)
    assert pallas.count('custom_call_target="tpu_custom_call"') == 3
    assert scores not in pallas
    xla = _tpu_hlo((b, t, n, h), policy, implementation="xla")
    assert "tpu_custom_call" not in xla
    assert scores in xla


def _tpu_hlo(shape, policy, implementation):
    """The TPU HLO of causal attention's forward and backward, compiled for one v5p chip."""
    topology = topologies.get_topology_desc(topology_name="v5p:1x1x1", platform="tpu")
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    dtype = jnp.float32 if policy else jnp.bfloat16
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    fn = functools.partial(
        mpjax.dot_product_attention, is_causal=True, implementation=implementation
    )
    if policy:
        fn = mpjax.autocast(fn, policy)

    def step(q, k, v):
        loss = lambda *qkv: fn(*qkv).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with jax.numpy_dtype_promotion("standard"):
        return jax.jit(step).lower(arg, arg, arg).compile().as_text()


@pytest.mark.skipif(
    TPU_REASON is not None and not os.environ.get("MPJAX_REQUIRE_TPU_PLAN"),
    reason=f"cannot compile for a TPU here: {TPU_REASON}",
)
def test_a_step_over_several_tpu_devices_runs_pallas_on_each_chips_share():
    """Traced for a slice of four chips, the batch sharded over them, each chip runs Pallas's
    three kernels on its two sequences, and nothing crosses between chips: the query, key and
    value stay where they are. The backward kernels declare no cost to XLA, and the plan says
    what that leaves out. A batch and heads the four chips cannot split keep XLA's path."""
    mesh = mpjax.plan_mesh("v5p:2x2x1", (4,), ("data",))

    def step(q, k, v):
        def loss(*qkv):
            return mpjax.dot_product_attention(*qkv, is_causal=True).astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def plan(shape, spec):
        arg = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
        with jax.numpy_dtype_promotion("standard"):
            return mpjax.plan(step, "v5p:2x2x1")(arg, arg, arg)

    sharded = plan((8, 256, 2, 64), P("data"))
    assert sharded.compiled and sharded.collectives == (), sharded.summary()
    assert [(a.backward, a.declares_cost) for a in sharded.attention] == [
        (False, True),
        (True, False),
        (True, False),
    ]
    assert {a.flops for a in sharded.attention} == {4 * 2 * 2 * 256 * 256 * 64}  # 2 sequences
    backward = sum(a.flops for a in sharded.attention if a.backward)
    assert sharded.uncosted_seconds == pytest.approx(backward / sharded.peak_flops)
    assert "leaves out 2 attention kernel runs that declare no cost" in sharded.summary()
    unsplit = plan((2, 256, 2, 64), P())
    assert unsplit.compiled and unsplit.attention == () and unsplit.custom_calls == 0
    assert unsplit.uncosted_seconds == 0.0
