"""What only a CUDA GPU can show, run on one: cuDNN's fused attention against XLA's path, fp8
GEMMs against their CPU emulation, loss scaling's skip on a float16 overflow in the GPU's
kernels, and the example's train step under each policy.

Marked ``gpu``: on a machine with a CUDA GPU, ``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu
tests/test_gpu.py`` (the ``gpu_tests`` part of ``benchmarks/gpu_session.py`` runs it and keeps
its JUnit report); elsewhere every test skips, saying why. What can be checked on a CPU is
checked in the CPU suite (the XLA path in tests/test_attention.py, the fp8 emulation in
tests/test_fp8.py, the skip logic in tests/test_loss_scaling.py, the steps in
tests/test_example.py); here the same things run in the GPU's own kernels. Each test records
the errors it saw and the bound it held them to (``record_property``: properties in the JUnit
report), so a run says how much margin the bounds leave.
"""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerances import tolerance

import mpjax
from mpjax import fp8, jax_compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402
import train_transformer as tt  # noqa: E402

pytestmark = pytest.mark.gpu

F32 = np.dtype(jnp.float32)


def _gpu():
    return jax.devices("gpu")[0]


def _on(device, *arrays):
    return jax.device_put(arrays, device)


def _plan(fn, *args) -> mpjax.Plan:
    """The plan of ``fn`` as XLA compiled it on the GPU (autotuned there)."""
    compiled = jax.jit(fn).lower(*_on(_gpu(), *args)).compile()
    return mpjax.Plan.from_hlo_text(compiled.as_text(), device=_gpu().device_kind)


def _compute_capability() -> tuple[int, ...]:
    text = getattr(_gpu(), "compute_capability", "0.0")
    return tuple(int(x) for x in str(text).split("."))


def _relative_error_in_norm(actual, desired) -> float:
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    return float(np.linalg.norm(actual - desired) / np.linalg.norm(desired))


# --- cuDNN's fused attention against XLA's path ---------------------------------------------

B, T, N, H = 2, 128, 4, 64
MASKS = ["causal", "padding", "bias"]


def _attention_inputs(dtype, mask):
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(key, (B, T, N, H)).astype(dtype) for key in keys[:3])
    cotangent = jax.random.normal(keys[3], (B, T, N, H))
    kwargs = {}
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "padding":
        padding = np.ones((B, 1, 1, T), bool)
        padding[1, ..., T - 32 :] = False  # the second sequence is 32 tokens shorter
        kwargs["mask"] = jnp.asarray(padding)
    else:
        kwargs["bias"] = jax.random.normal(keys[4], (1, N, T, T)).astype(dtype)
    return q, k, v, cotangent, kwargs


def _attention_and_gradients(implementation, kwargs):
    def loss(q, k, v, cotangent):
        out = mpjax.dot_product_attention(q, k, v, implementation=implementation, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    def run(q, k, v, cotangent):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            q, k, v, cotangent
        )
        return out, grads

    return run


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_cudnn_attention_matches_the_xla_path_forward_and_backward(dtype, mask, record_property):
    """cuDNN's kernel really runs (forward and backward custom calls in the compiled HLO) and
    computes what XLA's path computes. Both round the softmax's weights into ``dtype`` before
    the weighted sum and round their outputs; XLA's path also rounds the scores (in float16)
    and the backward's intermediates. So the two land within a few units of ``dtype``'s
    rounding of the largest score's effect: ``eps * (4 + max |score|)`` relative to the values'
    size forward, and, in norm, relative to each gradient's norm backward."""
    q, k, v, cotangent, kwargs = _attention_inputs(dtype, mask)
    assert mpjax.attention.cudnn_refusal(q, k, v, kwargs.get("bias")) is None
    cudnn, xla = (_attention_and_gradients(i, kwargs) for i in ("cudnn", "xla"))
    # XLA's path, called outside mpjax's engine, differentiates its score matmul from an f32
    # cotangent and bf16 keys, which strict promotion refuses when it lowers (as
    # tests/test_example.py notes); this test compares kernels, not promotion rules.
    with jax.numpy_dtype_promotion("standard"):
        plan = _plan(cudnn, q, k, v, cotangent)
        assert {a.backward for a in plan.attention} == {False, True}, str(plan)
        assert not _plan(xla, q, k, v, cotangent).attention
        args = _on(_gpu(), q, k, v, cotangent)
        (out_c, grads_c), (out_x, grads_x) = jax.jit(cudnn)(*args), jax.jit(xla)(*args)
    assert out_c.dtype == out_x.dtype == dtype
    eps = float(jnp.finfo(dtype).eps)
    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    max_score = float(np.abs(np.einsum("btnh,bsnh->bnts", q64, k64)).max()) / np.sqrt(H)
    rtol = eps * (4 + max_score) + tolerance(np.float32, T)
    bound = rtol * float(np.abs(np.asarray(v, np.float64)).max())
    forward = float(np.abs(np.asarray(out_c, np.float64) - np.asarray(out_x, np.float64)).max())
    record_property("forward_max_abs_error", forward)
    record_property("forward_bound", bound)
    assert forward <= bound
    for name, got, want in zip("qkv", grads_c, grads_x):
        assert got.dtype == dtype
        error = _relative_error_in_norm(got, want)
        record_property(f"d{name}_relative_error_in_norm", error)
        assert error <= rtol, f"d{name}: {error:.3g} > {rtol:.3g}"
    record_property("gradient_rtol", rtol)


