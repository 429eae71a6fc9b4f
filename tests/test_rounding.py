"""Rounding into narrow storage: stochastic rounding's unbiasedness against the binomial bound
(bfloat16 and float16, several binades, negatives, the smallest exponents), its two neighbours,
exact values, inf/NaN and saturation, reproducibility for a key (raw and typed keys, jit without
retrace), the carried rounding key, round_to, widen and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpjax.optim.rounding import (
    check_rounding,
    next_rounding_keys,
    round_to,
    rounding_key,
    stochastic_round,
    widen,
)

F32, BF16, F16 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

# (significand bits after the point, smallest normal exponent) of each target dtype.
FORMATS = {BF16: (7, -126), F16: (10, -14)}


def assert_bitwise_equal(x, y):
    assert jnp.result_type(x) == jnp.result_type(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def neighbours(x, dtype):
    """The ``dtype`` values just below and just above each float32 ``x`` (``lower == x`` when
    ``dtype`` holds ``x``), worked out in float64 from the format, independently of the code
    under test: the spacing around ``x`` is ``2 ** (exponent - mantissa bits)``, and never
    below the subnormals' spacing."""
    x = np.asarray(x, np.float64)
    mantissa, min_exp = FORMATS[dtype]
    exponent = np.floor(np.log2(np.maximum(np.abs(x), 2.0**min_exp)))
    spacing = 2.0 ** (exponent - mantissa)
    lower = np.floor(x / spacing) * spacing
    return lower, np.where(lower == x, x, lower + spacing), spacing


def test_neighbours_helper_agrees_with_casts():
    # The reference itself: both neighbours are dtype values and x lies between them.
    x = np.array([1.0 - 1e-4, -2.7, 1 / 3, 3e-8, 65500.0, 2.0**-126 * 1.3], np.float32)
    for dtype in (BF16, F16):
        lower, upper, _ = neighbours(x, dtype)
        finite = np.abs(x) < float(jnp.finfo(dtype).max)
        for bound in (lower, upper):
            cast = np.asarray(jnp.asarray(bound[finite], F32).astype(dtype).astype(F32), np.float64)
            np.testing.assert_array_equal(cast, bound[finite])
        assert np.all(lower <= x) and np.all(x <= upper)


def spread_values(dtype):
    """Values over many binades, of both signs, and near each format's edges."""
    rng = np.random.default_rng(0)
    mantissa, min_exp = FORMATS[dtype]
    max_exp = 14 if dtype == F16 else 100
    spread = rng.choice([-1.0, 1.0], 24) * 2.0 ** rng.uniform(min_exp, max_exp, 24)
    # Just above the smallest normal, where the spacing is tiny (for bfloat16 a float32
    # subnormal), and, for float16, among the subnormals themselves (float32 normals).
    smallest = 2.0**min_exp * np.array([1.3, 1.0001, 5.7, -2.2, 100.3])
    edges = [1.0 - 1e-4, 1.0 + 1e-4, -(1.0 - 1e-4), 1 / 3, -2.7, 1e-4 * 1.37]
    if dtype == F16:
        edges += [3e-8, 2.0**-24 * 1.3, -5e-7, 6.1e-5, 60000.5, -1000.1]
    return np.concatenate([spread, smallest, edges]).astype(np.float32)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_stochastic_rounding_is_unbiased(dtype):
    x = spread_values(dtype)
    n = 20_000
    r = stochastic_round(
        jnp.broadcast_to(jnp.asarray(x)[:, None], (len(x), n)), dtype, jax.random.key(1)
    )
    assert r.dtype == dtype
    got = np.asarray(r.astype(F32), np.float64)
    lower, upper, spacing = neighbours(x, dtype)
    assert np.all((got == lower[:, None]) | (got == upper[:, None]))
    p = (x.astype(np.float64) - lower) / spacing
    bound = 5 * spacing * np.sqrt(p * (1 - p) / n)
    error = np.abs(got.mean(axis=1) - x.astype(np.float64))
    assert np.all(error <= bound), list(
        zip(x[error > bound], error[error > bound], bound[error > bound])
    )
    # Not vacuous: most values sit well between their neighbours, and rounding to nearest
    # misses those by far more than the bound.
    between = (p > 0.05) & (p < 0.95)
    assert between.sum() > len(x) // 2
    nearest = np.asarray(jnp.asarray(x).astype(dtype).astype(F32), np.float64)
    assert np.all(np.abs(nearest - x)[between] > bound[between])


