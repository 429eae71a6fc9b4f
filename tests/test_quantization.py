"""Blockwise quantization: bitsandbytes' dynamic maps (pinned values, size, monotonicity) and
torchao's 4-bit maps, the layout (blocks along the last axis, 4-bit packing, absmax shape),
rounding to nearest against a reference, the round-trip error bound each map implies,
stochastic rounding (between the two neighbours, unbiased), sharding, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax import (
    QUANT_FORMATS,
    QuantFormat,
    QuantizedArray,
    create_dynamic_map,
    dequantize_blockwise,
    quantize_blockwise,
)

F32 = np.float32


def ulps(a, b):
    """Distance between float32 values in units in the last place."""
    return np.abs(
        np.asarray(a, F32).view(np.int32).astype(np.int64) - np.asarray(b, F32).view(np.int32)
    )


def scaled_blocks(shape, seed=0):
    """Normal values whose rows span magnitudes from 1e-6 to 1, a row's negative extreme in
    some rows, so blocks of every scale and sign are exercised."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape)
    scale = 10.0 ** jax.random.uniform(k2, shape[:-1] + (1,), minval=-6, maxval=0)
    return np.array(x * scale, F32)


# ---------------------------------------------------------------------------------------------
# Maps


def test_dynamic_map_is_bitsandbytes_construction():
    signed, unsigned = create_dynamic_map(True), create_dynamic_map(False)
    for m in (signed, unsigned):
        assert m.dtype == F32 and m.shape == (256,)
        assert np.all(np.diff(m) > 0)
        assert m[-1] == 1.0
    # Signed: 0 in the middle, the first decade's single value 5.5e-7 on either side of it, the
    # top decade's 64 midpoints of linspace(0.1, 1, 65) ending at 1 - 0.45 / 64, and no -1.
    assert signed[127] == 0.0
    np.testing.assert_array_equal(signed[[128, 126]], F32([5.5e-7, -5.5e-7]))
    np.testing.assert_array_equal(signed[[0, 254]], F32([-0.99296875, 0.99296875]))
    np.testing.assert_array_equal(signed[[191, 192]], F32([0.10703125, 0.12109375]))
    assert np.all(signed[128:255] == -signed[126::-1])
    # Unsigned: the sign bit doubles each decade's values; the first is 0, then 3.25e-7.
    np.testing.assert_array_equal(unsigned[:3], F32([0.0, 3.25e-7, 7.75e-7]))
    np.testing.assert_array_equal(unsigned[-2], F32(1 - 0.45 / 128))
    # Entries bitsandbytes computes with float32 torch.linspace (torch 2.13 on x86), each
    # within two float32 ulps of these (each one float32 product, an ulp from float64).
    torch_values = {
        (True, 128): 5.5000004e-07,
        (True, 131): 2.1249998e-05,
        (True, 163): 0.02265625,
        (True, 236): 0.7398437,
        (False, 1): 3.2500003e-07,
        (False, 100): 0.06273438,
        (False, 200): 0.61679685,
    }
    for (is_signed, i), value in torch_values.items():
        m = signed if is_signed else unsigned
        assert ulps(m[i], value) <= 2, (is_signed, i, m[i], value)


def test_four_bit_maps_are_torchaos():
    fmt = QUANT_FORMATS["dynamic4"]
    assert fmt.bits == 4 and fmt.block_size == 128
    np.testing.assert_array_equal(fmt.map(True), create_dynamic_map(True, 3, 4))
    expected = [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0]
    expected += [0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]
    np.testing.assert_allclose(fmt.map(True), expected, rtol=2**-23)
    np.testing.assert_array_equal(fmt.map(False), np.arange(1, 17, dtype=F32) / 16)  # no zero
    assert QUANT_FORMATS["dynamic8"].bits == 8 and QUANT_FORMATS["dynamic8"].block_size == 256
    np.testing.assert_array_equal(QUANT_FORMATS["dynamic8"].map(False), create_dynamic_map(False))
    e4m3 = QUANT_FORMATS["e4m3"].map(True)
    assert e4m3.size == 253 and e4m3[-1] == 1.0 and e4m3[0] == -1.0 and 0.0 in e4m3


