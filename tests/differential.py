"""The subjects of the differential numerics suite (``tests/test_differential.py``).

A subject is one layer whose precision a built-in rule or op category of mpjax decides
(LayerNorm, RMSNorm, GroupNorm, BatchNorm, attention with its softmax, an embedding lookup, a
softmax cross-entropy loss) or a small pre-LN transformer block, written for linen, NNX, Equinox
and as a plain JAX function (run by ``mpjax.autocast``). Each has three forms, functions
``form(params, x)`` of the same float32 params and input:

- ``"f32"``: the model as written, in float32: the reference.
- ``"mpjax"``: the same model run by mpjax under the policy (wrapped, set, or autocast).
- ``"hand"``: the model written by hand in the policy's compute dtype, as a careful user writes
  it without mpjax: Flax layers with ``dtype=`` the compute dtype (attention's softmax in
  float32), an Equinox model with its arrays cast, casts written into the JAX function.

Every subject but the embedding starts with an identity-initialised linear layer, so the layer
under test sees its input rounded through a matmul in the compute dtype, at the magnitude the
test gives, as a layer inside a model does. The embedding's input is its table. Attention's
query and key projections are scaled by one over the magnitude, so its scores stay those of a
normalized input (a softmax of scores in the thousands is a one-hot whose gradient is noise)
while its values and output carry the magnitude.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mpjax
import mpjax.equinox
import mpjax.linen
import mpjax.nnx

F32 = np.dtype(jnp.float32)
B, T, D, HEADS, GROUPS, VOCAB = 4, 8, 32, 4, 4, 48
EPS = 1e-6  # every norm's epsilon, small beside the variance of the smallest inputs tested
IDS = np.random.default_rng(1).integers(0, VOCAB, size=(B, T)).astype(np.int32)
LABELS = np.random.default_rng(2).integers(0, D, size=(B,)).astype(np.int32)
FRAMEWORKS = ("linen", "nnx", "equinox", "autocast")


def sample(magnitude: float, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """An input of largest magnitude ``magnitude`` shaped as a residual stream: values of both
    signs around a nonzero mean, and two outlier channels 8x the bulk's spread."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.3, 1.0, size=shape)
    x[..., :2] = 8.0 * np.sign(rng.normal(size=(*shape[:-1], 2)))
    return (magnitude * x / np.abs(x).max()).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Layer:
    """What a layer is, whatever framework writes it.

    Attributes:
      name: ``"LayerNorm"``.
      shape: the input's shape.
      reduction_length: the longest sum an output element goes through (the features, and
        the sequence for attention), for the float32 accumulation's share of the tolerance.
      roundings: how many times a value is rounded into the compute dtype on its way through
        the hand-written layer (its input, each matmul's output, the layer's output), forward
        or backward, whichever is more: attention's 8 are its input, the query, key and
        value, the logits, the probabilities, the weighted values and the output projection.
      out_shape: the output's shape.
    """

    name: str
    shape: tuple[int, ...]
    reduction_length: int
    roundings: int
    out_shape: tuple[int, ...]


LAYERS = {
    layer.name: layer
    for layer in (
        Layer("LayerNorm", (B, D), D, 3, (B, D)),
        Layer("RMSNorm", (B, D), D, 3, (B, D)),
        Layer("GroupNorm", (B, D), D, 3, (B, D)),
        Layer("BatchNorm", (B, D), B + D, 3, (B, D)),
        Layer("attention", (B, T, D), T + D, 8, (B, T, D)),
        Layer("embedding", (VOCAB, D), B * T, 1, (B, T, D)),
        Layer("loss", (B, D), D, 3, (B,)),
        Layer("block", (B, T, D), T + 4 * D, 8, (B, T, D)),
    )
}


@dataclasses.dataclass(frozen=True)
class Subject:
    """A layer written in one framework.

    Attributes:
      framework: one of :data:`FRAMEWORKS`.
      layer: the :class:`Layer`.
      build: ``build(form, policy)`` gives, for a form of the subject, the function
        ``run(params, x, ct)`` that returns its output and the gradient with respect to ``x``
        of the output's inner product with the cotangent ``ct`` (unjitted).
      params: ``params(magnitude)`` gives the float32 params every form takes.
      regions_in_f32: the paths of the modules a built-in rule keeps in float32 (their floating
        ops must all run in float32 or wider).
    """

    framework: str
    layer: Layer
    build: Callable[[str, Any], Callable[[Any, jax.Array, jax.Array], tuple]]
    params: Callable[[float], Any]
    regions_in_f32: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.framework}-{self.layer.name}"


