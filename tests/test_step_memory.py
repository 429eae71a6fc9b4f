"""How much memory the example's training step holds under mixed precision.

A bf16 step must hold less than the f32 one, and mpjax's step no more than the same model with
its dtypes written by hand. Two things used to break that: XLA's attention kept its ``T x T``
intermediates for the backward pass in both widths (f32 softmax and bf16 probabilities, more
than f32's), and mpjax ran the MLP's bias add and its GELU in f32 (a bf16 matmul output plus an
f32 bias; the GELU's cube), keeping f32 copies of the MLP's widest activation.

The fast tests read what the backward pass keeps (the leaves of ``jax.vjp``'s function); the
slow ones compile the example's step, the ``small`` preset with a batch of 4 (every sequence
holds the same; fewer layers would not do, since mpjax's step holds a fixed amount more than the
hand-written one, which outweighs two layers' savings: minutes per compile on two cores), for a
v5p chip (with libtpu) and an H100 (with JAX's CUDA plugin), and compare XLA's temporaries
(``memory_analysis()``). They skip without those;
``MPJAX_REQUIRE_TPU_PLAN`` / ``MPJAX_REQUIRE_GPU_PLAN`` turn a missing one into an error.
"""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402
import train_transformer as tt  # noqa: E402

# mpjax's step may hold this much more than the hand-written one (XLA's scheduling differs).
HAND_RATIO = 1.05


def residuals(fn, *args):
    """What the backward pass of ``fn`` keeps: ``{(dtype, shape): count}``."""
    leaves = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args))
    kept: dict = {}
    for x in leaves:
        key = (np.dtype(x.dtype).name, tuple(x.shape))
        kept[key] = kept.get(key, 0) + 1
    return kept


def kept_bytes(kept):
    """The bytes of the arrays kept; scalars (the constants of a trace) left out."""
    return sum(np.dtype(d).itemsize * int(np.prod(s)) * n for (d, s), n in kept.items() if s)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_xla_attention_keeps_no_scores_for_the_backward_pass(dtype):
    t = 64
    q = k = v = jax.ShapeDtypeStruct((2, t, 4, 16), dtype)

    def attention(q, k, v):
        return mpjax.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    kept = residuals(attention, q, k, v)
    assert not [s for (_, s), _ in kept.items() if s[-2:] == (t, t)], kept


def _loss(mode, policy):
    config = gpt.GPTConfig(block_size=64, n_layer=1, n_head=2, d_model=32)
    model = tt.build_model(config, mpjax.get_policy(policy), mode)
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((2, 64), jnp.int32))["params"]
    )
    return residuals(lambda p, x: tt.loss_fn(model, p, x, x), params, tokens)


def test_mpjax_keeps_what_the_hand_written_model_keeps():
    # The MLP's hidden activation [2, 64, 128] is kept in bf16 only. (Under float16 the GELU's
    # cube runs in f32, for its range, and keeps f32 copies.)
    mpjax_kept = _loss("mpjax", "mixed_bfloat16")
    hand_kept = _loss("hand", "mixed_bfloat16")
    assert not [k for k in mpjax_kept if k == ("float32", (2, 64, 128))], mpjax_kept
    assert kept_bytes(mpjax_kept) <= kept_bytes(hand_kept), (mpjax_kept, hand_kept)


def test_float16_still_cubes_in_f32():
    """Powers stay f32 where the compute dtype lacks the range: 400 cubed is past f16's max."""
    cube = mpjax.autocast(lambda w, x: (x @ w) ** 3, "mixed_float16")
    assert jnp.isfinite(cube(jnp.eye(4), jnp.full((2, 4), 400.0))).all()


# --- Compiled for a v5p chip and an H100 -------------------------------------------------------


TARGET = {
    target: pytest.param(
        target,
        marks=pytest.mark.skipif(
            mpjax.plan_unavailable(target) is not None,
            reason=f"the plan cannot compile: {mpjax.plan_unavailable(target)}",
        ),
    )
    for target in ("v5p", "h100")
}


@functools.cache
def step_temporaries(target, variant):
    """XLA's temporaries (bytes) of the example's train step for one benchmark row, planned
    for ``target`` (the example's own --plan path) with the ``small`` preset and a batch of 4."""
    policy, mode = variant
    cfg = tt.TrainConfig(policy=policy, preset="small", mode=mode, batch_size=4, plan=target)
    # The hand-written model's attention gradient needs standard promotion when it compiles
    # (see mpjax.dot_product_attention); the benchmark compiles under JAX's default too.
    with jax.numpy_dtype_promotion("standard"):
        return tt.plan_step(cfg).memory.temp_bytes


F32_ROW = ("float32", "hand")
BF16_HAND = ("mixed_bfloat16", "hand")
BF16_MPJAX = ("mixed_bfloat16", "mpjax")


@pytest.mark.slow
@pytest.mark.parametrize("target", [TARGET["v5p"]])
def test_bf16_step_holds_less_than_f32_on_tpu(target):
    for row in (BF16_HAND, BF16_MPJAX):
        assert step_temporaries(target, row) < step_temporaries(target, F32_ROW), row


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGET.values()))
def test_mpjax_step_holds_what_the_hand_written_step_holds(target):
    mpjax_bytes = step_temporaries(target, BF16_MPJAX)
    hand_bytes = step_temporaries(target, BF16_HAND)
    assert mpjax_bytes <= HAND_RATIO * hand_bytes, (mpjax_bytes, hand_bytes)
