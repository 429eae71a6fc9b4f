"""fp8 matmuls: saturating quantization, scales that follow amax, matmul error within the
e4m3/e5m2 bounds, the scaled-dequantization pattern on every dot of the HLO (forward and
backward) for autocast, linen and NNX, and policies that carry the recipe."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from tolerances import tolerance

import mpjax
from mpjax import fp8, jax_compat

E4M3, E5M2 = fp8.E4M3, fp8.E5M2
DENSE = (((1,), (0,)), ((), ()))
# Half a unit in the last place, relative, for normal numbers: 3 and 2 mantissa bits.
UNIT_ROUNDOFF = {E4M3: 2.0**-4, E5M2: 2.0**-3}
# Half the subnormal spacing (absolute, before scaling): 2**-9 / 2 and 2**-16 / 2.
SUBNORMAL_HALF_STEP = {E4M3: 2.0**-10, E5M2: 2.0**-17}


def normal(shape, seed, scale=1.0, dtype=jnp.float32):
    return (scale * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def quantization_bound(x, dtype):
    """The most an element of ``x`` moves under current-scaling quantization to ``dtype``."""
    scale = np.float32(fp8.current_scale(x, dtype))
    x = np.abs(np.asarray(x, np.float64))
    return np.maximum(UNIT_ROUNDOFF[dtype] * x, SUBNORMAL_HALF_STEP[dtype] * scale)


def dot_bound(x, w, dx, dw):
    """Worst-case error of ``x @ w`` when every element of x and w moves by at most dx, dw."""
    x, w = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    return dx @ w + x @ dw + dx @ dw


# --- Quantization -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_finite_values_and_keeps_non_finite_ones(dtype):
    top = float(jnp.finfo(dtype).max)
    x = jnp.array([3 * top, -3 * top, top, 1.0, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    q = np.asarray(fp8.quantize(x, dtype, jnp.float32(1.0)).astype(jnp.float32))
    np.testing.assert_array_equal(q[:4], [top, -top, top, 1.0])
    assert not np.isfinite(q[4:]).any()
    # What a plain cast does instead: NaN (e4m3 has no inf) or inf.
    assert not np.isfinite(np.asarray(x[:1].astype(dtype).astype(jnp.float32))).any()


def test_current_scale_maps_amax_to_the_fp8_maximum():
    x = jnp.array([[-896.0, 3.0], [1.0, 0.5]])
    assert float(fp8.current_scale(x, E4M3)) == 2.0
    assert fp8.current_scale(x.astype(jnp.bfloat16), E4M3).dtype == jnp.float32
    assert float(fp8.current_scale(x, E5M2)) == 896.0 / 57344.0
    assert float(fp8.current_scale(x, E4M3, margin=2)) == 8.0
    assert float(fp8.current_scale(jnp.zeros(3), E4M3)) == 1.0
    assert float(fp8.current_scale(jnp.array([1.0, jnp.inf]), E4M3)) == 1.0
    assert float(fp8.current_scale(jnp.array([jnp.nan]), E4M3)) == 1.0


@pytest.mark.parametrize("exponent", [-20, -3, 0, 7, 30])
def test_scales_follow_amax(exponent):
    """Scaling the input by a power of two scales its scale alike and leaves the fp8 values
    unchanged, whatever its magnitude: the largest element always lands on ±448."""
    x = normal((64,), 0)
    y = x * 2.0**exponent
    scale_x, scale_y = fp8.current_scale(x, E4M3), fp8.current_scale(y, E4M3)
    assert float(scale_y) == float(scale_x) * 2.0**exponent
    qx, qy = fp8.quantize(x, E4M3, scale_x), fp8.quantize(y, E4M3, scale_y)
    np.testing.assert_array_equal(qx.astype(jnp.float32), qy.astype(jnp.float32))
    assert float(jnp.max(jnp.abs(qy.astype(jnp.float32)))) == 448.0


# --- The fp8 matmul -----------------------------------------------------------------------


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_fp8_matmul_is_within_the_e4m3_error_of_f32(magnitude):
    x, w = normal((32, 128), 1, magnitude), normal((128, 16), 2)
    out = np.asarray(fp8.dot_general(x, w, DENSE), np.float64)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    bound = dot_bound(x, w, quantization_bound(x, E4M3), quantization_bound(w, E4M3))
    err = np.abs(out - exact)
    assert (err <= bound * (1 + 1e-5) + 1e-6 * np.abs(exact)).all()
    # Not vacuous: the rounding is visible, and well inside the bound on average.
    assert err.max() > 0 and err.mean() < 0.25 * bound.mean()


def test_fp8_matmul_gradients_are_e5m2_times_e4m3_matmuls():
    """Under grad the cotangent is quantized to e5m2 and both backward matmuls use the
    quantized forward operands: the gradients equal those matmuls computed by hand."""
    x, w, g = normal((16, 64), 3), normal((64, 8), 4), normal((16, 8), 5, 1e-4)
    _, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, DENSE), x, w)
    dx, dw = vjp(g)

    def qdq(v, dtype):
        scale = fp8.current_scale(v, dtype)
        return fp8.dequantize(fp8.quantize(v, dtype, scale), jnp.float32, scale)

    qx, qw, qg = (np.asarray(qdq(v, d), np.float64) for v, d in ((x, E4M3), (w, E4M3), (g, E5M2)))
    # The fp8 products are exact in f32; only the f32 sums round, in an order that depends on
    # the machine.
    for got, a, b in ((dx, qg, qw.T), (dw, qx.T, qg)):
        bound = tolerance(np.float32, a.shape[1]) * (np.abs(a) @ np.abs(b))
        assert (np.abs(np.asarray(got, np.float64) - a @ b) <= bound).all()
    # And within the e5m2 x e4m3 bound of the exact gradient.
    exact = np.asarray(g, np.float64) @ np.asarray(w, np.float64).T
    bound = dot_bound(g, w.T, quantization_bound(g, E5M2), quantization_bound(w, E4M3).T)
    assert (np.abs(np.asarray(dx, np.float64) - exact) <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_fp8_matmul_returns_the_compute_dtype_forward_and_backward(dtype):
    x, w = normal((8, 32), 6, dtype=dtype), normal((32, 4), 7, dtype=dtype)
    out = jax.jit(fp8.dot_general, static_argnums=2)(x, w, DENSE)
    grad = jax.grad(lambda x, w: fp8.dot_general(x, w, DENSE).sum(), argnums=(0, 1))
    dx, dw = jax.jit(grad)(x, w)
    assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype


def test_fp8_matmul_rejects_a_compute_dtype_it_cannot_dequantize_into():
    x = jnp.ones((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32; got int32"):
        fp8.dot_general(x, x, DENSE)


def test_overflow_stays_visible_forward_and_backward():
    x, w = normal((4, 16), 8), normal((16, 4), 9)
    assert not np.isfinite(fp8.dot_general(x.at[0, 0].set(jnp.inf), w, DENSE)).all()
    _, vjp = jax.vjp(lambda x: fp8.dot_general(x, w, DENSE), x)
    (dx,) = vjp(jnp.ones((4, 4)).at[1, 1].set(jnp.inf))
    assert not np.isfinite(dx).all()
    # A huge but finite value sets the scale: the result stays finite.
    big = fp8.dot_general(x.at[0, 0].set(1e30), w, DENSE)
    assert np.isfinite(big).all() and float(jnp.max(jnp.abs(big))) > 1e29


# --- Recipes and policies -----------------------------------------------------------------


def test_recipe_round_trips_through_its_string():
    for recipe in (fp8.Fp8Recipe(), fp8.Fp8Recipe(margin=3), fp8.Fp8Recipe(batched=True)):
        assert fp8.Fp8Recipe.parse(str(recipe)) == recipe


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"scaling": "sometimes"}, ValueError, r"scaling=\.\.\.\) must be one of 'current'"),
        ({"margin": -1}, ValueError, "margin=...\\) must be from 0 to 16; got -1"),
        ({"margin": 1.5}, TypeError, "margin=...\\) must be an int"),
        ({"margin": True}, TypeError, "margin=...\\) must be an int"),
        ({"batched": "yes"}, TypeError, "batched=...\\) must be True or False"),
    ],
)
def test_recipe_rejects_bad_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        fp8.Fp8Recipe(**kwargs)


@pytest.mark.parametrize("text", ["current;margin=x", "current;fast", "current;margin"])
def test_recipe_parse_names_the_bad_option(text):
    with pytest.raises(ValueError, match="Unknown fp8 option"):
        fp8.Fp8Recipe.parse(text)


def test_policies_carry_the_recipe_through_strings_presets_and_replacement():
    policy = mpjax.get_policy("mixed_bfloat16_fp8")
    assert policy == mpjax.MIXED_BFLOAT16.with_fp8("current")
    assert str(policy) == "p=f32,c=bf16,o=f32,fp8=current"
    assert mpjax.get_policy(str(policy)) == policy
    custom = mpjax.get_policy("c=bf16, fp8=current;margin=1;batched")
    assert custom.fp8 == fp8.Fp8Recipe(margin=1, batched=True)
    assert mpjax.get_policy(str(custom)) == custom
    assert policy.with_fp8(None) == mpjax.MIXED_BFLOAT16
    assert "fp8='current'" in repr(policy)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("p=f32,c=bf16,fp8=sometimes", "scaling=...\\) must be one of"),
        ("p=f32,fp8=current,fp8=current", "Duplicate key 'fp8'"),
        ("p=f32,c=f64,fp8=current", "bfloat16, float16 or float32; got float64"),
        (
            "p=f32,fp9=current",
            "Valid keys: p, params, c, compute, o, output, r, reduce, d, dispatch, fp8",
        ),
    ],
)
def test_bad_fp8_policy_strings_say_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        mpjax.get_policy(spec)


def test_policy_rejects_a_non_recipe_fp8():
    with pytest.raises(TypeError, match="fp8 must be an mpjax.Fp8Recipe or its string form"):
        mpjax.Policy("f32", "bf16", "f32", fp8=8)


def test_a_policy_with_fp8_does_not_silently_become_a_jmp_policy():
    with pytest.raises(ValueError, match="policy.with_fp8\\(None\\).to_jmp\\(\\)"):
        mpjax.get_policy("mixed_bfloat16_fp8").to_jmp()


# --- Where the policies apply: autocast, linen, NNX ---------------------------------------


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(64)(x))
        h = nn.LayerNorm()(h)
        scores = jnp.einsum("bqd,bkd->bqk", h, h)  # batched, like attention
        h = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), h)
        return nn.Dense(8, name="head")(h)


def linen_setup():
    x = normal((2, 8, 16), 10)
    params = jax.jit(Mlp().init)(jax.random.key(0), x)["params"]
    return x, params


def assert_fp8_dots(report, fp8_count, other_count):
    """``fp8_count`` dots on e4m3/e5m2 operands (accumulating in f32, scaled after);
    ``other_count`` others."""
    kinds = [(d.lhs.fp8, d.rhs.fp8) for d in report if d.fp8]
    assert len(kinds) == fp8_count, str(report)
    assert sum(not d.fp8 for d in report) == other_count, str(report)
    # Forward dots are e4m3 x e4m3; every backward dot takes the e5m2 gradient.
    assert set(kinds) <= {("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}
    # Direct fp8 GEMMs write f32 (scaled after); where this JAX's XLA cannot take two fp8
    # types in a dot, the backward GEMMs are written dequantized, in bf16.
    assert all(d.out_dtype == ("f32" if d.direct else "bf16") for d in report if d.fp8)
    backward_direct = {d.direct for d in report if d.fp8 and "f8e5m2" in (d.lhs.fp8, d.rhs.fp8)}
    assert backward_direct <= {jax_compat.mixed_fp8_dots()}


def test_autocast_runs_unbatched_matmuls_in_fp8_forward_and_backward():
    x, params = linen_setup()
    fn = mpjax.autocast(lambda p, x: Mlp().apply({"params": p}, x), "mixed_bfloat16_fp8")

    def loss(p, x):
        return jnp.mean(fn(p, x) ** 2)

    # Two dense layers: 2 forward and 3 backward matmuls (no input gradient of the first);
    # the two batched einsums and their 4 backward matmuls stay bf16.
    assert_fp8_dots(mpjax.hlo_dots(jax.grad(loss))(params, x), 5, 6)
    rows = {(r.scope, r.primitive, r.category) for r in mpjax.describe(fn)(params, x)}
    assert ("Mlp/head", "dot_general", "fp8") in rows
    assert ("Mlp/bqd,bkd->bqk", "dot_general", "lower") in rows  # the einsums


def test_a_batched_recipe_also_runs_the_batched_matmuls_in_fp8():
    x, params = linen_setup()
    policy = "p=f32,c=bf16,o=f32,fp8=current;batched"
    fn = mpjax.autocast(lambda p, x: Mlp().apply({"params": p}, x), policy)
    assert_fp8_dots(mpjax.hlo_dots(jax.grad(lambda p: jnp.mean(fn(p, x) ** 2)))(params), 11, 0)


def test_linen_rules_choose_which_modules_run_in_fp8():
    x, params = linen_setup()
    rules = mpjax.Rules({"head": "mixed_bfloat16"}, default="mixed_bfloat16_fp8")
    model = mpjax.linen.apply_policy(Mlp(), rules)
    created = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    assert jax.tree.map(lambda a: a.dtype, created) == jax.tree.map(lambda a: a.dtype, params)

    def loss(p):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    # Dense_0: forward and weight gradient in fp8; the head and the einsums in bf16.
    assert_fp8_dots(mpjax.hlo_dots(jax.grad(loss))(params), 2, 9)
    grads = jax.eval_shape(jax.grad(loss), params)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.head = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(nnx.gelu(self.up(x))))


def test_nnx_models_run_their_matmuls_in_fp8():
    model = NnxMlp(nnx.Rngs(0))
    mpjax.nnx.set_policy(model, "mixed_bfloat16_fp8")
    x = normal((4, 16), 11)

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    graph, state = nnx.split(model)

    def loss_of_state(state, x):
        return loss(nnx.merge(graph, state), x)

    assert_fp8_dots(mpjax.hlo_dots(jax.grad(loss_of_state))(state, x), 5, 0)
    grads = jax.eval_shape(jax.grad(loss_of_state), state, x)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_full_precision_regions_never_run_in_fp8():
    x, params = linen_setup()

    def fn(p, x):
        with mpjax.full_precision():
            return Mlp().apply({"params": p}, x)

    report = mpjax.hlo_dots(mpjax.autocast(fn, "mixed_bfloat16_fp8"))(params, x)
    assert not any(d.fp8 for d in report) and {d.out_dtype for d in report} == {"f32"}


class ScannedBlocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        class Layer(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return h + nn.Dense(h.shape[-1])(nn.LayerNorm()(h)), None

        layers = nn.scan(
            nn.remat(Layer),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        return layers()(x, None)[0]


def test_fp8_under_scan_over_layers_and_remat():
    x = normal((4, 32), 12)
    model = mpjax.linen.apply_policy(ScannedBlocks(), "mixed_bfloat16_fp8")
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    report = mpjax.hlo_dots(jax.grad(loss))(params)
    assert report and all(d.fp8 for d in report), str(report)
    # Inside the loop: the scanned layer's dots are in the while body, not the entry.
    assert any(not d.computation.startswith("main") for d in report), str(report)
    grads = jax.jit(jax.grad(loss))(params)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_fp8_under_sharding_matches_the_unsharded_step():
    """Sharded (data-parallel batch, FSDP-style kernels), the fp8 gradients stay closer to the
    unsharded fp8 gradients than fp8 is to bf16: partial sums are added in another order, and
    a value that moves by one bf16 ulp can round to the neighbouring fp8 value, nothing more.
    test_fp8_scales_are_global_under_sharding checks the scales exactly."""
    x = normal((8, 1, 16), 13)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def grads(policy, sharded):
        model = mpjax.linen.apply_policy(Mlp(), policy)
        params = model.init(jax.random.key(0), x)["params"]

        def loss(p, x):
            return jnp.mean(model.apply({"params": p}, x) ** 2)

        if not sharded:
            return jax.jit(jax.grad(loss))(params, x)
        kernels = jax.tree.map(
            lambda a: (
                jax.device_put(
                    a, NamedSharding(mesh, PartitionSpec(*[None] * (a.ndim - 1), "data"))
                )
                if a.shape[-1] % 8 == 0
                else a
            ),
            params,
        )
        batch = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
        return jax.jit(jax.grad(loss))(kernels, batch)

    expected, got = grads("mixed_bfloat16_fp8", False), grads("mixed_bfloat16_fp8", True)
    bf16 = grads("mixed_bfloat16", False)
    for e, g, b in zip(*map(jax.tree.leaves, (expected, got, bf16))):
        assert float(jnp.linalg.norm(g - e)) <= float(jnp.linalg.norm(b - e)) + 1e-7


def test_fp8_scales_are_global_under_sharding():
    """Each shard quantizes with the amax of the whole tensor: sharded, the matmul multiplies
    the fp8 values of the unsharded one, and only the order of its f32 sums may differ. A
    per-shard amax would quantize the small rows finely instead, far outside that bound."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    # Rows of very different magnitudes, one on each device.
    x = normal((8, 16), 18) * (4.0 ** jnp.arange(8.0))[:, None]
    w = normal((16, 64), 19)
    matmul = jax.jit(lambda x, w: fp8.dot_general(x, w, DENSE))
    got = matmul(
        jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))),
        jax.device_put(w, NamedSharding(mesh, PartitionSpec(None, "data"))),
    )

    def fp8_values(v, scale):
        """``v`` quantized to e4m3 with ``scale`` and scaled back, exactly (in float64)."""
        q = fp8.quantize(v, E4M3, scale).astype(jnp.float32)
        return np.asarray(q, np.float64) * np.asarray(scale, np.float64)

    qx, qw = fp8_values(x, fp8.current_scale(x, E4M3)), fp8_values(w, fp8.current_scale(w, E4M3))
    # The products of fp8 values are exact in f32; the 16-term sums and the scaling round.
    bound = tolerance(np.float32, 16) * (np.abs(qx) @ np.abs(qw))
    for out in (got, matmul(x, w)):
        assert (np.abs(np.asarray(out, np.float64) - qx @ qw) <= bound).all()
    # What each shard holds: a row of x, a block of 8 columns of w.
    row_scales = jax.vmap(lambda row: fp8.current_scale(row, E4M3))(x)[:, None]
    blocks = w.reshape(16, 8, 8)
    block_scales = jax.vmap(lambda b: fp8.current_scale(b, E4M3), in_axes=1)(blocks)
    per_shard = fp8_values(x, row_scales) @ fp8_values(w, jnp.repeat(block_scales, 8)[None])
    assert (np.abs(per_shard - qx @ qw) > bound).any()


