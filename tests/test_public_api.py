"""The public API, held name by name: the names users import from mpjax and its integrations,
whatever module of the package defines them."""

import importlib

import pytest

PUBLIC = {
    "mpjax": (
        "AutocastReport",
        "AutocastRow",
        "AutocastWarning",
        "DEFAULT_OP_CATEGORIES",
        "DiagnosisReport",
        "Doctor",
        "DynamicLossScale",
        "FULL_PRECISION_SCOPE",
        "Fp8Recipe",
        "PlanAttention",
        "PlanCollective",
        "PlanUnavailableError",
        "PlanGemm",
        "Plan",
        "PlanMemory",
        "PlanScatter",
        "HloDot",
        "HloDotReport",
        "HloOperand",
        "LossScale",
        "LossScalingInfo",
        "LossScalingState",
        "LossScalingWarning",
        "LowPrecisionParamsState",
        "MIXED_BFLOAT16",
        "MIXED_BFLOAT16_FP8",
        "MIXED_FLOAT16",
        "MasterWeightsState",
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
        "create_dynamic_map",
        "dequantize_blockwise",
        "describe",
        "diagnose",
        "dot_product_attention",
        "equinox",
        "psum_gradients",
        "fp8_state",
        "full_precision",
        "embedding_policy",
        "get_policy",
        "plan",
        "plan_mesh",
        "plan_unavailable",
        "hlo_dots",
        "hlo_op_counts",
        "inspect_matmuls",
        "linen",
        "loss_scaling",
        "loss_scaling_info",
        "low_precision_params",
        "master_weights",
        "memory_report",
        "nnx",
        "norm_policy",
        "quantization_choices",
        "quantize_blockwise",
        "quantized_state",
        "scale_loss",
        "scaled_value_and_grad",
        "state_precision",
        "stochastic_round",
        "with_fp8_state",
    ),
    "mpjax.linen": (
        "FP8_COLLECTION",
        "apply_policy",
    ),
    "mpjax.nnx": (
        "FP8_ATTRIBUTE",
        "Fp8State",
        "init_fp8_state",
        "scaled_value_and_grad",
        "set_policy",
    ),
    "mpjax.equinox": (
        "MixedPrecision",
        "apply_policy",
        "filter_value_and_grad",
        "module_paths",
    ),
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_names_are_exactly_these(module):
    assert sorted(importlib.import_module(module).__all__) == sorted(PUBLIC[module])


@pytest.mark.parametrize(
    "module, name", [(module, name) for module, names in PUBLIC.items() for name in names]
)
def test_each_public_name_imports_where_users_import_it(module, name):
    namespace: dict = {}
    exec(f"from {module} import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(module), name)