def _compute(form: str, policy: Any) -> Any:
    """The dtype a form's layers are written in: None (as written) but by hand."""
    return mpjax.get_policy(policy).compute_dtype if form == "hand" else None


def value_and_input_grad(fn: Callable[..., Any]) -> Callable[..., tuple]:
    """``run(params, x, ct)``: ``fn(params, x)`` and the gradient of its inner product with
    ``ct`` with respect to ``x``."""

    def run(params, x, ct):
        def inner(x):
            y = fn(params, x)
            return jnp.sum(y.astype(jnp.float32) * ct), y

        grad, y = jax.grad(inner, has_aux=True)(x)
        return y, grad

    return run


def _standard_promotion(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced under JAX's standard dtype promotion: Flax's layers with ``dtype=`` a
    narrow dtype mix it with their float32 params, which the suite's strict promotion refuses."""

    @functools.wraps(fn)
    def standard(*args):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args)

    return standard


def _scaled_qk(tree: Any, scale: float) -> Any:
    """``tree`` with the leaves under a query or key projection multiplied by ``scale``."""

    def leaf(path, x):
        names = jax.tree_util.keystr(path)
        return x * scale if "query" in names or "key" in names else x

    return jax.tree_util.tree_map_with_path(leaf, tree)


def _params(init: Callable[[], Any], layer: Layer) -> Callable[[float], Any]:
    """``params(magnitude)``: ``init()``'s params, attention's query and key scaled."""
    base = init()
    if layer.name != "attention":
        return lambda magnitude: base
    return lambda magnitude: _scaled_qk(base, 1.0 / magnitude)


def _key() -> jax.Array:
    """The key every subject is initialised from: XLA compiles the "rbg" generator several
    times faster on CPU than the default threefry."""
    return jax.random.key(0, impl="rbg")


def _eye(key, shape, dtype=jnp.float32):
    del key
    return jnp.eye(*shape, dtype=dtype)


# --- linen ---------------------------------------------------------------------------------------


class LinenNorm(nn.Module):
    kind: str
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D, kernel_init=_eye, dtype=self.dtype, name="proj")(x)
        if self.kind == "BatchNorm":
            norm = nn.BatchNorm(use_running_average=False, epsilon=EPS, dtype=self.dtype)
        elif self.kind == "GroupNorm":
            norm = nn.GroupNorm(num_groups=GROUPS, epsilon=EPS, dtype=self.dtype)
        else:
            norm = getattr(nn, self.kind)(epsilon=EPS, dtype=self.dtype)
        return norm(h)


def _linen_attention(dtype, name="attn"):
    return nn.MultiHeadDotProductAttention(
        HEADS, dtype=dtype, force_fp32_for_softmax=dtype is not None, name=name
    )


class LinenAttention(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D, kernel_init=_eye, dtype=self.dtype, name="proj")(x)
        return _linen_attention(self.dtype)(h, mask=nn.make_causal_mask(IDS))


class LinenEmbedding(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, ids):
        return nn.Embed(VOCAB, D, dtype=self.dtype or jnp.float32, name="embed")(ids)


class LinenLoss(nn.Module):
    """Logits and their softmax cross-entropy inside the model, as a model that returns its
    loss computes it (under mpjax, in the root's policy); by hand, in float32."""

    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        logits = nn.Dense(D, kernel_init=_eye, dtype=self.dtype, name="head")(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), LABELS)


class LinenBlock(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, kernel_init=_eye, dtype=self.dtype, name="proj")(x)
        h = nn.LayerNorm(epsilon=EPS, dtype=self.dtype, name="ln1")(x)
        x = x + _linen_attention(self.dtype)(h, mask=nn.make_causal_mask(IDS))
        h = nn.LayerNorm(epsilon=EPS, dtype=self.dtype, name="ln2")(x)
        h = nn.gelu(nn.Dense(4 * D, dtype=self.dtype, name="fc")(h))
        return x + nn.Dense(D, dtype=self.dtype, name="out")(h)


_LINEN_IN_F32 = {
    "LayerNorm": ("LayerNorm_0",),
    "RMSNorm": ("RMSNorm_0",),
    "GroupNorm": ("GroupNorm_0",),
    "BatchNorm": ("BatchNorm_0",),
    "block": ("ln1", "ln2"),
}


def _linen_module(layer: str, dtype: Any) -> nn.Module:
    if layer in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"):
        return LinenNorm(layer, dtype)
    classes = {
        "attention": LinenAttention,
        "embedding": LinenEmbedding,
        "loss": LinenLoss,
        "block": LinenBlock,
    }
    return classes[layer](dtype)