@pytest.mark.slow
def test_a_model_trains_under_fp8_like_under_bf16():
    """A regression MLP reaches nearly the same loss under fp8 as under mixed bf16."""
    x = normal((256, 16), 14)
    target = jnp.sin(x @ normal((16, 8), 15))

    def train(policy):
        model = mpjax.linen.apply_policy(Mlp(), policy)
        params = model.init(jax.random.key(1), x[:, None])["params"]
        tx = optax.adam(3e-3)
        state = tx.init(params)

        @jax.jit
        def step(params, state):
            def loss(p):
                out = model.apply({"params": p}, x[:, None])[:, 0]
                return jnp.mean((out.astype(jnp.float32) - target) ** 2)

            value, grads = jax.value_and_grad(loss)(params)
            with jax.numpy_dtype_promotion("standard"):
                updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        losses = []
        for _ in range(150):
            params, state, value = step(params, state)
            losses.append(float(value))
        return losses

    bf16, f8 = train("mixed_bfloat16"), train("mixed_bfloat16_fp8")
    assert f8[-1] < 0.25 * f8[0]
    assert abs(f8[-1] - bf16[-1]) < 0.1 * bf16[-1]
    assert f8 != bf16  # fp8 really ran


# --- hlo_dots on hand-written HLO patterns ------------------------------------------------


