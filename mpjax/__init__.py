"""mpjax: mixed-precision training for JAX, Flax and optax."""

from mpjax.inspection import MatmulInfo, MatmulReport, hlo_op_counts, inspect_matmuls
from mpjax.policy import (
    MIXED_BFLOAT16,
    MIXED_FLOAT16,
    Policy,
    PolicyLike,
    cast_floating,
    get_policy,
)
from mpjax.report import ModuleRow, PrecisionReport, describe
from mpjax.rules import Resolution, Rule, Rules, RuleWarning, as_rules, norm_policy

__version__ = "0.1.0"

__all__ = [
    "MIXED_BFLOAT16",
    "MIXED_FLOAT16",
    "MatmulInfo",
    "MatmulReport",
    "ModuleRow",
    "Policy",
    "PolicyLike",
    "PrecisionReport",
    "Resolution",
    "Rule",
    "RuleWarning",
    "Rules",
    "as_rules",
    "cast_floating",
    "describe",
    "get_policy",
    "hlo_op_counts",
    "inspect_matmuls",
    "norm_policy",
]