# ---------------------------------------------------------------------------------------------
# Layout and rounding to nearest


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic8", "dynamic4"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_nearest_codes_match_a_reference(name, signed):
    fmt = QUANT_FORMATS[name]
    x = scaled_blocks((4, 3, 512))
    if not signed:
        x = np.abs(x)
    q = quantize_blockwise(x, name, signed=signed)
    assert isinstance(q, QuantizedArray) and q.shape == x.shape
    assert q.codes.dtype == np.uint8 and q.absmax.dtype == F32
    block = fmt.block_size
    assert q.absmax.shape == (4, 3, 512 // block)
    assert q.codes.shape == ((4, 3, 512) if fmt.bits == 8 else (4, 3, 256))
    # The reference: the absmax of each run of `block` along the last axis, and the index of
    # the nearest map entry to each value divided by it, in float64.
    blocks = x.reshape(4, 3, -1, block).astype(np.float64)
    absmax = np.abs(blocks).max(-1)
    np.testing.assert_array_equal(np.asarray(q.absmax), absmax.astype(F32))
    v = (x.reshape(4, 3, -1, block) / absmax.astype(F32)[..., None]).reshape(-1)
    m = fmt.map(signed).astype(np.float64)
    codes = np.argmin(np.abs(v[:, None].astype(np.float64) - m[None, :]), axis=1).astype(np.uint8)
    if not signed:  # a positive value takes at least the smallest positive entry, never 0
        codes = np.where((v > 0) & (m[codes] <= 0), np.argmax(m > 0), codes).astype(np.uint8)
    codes = codes.reshape(x.shape)
    if fmt.bits == 4:  # two a byte, the first in the high nibble
        codes = (codes[..., 0::2] << 4) | codes[..., 1::2]
    np.testing.assert_array_equal(np.asarray(q.codes), codes)


def _bound(fmt, signed, absmax):
    """The largest error of rounding to nearest a value of a block with ``absmax``: half the
    widest gap between map entries, or the distance from an end of the range a value can take
    ([-1, 1] signed, [0, 1] unsigned) to the map's entry there, or (unsigned: a positive value
    never becomes 0) the smallest positive entry; plus two float32 roundings (the division by
    absmax, the product with it)."""
    m = fmt.map(signed).astype(np.float64)
    low = -1.0 if signed else 0.0
    gap = max(np.max(np.diff(m)) / 2, m[0] - low, 1.0 - m[-1], m[m > 0][0] if not signed else 0)
    return absmax * (gap + 2**-23)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic8", "dynamic4"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_round_trip_error_is_bounded_by_the_maps_widest_gap(name, signed):
    fmt = QUANT_FORMATS[name]
    x = scaled_blocks((16, 1024), seed=1)
    if not signed:
        x = np.abs(x)
    x[0, 0] = -np.abs(x[0, :256]).max() * 1.5 if signed else x[0, 0]  # a negative extreme
    q = quantize_blockwise(x, name, signed=signed)
    error = np.abs(np.asarray(dequantize_blockwise(q), np.float64) - x)
    absmax = np.repeat(np.asarray(q.absmax, np.float64), fmt.block_size, axis=-1)
    bound = _bound(fmt, signed, absmax)
    assert np.all(error <= bound)
    # The bound is tight: the worst element comes within a tenth of it.
    assert np.max(error / bound) > 0.9 if name == "dynamic4" else np.max(error / bound) > 0.5
    assert q.dequantize().dtype == F32


def test_e4m3_round_trip_error_is_half_an_e4m3_ulp_of_the_scaled_value():
    x = scaled_blocks((16, 1024), seed=2)
    q = quantize_blockwise(x, "e4m3")
    assert q.codes.dtype == np.uint8 and q.codes.shape == x.shape
    scale = np.repeat(np.asarray(q.absmax, np.float64) / 448, 256, axis=-1)
    error = np.abs(np.asarray(q.dequantize(), np.float64) - x)
    # Three mantissa bits: half an ulp is 2**-4 of the value, 2**-10 below the normals.
    bound = scale * np.maximum(np.abs(x) / scale * 2**-4, 2**-10) + np.abs(x) * 2**-22
    assert np.all(error <= bound)
    # The codes are the float8 bit patterns of x / (absmax / 448), rounded to nearest even.
    expected = (x / (np.asarray(q.absmax) / F32(448)).repeat(256, -1)).astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.codes), expected.view(np.uint8))
    # The block's largest magnitude is e4m3's largest, 448.
    assert np.all(np.abs(np.asarray(q.codes).view(jnp.float8_e4m3fn).astype(F32)).max(-1) == 448)


