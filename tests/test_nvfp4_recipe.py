"""NVIDIA's NVFP4 training recipe: the random Hadamard transform against its definition,
stochastic rounding unbiased over many draws and the same for one key, 16 x 16 weight tiles
giving the forward and the input-gradient GEMM the same quantized weight, the key made from the
gradient when none is given, and the recipe's strings and policies."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpjax
from mpjax import block_scaled

DENSE = (((1,), (0,)), ((), ()))
SIGNS = (1, -1, -1, 1, 1, 1, -1, 1, -1, -1, 1, -1, 1, 1, -1, -1)


@pytest.fixture(autouse=True)
def _quiet_emulation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", block_scaled.EmulationWarning)
        yield


def normal(shape, seed, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# --- The random Hadamard transform ------------------------------------------------------------


def test_the_hadamard_matrix_is_sylvesters_with_the_sign_vector_and_orthogonal():
    i = np.arange(16)
    popcount = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    definition = (-1.0) ** popcount * np.array(SIGNS)[None, :] / 4.0
    matrix = block_scaled.hadamard_matrix(16)
    np.testing.assert_array_equal(matrix, definition)
    # Entries of +-1/4: the products and sums of the check are exact in float32.
    np.testing.assert_array_equal(matrix @ matrix.T, np.eye(16, dtype=np.float32))


def test_the_transform_is_the_matrix_on_each_run_of_16_exactly_for_small_integers():
    x = np.random.default_rng(0).integers(-64, 64, (3, 5, 64)).astype(np.float32)
    transformed = block_scaled.hadamard_transform(jnp.asarray(x, jnp.bfloat16))
    assert transformed.dtype == jnp.float32  # any input dtype: the transform is float32
    got = np.asarray(block_scaled.hadamard_transform(jnp.asarray(x)))
    runs = x.reshape(-1, 16).astype(np.float64)
    want = (runs @ block_scaled.hadamard_matrix(16).astype(np.float64).T).reshape(x.shape)
    np.testing.assert_array_equal(got, want)  # multiples of 1/4 below 2**24: exact


def test_transformed_operands_keep_their_product_and_spread_an_outlier():
    a, b = normal((8, 256), 1), normal((8, 256), 2)
    ta, tb = block_scaled.hadamard_transform(a), block_scaled.hadamard_transform(b)
    np.testing.assert_allclose(ta @ tb.T, a @ b.T, rtol=0, atol=1e-4 * 16)
    spike = jnp.zeros((1, 16)).at[0, 5].set(1000.0)  # one outlier in a block of 16
    np.testing.assert_array_equal(jnp.abs(block_scaled.hadamard_transform(spike)), 250.0)


# --- Stochastic rounding ---------------------------------------------------------------------


def _clipped(x, q):
    """What stochastic rounding averages to: ``x`` over its scales, clipped to the format's
    largest value (saturation is the one bias), times the scales."""
    fmt = block_scaled.NVFP4
    scales = np.repeat(np.asarray(q.scales.astype(jnp.float32)), fmt.block, -1)
    scales = scales * float(q.tensor_scale)
    return np.clip(np.asarray(x) / scales, -fmt.data_max, fmt.data_max) * scales, scales


def test_stochastic_rounding_is_unbiased_over_many_draws():
    x = normal((4, 64), 3, 300.0)  # values in the hundreds
    draws = 4096
    keys = jax.random.split(jax.random.key(0), draws)
    quantized = jax.jit(
        jax.vmap(lambda k: block_scaled.dequantize(block_scaled.quantize(x, "nvfp4", key=k)))
    )
    samples = np.asarray(quantized(keys), np.float64)
    target, scales = _clipped(x, block_scaled.quantize(x, "nvfp4"))
    # Each draw is one of two neighbours at most a step apart (2 at the top binade, times the
    # scales): its standard deviation is at most a step / 2; the mean of 4096 within 5 sigma.
    bound = 5 * (2.0 * scales / 2) / np.sqrt(draws)
    assert (np.abs(samples.mean(0) - target) <= bound).all()
    nearest = np.asarray(block_scaled.dequantize(block_scaled.quantize(x, "nvfp4")))
    assert np.abs(nearest - target).mean() > 10 * np.abs(samples.mean(0) - target).mean()
    # Every draw lands on a neighbour of the value: within one step of it.
    assert (np.abs(samples - target) <= 2.0 * scales + 1e-6).all()


def test_stochastic_rounding_is_the_same_for_one_key_and_keeps_representable_values():
    x = normal((8, 32), 4, 50.0)
    quantize = jax.jit(block_scaled.quantize, static_argnames="format")
    one = quantize(x, "nvfp4", key=jax.random.key(7))
    again = quantize(x, "nvfp4", key=jax.random.key(7))
    raw = quantize(x, "nvfp4", key=jax.random.PRNGKey(7))
    other = quantize(x, "nvfp4", key=jax.random.key(8))
    np.testing.assert_array_equal(one.data.view(np.uint8), again.data.view(np.uint8))
    np.testing.assert_array_equal(one.data.view(np.uint8), raw.data.view(np.uint8))
    assert (np.asarray(one.data.view(np.uint8)) != np.asarray(other.data.view(np.uint8))).any()
    grid = jnp.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4).reshape(2, 16)
    exact = quantize(grid, "nvfp4", key=jax.random.key(1))
    np.testing.assert_array_equal(exact.data.astype(jnp.float32), grid)  # scales 448 x 1/448
    # Non-finite values stay visible, as when rounding to nearest.
    bad = quantize(x.at[0, 0].set(jnp.inf), "nvfp4", key=jax.random.key(1))
    assert not np.isfinite(np.asarray(block_scaled.dequantize(bad))[0]).any()


def test_the_gradient_rounds_stochastically_unbiased_with_the_key_made_from_it():
    """With no key, each gradient makes its own: changing one element of the gradient (a new
    step) re-draws the rounding of all the others, and over such steps the input gradient
    averages to the unrounded gradient times the quantized weight."""
    x, w = normal((32, 64), 5), normal((64, 32), 6, 0.1)
    g0 = normal((32, 32), 7, 30.0)
    steps = 1024

    def input_gradient(g):
        _, vjp = jax.vjp(lambda a: block_scaled.dot_general(a, w, DENSE, "nvfp4"), x)
        return vjp(g)[0]

    gs = (
        jnp.broadcast_to(g0, (steps, 32, 32))
        .at[:, 0, 0]
        .set(jnp.arange(steps, dtype=jnp.float32) * 1e-3)
    )
    # lax.map, not vmap: jax 0.8.1 cannot batch a scaled matmul with one operand unbatched.
    samples = np.asarray(jax.jit(lambda gs: jax.lax.map(input_gradient, gs))(gs), np.float64)
    again = np.asarray(jax.jit(input_gradient)(gs[3]))
    np.testing.assert_array_equal(samples[3], again)  # one gradient, one rounding
    assert not np.array_equal(samples[3], samples[4])
    wq = np.asarray(block_scaled.dequantize(block_scaled.quantize_tiles(w.T)), np.float64)
    target, scales = _clipped(g0, block_scaled.quantize(g0, "nvfp4"))
    want = target[1:] @ wq  # rows past the first: their gradient never changed
    # Each product sums 32 draws, each off by at most a step / 2 in deviation, times |w|.
    sigma = np.sqrt(((2.0 * scales[1:] / 2) ** 2) @ (wq**2))
    assert (np.abs(samples[:, 1:].mean(0) - want) <= 5 * sigma / np.sqrt(steps) + 1e-4).all()


# --- 2D weight blocks --------------------------------------------------------------------------


def tiles_by_hand(w):
    """NVFP4 with one e4m3 scale per 16 x 16 tile, written out in numpy."""
    amax = np.float32(np.abs(w).max())
    tensor = np.float32(amax / np.float32(6 * 448))
    tiles = w.reshape(w.shape[0] // 16, 16, w.shape[1] // 16, 16)
    tile_amax = np.abs(tiles).max((1, 3), keepdims=True)
    scale = (tile_amax / np.float32(6) / tensor).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elements = np.clip(tiles / (scale * tensor), -6, 6).astype(ml_dtypes.float4_e2m1fn)
    return elements.astype(np.float32).reshape(w.shape), scale[:, 0, :, 0], tensor


def test_tiles_quantize_by_the_definition_and_transpose_to_the_same_values():
    w = np.asarray(normal((32, 64), 8)) * np.repeat(np.array([1.0, 50.0, 0.01, 3.0]), 16)[None, :]
    q = block_scaled.quantize_tiles(jnp.asarray(w))
    assert (q.data.dtype, q.scales.dtype, q.tensor_scale.dtype) == (
        jnp.float4_e2m1fn,
        jnp.float8_e4m3fn,
        jnp.float32,
    )
    elements, scale, tensor = tiles_by_hand(w)
    np.testing.assert_array_equal(np.asarray(q.data.astype(jnp.float32)), elements)
    np.testing.assert_array_equal(np.asarray(q.scales.astype(jnp.float32))[::16], scale)
    assert np.float32(q.tensor_scale) == tensor
    t = block_scaled.transpose_tiles(q)
    assert t.data.shape == (64, 32) and t.scales.shape == (64, 2)
    np.testing.assert_array_equal(block_scaled.dequantize(t), block_scaled.dequantize(q).T)


@pytest.mark.parametrize("tiles", [True, False])
def test_2d_blocks_give_the_forward_and_backward_gemms_the_same_quantized_weight(tiles):
    """Identity inputs read the weight back as each GEMM multiplied it: the forward's as
    ``I @ w``, the input gradient's as ``I @ w.T``. One-hot rows quantize exactly."""
    w = normal((64, 32), 9) * jnp.repeat(jnp.array([1.0, 40.0, 0.05, 7.0]), 16)[:, None]
    dot = lambda a, b: block_scaled.dot_general(a, b, DENSE, "nvfp4", weight_blocks_2d=tiles)  # noqa: E731

    @jax.jit
    def both(w):
        _, vjp = jax.vjp(lambda a: dot(a, w), jnp.ones((32, 64)))
        return dot(jnp.eye(64), w), vjp(jnp.eye(32))[0].T

    forward, backward = both(w)
    if tiles:
        np.testing.assert_array_equal(forward, backward)
    else:  # blocks of 16 along K forward, along N backward: two quantizations of w
        assert not np.array_equal(forward, backward)


