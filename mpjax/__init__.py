"""mpjax: mixed-precision training for JAX, Flax and optax."""

from mpjax.inspection import MatmulInfo, MatmulReport, hlo_op_counts, inspect_matmuls
from mpjax.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    get_loss_scale,
    loss_scale_for,
)
from mpjax.loss_scaling import (
    LossScalingState,
    PersistentOverflowError,
    check_overflow,
    find_loss_scaling_state,
    loss_scaling,
    scale_loss,
)
from mpjax.master_weights import MasterWeightsState, master_weights
from mpjax.policy import (
    MIXED_BFLOAT16,
    MIXED_FLOAT16,
    Policy,
    PolicyLike,
    cast_floating,
    get_policy,
)

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "LossScalingState",
    "MIXED_BFLOAT16",
    "MIXED_FLOAT16",
    "MasterWeightsState",
    "MatmulInfo",
    "MatmulReport",
    "NoOpLossScale",
    "PersistentOverflowError",
    "Policy",
    "PolicyLike",
    "StaticLossScale",
    "cast_floating",
    "check_overflow",
    "find_loss_scaling_state",
    "get_loss_scale",
    "get_policy",
    "hlo_op_counts",
    "inspect_matmuls",
    "loss_scale_for",
    "loss_scaling",
    "master_weights",
    "scale_loss",
]