def test_hlo_dots_tells_fp8_dequantized_and_plain_operands_apart():
    x, w = normal((4, 16), 16, dtype=jnp.bfloat16), normal((16, 8), 17, dtype=jnp.bfloat16)

    def unscaled(x, w):
        return x.astype(E4M3).astype(jnp.bfloat16) @ w

    (dot,) = mpjax.hlo_dots(unscaled)(x, w)
    assert dot.lhs == mpjax.HloOperand("bf16", "f8e4m3fn", False)
    assert dot.rhs == mpjax.HloOperand("bf16", None, False)
    assert not dot.fp8

    def transposed(x, w):
        scale = jnp.float32(2.0)
        qw = fp8.dequantize(fp8.quantize(w.T, E4M3, scale), jnp.bfloat16, scale)
        qx = fp8.dequantize(fp8.quantize(x, E4M3, scale), jnp.bfloat16, scale)
        return qx @ qw.T.reshape(16, 8)

    (dot,) = mpjax.hlo_dots(transposed)(x, w)
    assert dot.fp8 and not dot.direct, str(mpjax.hlo_dots(transposed)(x, w))
    assert dot.lhs == mpjax.HloOperand("bf16", "f8e4m3fn", True)

    def direct(x, w):
        return jax.lax.dot_general(
            x.astype(E4M3), w.astype(E5M2), DENSE, preferred_element_type=jnp.float32
        )

    (dot,) = mpjax.hlo_dots(direct)(x, w)
    assert dot.fp8 and dot.direct
    assert (dot.lhs, dot.rhs) == (
        mpjax.HloOperand("f8e4m3fn", "f8e4m3fn", False),
        mpjax.HloOperand("f8e5m2", "f8e5m2", False),
    )