def _linen_subject(layer: Layer) -> Subject:
    embedding = layer.name == "embedding"

    def build(form, policy):
        model = _linen_module(layer.name, _compute(form, policy))
        if form == "mpjax":
            model = mpjax.linen.apply_policy(model, policy)

        def fn(variables, x):
            if embedding:
                return model.apply({"params": {"embed": {"embedding": x}}}, IDS)
            out, _ = model.apply(variables, x, mutable=["batch_stats"])
            return out

        return value_and_input_grad(_standard_promotion(fn) if form == "hand" else fn)

    def init():
        example = IDS if embedding else jnp.zeros(layer.shape, jnp.float32)
        return jax.jit(_linen_module(layer.name, None).init)(_key(), example)

    return Subject("linen", layer, build, _params(init, layer), _LINEN_IN_F32.get(layer.name, ()))


# --- NNX -----------------------------------------------------------------------------------------


class NnxNorm(nnx.Module):
    def __init__(self, kind, dtype, rngs):
        self.proj = nnx.Linear(D, D, kernel_init=_eye, dtype=dtype, rngs=rngs)
        if kind == "BatchNorm":
            self.norm = nnx.BatchNorm(D, epsilon=EPS, dtype=dtype, rngs=rngs)
        elif kind == "GroupNorm":
            self.norm = nnx.GroupNorm(D, num_groups=GROUPS, epsilon=EPS, dtype=dtype, rngs=rngs)
        else:
            self.norm = getattr(nnx, kind)(D, epsilon=EPS, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.proj(x))


def _nnx_attention(dtype, rngs):
    # NNX's attention has no force_fp32_for_softmax (linen's has): by hand, it runs its
    # softmax in its dtype.
    return nnx.MultiHeadAttention(HEADS, D, dtype=dtype, decode=False, rngs=rngs)


class NnxAttention(nnx.Module):
    def __init__(self, dtype, rngs):
        self.proj = nnx.Linear(D, D, kernel_init=_eye, dtype=dtype, rngs=rngs)
        self.attn = _nnx_attention(dtype, rngs)

    def __call__(self, x):
        return self.attn(self.proj(x), mask=nnx.make_causal_mask(IDS))


class NnxEmbedding(nnx.Module):
    def __init__(self, dtype, rngs):
        self.embed = nnx.Embed(VOCAB, D, dtype=dtype or jnp.float32, rngs=rngs)

    def __call__(self, ids):
        return self.embed(ids)