@pytest.mark.slow
def test_zero_blocks_and_negative_extremes():
    zeros = quantize_blockwise(jnp.zeros((2, 256)), "dynamic8")
    np.testing.assert_array_equal(np.asarray(zeros.absmax), np.zeros((2, 1)))
    np.testing.assert_array_equal(np.asarray(zeros.dequantize()), np.zeros((2, 256)))
    z4 = quantize_blockwise(jnp.zeros(128), "dynamic4", signed=False)  # the map has no zero
    np.testing.assert_array_equal(np.asarray(z4.dequantize()), np.zeros(128))
    # bitsandbytes' signed map ends at -0.99296875: a block's negative extreme comes back 0.7%
    # smaller; its positive extreme exactly.
    x = jnp.zeros((2, 256)).at[0, 0].set(-2.0).at[1, 0].set(2.0)
    back = np.asarray(quantize_blockwise(x, "dynamic8").dequantize())
    assert back[0, 0] == F32(-0.99296875) * 2 and back[1, 0] == 2.0


@pytest.mark.parametrize("name", ["dynamic8", "e4m3", "dynamic4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_unsigned_map_never_makes_a_positive_value_zero(name, rounding):
    # A second moment that became 0 under a first moment that did not would make Adam's update
    # the first moment over epsilon: the unsigned map keeps positive values above 0.
    x = jnp.zeros((64, 256)).at[:, 0].set(1.0).at[:, 1].set(1e-12)
    q = quantize_blockwise(x, name, signed=False, rounding=rounding, key=jax.random.key(0))
    back = np.asarray(q.dequantize())
    unsigned_map = QUANT_FORMATS[name].map(False)
    smallest = unsigned_map[unsigned_map > 0][0]
    assert np.all(back[:, 1] > 0) and np.allclose(back[:, 1], smallest, rtol=2**-20)
    assert np.all(back[:, 0] == 1.0)
    if name != "dynamic4":  # exact zeros stay 0 (the 4-bit unsigned map has no 0: x 0 = 0)
        assert np.all(back[:, 2:] == 0.0)
    signed = np.asarray(
        quantize_blockwise(x, name, rounding=rounding, key=jax.random.key(0)).dequantize()
    )
    assert np.all(signed[:, 1] == 0.0)  # a signed map rounds it to 0, as bitsandbytes does


# ---------------------------------------------------------------------------------------------
# Stochastic rounding


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic8", "e4m3", "dynamic4"])
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(name):
    fmt = QUANT_FORMATS[name]
    block = fmt.block_size
    value = 0.3  # between two entries of every map
    x = jnp.full((512, block), value).at[:, 0].set(1.0)  # absmax 1 in every block
    q = quantize_blockwise(x, name, rounding="stochastic", key=jax.random.key(0))
    back = np.asarray(q.dequantize())[:, 1:].ravel()
    grid = fmt.map(True).astype(np.float64)
    lower, upper = grid[grid <= value].max(), grid[grid > value].min()
    # Each value one of the two neighbours (e4m3's times absmax / 448, rounded once).
    assert np.all(
        np.isclose(back, lower, rtol=2**-22, atol=0) | np.isclose(back, upper, rtol=2**-22, atol=0)
    )
    assert np.any(back < value) and np.any(back > value)
    p = (value - lower) / (upper - lower)
    sigma = (upper - lower) * np.sqrt(p * (1 - p) / back.size)
    assert abs(back.mean(dtype=np.float64) - value) < 5 * sigma
    # Deterministic given the key; a raw key works alike; another key rounds otherwise.
    again = quantize_blockwise(x, name, rounding="stochastic", key=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(q.codes))
    other = quantize_blockwise(x, name, rounding="stochastic", key=jax.random.key(1))
    assert not np.array_equal(np.asarray(other.codes), np.asarray(q.codes))
    # A value the map holds exactly is kept, whatever the key.
    exact = quantize_blockwise(
        jnp.ones((2, block)), name, rounding="stochastic", key=jax.random.key(3)
    )
    np.testing.assert_array_equal(np.asarray(exact.dequantize()), np.ones((2, block)))


# ---------------------------------------------------------------------------------------------
# Sharding


@pytest.mark.parametrize("name", ["dynamic8", "e4m3", "dynamic4"])
def test_sharded_along_the_leading_axis_quantizes_bit_for_bit_alike(name):
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    x = scaled_blocks((64, 512), seed=4)
    quantize = jax.jit(lambda x, key: quantize_blockwise(x, name, rounding="stochastic", key=key))
    q = quantize(jax.device_put(x, sharding), jax.random.key(5))
    expected = quantize(x, jax.random.key(5))
    # Whole blocks on each device: the codes and the absmaxes are sharded like the array.
    assert q.codes.sharding.is_equivalent_to(sharding, 2)
    assert q.absmax.sharding.is_equivalent_to(sharding, 2)
    for a, b in ((q.codes, expected.codes), (q.absmax, expected.absmax)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Compiled alike (XLA may turn e4m3's division by 448 into a product with its reciprocal).
    dequantize = jax.jit(dequantize_blockwise)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), np.asarray(dequantize(expected)))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", ["dynamic8", "e4m3", "dynamic4"])
def test_finding_the_code_runs_no_loop(name, rounding):
    # A loop hides its work from XLA's TPU cost model (which then estimates no step time for
    # a train step that quantizes its state) and runs its iterations one after another. The
    # random draws of stochastic rounding may lower to loops of their own on a CPU.
    x, key = scaled_blocks((8, 512), seed=6), jax.random.key(7)

    def loops(fn):
        return jax.jit(fn).lower(x, key).as_text().count("stablehlo.while")

    draws = loops(lambda x, key: jax.random.uniform(key, x.shape)) if rounding != "nearest" else 0
    assert loops(lambda x, key: quantize_blockwise(x, name, rounding=rounding, key=key)) == draws


def critical_values(grid, lo=-1.0, hi=1.0):
    """Where a code changes: each entry and midpoint of ``grid`` and the float32 values on
    either side of them, with random values between; normal float32 only (XLA's CPU backend
    treats subnormal inputs as zero, numpy does not)."""
    midpoints = (grid[:-1] + grid[1:]) / F32(2)
    points = np.concatenate([grid, midpoints])
    rng = np.random.default_rng(0)
    y = np.concatenate(
        [
            points,
            np.nextafter(points, F32(np.inf)),
            np.nextafter(points, F32(-np.inf)),
            rng.uniform(lo, hi, 20000),
            np.sign(rng.normal(size=20000)) * hi * 10 ** rng.uniform(-9, 0, 20000),
        ]
    ).astype(F32)
    y = np.clip(y, F32(lo), F32(hi))
    return y[(y == 0) | (np.abs(y) >= np.finfo(F32).tiny)]


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_8bit_dynamic_maps_are_computed_to_the_tables_entries_and_searches(signed):
    """The 8-bit dynamic maps decode a code by arithmetic and find a value's code from its
    decade and fraction: the table's entries bit for bit, and the codes its search finds
    (nearest, and the entry below for stochastic rounding), at every midpoint and entry and
    the float32 values either side of them."""
    from mpjax.optim import quantization as q

    grid = create_dynamic_map(signed)
    computed = q._computed_map(grid)
    assert computed is not None and computed.signed is signed
    np.testing.assert_array_equal(jax.jit(computed.decode)(jnp.arange(256, dtype=jnp.int32)), grid)
    y = jnp.asarray(critical_values(grid))
    midpoints = (grid[:-1] + grid[1:]) / F32(2)
    nearest = jax.jit(computed.nearest)(y)
    np.testing.assert_array_equal(nearest, q._search_by_bisection(midpoints, y))
    below = nearest - (y < grid[nearest]).astype(jnp.int32)
    np.testing.assert_array_equal(
        jnp.clip(below, 0, 254), jnp.clip(q._search_by_bisection(grid, y) - 1, 0, 254)
    )
    # Other maps (the 4-bit ones, a map of one's own) search their table.
    assert q._computed_map(create_dynamic_map(signed, 3, 4)) is None
    assert q._computed_map(np.linspace(-1, 1, 256, dtype=F32)) is None


def test_the_8bit_dynamic_map_entries_are_one_float32_product_each():
    """Entry k of a decade of n is the float32 product of the integer 2n + 18k + 9 and the
    decade's constant 10 ** (i - 6) / (20n), within an ulp of the float64 construction."""
    signed = create_dynamic_map(True)
    top = (2 * 64 + 18 * np.arange(64) + 9).astype(F32) * F32(1 / (20 * 64))
    np.testing.assert_array_equal(signed[191:255], top)
    float64 = np.linspace(0.1, 1, 65)
    assert ulps(signed[191:255], ((float64[:-1] + float64[1:]) / 2).astype(F32)).max() <= 1


def test_stochastic_e4m3_steps_from_the_nearest_value_to_the_neighbours_a_search_finds():
    """Stochastic rounding to e4m3 takes the value below ``y`` and the one above from e4m3's
    own nearest by a step of the bit pattern: the two a search of every e4m3 value finds, at
    every e4m3 value and midpoint and either side of them, and at +-448."""
    from mpjax.optim import quantization as q

    grid = q._e4m3_values()
    y = critical_values(grid, -448.0, 448.0)
    lower = np.clip(np.asarray(q._search_by_bisection(grid, jnp.asarray(y))) - 1, 0, grid.size - 2)
    low, high = grid[lower], grid[lower + 1]
    p_upper = np.clip((y - low) / (high - low), 0, 1)
    for u in (0.0, 0.5, np.nextafter(F32(1), F32(0))):
        expected = np.where(F32(u) < p_upper, high, low)
        got = jax.jit(q._round_e4m3)(jnp.asarray(y), jnp.full(y.shape, u, jnp.float32))
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", ["dynamic8", "e4m3"])
def test_8bit_formats_read_no_table(name, rounding):
    """The 8-bit formats gather from no table, quantizing or dequantizing: codes are computed,
    so a TPU (where a gather per element costs the table's bytes) runs passes over the array."""
    x = jnp.ones((4, 256))

    def round_trip(x):
        q = quantize_blockwise(x, name, rounding=rounding, key=jax.random.key(0))
        return dequantize_blockwise(q)

    text = str(jax.make_jaxpr(round_trip)(x))
    assert "gather" not in text and "platform_index" not in text


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_tpu_search_and_lookup_of_a_table_give_the_integers_and_values_of_the_others(signed):
    """Maps that are not computed (the 4-bit ones, one's own) are searched: on a TPU by
    comparing with every entry and read by selecting among all of them, elsewhere by a
    bisection and a gather. The same codes and values either way, so a state quantized on one
    platform is the state on another."""
    from mpjax.optim import quantization as q

    own = np.sort(np.concatenate([np.linspace(-1, 1, 255), [0.001]])).astype(F32)
    for grid in (QUANT_FORMATS["dynamic4"].map(signed), own):
        midpoints = (grid[:-1] + grid[1:]) / F32(2)
        y = jnp.asarray(critical_values(grid))
        for entries in (grid, midpoints):
            found = q._search_by_comparison(entries, y)
            np.testing.assert_array_equal(found, q._search_by_bisection(entries, y))
        index = jnp.arange(grid.size, dtype=jnp.int32)
        np.testing.assert_array_equal(
            q._lookup_by_selection(grid, index), q._lookup_by_gather(grid, index)
        )


_TPU = mpjax.plan_unavailable("v5p")


@pytest.mark.slow
@pytest.mark.skipif(_TPU is not None, reason=f"the plan cannot compile for a TPU: {_TPU}")
@pytest.mark.parametrize("name", ["dynamic8", "e4m3", "dynamic4"])
def test_on_a_tpu_a_round_trip_costs_a_few_passes_over_the_array(name):
    """XLA's estimate for a v5p of quantizing (stochastically: the search and two lookups)
    and dequantizing a 1024 x 4096 array, against scaling it: the comparisons and selections
    fuse into passes over the array, where a gather per element cost a v5p as much as 800."""
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.float32)

    def round_trip(x):
        key = jax.random.key(0)
        return dequantize_blockwise(quantize_blockwise(x, name, rounding="stochastic", key=key))

    scaled = mpjax.plan(lambda x: x * 2, "v5p")(x).estimated_seconds
    trip = mpjax.plan(round_trip, "v5p")(x).estimated_seconds
    assert trip < 40 * scaled, (trip, scaled)
    if name != "dynamic4":
        # Computed codes: rounding stochastically (finding the entries below and above, and a
        # draw) costs little more than to nearest. Searching the 8-bit table cost 2.3x.
        def nearest_trip(x):
            return dequantize_blockwise(quantize_blockwise(x, name))

        nearest = mpjax.plan(nearest_trip, "v5p")(x).estimated_seconds
        assert trip < 1.25 * nearest, (trip, nearest)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input():
    with pytest.raises(
        ValueError, match=r"format must be one of \('dynamic8', 'e4m3', 'dynamic4'\)"
    ):
        quantize_blockwise(jnp.ones(256), "int8")
    with pytest.raises(ValueError, match="block_size must be a positive power of two .* got 96"):
        quantize_blockwise(jnp.ones(192), block_size=96)
    with pytest.raises(ValueError, match="block_size must be a positive power of two .* got 0"):
        quantize_blockwise(jnp.ones(192), block_size=0)
    with pytest.raises(
        TypeError, match="block_size must be a positive power of two .* of type float"
    ):
        quantize_blockwise(jnp.ones(256), block_size=256.0)
    with pytest.raises(
        ValueError,
        match=r"shape \(3, 100\) cannot be quantized: its last axis, 100, is not a multiple of block_size 256",
    ):
        quantize_blockwise(jnp.ones((3, 100)))
    with pytest.raises(ValueError, match="a scalar has no axis"):
        quantize_blockwise(jnp.float32(1.0))
    with pytest.raises(ValueError, match="stochastic rounding needs a PRNG key"):
        quantize_blockwise(jnp.ones(256), rounding="stochastic")
    with pytest.raises(ValueError, match="rounding must be one of"):
        quantize_blockwise(jnp.ones(256), rounding="up")
    with pytest.raises(TypeError, match="x must be a floating-point array, got int32"):
        quantize_blockwise(jnp.ones(256, jnp.int32))
    with pytest.raises(TypeError, match="q must be a QuantizedArray, got ArrayImpl"):
        dequantize_blockwise(jnp.ones(3))
    # User maps: checked when the format is made.
    good = np.linspace(-1, 1, 16)
    assert QuantFormat("lin4", good, block_size=64).bits == 4
    with pytest.raises(
        ValueError,
        match=r"signed_map must be strictly increasing .* entry 3 \(.*\) is not above entry 2",
    ):
        QuantFormat("bad", good[[0, 1, 2, 2, *range(4, 16)]])
    with pytest.raises(ValueError, match=r"signed_map must be strictly increasing"):
        QuantFormat("bad", good[::-1])
    with pytest.raises(
        ValueError,
        match=r"must hold 256 values \(8-bit codes\) or 16 \(4-bit codes\), got shape \(10,\)",
    ):
        QuantFormat("bad", np.linspace(-1, 1, 10))
    with pytest.raises(ValueError, match=r"unsigned_map must lie in \[-1, 1\]"):
        QuantFormat("bad", good, good * 2)
    with pytest.raises(ValueError, match="signed_map has 16 values and unsigned_map 256"):
        QuantFormat("bad", good, create_dynamic_map(False))
    with pytest.raises(ValueError, match="QuantFormat block_size must be a positive power of two"):
        QuantFormat("bad", good, block_size=100)
    with pytest.raises(ValueError, match="total_bits must be 4 or 8, got 6"):
        create_dynamic_map(True, 3, 6)