# --- Delayed scaling (explicit state) -----------------------------------------------------


def delayed_grads(x, w, meta, g):
    """Gradients of x, w and the state for an upstream gradient ``g``."""
    out, vjp = jax.vjp(lambda x, w, m: fp8.delayed_dot_general(x, w, DENSE, m), x, w, meta)
    return out, *vjp(g)


def test_delayed_history_and_scales_update_exactly():
    meta = fp8.init_meta(3)
    amaxes = []
    for step in range(5):
        x, w = normal((4, 16), 20 + step, 2.0**step), normal((16, 8), 30 + step)
        g = normal((4, 8), 40 + step, 1e-3)
        _, _, _, meta = delayed_grads(x, w, meta, g)
        amaxes.append([float(jnp.max(jnp.abs(a))) for a in (x, w, g)])
        newest_first = amaxes[::-1][:3] + [[0.0] * 3] * max(0, 3 - len(amaxes))
        np.testing.assert_array_equal(meta.amax_history, np.float32(newest_first))
        largest = np.max(np.float32(newest_first), axis=0)
        np.testing.assert_array_equal(meta.scale, largest / np.float32([448, 448, 57344]))


def test_delayed_scaling_quantizes_with_the_previous_steps_scales():
    meta = fp8.Fp8Meta(jnp.array([0.5, 0.25, 1e-4]), jnp.zeros((4, 3)))
    x, w, g = normal((4, 16), 1, 10.0), normal((16, 8), 2), normal((4, 8), 3, 1e-2)
    out, dx, _, _ = delayed_grads(x, w, meta, g)

    def qdq(v, dtype, scale):
        scale = jnp.float32(scale)
        return fp8.dequantize(fp8.quantize(v, dtype, scale), jnp.float32, scale)

    qx, qw, qg = qdq(x, E4M3, 0.5), qdq(w, E4M3, 0.25), qdq(g, E5M2, 1e-4)
    # The same products, summed in f32 in an order of XLA's choosing.
    for got, a, b in ((out, qx, qw), (dx, qg, qw.T)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        bound = tolerance(np.float32, a.shape[1]) * (np.abs(a) @ np.abs(b))
        assert (np.abs(np.asarray(got, np.float64) - a @ b) <= bound).all()


def test_a_stale_scale_saturates_instead_of_overflowing():
    """The first step's scale of 1 meets an input up to 1000: it saturates at 448 (a plain
    e4m3 cast would give NaN), and the next state has the scale that fits."""
    x = jnp.array([[1000.0, -2.0]])
    w = jnp.eye(2)
    out, _, _, meta = delayed_grads(x, w, fp8.init_meta(4), jnp.ones((1, 2)))
    np.testing.assert_array_equal(out, [[448.0, -2.0]])
    assert float(meta.scale[0]) == np.float32(1000.0) / np.float32(448.0)


def test_an_overflowing_gradient_leaves_its_state_alone():
    meta = fp8.next_meta(fp8.init_meta(2), jnp.array([1.0, 2.0, 3.0]))
    x, w = normal((2, 4), 4), normal((4, 2), 5)
    _, dx, _, new = delayed_grads(x, w, meta, jnp.ones((2, 2)).at[0, 0].set(jnp.inf))
    assert not np.isfinite(dx).all()  # the overflow still reaches loss scaling
    assert float(new.scale[2]) == float(meta.scale[2])
    np.testing.assert_array_equal(new.amax_history[:, 2], meta.amax_history[:, 2])
    assert float(new.amax_history[0, 0]) == float(jnp.max(jnp.abs(x)))  # the others move on


def stacked_model(params, metas, x, remat=False):
    """Layers under lax.scan, each with its own stacked slice of the state."""

    def layer(h, p_and_meta):
        w, meta = p_and_meta
        return jnp.tanh(fp8.delayed_dot_general(h, w, DENSE, meta)), None

    layer = jax.checkpoint(layer) if remat else layer
    return jnp.mean(jax.lax.scan(layer, x, (params, metas))[0] ** 2)


def test_delayed_scaling_under_scan_and_remat_matches_a_python_loop():
    params = normal((3, 16, 16), 6, 0.3)
    metas = jax.tree.map(lambda a: jnp.stack([a] * 3), fp8.init_meta(4))
    metas = jax.vmap(lambda m, k: fp8.next_meta(m, k))(metas, 1.0 + jnp.arange(9.0).reshape(3, 3))
    x = normal((4, 16), 7)

    def looped(params, metas, x):
        h = x
        for i in range(3):
            meta = jax.tree.map(lambda a, i=i: a[i], metas)
            h = jnp.tanh(fp8.delayed_dot_general(h, params[i], DENSE, meta))
        return jnp.mean(h**2)

    expected = jax.jit(jax.grad(looped, argnums=(0, 1)))(params, metas, x)
    for remat in (False, True):
        got = jax.jit(jax.grad(stacked_model, argnums=(0, 1)), static_argnums=3)(
            params, metas, x, remat
        )
        for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=0)
    new_metas = expected[1]
    assert new_metas.amax_history.shape == (3, 4, 3) and (new_metas.amax_history[:, 0] > 0).all()
    dots = mpjax.hlo_dots(jax.grad(stacked_model, argnums=(0, 1)))(params, metas, x)
    assert dots and all(d.fp8 for d in dots), str(dots)


