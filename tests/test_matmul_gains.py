"""Which matmuls gain from a narrow recipe on a target, by its roofline: the GEMMs of a model
forward and backward by module, timed both ways on the chip's published figures, the verdicts
at the sizes where peers measured them, and rules that put only the gaining modules in the
recipe."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import mpjax


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4096, name="big")(x)
        h = nn.Dense(64, name="squeeze")(h)
        return nn.Dense(64, name="small")(h)


X = jax.ShapeDtypeStruct((8192, 4096), jnp.float32)


def gains(target, recipe, rules="mixed_bfloat16"):
    model = mpjax.linen.apply_policy(Net(), rules)
    variables = jax.eval_shape(model.init, jax.random.key(0), X)
    return mpjax.matmul_gains(lambda v, x: jnp.mean(model.apply(v, x)), target, recipe)(
        variables, X
    )


def test_each_module_counts_its_three_gemms_with_their_shapes():
    report = gains("h100", "current")
    by_path = {m.path: m for m in report}
    assert set(by_path) == {"big", "squeeze", "small"}
    big = by_path["big"]
    # Forward x @ w, then both gradients: (batch, m, n, k) of each.
    assert sorted(g.shape for g in big.gemms) == sorted(
        [(1, 8192, 4096, 4096), (1, 8192, 4096, 4096), (1, 4096, 4096, 8192)]
    )
    assert [g.backward for g in big.gemms].count(True) == 2
    # bf16 on an H100: 3 * 2 * 8192 * 4096**2 FLOPs at 989 TF/s, compute-bound.
    assert big.compute_seconds == pytest.approx(3 * 2 * 8192 * 4096**2 / 989e12)


@pytest.mark.parametrize(
    "target, recipe", [("h100", "current"), ("b200", "mxfp8"), ("b200", "nvfp4")]
)
def test_big_gemms_gain_and_small_or_thin_ones_lose(target, recipe):
    by_path = {m.path: m.gain for m in gains(target, recipe)}
    assert by_path["big"] > 1.3
    assert by_path["squeeze"] < 1 and by_path["small"] < 1


def test_the_model_agrees_with_a_peers_measurement_of_one_fp8_gemm():
    """torchao measured fp8 at 0.80x bf16 for a 1024x2048x1024 GEMM on an H100, and a gain from
    4096 on; the roofline with the quantization pass says the same."""

    def one_gemm(m, k, n):
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        (module,) = mpjax.matmul_gains(lambda x, w: x @ w, "h100", "current")(x, w)
        forward = [g for g in module.gemms if not g.backward]
        return forward[0].compute_seconds / forward[0].narrow_seconds

    assert 0.6 < one_gemm(1024, 2048, 1024) < 1
    assert one_gemm(4096, 4096, 4096) > 1.2


def test_chips_without_the_format_lose_everywhere():
    assert all(m.gain < 1 for m in gains("a100", "current"))  # no fp8 matrix unit
    assert all(m.gain < 1 for m in gains("h100", "mxfp8"))  # no block-scaled GEMMs: emulated


def test_the_rules_put_only_the_gaining_modules_in_the_recipe():
    report = gains("b200", "mxfp8")
    rules = report.rules()
    assert rules == {
        "squeeze": mpjax.MIXED_BFLOAT16,
        "small": mpjax.MIXED_BFLOAT16,
    }
    assert "loses: 3 GEMMs up to 8192x4096x64" in {m.path: m.reason for m in report}["squeeze"]
    narrow = mpjax.Rules(rules, default="mixed_bfloat16_mxfp8")
    model = mpjax.linen.apply_policy(Net(), narrow)
    variables = jax.eval_shape(model.init, jax.random.key(0), X)
    report = mpjax.describe(model, variables=variables)(X)
    formats = {
        row.path: {k.split("@")[-1] for k, _ in row.matmuls} for row in report.rows if row.path
    }
    assert formats == {"big": {"mxfp8"}, "squeeze": {"bf16,bf16"}, "small": {"bf16,bf16"}}
    assert "mxfp8 on b200, by the roofline" in str(gains("b200", "mxfp8"))


def test_bad_arguments_name_what_is_valid():
    with pytest.raises(TypeError, match="matmul_gains\\(fn\\): fn must be the function"):
        mpjax.matmul_gains(3)
    with pytest.raises(ValueError, match="matmul_gains: unknown target 'h300'"):
        mpjax.matmul_gains(jnp.dot, "h300")
    with pytest.raises(ValueError, match="must be one of"):
        mpjax.matmul_gains(jnp.dot, "h100", "mxfp6")
