"""Under mixed_float16, what PyTorch's autocast runs in f32 stays finite and f32-accurate here:
powers, norms, reciprocals, cosine similarity and distances of f16 matmul outputs of magnitude
up to a few thousand, in autocast and in wrapped linen and NNX modules alike."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax

EPS = 1e-6


def rms_norm(h):
    return h * jax.lax.rsqrt(jnp.mean(h**2, axis=-1, keepdims=True) + EPS)


COMPUTATIONS = {
    "x ** 2": lambda h: h**2,
    "square": jnp.square,
    "x ** 3 (cube)": lambda h: h**3,
    "mean of squares": lambda h: jnp.mean(h * h, axis=-1),
    "hand-written rms norm": rms_norm,
    "l2 norm": lambda h: jnp.linalg.norm(h, axis=-1),
    "sqrt of sum of squares": lambda h: jnp.sqrt(jnp.sum(jnp.square(h), axis=-1)),
    "reciprocal of small values": lambda h: jnp.reciprocal((jnp.abs(h) + 1000) * 1e-8),
    "cosine similarity": lambda h: (
        jnp.sum(h[:1] * h, -1) / (jnp.linalg.norm(h[:1], axis=-1) * jnp.linalg.norm(h, axis=-1))
    ),
    "pairwise distances": lambda h: jnp.sqrt(jnp.sum((h[:, None] - h[None]) ** 2, axis=-1)),
    "variance": lambda h: jnp.var(h, axis=-1),
    "softmax": lambda h: jax.nn.softmax(h, axis=-1),
}


def _inputs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 32)) * 500, jnp.float32)  # outputs up to ~4000
    return x, w


def _check(name, out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), f"{name}: non-finite where f32 gives {ref.ravel()[:4]}"
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=1e-3 * np.abs(ref).max(), err_msg=name)


def test_matmul_outputs_reach_a_few_thousand():
    x, w = _inputs()
    assert 2000 < float(jnp.abs(x @ w).max()) < 10000


@pytest.mark.parametrize("name", COMPUTATIONS)
def test_autocast_keeps_f32_computations_finite_in_f16(name):
    x, w = _inputs()
    fn = lambda x, w: COMPUTATIONS[name](x @ w)  # noqa: E731
    out = jax.jit(mpjax.autocast(fn, "mixed_float16"))(x, w)
    _check(name, out, fn(x, w))
    (dot,) = mpjax.inspect_matmuls(mpjax.autocast(fn, "mixed_float16"))(x, w)
    assert dot.operand_dtypes == (np.dtype(jnp.float16),) * 2  # the matmul itself stays f16


def test_without_the_f32_list_these_overflow_in_f16():
    x, w = _inputs()
    h = x.astype(jnp.float16) @ w.astype(jnp.float16)
    assert not np.all(np.isfinite(np.asarray(h**2, np.float32)))  # what the f32 list avoids


class LinenHead(nn.Module):
    """Third-party style: raw param and jnp math, then one of the computations."""

    name_of: str

    @nn.compact
    def __call__(self, x, w):
        return COMPUTATIONS[self.name_of](x @ self.param("w", lambda *_: w))


class NNXHead(nnx.Module):
    def __init__(self, w, name):
        self.w = nnx.Param(w)
        self.name_of = name

    def __call__(self, x):
        return COMPUTATIONS[self.name_of](x @ self.w[...])


@pytest.mark.parametrize(
    "name",
    ["hand-written rms norm", "cosine similarity", "pairwise distances", "x ** 2", "l2 norm"],
)
def test_wrapped_modules_keep_f32_computations_finite_in_f16(name):
    x, w = _inputs()
    model = mpjax.linen.apply_policy(LinenHead(name), "mixed_float16")
    variables = model.init(jax.random.key(0), x, w)
    ref = COMPUTATIONS[name](x @ w)
    _check(f"linen {name}", jax.jit(model.apply)(variables, x, w), ref)
    module = NNXHead(w, name)
    mpjax.nnx.set_policy(module, "mixed_float16")
    _check(f"nnx {name}", module(x), ref)
    report = mpjax.inspect_matmuls(lambda x: module(x))(x)
    assert report.operand_dtypes() == {("float16", "float16"): 1}


class Callback(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.ones, (x.shape[-1], 2))
        host = jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return host @ w


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Callback(name="reader")(nn.Dense(3, name="proj")(x))


def test_a_host_callback_is_warned_about_with_the_module_path():
    model = mpjax.linen.apply_policy(Model(), "mixed_bfloat16")
    x = jnp.ones((2, 3))
    with pytest.warns(mpjax.AutocastWarning, match=r"'reader' calls host code \(pure_callback\)"):
        variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mpjax.AutocastWarning)
        report = mpjax.inspect_matmuls(lambda v: model.apply(v, x))(variables)
    # The matmuls around the callback still run in bf16.
    assert report.operand_dtypes() == {("bfloat16", "bfloat16"): 2}


# --- A norm a rule keeps in float32, fed float16 values past 256 -------------------------------

_W = np.asarray(jax.random.normal(jax.random.key(1), (64, 64)))


class ProjectedNorm(nn.Module):
    """A Dense whose float16 outputs reach ~1100, into a LayerNorm: squared in float16, its
    input overflows (a value past 256 squared is past 65504) and the variance is lost."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(64, name="proj", kernel_init=lambda *_: jnp.asarray(_W))
        return nn.LayerNorm(name="norm")(dense(x))


class NnxProjectedNorm(nnx.Module):
    def __init__(self):
        self.proj = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
        self.proj.kernel.value = jnp.asarray(_W)
        self.norm = nnx.LayerNorm(64, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.norm(self.proj(x))


def test_a_linen_norm_kept_in_f32_normalizes_float16_inputs_past_256():
    x = jax.random.normal(jax.random.key(0), (8, 64)) * 40.0
    variables = ProjectedNorm().init(jax.random.key(1), x)
    ref = ProjectedNorm().apply(variables, x)
    out = mpjax.linen.apply_policy(ProjectedNorm(), "mixed_float16").apply(variables, x)
    assert float(jnp.abs(out.astype(jnp.float32) - ref).max()) <= 2e-3


def test_an_nnx_norm_kept_in_f32_normalizes_float16_inputs_past_256():
    x = jax.random.normal(jax.random.key(0), (8, 64)) * 40.0
    model = NnxProjectedNorm()
    ref = model(x)
    mpjax.nnx.set_policy(model, "mixed_float16")
    assert float(jnp.abs(model(x).astype(jnp.float32) - ref).max()) <= 2e-3