def delayed_training(params):
    """Adam on the scanned model: a jitted step and the initial optimizer state; the
    gradient of the fp8 state is the next state."""
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, metas, opt_state, i):
        x = jax.random.normal(jax.random.fold_in(jax.random.key(9), i), (4, 16))
        grads, metas = jax.grad(stacked_model, argnums=(0, 1))(params, metas, x)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), metas, opt_state

    return step, opt_state


def test_delayed_state_checkpoint_resume_is_bit_identical():
    import flax.serialization

    params = normal((3, 16, 16), 8, 0.3)
    metas = jax.tree.map(lambda a: jnp.stack([a] * 3), fp8.init_meta(4))
    step, opt_state = delayed_training(params)
    straight = (params, metas, opt_state)
    saved = None
    for i in range(6):
        straight = step(*straight, i)
        if i == 2:
            saved = flax.serialization.to_bytes(straight)
    assert step._cache_size() == 1  # the state is arrays: no retrace from step to step
    restored = flax.serialization.from_bytes(straight, saved)
    for i in range(3, 6):
        restored = step(*restored, i)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_delayed_state_inputs_are_checked():
    with pytest.raises(TypeError, match="takes an mpjax.fp8.Fp8Meta"):
        fp8.delayed_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DENSE, {"scale": 1.0})
    with pytest.raises(ValueError, match="must be at least 1; got 0"):
        fp8.init_meta(0)
    with pytest.raises(TypeError, match="must be an int"):
        fp8.init_meta(2.5)
    with pytest.raises(ValueError, match="margin"):
        fp8.delayed_dot_general(
            jnp.ones((2, 2)), jnp.ones((2, 2)), DENSE, fp8.init_meta(), margin=-2
        )