# --- Strings, policies and the engine ----------------------------------------------------------


def test_the_recipe_is_nvfp4s_default_and_each_ingredient_turns_off_by_name():
    full = mpjax.Fp8Recipe("nvfp4")
    assert (full.hadamard, full.stochastic_rounding, full.weight_blocks_2d) == (True,) * 3
    assert str(full) == "nvfp4" and mpjax.Fp8Recipe.parse("nvfp4") == full
    ablation = mpjax.Fp8Recipe.parse("nvfp4;no_hadamard")
    assert (
        ablation == mpjax.Fp8Recipe("nvfp4", hadamard=False)
        and str(ablation) == "nvfp4;no_hadamard"
    )
    plain = mpjax.Fp8Recipe.parse("nvfp4;plain")
    assert plain == mpjax.Fp8Recipe.parse("nvfp4;no_hadamard;no_stochastic_rounding;no_2d")
    assert str(plain) == "nvfp4;plain"
    assert repr(mpjax.Fp8Recipe("mxfp8")) == (
        "Fp8Recipe(scaling='mxfp8', history=1024, margin=0, batched=False)"
    )
    policy = mpjax.get_policy("p=f32,c=bf16,o=f32,fp8=nvfp4;no_2d")
    assert policy.fp8 == mpjax.Fp8Recipe("nvfp4", weight_blocks_2d=False)
    assert mpjax.get_policy(str(policy)) == policy
    assert mpjax.MIXED_BFLOAT16_NVFP4.fp8 == full


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: mpjax.Fp8Recipe("mxfp8", hadamard=True), ValueError, "scaling 'mxfp8' takes none"),
        (lambda: mpjax.Fp8Recipe("current", weight_blocks_2d=False), ValueError, "takes none"),
        (lambda: mpjax.Fp8Recipe("nvfp4", hadamard="yes"), TypeError, "True, False or None"),
        (lambda: mpjax.Fp8Recipe.parse("mxfp8;no_2d"), ValueError, "for nvfp4 alone no_hadamard"),
        (lambda: mpjax.get_policy("mixed_bfloat16,fp8=nvfp4;no_rht"), ValueError, "no_rht"),
    ],
)
def test_recipe_flags_off_nvfp4_are_errors_naming_the_choices(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    "spec",
    ["nvfp4", "nvfp4;no_hadamard", "nvfp4;no_stochastic_rounding", "nvfp4;no_2d", "nvfp4;plain"],
)
def test_autocast_runs_each_variant_as_the_call_with_its_flags(spec):
    """Bit for bit: the engine hands the policy's ingredients to the block-scaled matmul."""
    recipe = mpjax.Fp8Recipe.parse(spec)
    x, w = normal((32, 64), 10, 20.0), normal((64, 48), 11, 0.1)
    policy = mpjax.get_policy(f"p=f32,c=f32,o=f32,fp8={spec}")
    flags = {n: getattr(recipe, n) for n in ("hadamard", "stochastic_rounding", "weight_blocks_2d")}

    def loss(dot):
        return lambda x, w: jnp.sum(jnp.sin(dot(x, w)))

    by_policy = jax.jit(jax.grad(loss(mpjax.autocast(jnp.matmul, policy)), (0, 1)))(x, w)
    by_hand = jax.jit(
        jax.grad(loss(lambda a, b: block_scaled.dot_general(a, b, DENSE, "nvfp4", **flags)), (0, 1))
    )(x, w)
    for got, want in zip(by_policy, by_hand):
        np.testing.assert_array_equal(got, want)


