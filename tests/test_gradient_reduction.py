"""The policy's reduce dtype: the gradients of what a policy casts down (params stored wider
than the compute dtype) are computed and summed in it, through every integration.

Dtypes are read from the jaxpr of the gradient (compiled CPU HLO upcasts bf16)."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import tolerance

import mpjax
from mpjax.casting import gradient_reduction
from mpjax.inspection.matmuls import iter_equations

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
MIXED, REDUCE_BF16 = "mixed_bfloat16", "p=f32,c=bf16,o=f32,r=bf16"


def _equations(fn, *args, primitive):
    """The ``primitive`` equations of ``jax.grad(fn)``'s jaxpr, nested ones included."""
    grad = eqx.filter_grad(fn)
    return [e for e, _ in iter_equations(grad, *args) if e.primitive.name == primitive]


def _gradient_dots(fn, *args):
    """``(lhs dtype, rhs dtype, result dtype, result size)`` of every dot_general in the
    jaxpr of ``jax.grad(fn)``."""
    return sorted(
        (
            str(e.invars[0].aval.dtype),
            str(e.invars[1].aval.dtype),
            str(e.outvars[0].aval.dtype),
            e.outvars[0].aval.size,
        )
        for e in _equations(fn, *args, primitive="dot_general")
    )


def _sums(fn, *args):
    """The dtypes of the ``reduce_sum`` equations of ``jax.grad(fn)`` that sum over axes."""
    return sorted(
        str(e.outvars[0].aval.dtype)
        for e in _equations(fn, *args, primitive="reduce_sum")
        if e.outvars[0].aval.ndim > 0
    )


# --- The policy field -------------------------------------------------------------------


def test_the_reduce_dtype_is_the_param_dtype_unless_named():
    assert mpjax.get_policy(MIXED).reduce_dtype == F32
    assert mpjax.get_policy("bfloat16").reduce_dtype == BF16
    policy = mpjax.get_policy(REDUCE_BF16)
    assert policy.reduce_dtype == BF16
    assert str(policy) == REDUCE_BF16 and mpjax.get_policy(str(policy)) == policy
    assert repr(policy).endswith("output_dtype=float32, reduce_dtype=bfloat16)")
    assert mpjax.get_policy(
        "params=float32,compute=bfloat16,reduce=bfloat16"
    ) == policy.with_output_dtype("bf16")
    assert policy.with_reduce_dtype(None) == mpjax.get_policy(MIXED)
    assert mpjax.get_policy(MIXED).with_reduce_dtype("bf16") == policy
    # A reduce dtype that followed the param dtype keeps following it.
    assert mpjax.get_policy(MIXED).with_param_dtype("bf16").reduce_dtype == BF16
    assert policy.with_param_dtype("f16").reduce_dtype == BF16


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3fn"])
def test_a_reduce_dtype_narrower_than_16_bits_is_refused(dtype):
    with pytest.raises(ValueError, match=r"reduce_dtype=float8_e\w+\): gradients cannot"):
        mpjax.Policy("f32", "bf16", "f32", reduce_dtype=dtype)
    with pytest.raises(ValueError, match="reduce_dtype"):
        mpjax.get_policy(MIXED).with_reduce_dtype(getattr(jnp, dtype))


def test_a_reduce_dtype_must_be_floating_and_known():
    with pytest.raises(ValueError, match="reduce_dtype"):
        mpjax.Policy("f32", "bf16", "f32", reduce_dtype="int32")
    with pytest.raises(ValueError, match=r"reduce dtype \(r=\)"):
        mpjax.get_policy("p=f32,c=bf16,r=bf17")
    with pytest.raises(ValueError, match="Duplicate key 'reduce'"):
        mpjax.get_policy("p=f32,r=bf16,reduce=f32")


def test_jmp_cannot_express_a_reduce_dtype():
    with pytest.raises(ValueError, match=r"with_reduce_dtype\(None\)\.to_jmp\(\)"):
        mpjax.get_policy(REDUCE_BF16).to_jmp()


# --- Matmuls and biases, through every integration ----------------------------------------

X = jax.random.normal(jax.random.key(0), (4, 16, 32))


def _linen(policy):
    model = mpjax.linen.apply_policy(nn.Dense(8), policy)
    params = model.init(jax.random.key(1), X)
    return lambda p: jnp.sum(model.apply(p, X)), params