# --- Delayed scaling through policies: autocast, linen, NNX -------------------------------

DELAYED = "p=f32,c=bf16,o=f32,fp8=delayed;history=4"


def test_delayed_recipes_parse_and_round_trip():
    policy = mpjax.get_policy(DELAYED)
    assert policy.fp8 == fp8.Fp8Recipe("delayed", history=4)
    assert mpjax.get_policy(str(policy)) == policy
    with pytest.raises(ValueError, match=r"history=\.\.\.\) must be an int, at least 1"):
        fp8.Fp8Recipe("delayed", history=0)


def scanned_layers(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, x, ws)[0] @ ws[0]


def test_autocast_delayed_state_is_stacked_per_scan_and_updated_by_grad():
    f = mpjax.autocast(scanned_layers, DELAYED)
    ws, x = normal((3, 16, 16), 21, 0.3), normal((4, 16), 22)
    state = mpjax.fp8_state(f)(ws, x)
    assert jax.tree.map(jnp.shape, state) == {
        "[scan0]/#0": fp8.Fp8Meta((3, 3), (3, 4, 3)),
        "#0": fp8.Fp8Meta((3,), (4, 3)),
    }

    def loss(ws, state):
        return jnp.sum(mpjax.with_fp8_state(f, state)(ws, x))

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    grads, new = step(ws, state)
    # The last matmul: this step's amaxes of its bf16 operands and of the gradient (ones).
    head = new["#0"].amax_history[0]
    assert float(head[1]) == float(jnp.max(jnp.abs(ws[0].astype(jnp.bfloat16))))
    assert float(head[2]) == 1.0 and 0 < float(head[0]) <= 1.0  # tanh's output
    first = new["[scan0]/#0"].amax_history[0, 0]
    assert float(first[0]) == float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))))
    # A second step rolls the history and takes its scales from it.
    _, newer = step(ws, new)
    np.testing.assert_array_equal(newer["#0"].amax_history[1], new["#0"].amax_history[0])
    assert step._cache_size() == 1
    dots = mpjax.hlo_dots(jax.grad(loss, argnums=(0, 1)))(ws, state)
    assert dots and all(d.fp8 for d in dots), str(dots)


