"""Block-scaled expert GEMMs at a capacity (mpjax.grouped.capacity): a mixture of experts'
three grouped GEMMs as batched MXFP8 or NVFP4 GEMMs over each expert's first rows, the rows past
its capacity dropped. Against float64 forward and backward at magnitudes from 1e-3 to the
thousands, the dropped rows exactly zero in value and gradient, the formats of all three GEMMs
read from the jaxpr, under a policy string through autocast and linen, and bad input."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpjax
from mpjax import block_scaled, fp8
from mpjax.grouped import capacity as gc

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
E4M3, E2M1 = fp8.E4M3, block_scaled.FORMATS["nvfp4"].data
SIZES = np.array([100, 0, 20, 136])  # an empty expert, one past its capacity of 128 (M = 256)
M, K, N = 256, 64, 96
MXFP8 = "mxfp8;capacity=1.25"
U8 = float(jnp.finfo(E4M3).eps) / 2  # e4m3's unit roundoff, 2**-4

pytestmark = pytest.mark.filterwarnings("ignore::mpjax.block_scaled.EmulationWarning")


def _operands(scale=1.0, seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K)) * scale
    w = jax.random.normal(kw, (len(SIZES), K, N)) / np.sqrt(K)
    g = jax.random.normal(kg, (M, N))
    return x, w, jnp.asarray(SIZES, jnp.int32), g


def _kept(sizes, capacity):
    """Which rows an expert keeps: its first ``capacity``."""
    return np.concatenate(
        [np.arange(s) < capacity for s in sizes] + [np.zeros(M - sizes.sum(), bool)]
    )


def _ragged64(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for expert, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size] @ w[expert]
        start += size
    return out


def _relative(a, ref):
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref))


def test_capacity_is_each_experts_share_of_the_rows_rounded_up_to_the_row_tile():
    assert gc.capacity_rows(4 * M, 4, 1.25) == 384  # 320 rounded up to 3 x 128
    assert gc.capacity_rows(4 * M, 4, 1.0) == 256
    assert gc.capacity_rows(8, 4, 1.0) == 128  # never below one tile
    assert gc.slots(jnp.asarray(SIZES), M, 96).dtype == np.dtype(np.int32)
    assert gc.dropped_rows(jnp.asarray(SIZES, np.int64), 96).dtype == np.dtype(np.int32)
    slot = np.asarray(gc.slots(jnp.asarray(SIZES), M, 96))
    kept = _kept(SIZES, 96)
    assert (slot[~kept] == 4 * 96).all() and len(set(slot[kept])) == kept.sum()
    # Expert 3's rows start at slot 3 * 96: each expert's rows on blocks of their own.
    assert slot[120] == 3 * 96 and slot[119] == 2 * 96 + 19
    assert int(gc.dropped_rows(jnp.asarray(SIZES), 96)) == (~kept[:256]).sum() == 40 + 4


@pytest.mark.parametrize("scale", [1e-3, 1.0, 3000.0])
def test_kept_rows_are_within_mxfp8_rounding_of_float64_forward_and_backward(scale):
    x, w, sizes, g = _operands(scale)
    kept = _kept(SIZES, gc.capacity_rows(M, 4, 1.25))

    def layer(x, w):
        return gc.capacity_dot(x, w, sizes, recipe=MXFP8, compute=BF16)

    y, vjp = jax.vjp(layer, x, w)
    dx, dw = vjp(g.astype(BF16))
    assert y.dtype == BF16 and dx.dtype == dw.dtype == F32
    # Each product rounds both operands to e4m3 (relative 2**-4 each) and the result to bf16.
    bound = 3 * U8
    x_kept = np.where(kept[:, None], np.asarray(x, np.float64), 0.0)
    assert _relative(np.asarray(y, F32)[kept], _ragged64(x, w, SIZES)[kept]) < bound
    # The input gradient: g @ w_e^T on the kept rows; the weights': x_kept^T @ g per expert.
    g64 = np.asarray(g.astype(BF16), np.float64)
    dx_ref = _ragged64(g64, np.swapaxes(np.asarray(w, np.float64), 1, 2), SIZES)
    assert _relative(np.asarray(dx)[kept], dx_ref[kept]) < bound
    dw_ref, start = np.zeros(w.shape), 0
    for expert, size in enumerate(SIZES):
        rows = slice(start, start + size)
        dw_ref[expert] = x_kept[rows].T @ g64[rows]
        start += size
    present = [e for e, size in enumerate(SIZES) if size]
    assert _relative(np.asarray(dw)[present], dw_ref[present]) < bound
    assert not np.asarray(dw)[1].any()  # the expert with no rows


@pytest.mark.parametrize("recipe", [MXFP8, "nvfp4;capacity=1.25", "nvfp4;plain;capacity=1.25"])
def test_dropped_rows_are_zero_and_get_no_gradient(recipe):
    x, w, sizes, g = _operands(seed=1)
    capacity = gc.capacity_rows(M, 4, 1.25)
    kept = _kept(SIZES, capacity)
    assert capacity == 128 and (~kept).sum() == 136 - 128

    def layer(x, w):
        return gc.capacity_dot(x, w, sizes, recipe=recipe, compute=BF16)

    y, vjp = jax.vjp(layer, x, w)
    dx, dw = vjp(g.astype(BF16))
    assert not np.asarray(y, F32)[~kept].any() and not np.asarray(dx)[~kept].any()
    # The weights' gradient is the kept rows' alone: the same with the dropped rows changed.
    x_other = jnp.where(jnp.asarray(kept)[:, None], x, 1e3)
    _, vjp_other = jax.vjp(layer, x_other, w)
    np.testing.assert_array_equal(vjp_other(g.astype(BF16))[1], dw)


@pytest.mark.parametrize("recipe, dtype", [(MXFP8, E4M3), ("nvfp4;capacity=1.25", E2M1)])
def test_all_three_gemms_multiply_block_scaled_values(recipe, dtype):
    x, w, sizes, _ = _operands()

    def loss(x, w):
        out = gc.capacity_dot(x, w, sizes, recipe=recipe, compute=BF16)
        return jnp.sum(out.astype(F32) ** 2)

    found = mpjax.inspect_matmuls(jax.grad(loss, (0, 1)))(x, w).operand_dtypes()
    assert found == {(dtype.name, dtype.name): 3}, found


@pytest.mark.parametrize("transposed", [False, True])
def test_a_policy_with_a_capacity_runs_the_experts_batched_block_scaled(transposed):
    x, w, sizes, _ = _operands()
    if transposed:
        w = jnp.swapaxes(w, 1, 2)
    dims = lax.RaggedDotDimensionNumbers(((((1,), (2 if transposed else 1,)), ((), ()))), [0], [0])

    def loss(x, w):
        out = lax.ragged_dot_general(x, w, sizes, dims)
        return jnp.sum(out.astype(F32) ** 2)

    policy = f"p=f32,c=bf16,o=f32,fp8={MXFP8}"
    fn = mpjax.autocast(loss, policy)
    (row,) = [r for r in mpjax.describe(fn)(x, w) if r.primitive == "ragged_dot_general"]
    assert row.category == "grouped mxfp8 at capacity 1.25"
    found = mpjax.inspect_matmuls(jax.grad(fn, (0, 1)))(x, w).operand_dtypes()
    assert found == {("float8_e4m3fn", "float8_e4m3fn"): 3}, found
    # The same numbers as the function called directly.
    direct = gc.capacity_dot(x, w, sizes, recipe=MXFP8, compute=BF16, transposed=transposed)
    np.testing.assert_array_equal(jax.jit(fn)(x, w), jnp.sum(direct.astype(BF16).astype(F32) ** 2))


def test_without_a_capacity_or_with_unaligned_shapes_the_experts_stay_grouped_saying_why():
    x, w, sizes, _ = _operands()

    def loss(x, w):
        return jnp.sum(lax.ragged_dot(x, w, sizes).astype(F32) ** 2)

    for policy, x_, w_, why in [
        ("mixed_bfloat16_mxfp8", x, w, "a capacity runs them batched"),
        (f"p=f32,c=bf16,o=f32,fp8={MXFP8}", x[:, :48], w[:, :48], "K=48 not a multiple"),
    ]:
        fn = mpjax.autocast(loss, policy)
        (row,) = [r for r in mpjax.describe(fn)(x_, w_) if r.primitive == "ragged_dot_general"]
        assert row.category.startswith("grouped (not mxfp8: ") and why in row.category


def test_a_linen_mixture_of_experts_with_its_weights_stored_transposed_under_a_capacity():
    class TransposedExperts(nn.Module):  # each expert's weight stored [N, K]
        @nn.compact
        def __call__(self, x, sizes):
            w = self.param("w", nn.initializers.normal(0.05), (len(SIZES), N, K))
            dims = lax.RaggedDotDimensionNumbers(((((1,), (2,)), ((), ()))), [0], [0])
            return lax.ragged_dot_general(x, w, sizes, dims)

    x, _, sizes, _ = _operands()
    model = mpjax.linen.apply_policy(TransposedExperts(), f"p=f32,c=bf16,o=f32,fp8={MXFP8}")
    variables = model.init(jax.random.key(0), x, sizes)
    grad = jax.grad(lambda v: jnp.sum(model.apply(v, x, sizes).astype(F32)))
    found = mpjax.inspect_matmuls(grad)(variables).operand_dtypes()
    assert found == {("float8_e4m3fn", "float8_e4m3fn"): 3}, found
    assert grad(variables)["params"]["w"].dtype == F32


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: mpjax.Fp8Recipe("current", capacity=1.25), ValueError, "takes none"),
        (lambda: mpjax.Fp8Recipe("mxfp8", capacity=0), ValueError, "positive and finite"),
        (lambda: mpjax.Fp8Recipe("mxfp8", capacity=float("inf")), ValueError, "finite"),
        (lambda: mpjax.Fp8Recipe("mxfp8", capacity="big"), TypeError, "must be a number"),
        (lambda: mpjax.Fp8Recipe.parse("mxfp8;capacity=lots"), ValueError, "capacity=F"),
        (
            lambda: mpjax.get_policy("p=f32,c=bf16,o=f32,fp8=rowwise;capacity=2"),
            ValueError,
            "rowwise",
        ),
    ],
)
def test_bad_capacities_are_refused_by_name(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_capacity_dot_refuses_what_it_cannot_run():
    x, w, sizes, _ = _operands()
    with pytest.raises(ValueError, match=r"capacity_dot\(recipe=...\).*'mxfp8'"):
        gc.capacity_dot(x, w, sizes, recipe="mxfp8", compute=BF16)
    with pytest.raises(ValueError, match="N=90 not a multiple of mxfp8's block of 32"):
        gc.capacity_dot(x, w[:, :, :90], sizes, recipe=MXFP8, compute=BF16)


def test_the_recipe_string_round_trips_with_a_capacity():
    recipe = mpjax.Fp8Recipe.parse("nvfp4;no_2d;capacity=1.5")
    assert (recipe.capacity, recipe.weight_blocks_2d) == (1.5, False)
    assert str(recipe) == "nvfp4;no_2d;capacity=1.5"
    assert mpjax.Fp8Recipe.parse(str(recipe)) == recipe
    policy = mpjax.get_policy(f"p=f32,c=bf16,o=f32,fp8={MXFP8}")
    assert policy.fp8.capacity == 1.25 and str(policy).endswith("fp8=mxfp8;capacity=1.25")


NO_B200 = mpjax.plan_unavailable("b200")


@pytest.mark.skipif(NO_B200 is not None, reason=f"the plan cannot compile: {NO_B200}")
def test_a_b200_plan_counts_the_slots_padding_against_the_work():
    """1024 rows over 8 experts at capacity 1.25: 160 slots each, rounded up to 256, so the
    batched GEMMs multiply twice the ragged dot's FLOPs, all three block-scaled."""
    x = jax.ShapeDtypeStruct((1024, 256), BF16)
    w = jax.ShapeDtypeStruct((8, 256, 512), F32)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

    def loss(x, w, sizes):
        out = gc.capacity_dot(x, w, sizes, recipe=MXFP8, compute=BF16)
        return jnp.sum(out.astype(F32) ** 2)

    plan = mpjax.plan(jax.grad(loss, (0, 1)), "b200")(x, w, sizes)
    assert [g.grouped for g in plan.gemms] == ["at_capacity"] * 3
    assert all(g.block_scaled for g in plan.gemms)
    assert {g.model_flops for g in plan.gemms} == {2 * 1024 * 256 * 512}
    assert {g.flops for g in plan.gemms} == {2 * 8 * 256 * 256 * 512}
    assert (
        "experts at a capacity: 3 batched GEMM runs, 1.61G FLOPs for 805M of work (every slot "
        "multiplied: 2.00x), 100.0% of them block-scaled" in plan.summary()
    )
