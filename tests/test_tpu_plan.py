"""The example's training step compiled for a TPU, on this machine without one.

What mpjax promises a TPU runs, checked in XLA's optimized TPU HLO and analyses
(:func:`mpjax.plan`), on the example's own ``--plan`` path (:func:`train_transformer.plan_step`):
under ``mixed_bfloat16`` every matmul FLOP has bf16 operands, attention is Pallas's fused kernels
forward and backward, and mpjax's step costs what the hand-written bf16 step costs in XLA's
estimated time; under ``float32`` every matmul runs at true float32 (``highest``).

These need libtpu (``pip install "mpjax[tpu]"``, no TPU needed) and skip without it; CI installs
it and sets ``MPJAX_REQUIRE_TPU_PLAN``, which turns a missing libtpu into an error. Each plan is
one compile of a whole training step (a minute or more on two cores), so they are slow tests.
"""

import functools
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from mpjax.planning.devices import plan_unavailable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train_transformer as tt  # noqa: E402

REASON = plan_unavailable("v5p")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"the plan cannot compile for a TPU: {REASON}"),
]

BF16 = np.dtype(jnp.bfloat16)
# The benchmark's batch for each preset.
BATCH = {"tiny": 16, "small": 16}


@functools.cache
def example_plan(preset, policy, mode=tt.MODE, target="v5p"):
    """The plan of the example's own train step (forward, backward, clipping, AdamW and loss
    scaling where the policy has it) for one batch of the benchmark's size, on one chip."""
    cfg = tt.TrainConfig(
        policy=policy, preset=preset, mode=mode, plan=target, batch_size=BATCH[preset]
    )
    return cfg.model_config(), tt.plan_step(cfg)


def test_mixed_bfloat16_runs_every_matmul_flop_on_bf16():
    config, plan = example_plan("small", "mixed_bfloat16")
    assert plan.platform == "tpu" and plan.compiled, str(plan)
    assert plan.flop_share(jnp.bfloat16) == 1.0, str(plan)
    assert {(g.lhs_dtype, g.rhs_dtype) for g in plan.gemms} == {(BF16, BF16)}
    # The plan's matmul FLOPs are the model's (the example's MFU counts the same FLOPs).
    tokens = BATCH["small"] * config.block_size
    assert plan.total_flops == pytest.approx(tokens * config.flops_per_token(), rel=0.02)


def test_attention_is_pallas_forward_and_backward_in_every_layer():
    config, plan = example_plan("small", "mixed_bfloat16")
    forward = sum(a.executions for a in plan.attention if not a.backward)
    backward = sum(a.executions for a in plan.attention if a.backward)
    assert forward == config.n_layer and backward == 2 * config.n_layer, str(plan)
    assert {a.target for a in plan.attention} == {"tpu_custom_call"}
    assert {a.dtype for a in plan.attention} == {BF16}


def test_float32_means_float32_on_a_tpu():
    # At JAX's default a TPU multiplies float32 in one bf16 pass; mpjax's float32 is highest.
    _, plan = example_plan("tiny", "float32")
    assert set(plan.float32_precisions()) == {"highest"}, plan.summary()
    assert plan.attention == ()  # float32 attention keeps XLA's path, at highest too
    assert plan.flop_share(jnp.float32) == 1.0


def test_mpjax_costs_what_the_hand_written_bf16_step_costs():
    _, mpjax_plan = example_plan("small", "mixed_bfloat16")
    _, hand = example_plan("small", "mixed_bfloat16", mode="hand")
    assert mpjax_plan.estimated_seconds <= 1.02 * hand.estimated_seconds, (
        mpjax_plan.summary(),
        hand.summary(),
    )


def test_the_example_fsdp_step_on_a_slice_gathers_weights_not_activations():
    # Eight v5p chips, params sliced over all eight, the batch split over them. Each block's
    # input is pinned to the batch sharding (examples/sharding.py): without it, XLA kept the
    # weight slices in place and moved the activations instead, 28 GB of collectives a step
    # per chip against the weights' 0.5 GB.
    cfg = tt.TrainConfig(preset="small", plan="v5p:2x2x2", fsdp=8, batch_size=64)
    plan = tt.plan_step(cfg)
    config = cfg.model_config()
    weights = config.num_params() * 2  # the params in bf16
    # Gathered forward and backward in bf16 (twice the weights), their gradients reduce-
    # scattered in f32, the policy's reduce dtype (twice the weights' bytes, which XLA's
    # permutes send about twice): some six times the weights (the activations' placement
    # moved over a hundred times them).
    moved = plan.collective_bytes()
    assert sum(moved.values()) < 8 * weights, plan.summary()
    assert moved["all-gather bfloat16"] == pytest.approx(2 * weights, rel=0.1), plan.summary()
    assert moved["collective-permute float32"] > 2 * weights, plan.summary()
    assert "collective-permute bfloat16" not in moved, plan.summary()
    assert plan.memory.fits and plan.devices == 8
    # At the chips' interconnect bandwidth the collectives take a few percent of the step
    # XLA estimates; the table gives each one's share.
    bound = plan.collective_seconds()
    assert 0 < bound < 0.2 * plan.estimated_seconds, plan.summary()
    assert "of the estimated step" in plan.summary() and "of the estimate" in plan.table()
    # Pallas's attention runs on each chip's share of the batch (a shard_map), forward and
    # backward in every layer, where XLA's materialized softmax ran before (28.3% MFU). With
    # the backward kernels' time, which XLA's estimate leaves out, at their nominal FLOPs at the
    # peak, the step is still above 40% MFU of the model FLOPs (42.5% with jax 0.12.0.1).
    forward = sum(a.executions for a in plan.attention if not a.backward)
    backward = sum(a.executions for a in plan.attention if a.backward)
    assert forward == config.n_layer and backward == 2 * config.n_layer, plan.summary()
    model_flops = cfg.batch_size * config.block_size * config.flops_per_token() / plan.devices
    fuller = plan.estimated_seconds + plan.uncosted_seconds
    assert plan.uncosted_seconds > 0, plan.summary()
    assert plan.mfu(model_flops) * plan.estimated_seconds / fuller > 0.4, plan.summary()