def test_mean_of_one_minus_1e4_in_bfloat16():
    # The motivating case: 1 - 1e-4 rounds to 1.0 to nearest; stochastic rounding averages to it.
    n = 20_000
    r = stochastic_round(jnp.full(n, 1.0 - 1e-4, F32), BF16, jax.random.key(0))
    values = set(np.asarray(r.astype(F32)).tolist())
    assert values == {0.99609375, 1.0}
    p = 1e-4 / 2.0**-8  # chance of the lower neighbour
    bound = 5 * 2.0**-8 * np.sqrt(p * (1 - p) / n)
    assert (
        abs(np.asarray(r.astype(F32), np.float64).mean() - np.float64(np.float32(1.0 - 1e-4)))
        < bound
    )


def test_bfloat16_smallest_exponents_round_up_and_down():
    # Near 2**-126 bfloat16's spacing (and x - lower) is a float32 subnormal, which XLA flushes
    # to zero on CPU: computed naively the probability is 0/0 and every value rounds down.
    x = np.array([2.0**-126 * (1 + 3 * 2.0**-10), -(2.0**-122) * (1 + 2.0**-8)], np.float32)
    p_upper = np.array([3 / 8, 1 / 2])  # (x - lower) / spacing, by construction
    n = 20_000
    r = stochastic_round(jnp.broadcast_to(jnp.asarray(x)[:, None], (2, n)), BF16, jax.random.key(3))
    got = np.asarray(r.astype(F32), np.float64)
    lower, upper, _ = neighbours(x, BF16)
    frac_upper = (got == upper[:, None]).mean(axis=1)
    np.testing.assert_array_less(
        np.abs(frac_upper - p_upper), 5 * np.sqrt(p_upper * (1 - p_upper) / n)
    )
    assert np.all((got == lower[:, None]) | (got == upper[:, None]))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_each_result_is_one_of_the_two_neighbours(dtype):
    rng = np.random.default_rng(1)
    top = 15 if dtype == F16 else 120
    x = (rng.choice([-1.0, 1.0], 4096) * 2.0 ** rng.uniform(-20, top, 4096)).astype(np.float32)
    lower, upper, _ = neighbours(x, dtype)
    for seed in range(3):
        got = np.asarray(stochastic_round(jnp.asarray(x), dtype, jax.random.key(seed)).astype(F32))
        assert np.all((got == lower) | (got == upper))
        assert np.any(got != np.asarray(jnp.asarray(x).astype(dtype).astype(F32)))  # not a cast


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_representable_values_come_back_unchanged_for_any_key(dtype):
    rng = np.random.default_rng(2)
    info = jnp.finfo(dtype)
    exact = jnp.asarray(rng.normal(size=1000) * 100).astype(dtype)
    specials = jnp.array(
        [0.0, -0.0, 1.0, -1.0, float(info.max), -float(info.max), float(info.smallest_normal)],
        dtype,
    )
    if dtype == F16:  # float16's subnormals are float32 normals
        specials = jnp.concatenate([specials, jnp.array([2.0**-24, -(2.0**-20)], dtype)])
    x = jnp.concatenate([exact, specials])
    for seed in range(5):
        got = stochastic_round(x.astype(F32), dtype, jax.random.key(seed))
        # Bit for bit: -0.0 keeps its sign.
        assert_bitwise_equal(got.view(np.uint16), x.view(np.uint16))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_inf_and_nan_stay_and_finite_values_beyond_max_saturate(dtype):
    big = float(jnp.finfo(dtype).max)
    f32_max = float(jnp.finfo(F32).max)
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, f32_max, -f32_max, big * 1.001, -big * 1.001], F32)
    for seed in range(3):
        got = np.asarray(stochastic_round(x, dtype, jax.random.key(seed)).astype(F32))
        np.testing.assert_array_equal(got, [np.inf, -np.inf, np.nan, big, -big, big, -big])


def test_float16_saturates_to_65504_where_rounding_to_nearest_gives_inf():
    x = jnp.array([70000.0, -70000.0, 65520.0, 1e30], F32)
    got = stochastic_round(x, F16, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(got), np.array([65504, -65504, 65504, 65504], F16))
    assert bool(jnp.all(jnp.isinf(x.astype(F16))))  # what a cast does