class NnxLoss(nnx.Module):
    def __init__(self, dtype, rngs):
        self.head = nnx.Linear(D, D, kernel_init=_eye, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        logits = self.head(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS)


class NnxBlock(nnx.Module):
    def __init__(self, dtype, rngs):
        self.proj = nnx.Linear(D, D, kernel_init=_eye, dtype=dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, epsilon=EPS, dtype=dtype, rngs=rngs)
        self.attn = _nnx_attention(dtype, rngs)
        self.ln2 = nnx.LayerNorm(D, epsilon=EPS, dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(D, 4 * D, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(4 * D, D, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = self.proj(x)
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(IDS))
        return x + self.out(nnx.gelu(self.fc(self.ln2(x))))


_NNX_IN_F32 = {
    **{name: ("norm",) for name in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")},
    "block": ("ln1", "ln2"),
}


def _nnx_module(layer: str, dtype: Any) -> nnx.Module:
    rngs = nnx.Rngs(_key())
    if layer in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"):
        return NnxNorm(layer, dtype, rngs)
    classes = {
        "attention": NnxAttention,
        "embedding": NnxEmbedding,
        "loss": NnxLoss,
        "block": NnxBlock,
    }
    return classes[layer](dtype, rngs)


def _nnx_subject(layer: Layer) -> Subject:
    embedding = layer.name == "embedding"

    def build(form, policy):
        model = _nnx_module(layer.name, _compute(form, policy))
        if form == "mpjax":
            mpjax.nnx.set_policy(model, policy)
        graphdef, _ = nnx.split(model)

        def call(x, model):
            if embedding:
                table, state = nnx.split(model)
                return nnx.merge(table, jax.tree.map(lambda _: x, state))(IDS)
            return model(x)

        def run(state, x, ct):
            # nnx.grad, not jax.grad: a BatchNorm updates its statistics in place, which NNX
            # allows only to a module its own transformation passes in.
            def inner(x, model):
                y = call(x, model)
                return jnp.sum(y.astype(jnp.float32) * ct), y

            grad = nnx.grad(inner, has_aux=True)
            if form == "hand":
                grad = _standard_promotion(grad)
            g, y = grad(x, nnx.merge(graphdef, state))
            return y, g

        return run

    def init():
        return jax.jit(lambda: nnx.split(_nnx_module(layer.name, None))[1])()

    return Subject("nnx", layer, build, _params(init, layer), _NNX_IN_F32.get(layer.name, ()))


# --- Equinox -------------------------------------------------------------------------------------


def _eqx_linear(key):
    """The identity, as the other frameworks' layers start (Equinox draws a bias; Flax's is
    zero): a bias would dominate the smallest inputs."""
    linear = eqx.nn.Linear(D, D, key=key)
    return eqx.tree_at(lambda m: (m.weight, m.bias), linear, (jnp.eye(D), jnp.zeros(D)))


class EqxNorm(eqx.Module):
    proj: eqx.nn.Linear
    norm: eqx.Module

    def __init__(self, kind, key):
        self.proj = _eqx_linear(key)
        if kind == "BatchNorm":
            self.norm = eqx.nn.BatchNorm(D, axis_name="batch", eps=EPS, momentum=0.9)
        elif kind == "GroupNorm":
            self.norm = eqx.nn.GroupNorm(GROUPS, D, eps=EPS)
        else:
            self.norm = getattr(eqx.nn, kind)(D, eps=EPS)

    def __call__(self, x, state=None):
        h = self.proj(x)
        if state is None:
            return self.norm(h)
        return self.norm(h, state)


class EqxAttention(eqx.Module):
    proj: eqx.nn.Linear
    attn: eqx.nn.MultiheadAttention

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.proj = _eqx_linear(k1)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.proj)(x)
        return self.attn(h, h, h, mask=jnp.tril(jnp.ones((T, T), bool)))


class EqxLoss(eqx.Module):
    head: eqx.nn.Linear

    def __init__(self, key):
        self.head = _eqx_linear(key)

    def __call__(self, x, label):
        logits = self.head(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, label)


class EqxBlock(eqx.Module):
    proj: eqx.nn.Linear
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.proj = _eqx_linear(k1)
        self.ln1 = eqx.nn.LayerNorm(D, eps=EPS)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k2)
        self.ln2 = eqx.nn.LayerNorm(D, eps=EPS)
        self.fc = eqx.nn.Linear(D, 4 * D, key=k3)
        self.out = eqx.nn.Linear(4 * D, D, key=k4)

    def __call__(self, x):
        x = jax.vmap(self.proj)(x)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((T, T), bool)))
        h = jax.vmap(lambda v: self.out(jax.nn.gelu(self.fc(self.ln2(v)))))(x)
        return x + h


_EQX_IN_F32 = {
    **{name: ("norm",) for name in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")},
    "block": ("ln1", "ln2"),
}


def _eqx_module(layer: str) -> Any:
    key = _key()
    if layer in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"):
        model = EqxNorm(layer, key)
        return eqx.nn.make_with_state(lambda: model)() if layer == "BatchNorm" else model
    if layer == "embedding":
        return eqx.nn.Embedding(VOCAB, D, key=key)
    return {"attention": EqxAttention, "loss": EqxLoss, "block": EqxBlock}[layer](key)


def _cast_floating(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree)


def _eqx_call(layer: str, model: Any, x: jax.Array, state: Any = None) -> jax.Array:
    """The Equinox layer's call on a batch, per example as Equinox layers take them."""
    if layer == "embedding":
        return jax.vmap(jax.vmap(model))(IDS)
    if layer == "BatchNorm":
        out, _ = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
        return out
    if layer == "loss":
        return jax.vmap(model)(x, LABELS)
    return jax.vmap(model)(x)


def _eqx_subject(layer: Layer) -> Subject:
    name = layer.name

    def build(form, policy):
        compute = _compute(form, policy)

        def fn(params, x):
            model, state = params
            if name == "embedding":
                model = eqx.tree_at(lambda m: m.weight, model, x)
            if form == "mpjax":
                model = mpjax.equinox.apply_policy(model, policy)
            elif form == "hand":
                model, state = _cast_floating(model, compute), _cast_floating(state, compute)
                x = x.astype(compute)
            return _eqx_call(name, model, x, state)

        return value_and_input_grad(_standard_promotion(fn) if form == "hand" else fn)

    def init():
        made = eqx.filter_jit(_eqx_module)(name)
        return made if name == "BatchNorm" else (made, None)

    return Subject("equinox", layer, build, _params(init, layer), _EQX_IN_F32.get(name, ()))


# --- Plain JAX under autocast --------------------------------------------------------------------


def _cast(x, dtype):
    return x if dtype is None else x.astype(dtype)


def _dense(p, x, dtype):
    return _cast(x, dtype) @ _cast(p["w"], dtype) + _cast(p["b"], dtype)


def _layer_norm(p, h, dtype, rms=False, groups=1):
    """A norm as JAX code writes one: statistics of the float32 value, the output cast back."""
    x = h.astype(jnp.float32)
    shape = x.shape
    x = x.reshape(*shape[:-1], groups, shape[-1] // groups)
    if rms:
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + EPS)
    else:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + EPS)
    y = y.reshape(shape) * p["scale"]
    if not rms:
        y = y + p["bias"]
    return y.astype(h.dtype)