# --- fp8 GEMMs against their CPU emulation ---------------------------------------------------

DENSE = (((1,), (0,)), ((), ()))
# fp8 GEMMs per fp8 matmul forward and backward with XLA's default flags: before jax 0.10.2
# mpjax writes the e5m2 x e4m3 gradients dequantized (Triton's GEMMs refuse them), so only the
# forward is an fp8 GEMM there.
FP8_GEMMS_PER_MATMUL = 3 if jax_compat.mixed_fp8_dots() else 1


def _fp8_step(x, w, g):
    out, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, DENSE), x, w)
    return (out, *vjp(g))


def test_fp8_matmuls_run_fp8_gemms_on_the_gpu_and_match_their_cpu_emulation(record_property):
    """The fp8 matmul forward (e4m3 x e4m3) and its two gradients (e5m2 x e4m3) are fp8 GEMMs
    on the GPU (the forward alone before jax 0.10.2), and compute what the CPU computes from
    the same quantized operands: the
    products are exact in float32 and the dot asks for a float32 result, so the two may
    differ by the order of float32 sums and the final rounding into bfloat16. A GEMM that
    accumulates in fewer bits than float32 fails here, by the factor it records."""
    if _compute_capability() < (8, 9):
        pytest.skip(f"fp8 GEMMs need compute capability 8.9 (Ada, Hopper); {_gpu().device_kind}")
    keys = jax.random.split(jax.random.key(1), 3)
    m, k, n = 256, 512, 384
    x = jax.random.normal(keys[0], (m, k)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(keys[1], (k, n))).astype(jnp.bfloat16)
    g = (1e-3 * jax.random.normal(keys[2], (m, n))).astype(jnp.bfloat16)
    plan = _plan(_fp8_step, x, w, g)
    fp8_gemms = [gm for gm in plan.gemms if gm.lhs_dtype.itemsize == gm.rhs_dtype.itemsize == 1]
    assert sum(gm.executions for gm in fp8_gemms) == FP8_GEMMS_PER_MATMUL, str(plan)
    record_property("fp8_gemm_libraries", ",".join(sorted({gm.library for gm in fp8_gemms})))
    on_gpu = jax.jit(_fp8_step)(*_on(_gpu(), x, w, g))
    on_cpu = jax.jit(_fp8_step)(*_on(jax.devices("cpu")[0], x, w, g))

    # Each result's terms, from the operands as quantized: |x| |w| bounds them elementwise
    # up to the quantization's relative error, which both sides share.
    def magnitudes(a, b):
        return np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64))

    sums = {"out": magnitudes(x, w), "dx": magnitudes(g, w.T), "dw": magnitudes(x.T, g)}
    lengths = {"out": k, "dx": n, "dw": m}
    bf16_eps = float(jnp.finfo(jnp.bfloat16).eps)
    for (name, terms), got, want in zip(sums.items(), on_gpu, on_cpu):
        assert got.dtype == want.dtype == jnp.bfloat16
        # Quantization moves each operand by at most e4m3's or e5m2's unit roundoff (1/16,
        # 1/8): twice the terms' magnitudes bound the quantized ones. Each side rounds its
        # result into bfloat16 (half an eps each).
        accumulation = tolerance(np.float32, lengths[name]) * 2 * terms
        bound = accumulation + bf16_eps * np.abs(np.asarray(want, np.float64))
        error = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        record_property(f"{name}_max_error_over_bound", float((error / bound).max()))
        assert (error <= bound).all(), f"{name}: {float((error / bound).max()):.3g} of the bound"