def test_a_dtype_at_least_as_wide_is_a_plain_cast():
    x = jnp.asarray(np.random.default_rng(3).normal(size=64), F32)
    assert_bitwise_equal(stochastic_round(x, F32, jax.random.key(0)), x)
    low = x.astype(BF16)
    assert_bitwise_equal(
        stochastic_round(low, "float32", jax.random.key(0)), x.astype(BF16).astype(F32)
    )
    half = x.astype(F16)
    assert_bitwise_equal(stochastic_round(half, BF16, jax.random.key(0)), half.astype(BF16))


def test_same_key_same_bits_other_key_other_bits():
    x = jnp.asarray(np.random.default_rng(4).normal(size=4096), F32)
    a = stochastic_round(x, BF16, jax.random.key(7))
    b = stochastic_round(x, BF16, jax.random.key(7))
    c = stochastic_round(x, BF16, jax.random.key(8))
    assert_bitwise_equal(a, b)
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_raw_key_data_and_typed_keys_round_alike():
    x = jnp.asarray(np.random.default_rng(5).normal(size=1024), F32)
    typed = stochastic_round(x, BF16, jax.random.key(0))
    assert_bitwise_equal(stochastic_round(x, BF16, jax.random.PRNGKey(0)), typed)
    assert_bitwise_equal(stochastic_round(x, BF16, rounding_key(0)), typed)
    assert_bitwise_equal(stochastic_round(x, BF16, rounding_key(jax.random.key(0))), typed)


def test_jit_with_a_new_key_does_not_retrace():
    traces = []

    @jax.jit
    def f(x, key):
        traces.append(1)
        return stochastic_round(x, BF16, key)

    x = jnp.full(256, 1.0 - 1e-4, F32)
    a = f(x, jax.random.key(0))
    b = f(x, jax.random.key(1))
    assert len(traces) == 1
    assert_bitwise_equal(a, stochastic_round(x, BF16, jax.random.key(0)))  # jit = eager
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    f(x, rounding_key(0))  # raw key data: one trace of its own, then none
    f(x, rounding_key(1))
    assert len(traces) == 2


def test_rounding_key_is_raw_uint32_data():
    key = rounding_key(0)
    assert key.dtype == np.uint32 and key.shape == (2,)
    assert_bitwise_equal(key, jax.random.key_data(jax.random.key(0)))
    assert_bitwise_equal(rounding_key(np.int64(5)), jax.random.key_data(jax.random.key(5)))
    assert_bitwise_equal(rounding_key(jax.random.key(3)), jax.random.key_data(jax.random.key(3)))
    assert_bitwise_equal(
        rounding_key(jax.random.PRNGKey(3)), jax.random.key_data(jax.random.key(3))
    )
    assert not np.array_equal(np.asarray(rounding_key(0)), np.asarray(rounding_key(1)))


def test_next_rounding_keys_advances_only_when_asked():
    key = rounding_key(0)
    nxt, keys = next_rounding_keys(key, 3)
    assert nxt.dtype == np.uint32 and nxt.shape == key.shape
    assert not np.array_equal(np.asarray(nxt), np.asarray(key))
    assert len(keys) == 3
    data = [np.asarray(jax.random.key_data(k)) for k in keys]
    assert len({d.tobytes() for d in data}) == 3  # three different leaf keys
    assert nxt.tobytes() not in {d.tobytes() for d in data}  # none is the carried key
    same, keys_again = next_rounding_keys(key, 3, advance=False)
    assert_bitwise_equal(same, key)
    for a, b in zip(keys, keys_again):
        assert_bitwise_equal(jax.random.key_data(a), jax.random.key_data(b))
    assert next_rounding_keys(key, 0)[1] == []

    @jax.jit
    def step(key, advance):
        return next_rounding_keys(key, 2, advance)[0]

    assert_bitwise_equal(step(key, jnp.array(True)), nxt)
    assert_bitwise_equal(step(key, jnp.array(False)), key)


def test_round_to():
    x = jnp.asarray(np.random.default_rng(6).normal(size=512), F32)
    assert_bitwise_equal(round_to(x, BF16, "nearest"), x.astype(BF16))
    assert_bitwise_equal(round_to(jnp.float32(1.0 - 1e-4), BF16, "nearest"), jnp.array(1.0, BF16))
    key = jax.random.key(2)
    assert_bitwise_equal(round_to(x, F16, "stochastic", key), stochastic_round(x, F16, key))
    with pytest.raises(ValueError, match=r"rounding must be one of \('nearest', 'stochastic'\)"):
        round_to(x, BF16, "up")
    with pytest.raises(ValueError, match="stochastic rounding needs a PRNG key, got key=None"):
        round_to(x, BF16, "stochastic")