# --- Which blocks stay bf16 ---------------------------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32)(nn.gelu(nn.Dense(32)(x)))


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = Block()(x)
        return nn.Dense(16, name="head")(x)


def test_linen_edge_blocks_stay_bf16_and_describe_shows_each_modules_format():
    x = normal((32, 32), 12)
    variables = Stack().init(jax.random.key(0), x)
    assert mpjax.layer_stack(variables).blocks == ("Block_0", "Block_1", "Block_2", "Block_3")
    kept = mpjax.edge_block_rules(variables, first=1, last=1)
    assert [key.pattern for key in kept] == ["Block_0(?:[/.].*)?", "Block_3(?:[/.].*)?"]
    rules = mpjax.Rules({**kept, "head": "mixed_bfloat16"}, default="mixed_bfloat16_nvfp4")
    report = mpjax.describe(mpjax.linen.apply_policy(Stack(), rules), variables=variables)(x)
    formats = {row.path: set(dict(row.matmuls)) for row in report.rows if row.matmuls}
    for path, found in formats.items():
        narrow = path.split("/")[0] in ("Block_1", "Block_2")
        want = "float4_e2m1fn,float4_e2m1fn@nvfp4" if narrow else "bf16,bf16"
        assert found == {want}, (path, found)
    assert len(formats) == 9