def _nnx(policy):
    model = nnx.Linear(32, 8, rngs=nnx.Rngs(1))
    mpjax.nnx.set_policy(model, policy)
    graphdef, params = nnx.split(model)
    return lambda p: jnp.sum(nnx.merge(graphdef, p)(X)), params


def _equinox(policy):
    model = mpjax.equinox.apply_policy(eqx.nn.Linear(32, 8, key=jax.random.key(1)), policy)
    return lambda m: jnp.sum(jax.vmap(jax.vmap(m))(X)), model


def _autocast(policy):
    params = {"w": jax.random.normal(jax.random.key(1), (32, 8)), "b": jnp.zeros(8)}
    fn = mpjax.autocast(lambda p: jnp.sum(X @ p["w"] + p["b"]), policy)
    return fn, params


INTEGRATIONS = {"linen": _linen, "nnx": _nnx, "equinox": _equinox, "autocast": _autocast}


@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_weight_gradients_are_computed_in_the_reduce_dtype(integration):
    fn, params = INTEGRATIONS[integration](MIXED)
    dots = _gradient_dots(fn, params)
    # Every matmul multiplies bf16 operands and the forward one writes bf16; the weight's
    # gradient, written in f32, is the only backward one (the input needs none). Under
    # Equinox's vmap it is a batched matmul summed over the batch, which XLA folds into one.
    assert all(lhs == rhs == "bfloat16" for lhs, rhs, _, _ in dots), dots
    expected = 32 * 8 * (4 * 16 if integration == "equinox" else 1)
    assert [(out, size) for *_, out, size in dots] == [
        ("bfloat16", 4 * 16 * 8),
        ("float32", expected),
    ]
    grads = eqx.filter_grad(fn)(params)
    assert {np.dtype(g.dtype) for g in jax.tree.leaves(grads) if hasattr(g, "dtype")} == {F32}


@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_a_bf16_reduce_dtype_computes_weight_gradients_in_bf16(integration):
    fn, params = INTEGRATIONS[integration](REDUCE_BF16)
    assert {out for *_, out, _ in _gradient_dots(fn, params)} == {"bfloat16"}


@pytest.mark.parametrize("integration", ["linen", "nnx"])
def test_a_bias_gradient_sums_over_the_batch_in_the_reduce_dtype(integration):
    fn, params = INTEGRATIONS[integration](MIXED)
    assert "float32" in _sums(fn, params) and "bfloat16" not in _sums(fn, params)
    fn, params = INTEGRATIONS[integration](REDUCE_BF16)
    assert "bfloat16" in _sums(fn, params)


def test_an_equinox_bias_gradient_sums_over_vmap_in_f32():
    """An Equinox layer adds its bias to one example; ``vmap`` sums the bias's cotangents
    over the batch after they are widened to its f32 dtype."""
    fn, params = _equinox(MIXED)
    assert set(_sums(fn, params)) == {"float32"}


def test_weight_gradients_in_f32_are_closer_to_the_f32_gradient():
    """The same bf16 products, summed over 4 * 16 tokens: written in f32, the weight gradient
    is the f32 gradient of the bf16-rounded operands up to f32 rounding; written in bf16 it is
    rounded once more, to 8 bits."""
    fn, params = _linen(MIXED)
    got = jax.grad(fn)(params)["params"]["kernel"]
    rounded = X.astype(BF16).astype(F32)
    want = jnp.einsum("btk,btn->kn", rounded, jnp.ones((4, 16, 8)), precision="highest")
    n = 4 * 16
    np.testing.assert_allclose(
        got, want, rtol=0, atol=tolerance(F32, n) * float(jnp.abs(rounded).sum(axis=(0, 1)).max())
    )
    fn, params = _linen(REDUCE_BF16)
    rounded_once_more = jax.grad(fn)(params)["params"]["kernel"]
    assert not np.array_equal(rounded_once_more, got)
    np.testing.assert_array_equal(rounded_once_more, got.astype(BF16).astype(F32))


def test_matmul_gradients_match_jax_for_any_dimension_numbers():
    """The backward matmuls the reduce dtype rewrites are JAX's own transposes: a batched,
    permuted contraction gives JAX's gradients (both in f32, so up to rounding)."""
    a = jax.random.normal(jax.random.key(2), (3, 5, 4, 6))
    b = jax.random.normal(jax.random.key(3), (4, 3, 7, 6))
    dims = (((3, 2), (3, 0)), ((0,), (1,)))

    def ours(a, b):
        out = gradient_reduction.dot_general(
            a, b, dimension_numbers=dims, precision="highest", compute=F32, reduce=F32
        )
        return jnp.sum(jnp.sin(out))

    def theirs(a, b):
        return jnp.sum(jnp.sin(jax.lax.dot_general(a, b, dims, precision="highest")))

    for got, want in zip(jax.grad(ours, (0, 1))(a, b), jax.grad(theirs, (0, 1))(a, b)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=tolerance(F32, 4 * 6 * 7), atol=1e-6)


