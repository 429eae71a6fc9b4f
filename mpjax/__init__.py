"""mpjax: mixed-precision training for JAX, Flax and optax.

The core (policies, rules, autocast, reports, loss scaling, master weights, optimizer-state
precision, quantized optimizer states, low-precision params and the memory report) needs only JAX and optax. The Flax integrations, :mod:`mpjax.linen` and :mod:`mpjax.nnx`, are imported here when
Flax is installed (``pip install "mpjax[flax]"``), and the Equinox one, :mod:`mpjax.equinox`,
when Equinox is (``pip install "mpjax[equinox]"``); importing them registers their built-in
rules, their :func:`describe` support and the loss scales' ``flax.serialization`` support.
"""

from typing import Any

from mpjax.attention import dot_product_attention
from mpjax.autocast import AutocastReport, AutocastRow, autocast, fp8_state, with_fp8_state
from mpjax.casting.collectives import (
    all_gather_params,
    combine_tokens,
    dispatch_tokens,
    psum_gradients,
)
from mpjax.casting.op_categories import DEFAULT_OP_CATEGORIES
from mpjax.casting.regions import FULL_PRECISION_SCOPE, full_precision
from mpjax.casting.trace_context import AutocastWarning
from mpjax.doctor.diagnosis import Doctor, diagnose
from mpjax.doctor.diagnosis_report import DiagnosisReport
from mpjax.doctor.layer_stack import LayerStack, edge_block_rules, layer_stack
from mpjax.doctor.monitor import ModuleCheck, PrecisionMonitor
from mpjax.experts import ragged_dot
from mpjax.fp8 import Fp8Recipe
from mpjax.grouped.matmul import GroupedMatmulWarning
from mpjax.inspection.describe import describe
from mpjax.inspection.matmuls import (
    HloDot,
    HloDotReport,
    HloOperand,
    MatmulInfo,
    MatmulReport,
    hlo_dots,
    hlo_op_counts,
    inspect_matmuls,
)
from mpjax.inspection.report import ModuleRow, PrecisionReport
from mpjax.optim.loss_scale import DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from mpjax.optim.loss_scaling import LossScalingState, LossScalingWarning, loss_scaling
from mpjax.optim.loss_scaling_readers import (
    LossScalingInfo,
    PersistentOverflowError,
    check_loss_scaling,
    check_overflow,
    loss_scaling_info,
    scale_loss,
    scaled_value_and_grad,
)
from mpjax.optim.low_precision_params import (
    PARAM_ROUNDINGS,
    LowPrecisionParamsState,
    low_precision_params,
)
from mpjax.optim.master_weights import MasterWeightsState, master_weights
from mpjax.optim.memory import MemoryReport, MemoryRow, memory_report
from mpjax.optim.quantization import (
    QUANT_FORMATS,
    QuantFormat,
    QuantizedArray,
    create_dynamic_map,
    dequantize_blockwise,
    quantize_blockwise,
)
from mpjax.optim.quantized_state import (
    QuantizationChoice,
    QuantizationChoices,
    QuantizedState,
    quantization_choices,
    quantized_state,
)
from mpjax.optim.rounding import stochastic_round
from mpjax.optim.state_precision import StatePrecisionState, state_precision
from mpjax.planning.collectives import PlanCollective
from mpjax.planning.compile_only import compile_only
from mpjax.planning.devices import PlanUnavailableError, plan_mesh, plan_unavailable
from mpjax.planning.loops import PlanLoop
from mpjax.planning.matmul_gains import MatmulGains, matmul_gains
from mpjax.planning.plan import Plan, plan
from mpjax.planning.rows import PlanAttention, PlanGemm, PlanMemory, PlanScatter
from mpjax.policy import (
    MIXED_BFLOAT16,
    MIXED_BFLOAT16_FP8,
    MIXED_BFLOAT16_FP8_ROWWISE,
    MIXED_BFLOAT16_MXFP8,
    MIXED_BFLOAT16_NVFP4,
    MIXED_FLOAT16,
    Policy,
    PolicyLike,
    cast_floating,
    get_policy,
)
from mpjax.rules import (
    Resolution,
    Rule,
    Rules,
    RuleWarning,
    as_rules,
    embedding_policy,
    norm_policy,
    router_policy,
)