def _batch_norm(p, h, dtype):
    x = h.astype(jnp.float32)
    mean = jnp.mean(x, axis=0)
    var = jnp.mean(jnp.square(x - mean), axis=0)
    return ((x - mean) * jax.lax.rsqrt(var + EPS) * p["scale"] + p["bias"]).astype(h.dtype)


def _attention(p, h, dtype):
    b, t, _ = h.shape

    def heads(w):
        return _dense(w, h, dtype).reshape(b, t, HEADS, D // HEADS)

    q, k, v = heads(p["query"]), heads(p["key"]), heads(p["value"])
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return _dense(p["out"], out.reshape(b, t, D), dtype)


def _loss(p, x, dtype):
    logits = _dense(p["head"], x, dtype).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS)


def _function(name: str) -> Callable[[Any, jax.Array, Any], jax.Array]:
    """The subject as a JAX function ``f(params, x, dtype)``: as written for ``dtype=None``."""
    if name == "embedding":
        return lambda p, table, dtype: _cast(table, dtype)[IDS]
    if name == "loss":
        return _loss
    if name == "attention":
        return lambda p, x, dtype: _attention(p["attn"], _dense(p["proj"], x, dtype), dtype)
    if name == "block":
        return _block
    norm = {
        "LayerNorm": _layer_norm,
        "RMSNorm": functools.partial(_layer_norm, rms=True),
        "GroupNorm": functools.partial(_layer_norm, groups=GROUPS),
        "BatchNorm": _batch_norm,
    }[name]
    return lambda p, x, dtype: norm(p["norm"], _dense(p["proj"], x, dtype), dtype)


def _block(p, x, dtype):
    x = _dense(p["proj"], x, dtype)
    x = x + _attention(p["attn"], _layer_norm(p["ln1"], x, dtype), dtype)
    h = jax.nn.gelu(_dense(p["fc"], _layer_norm(p["ln2"], x, dtype), dtype))
    return x + _dense(p["out"], h, dtype)


@functools.partial(jax.jit, static_argnums=0)
def _function_params(name: str) -> Any:
    keys = iter(jax.random.split(_key(), 8))

    def dense(n_in, n_out, eye=False):
        w = jnp.eye(n_in) if eye else jax.random.normal(next(keys), (n_in, n_out)) / n_in**0.5
        return {"w": w, "b": jnp.zeros((n_out,))}

    norm = {"scale": jnp.ones((D,)), "bias": jnp.zeros((D,))}
    attention = {k: dense(D, D) for k in ("query", "key", "value", "out")}
    if name == "embedding":
        return {}
    if name == "loss":
        return {"head": dense(D, D, eye=True)}
    if name == "attention":
        return {"proj": dense(D, D, eye=True), "attn": attention}
    if name == "block":
        return {
            "proj": dense(D, D, eye=True),
            "ln1": norm,
            "attn": attention,
            "ln2": norm,
            "fc": dense(D, 4 * D),
            "out": dense(4 * D, D),
        }
    return {"proj": dense(D, D, eye=True), "norm": norm}


def _autocast_subject(layer: Layer) -> Subject:
    function = _function(layer.name)

    def build(form, policy):
        if form == "mpjax":
            return value_and_input_grad(mpjax.autocast(lambda p, x: function(p, x, None), policy))
        compute = _compute(form, policy)
        fn = functools.partial(function, dtype=compute)
        return value_and_input_grad(_standard_promotion(fn) if form == "hand" else fn)

    return Subject("autocast", layer, build, _params(lambda: _function_params(layer.name), layer))


_BUILDERS = {
    "linen": _linen_subject,
    "nnx": _nnx_subject,
    "equinox": _eqx_subject,
    "autocast": _autocast_subject,
}


@functools.cache
def subject(framework: str, layer: str) -> Subject:
    """The subject of ``layer`` (a key of :data:`LAYERS`) written in ``framework``."""
    return _BUILDERS[framework](LAYERS[layer])