def test_forward_mode_goes_through_matmuls_in_a_while_loop():
    """Only forward mode differentiates a while loop, and the custom VJP of a reduce-dtype
    matmul has none: inside the loop the engine binds plain matmuls."""
    w = jax.random.normal(jax.random.key(4), (8, 8))

    def fn(w, x):
        return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]

    auto = mpjax.autocast(fn, MIXED)
    x = jnp.ones((2, 8))
    tangent = jax.jvp(lambda w: auto(w, x), (w,), (jnp.ones_like(w),))[1]
    assert tangent.dtype == F32 and bool(jnp.all(jnp.isfinite(tangent)))


# --- Embedding lookups -------------------------------------------------------------------

TOKENS = jnp.array([[0, 3, 3, 3], [3, 1, 3, 0]])


class _Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(8, 16)
        return embed.attend(embed(tokens))


@pytest.mark.parametrize("policy", [MIXED, REDUCE_BF16])
def test_a_lookup_gathers_compute_dtype_rows_and_sums_the_table_gradient_in_the_reduce_dtype(
    policy,
):
    model = mpjax.linen.apply_policy(_Tied(), policy)
    params = model.init(jax.random.key(5), TOKENS)

    def loss(p):
        return jnp.sum(model.apply(p, TOKENS).astype(F32) ** 2)

    gathers = _equations(loss, params, primitive="gather")
    scatters = _equations(loss, params, primitive="scatter-add")
    # The rows come from the table cast to bf16: a sharded table sends bf16 rows.
    assert any(e.invars[0].aval.dtype == BF16 for e in gathers)
    assert not any(
        e.invars[0].aval.dtype == F32 and e.outvars[0].aval.size == 8 * 16 for e in gathers
    )
    reduce = mpjax.get_policy(policy).reduce_dtype
    assert [e.outvars[0].aval.dtype for e in scatters] == [reduce]
    grad = jax.grad(loss)(params)["params"]["Embed_0"]["embedding"]
    assert grad.dtype == F32


def test_a_lookup_gradient_sums_repeated_rows_without_rounding_to_the_compute_dtype():
    """Token 3 appears five times: its row's gradient is the sum of five cotangents, which in
    bf16 would round at each of the four additions."""
    model = mpjax.linen.apply_policy(nn.Embed(8, 4), MIXED)
    params = model.init(jax.random.key(6), TOKENS)
    cotangent = 1.0 + 2.0**-7 * jnp.arange(1, 9, dtype=F32).reshape(2, 4)[..., None] * jnp.ones(4)
    _, vjp = jax.vjp(lambda p: model.apply(p, TOKENS), params)
    (grad,) = vjp(cotangent.astype(BF16))
    row = grad["params"]["embedding"][3]
    exact = float(cotangent[TOKENS == 3][:, 0].sum())
    np.testing.assert_array_equal(row, np.full(4, exact, np.float32))


# --- Sharded: what crosses between devices ----------------------------------------------


def test_a_data_parallel_weight_gradient_sums_over_8_devices_within_the_bound_of_its_dtype():
    """The weight gradient of a batch split over 8 devices: each device sums its share of the
    tokens, and the 8 partial sums are added across devices. Reduced in f32, it lands within
    f32 rounding of the exact sum of the same bf16 products; reduced in bf16, each partial
    sum and each of the 7 cross-device additions rounds to bf16: within
    ``tolerance(bf16, 8)`` of the sum of the terms' magnitudes (and, here, farther than f32's
    bound, which it would meet if the dtype did not matter)."""
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices, ("data",))
    x = jax.random.normal(jax.random.key(7), (64, 128))
    y = jax.random.normal(jax.random.key(8), (64, 16))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = jax.device_put(y, NamedSharding(mesh, P("data")))
    w = jnp.zeros((128, 16))
    rounded = np.asarray(x.astype(BF16), np.float64)
    cotangent = np.asarray(y.astype(BF16), np.float64)
    exact = rounded.T @ cotangent
    magnitude = np.abs(rounded).T @ np.abs(cotangent)

    def gradient(policy):
        fn = mpjax.autocast(lambda w, x, y: jnp.sum((x @ w).astype(F32) * y), policy)
        return np.asarray(jax.jit(jax.grad(fn))(w, x, y), np.float64)

    f32_bound = tolerance(F32, 64) * magnitude
    assert np.all(np.abs(gradient(MIXED) - exact) <= f32_bound)
    error = np.abs(gradient(REDUCE_BF16) - exact)
    assert np.all(error <= tolerance(BF16, 8) * magnitude)
    assert np.any(error > f32_bound)