_flax: Any
try:
    import flax as _flax
except ImportError:  # the core works without Flax; mpjax.linen and mpjax.nnx need it
    _flax = None
else:
    from mpjax import flax_serialization, linen, nnx  # noqa: F401  (they register themselves)

_equinox: Any
try:
    import equinox as _equinox
except ImportError:  # mpjax.equinox needs Equinox
    _equinox = None
else:
    from mpjax import equinox  # noqa: F401  (it registers itself)

__version__ = "0.1.0"

_NEED_FLAX = ("linen", "nnx", "flax_serialization")


def __getattr__(name: str) -> Any:
    if name in _NEED_FLAX and _flax is None:
        raise ImportError(
            f'mpjax.{name} needs Flax, which is not installed: pip install "mpjax[flax]".'
        )
    if name == "equinox" and _equinox is None:
        raise ImportError(
            'mpjax.equinox needs Equinox, which is not installed: pip install "mpjax[equinox]".'
        )
    raise AttributeError(f"module 'mpjax' has no attribute {name!r}")


__all__ = [
    "equinox",
    "linen",
    "nnx",
    "AutocastReport",
    "AutocastRow",
    "AutocastWarning",
    "DEFAULT_OP_CATEGORIES",
    "DiagnosisReport",
    "Doctor",
    "DynamicLossScale",
    "Fp8Recipe",
    "GroupedMatmulWarning",
    "Plan",
    "PlanAttention",
    "PlanCollective",
    "PlanGemm",
    "PlanLoop",
    "PlanMemory",
    "PlanScatter",
    "PlanUnavailableError",
    "HloDot",
    "HloDotReport",
    "HloOperand",
    "FULL_PRECISION_SCOPE",
    "LossScale",
    "LossScalingInfo",
    "LossScalingState",
    "LossScalingWarning",
    "LowPrecisionParamsState",
    "MIXED_BFLOAT16",
    "MIXED_BFLOAT16_FP8",
    "MIXED_BFLOAT16_FP8_ROWWISE",
    "MIXED_BFLOAT16_MXFP8",
    "MIXED_BFLOAT16_NVFP4",
    "MIXED_FLOAT16",
    "MasterWeightsState",
    "MatmulGains",
    "MatmulInfo",
    "MatmulReport",
    "MemoryReport",
    "MemoryRow",
    "ModuleCheck",
    "ModuleRow",
    "NoOpLossScale",
    "PARAM_ROUNDINGS",
    "PersistentOverflowError",
    "Policy",
    "PolicyLike",
    "PrecisionMonitor",
    "PrecisionReport",
    "QUANT_FORMATS",
    "QuantFormat",
    "QuantizationChoice",
    "QuantizationChoices",
    "QuantizedArray",
    "QuantizedState",
    "LayerStack",
    "Resolution",
    "Rule",
    "RuleWarning",
    "Rules",
    "StatePrecisionState",
    "StaticLossScale",
    "all_gather_params",
    "as_rules",
    "autocast",
    "cast_floating",
    "check_loss_scaling",
    "check_overflow",
    "combine_tokens",
    "create_dynamic_map",
    "dequantize_blockwise",
    "dispatch_tokens",
    "describe",
    "diagnose",
    "dot_product_attention",
    "fp8_state",
    "full_precision",
    "psum_gradients",
    "embedding_policy",
    "edge_block_rules",
    "get_policy",
    "layer_stack",
    "plan",
    "plan_mesh",
    "plan_unavailable",
    "hlo_dots",
    "hlo_op_counts",
    "compile_only",
    "inspect_matmuls",
    "matmul_gains",
    "loss_scaling",
    "loss_scaling_info",
    "low_precision_params",
    "master_weights",
    "memory_report",
    "norm_policy",
    "quantization_choices",
    "quantize_blockwise",
    "ragged_dot",
    "router_policy",
    "quantized_state",
    "scale_loss",
    "scaled_value_and_grad",
    "state_precision",
    "stochastic_round",
    "with_fp8_state",
]
if _flax is None:  # `from mpjax import *` without Flax
    __all__ = [name for name in __all__ if name not in _NEED_FLAX]
if _equinox is None:
    __all__ = [name for name in __all__ if name != "equinox"]