# --- Loss scaling's skip on a real overflow ------------------------------------------------

TINY = gpt.GPTConfig(block_size=64, n_layer=2, n_head=2, d_model=64)


@functools.cache
def _corpus():
    return tt.load_corpus(None, max_bytes=60_000)


def _batch(seq_len=TINY.block_size, batch=8):
    return tt.sample_batch(_corpus(), np.random.default_rng(0), (1, batch), seq_len)


def test_loss_scaling_skips_the_step_whose_float16_gradient_overflows_on_the_gpu(
    record_property,
):
    """With a loss scale of 2**40 the scaled loss is finite in float32, but its cotangent
    overflows float16 in the model's backward kernels: the step is skipped (params bit for
    bit as they were), the scale halves, and once it is small enough steps apply again."""
    policy = mpjax.get_policy("mixed_float16")
    model = tt.build_model(TINY, policy, "mpjax")
    tx = mpjax.loss_scaling(optax.adam(1e-3), mpjax.DynamicLossScale(2.0**40))
    state = jax.device_put(tt.init_state(model, tx, seed=0, seq_len=TINY.block_size), _gpu())
    x, y = _on(_gpu(), *_batch())
    step = jax.jit(tt.make_train_step(model, tx))
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step(state, x, y)
    assert int(metrics["skipped_steps"]) == 1 and float(metrics["loss_scale"]) == 2.0**39
    assert np.isfinite(float(metrics["loss"])) and float(metrics["unmoved"]) == 1.0
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(new), old)
    for _ in range(40):
        state, metrics = step(state, x, y)
        if int(metrics["consecutive_skipped"]) == 0:
            break
    applied_at = float(metrics["loss_scale"])
    record_property("first_applied_loss_scale", applied_at)
    record_property("skipped_steps", int(metrics["skipped_steps"]))
    assert int(metrics["consecutive_skipped"]) == 0, "no step applied after 40 halvings"
    assert float(metrics["unmoved"]) < 1.0 and np.isfinite(float(metrics["loss"]))


# --- The example's train step under each policy ----------------------------------------------

POLICIES = ["float32", "mixed_bfloat16", "mixed_float16", "mixed_bfloat16_fp8", tt.FP8_DELAYED]


@pytest.mark.parametrize("policy_name", POLICIES, ids=["f32", "bf16", "f16", "fp8", "fp8_delayed"])
def test_the_example_trains_on_the_gpu_under_each_policy(policy_name, record_property):
    """Five steps of the example's own train step on one batch, on the GPU: the loss goes
    down; under a 16-bit policy attention is cuDNN's forward and backward, under fp8 (on
    Ada and Hopper) each block's dense layers are fp8 GEMMs. The CPU's first loss from the same
    params is recorded beside the GPU's: how far the GPU's kernels land from the CPU's."""
    policy = mpjax.get_policy(policy_name)
    cfg = tt.TrainConfig(policy=policy_name, steps=10, warmup_steps=2, lr=1e-2)
    model = tt.build_model(TINY, policy, "mpjax")
    tx = tt.make_optimizer(cfg, policy)
    initial = tt.init_state(model, tx, seed=0, seq_len=TINY.block_size)
    x, y = _batch()
    train_step = tt.make_train_step(model, tx)
    plan = _plan(train_step, initial, x, y)
    if policy.compute_dtype != F32:
        attention = {(a.backward, a.dtype) for a in plan.attention}
        assert attention == {(False, policy.compute_dtype), (True, policy.compute_dtype)}
    if policy.fp8 is not None and _compute_capability() >= (8, 9):
        fp8_gemms = sum(g.executions for g in plan.gemms if g.lhs_dtype.itemsize == 1)
        assert fp8_gemms == FP8_GEMMS_PER_MATMUL * 4 * TINY.n_layer, str(plan)
    record_property("flop_share", str({d: plan.flop_share(d) for d in ("bfloat16", "fp8")}))
    cpu_loss = float(jax.jit(train_step)(*_on(jax.devices("cpu")[0], initial, x, y))[1]["loss"])
    step = jax.jit(train_step)
    state, (x, y) = jax.device_put(initial, _gpu()), _on(_gpu(), x, y)
    losses = []
    for _ in range(5):
        state, metrics = step(state, x, y)
        losses.append(float(metrics["loss"]))
    record_property("losses", str(losses))
    record_property("cpu_first_loss", cpu_loss)
    record_property("first_loss_relative_difference", abs(losses[0] - cpu_loss) / cpu_loss)
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