# --- Collectives written by hand (shard_map) ---------------------------------------------

MESH = Mesh(np.array(jax.devices()[:8]), ("fsdp",))


def _fsdp_loss(policy):
    """An FSDP step written by hand: each device holds an eighth of ``w``'s rows, gathers them
    for its matmul, and sums its share of the loss over the devices."""

    def local(w, x):
        full = mpjax.all_gather_params(w, "fsdp", policy)
        y = jnp.dot(x.astype(full.dtype), full, preferred_element_type=F32)
        return jax.lax.psum(jnp.sum(jnp.sin(y)), "fsdp")

    return jax.shard_map(local, mesh=MESH, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())


def _collectives(fn, *args):
    """``(primitive, operand dtype)`` of the gathers and reduce-scatters of ``jax.grad(fn)``."""
    return sorted(
        (e.primitive.name, str(e.invars[0].aval.dtype))
        for e, _ in iter_equations(jax.grad(fn), *args)
        if e.primitive.name in ("all_gather", "reduce_scatter")
    )


@pytest.mark.parametrize(("policy", "reduced"), [(MIXED, "float32"), (REDUCE_BF16, "bfloat16")])
def test_hand_written_fsdp_gathers_in_the_compute_dtype_and_reduces_in_the_reduce_dtype(
    policy, reduced
):
    w = jax.random.normal(jax.random.key(9), (64, 16))
    x = jax.random.normal(jax.random.key(10), (32, 64))
    loss = _fsdp_loss(policy)
    kinds = _collectives(loss, w, x)
    assert ("all_gather", "bfloat16") in kinds
    assert not any(k == "all_gather" and d == "float32" for k, d in kinds)
    assert ("reduce_scatter", reduced) in kinds
    grad = np.asarray(jax.jit(jax.grad(loss))(w, x), np.float64)
    assert grad.shape == w.shape
    # Each device's share of the gradient, from the same bf16 operands, exactly: the gathered
    # param is bf16, so each share arrives rounded to bf16 (one rounding), and the 8 shares
    # are summed in the reduce dtype (7 more roundings in bf16).
    xs = np.asarray(x.astype(BF16), np.float64).reshape(8, 4, 64)
    ws = np.asarray(w.astype(BF16), np.float64)
    shares = np.stack([xd.T @ np.cos(xd @ ws) for xd in xs])
    error = np.abs(grad - shares.sum(axis=0))
    magnitude = np.abs(shares).sum(axis=0)
    bound = tolerance(BF16, 8 if reduced == "bfloat16" else 0) + tolerance(F32, 64 + 8)
    assert np.all(error <= bound * magnitude)


@pytest.mark.parametrize(("policy", "reduced"), [(MIXED, F32), (REDUCE_BF16, BF16)])
def test_psum_gradients_sums_in_the_reduce_dtype_and_returns_each_leaf_in_its_own(policy, reduced):
    grads = {"w": jnp.arange(8 * 3, dtype=F32).reshape(8, 3) / 7, "step": jnp.ones(8, jnp.int32)}

    def local(g):
        return mpjax.psum_gradients(g, "fsdp", policy)

    summed = jax.shard_map(local, mesh=MESH, in_specs=P("fsdp"), out_specs=P())
    psums = [e for e, _ in iter_equations(summed, grads) if e.primitive.name.startswith("psum")]
    assert {np.dtype(e.invars[0].aval.dtype) for e in psums} >= {reduced}
    out = summed(grads)
    assert out["w"].dtype == F32 and out["step"].dtype == jnp.int32
    exact = np.asarray(grads["w"], np.float64).sum(axis=0)
    bound = tolerance(reduced, 8) * np.abs(np.asarray(grads["w"], np.float64)).sum(axis=0)
    assert np.all(np.abs(np.asarray(out["w"][0], np.float64) - exact) <= bound)
    assert int(out["step"][0]) == 8