def test_check_rounding():
    assert check_rounding("kahan", ("stochastic", "kahan"), "where") == "kahan"
    with pytest.raises(ValueError, match=r"where: rounding must be one of \('a', 'b'\), got 'c'"):
        check_rounding("c", ("a", "b"), "where")
    with pytest.raises(TypeError, match="where: rounding must be one of .* of type int"):
        check_rounding(1, ("a", "b"), "where")


def test_widen():
    tree = {
        "b": jnp.ones(2, BF16),
        "h": jnp.ones(2, F16),
        "f": jnp.ones(2, F32),
        "i": jnp.arange(2),
        "n": None,
    }
    wide = widen(tree)
    assert {k: v.dtype for k, v in wide.items() if v is not None} == {
        "b": F32,
        "h": F32,
        "f": F32,
        "i": np.dtype(jnp.int32),
    }
    assert wide["f"] is tree["f"] and wide["i"] is tree["i"] and wide["n"] is None
    x = jnp.asarray(np.random.default_rng(7).normal(size=64)).astype(BF16)
    assert_bitwise_equal(widen(x).astype(BF16), x)  # exact


def test_bad_input():
    key = jax.random.key(0)
    with pytest.raises(TypeError, match="stochastic_round: x must be a floating-point array"):
        stochastic_round(jnp.arange(3), BF16, key)
    with pytest.raises(TypeError, match="x must be a floating-point array.* of type list"):
        stochastic_round([1.0, 2.0], BF16, key)
    x = jnp.ones(3, F32)
    with pytest.raises(ValueError, match="dtype must be a floating-point dtype, got int8"):
        stochastic_round(x, jnp.int8, key)
    with pytest.raises(ValueError, match="dtype float8_e4m3fn is too narrow"):
        stochastic_round(x, jnp.float8_e4m3fn, key)
    with pytest.raises(ValueError, match="dtype float8_e5m2 is too narrow"):
        stochastic_round(x, "float8_e5m2", key)
    with pytest.raises(TypeError, match="dtype must be a floating dtype .* got None"):
        stochastic_round(x, None, key)
    with pytest.raises(ValueError, match="Unknown dtype name 'nope' for dtype"):
        stochastic_round(x, "nope", key)
    for seed, name in ((1.5, "float"), ("a", "str"), (True, "bool"), (np.bool_(True), "bool")):
        with pytest.raises(
            TypeError, match=f"seed must be an integer or a PRNG key.* of type {name}"
        ):
            rounding_key(seed)
    with pytest.raises(TypeError, match="seed must be an integer or a PRNG key"):
        rounding_key(jnp.zeros(2, jnp.int32))  # not uint32 key data


@pytest.mark.parametrize(
    "key, error, message",
    [
        (None, TypeError, r"key must be a PRNG key \(jax.random.key\(0\)\) .*got None"),
        (3, TypeError, r"key must be a PRNG key .*got 3 of type int"),
        ("k", TypeError, r"key must be a PRNG key .*got 'k' of type str"),
        (jnp.ones(2, F32), TypeError, r"key must be a PRNG key .*of type ArrayImpl"),
        (jax.random.split(jax.random.key(0), 3), ValueError, r"key must be one .*shape \(3,\)"),
        (jnp.zeros((3, 2), jnp.uint32), ValueError, r"key must be one PRNG key; raw .*\(3, 2\)"),
    ],
)
def test_stochastic_round_rejects_a_bad_key_naming_it(key, error, message):
    with pytest.raises(error, match=f"stochastic_round: {message}"):
        stochastic_round(jnp.ones(3, F32), BF16, key)


def test_stochastic_round_takes_typed_keys_and_raw_key_data_alike():
    x = jnp.full(64, 1.0 - 1e-4, F32)
    typed = stochastic_round(x, BF16, jax.random.key(3))
    raw = stochastic_round(x, BF16, jax.random.key_data(jax.random.key(3)))
    assert_bitwise_equal(typed, raw)


def test_a_seed_beyond_int64_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"seed must be a 64-bit signed integer, got 1180591"):
        rounding_key(2**70)
    assert rounding_key(2**63 - 1).dtype == np.uint32 and rounding_key(-(2**63)).shape == (2,)