def test_the_stack_is_found_in_nnx_and_equinox_paths():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(8, 8, 16, depth=3, key=jax.random.key(0))
    stack = mpjax.layer_stack(mpjax.equinox.module_paths(mlp))
    assert stack == mpjax.LayerStack("layers[]", tuple(f"layers[{i}]" for i in range(4)))
    paths = ["embed", "blocks/0", "blocks/0/attn", "blocks/0/Dense_1", "blocks/1", "blocks/2"]
    (key,) = mpjax.edge_block_rules(paths, first=0, last=1)
    assert key.fullmatch("blocks/2") and key.fullmatch("blocks/2/attn")
    assert not key.fullmatch("blocks/20") and not key.fullmatch("blocks/1")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: mpjax.edge_block_rules(["h0", "h1"], 1, 1),
            ValueError,
            "keeps every one of the 2",
        ),
        (lambda: mpjax.edge_block_rules(["h0", "h1", "h2"], -1), ValueError, "0 or more; got -1"),
        (lambda: mpjax.edge_block_rules(["h0", "h1", "h2"], 1.0), TypeError, "must be an int"),
        (lambda: mpjax.layer_stack(["embed", "head"]), ValueError, "no stack of blocks"),
        (lambda: mpjax.layer_stack("h0"), TypeError, "takes module paths"),
        (
            lambda: mpjax.edge_block_rules(["h0", "h1", "h2"], policy="mixed_bf16"),
            ValueError,
            r"edge_block_rules\(policy=...\)",
        ),
    ],
)
def test_bad_edge_block_calls_name_what_is_wrong(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- Sharded tensors ----------------------------------------------------------------------------


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (the suite fakes 8 CPUs)")
def test_a_shard_quantizes_as_its_part_of_the_whole_tensor():
    """Under shard_map the tensor scale comes from the amax of the whole tensor, all-reduced
    over the axes it is sharded over: each shard's NVFP4 values, block scales and tensor scale
    are those of its rows of the whole tensor, bit for bit."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("data",))
    x = normal((64, 32), 13).at[5, 3].set(900.0)  # the amax on the first device only
    whole = block_scaled.quantize(x, "nvfp4")

    def local(x):
        assert mpjax.jax_compat.varying_axes(x) == ("data",)  # read off the type, per version
        q = block_scaled.quantize(x, "nvfp4")
        return q.data.view(jnp.uint8), q.scales.view(jnp.uint8), q.tensor_scale[None]

    spec = jax.sharding.PartitionSpec("data")
    run = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec))
    data, scales, tensor = jax.jit(run)(x)
    np.testing.assert_array_equal(data, whole.data.view(jnp.uint8))
    np.testing.assert_array_equal(scales, whole.scales.view(jnp.uint8))
    np.testing.assert_array_equal(tensor, np.full(4, whole.tensor_scale))
    assert mpjax.jax_compat.varying_axes(x) == ()  # outside a shard_map: none
