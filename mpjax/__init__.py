"""mpjax: mixed-precision training for JAX, Flax and optax.

Flax is optional (``pip install "mpjax[flax]"``): without it, everything but the Flax
integrations (:mod:`mpjax.linen`, :mod:`mpjax.nnx`) and what needs them imports and works.
"""

try:
    import flax  # noqa: F401
except ImportError:
    _HAS_FLAX = False
else:
    _HAS_FLAX = True

from mpjax.autocast import (
    AutocastReport,
    AutocastRow,
    AutocastWarning,
    autocast,
    autocast_report,
)
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
from mpjax.report import ModuleRow, PrecisionReport
from mpjax.rules import Resolution, Rule, Rules, RuleWarning, as_rules, norm_policy

# The names that need Flax (describe.py imports the integrations on this branch).
_FLAX_NAMES = ("linen", "nnx", "describe")
if _HAS_FLAX:
    from mpjax import linen, nnx
    from mpjax.describe import describe

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
    "master_weights",
    "norm_policy",
    "scale_loss",
]
if not _HAS_FLAX:
    __all__ = [name for name in __all__ if name not in _FLAX_NAMES]


def __getattr__(name: str):
    if name in _FLAX_NAMES and not _HAS_FLAX:
        raise ImportError(
            f"mpjax.{name} needs Flax, which is not installed. Install it with: "
            'pip install "mpjax[flax]"'
        )
    raise AttributeError(f"module 'mpjax' has no attribute {name!r}")