def test_autocast_delayed_without_state_says_how_to_get_it():
    f = mpjax.autocast(lambda w, x: x @ w, DELAYED)
    with pytest.raises(ValueError, match=r"mpjax.fp8_state\(fn\)\(\*args\)"):
        f(jnp.ones((4, 2)), jnp.ones((2, 4)))
    with pytest.raises(TypeError, match="takes a function made by mpjax.autocast"):
        mpjax.fp8_state(lambda x: x)
    with pytest.raises(TypeError, match="state must be the mapping"):
        mpjax.with_fp8_state(f, [1, 2])


def test_a_state_made_for_another_model_is_refused_naming_the_matmul():
    f = mpjax.autocast(lambda w, x: x @ w, DELAYED)
    g = mpjax.autocast(lambda w, x: x @ w, "p=f32,c=bf16,o=f32,fp8=delayed;history=8")
    state = mpjax.fp8_state(g)(jnp.ones((4, 2)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"matmul '#0'.*history 4"):
        mpjax.with_fp8_state(f, state)(jnp.ones((4, 2)), jnp.ones((2, 4)))


def test_matmuls_in_a_cond_fall_back_to_current_scaling_with_a_warning():
    def fn(w, x):
        return jax.lax.cond(x.sum() > 0, lambda: x @ w, lambda: x @ w.T)

    f = mpjax.autocast(fn, DELAYED)
    w, x = normal((8, 8), 23), normal((2, 8), 24)
    with pytest.warns(mpjax.AutocastWarning, match="runs with current scaling instead"):
        state = mpjax.fp8_state(f)(w, x)
    assert state == {}
    dots = mpjax.hlo_dots(mpjax.with_fp8_state(f, state))(w, x)
    assert len(dots) == 2 and all(d.fp8 for d in dots)


def test_linen_init_creates_the_fp8_collection_and_apply_carries_it():
    model = mpjax.linen.apply_policy(ScannedBlocks(), DELAYED)
    x = normal((4, 32), 25)
    variables = model.init(jax.random.key(0), x)
    fp8_state = variables[mpjax.linen.FP8_COLLECTION]
    assert jax.tree.map(jnp.shape, fp8_state) == {
        "[scan0]/ScanCheckpointLayer_0/Dense_0#0": fp8.Fp8Meta((3, 3), (3, 4, 3))
    }
    with pytest.raises(ValueError, match="the 'fp8' collection of its variables"):
        model.apply({"params": variables["params"]}, x)

    def loss(params, state):
        return jnp.mean(model.apply({"params": params, "fp8": state}, x) ** 2)

    grads, new = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], fp8_state)
    history = new["[scan0]/ScanCheckpointLayer_0/Dense_0#0"].amax_history
    assert (history[:, 0] > 0).all() and (history[:, 1:] == 0).all()
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    report = mpjax.hlo_dots(jax.grad(loss, argnums=(0, 1)))(variables["params"], fp8_state)
    assert report and all(d.fp8 for d in report), str(report)
    # Restored by a checkpoint library as plain dicts, the state works the same.
    as_dicts = {site: meta._asdict() for site, meta in fp8_state.items()}
    _, from_dicts = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], as_dicts)
    for site, meta in new.items():
        np.testing.assert_array_equal(from_dicts[site]["amax_history"], meta.amax_history)


