"""mpjax: mixed-precision training for JAX, Flax and optax."""

from mpjax import linen, nnx
from mpjax.autocast import (
    AutocastReport,
    AutocastRow,
    AutocastWarning,
    autocast,
    autocast_report,
)
from mpjax.inspection import MatmulInfo, MatmulReport, hlo_op_counts, inspect_matmuls
from mpjax.loss_scaling import (
    DynamicLossScale,
    LossScale,
    LossScalingInfo,
    LossScalingState,
    NoOpLossScale,
    PersistentOverflowError,
    StaticLossScale,
    check_overflow,
    loss_scaling,
    loss_scaling_info,
    scale_loss,
)
from mpjax.loss_scaling import (  # deprecated aliases, kept for one release
    find_loss_scaling_state,
    get_loss_scale,
    loss_scale_for,
)
from mpjax import flax_serialization  # noqa: F401  (registers the loss scales with Flax)
from mpjax.master_weights import MasterWeightsState, master_weights
from mpjax.op_categories import DEFAULT_OP_CATEGORIES
from mpjax.policy import (
    MIXED_BFLOAT16,
    MIXED_FLOAT16,
    Policy,
    PolicyLike,
    cast_floating,
    get_policy,
)
from mpjax.regions import FULL_PRECISION_SCOPE, full_precision
from mpjax.describe import describe
from mpjax.report import ModuleRow, PrecisionReport
from mpjax.rules import Resolution, Rule, Rules, RuleWarning, as_rules, norm_policy

__version__ = "0.1.0"

__all__ = [
    "linen",
    "nnx",
    "AutocastReport",
    "AutocastRow",
    "AutocastWarning",
    "DEFAULT_OP_CATEGORIES",
    "DynamicLossScale",
    "FULL_PRECISION_SCOPE",
    "LossScale",
    "LossScalingInfo",
    "LossScalingState",
    "MIXED_BFLOAT16",
    "MIXED_FLOAT16",
    "MasterWeightsState",
    "MatmulInfo",
    "MatmulReport",
    "ModuleRow",
    "NoOpLossScale",
    "PersistentOverflowError",
    "Policy",
    "PolicyLike",
    "PrecisionReport",
    "Resolution",
    "Rule",
    "RuleWarning",
    "Rules",
    "StaticLossScale",
    "as_rules",
    "autocast",
    "autocast_report",
    "cast_floating",
    "check_overflow",
    "describe",
    "find_loss_scaling_state",
    "full_precision",
    "get_loss_scale",
    "get_policy",
    "hlo_op_counts",
    "inspect_matmuls",
    "loss_scale_for",
    "loss_scaling",
    "loss_scaling_info",
    "master_weights",
    "norm_policy",
    "scale_loss",
]