def linen_delayed_training(steps, resume_at=None):
    """A train loop whose checkpoint (params, fp8 collection, optimizer state) goes through
    bytes at ``resume_at``: resuming must change nothing."""
    import flax.serialization

    model = mpjax.linen.apply_policy(Mlp(), DELAYED)
    x = normal((2, 8, 16), 26)
    variables = model.init(jax.random.key(0), x)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(carry, i):
        params, state, opt_state = carry
        batch = x * (1.0 + i.astype(jnp.float32))

        def loss(params, state):
            return jnp.mean(model.apply({"params": params, "fp8": state}, batch) ** 2)

        grads, state = jax.grad(loss, argnums=(0, 1))(params, state)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state

    carry = (variables["params"], variables["fp8"], tx.init(variables["params"]))
    for i in range(steps):
        carry = step(carry, jnp.int32(i))
        if i == resume_at:
            carry = flax.serialization.from_bytes(carry, flax.serialization.to_bytes(carry))
    return carry


@pytest.mark.slow
def test_linen_delayed_training_resumes_bit_identically():
    straight, resumed = linen_delayed_training(5), linen_delayed_training(5, resume_at=2)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    histories = [m.amax_history for m in straight[1].values()]
    assert histories and all((h[:4] > 0).all() for h in histories)  # 4 steps in a history of 4


def test_nnx_delayed_state_lives_in_variables_and_updates_through_nnx_grad():
    model = NnxMlp(nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs a policy set on the model first"):
        mpjax.nnx.init_fp8_state(model, normal((4, 16), 27))
    mpjax.nnx.set_policy(model, DELAYED)
    x = normal((4, 16), 27)
    with pytest.raises(ValueError, match="mpjax.nnx.init_fp8_state"):
        model(x)
    mpjax.nnx.init_fp8_state(model, x)
    state = model.mpjax_fp8.get_value()
    assert set(state) == {"up#0", "head#0"}
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        diff = nnx.DiffState(0, nnx.Any(nnx.Param, mpjax.nnx.Fp8State))
        grads = nnx.grad(lambda m, x: jnp.mean(m(x) ** 2), argnums=diff)(model, x)
        params, fp8_state = nnx.split_state(grads, nnx.Param, mpjax.nnx.Fp8State)
        optimizer.update(model, params)
        nnx.update(model, fp8_state)

    step(model, optimizer, x)
    step(model, optimizer, x)
    history = model.mpjax_fp8.get_value()["up#0"].amax_history
    assert (history[:2] > 0).all() and (history[2:] == 0).all()
    assert float(history[0, 0]) == float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))))
    graph, params = nnx.split(model)
    dots = mpjax.hlo_dots(jax.grad(lambda s: jnp.mean(nnx.merge(graph, s)(x) ** 2)))(params)
    assert len(dots) == 5 and all(d.fp8 for d in dots), str(dots)


@pytest.mark.slow
def test_delayed_state_under_sharding_matches_the_unsharded_step():
    """Data-parallel over 8 devices, the next state holds the same global amaxes: of the input
    and the params bit for bit (a max is exact in any order); of the head's input, computed in
    bf16, and of the gradient up to one bf16 rounding (sums in another order may round to the
    neighbouring bf16 value)."""
    model = mpjax.linen.apply_policy(Mlp(), DELAYED)
    x = normal((8, 2, 16), 28)
    variables = model.init(jax.random.key(0), x)

    def loss(params, state, x):
        return jnp.mean(model.apply({"params": params, "fp8": state}, x) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    _, expected = step(variables["params"], variables["fp8"], x)
    _, got = step(variables["params"], variables["fp8"], sharded)
    rtol = tolerance(jnp.bfloat16, 0)
    for site, meta in expected.items():
        amax, amax_sharded = meta.amax_history[0], got[site].amax_history[0]
        np.testing.assert_array_equal(amax_sharded[1], amax[1])  # the params'
        if site.startswith("Dense_0"):
            np.testing.assert_array_equal(amax_sharded[0], amax[0])  # the input's
        else:
            np.testing.assert_allclose(amax_sharded[0], amax[0], rtol=rtol)
        np.testing.assert_allclose(amax_sharded[2], amax[2], rtol=rtol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_delayed_matmul_and_its_state_keep_their_dtypes(dtype):
    x, w = normal((8, 32), 29, dtype=dtype), normal((32, 4), 30, dtype=dtype)
    out, dx, dw, meta = delayed_grads(x, w, fp8.init_meta(4), jnp.ones((8, 4), dtype))
    assert out.dtype == dx.dtype == dw.dtype == dtype
    assert meta.scale.dtype == meta.amax_history.dtype == jnp.float32
    assert {a.dtype for a in fp8.init_meta(4, (2,))} == {np.dtype(jnp.float32)}
    assert fp8.quantize(x, E5M2, jnp.float32(1.0)).dtype == E5M2
    assert (
        fp8.dequantize(fp8.quantize(x, E4M3, jnp.float32(1.0)), dtype, jnp.float32(1.0)).dtype
        == dtype
    )
