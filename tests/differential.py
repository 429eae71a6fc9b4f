"""The subjects of the differential numerics suite (``tests/test_differential.py``).

A subject is one layer whose precision a built-in rule or op category of mpjax decides
(LayerNorm, RMSNorm, GroupNorm, BatchNorm, attention with its softmax, an embedding lookup, a
softmax cross-entropy loss, a mixture of experts' router and grouped GEMMs) or a small pre-LN
transformer block, written for linen, NNX, Equinox and as a plain JAX function (run by
``mpjax.autocast``). Each has three forms, functions
``form(params, x)`` of the same float32 params and input:

- ``"f32"``: the model as written, in float32: the reference.
- ``"mpjax"``: the same model run by mpjax under the policy (wrapped, set, or autocast).
- ``"hand"``: the model written by hand in the policy's compute dtype, as a careful user writes
  it without mpjax: Flax layers with ``dtype=`` the compute dtype (attention's softmax in
  float32, a mixture of experts' router in float32), an Equinox model with its arrays cast,
  casts written into the JAX function.

Every subject but the embedding starts with an identity-initialised linear layer, so the layer
under test sees its input rounded through a matmul in the compute dtype, at the magnitude the
test gives, as a layer inside a model does. The embedding's input is its table. Attention's
query and key projections are scaled by one over the magnitude, so its scores stay those of a
normalized input (a softmax of scores in the thousands is a one-hot whose gradient is noise)
while its values and output carry the magnitude. The mixture of experts' router and first expert
GEMM are divided by the magnitude too, and its second expert GEMM multiplied by it: its logits
and its experts' pre-activations stay those of a normalized input (as after the norm a model
puts before its experts), while its output carries the magnitude. A SiLU of pre-activations in
the thousands is a ReLU, whose derivative jumps wherever rounding moves a pre-activation across
zero: unscaled, in bfloat16 at 1e5 the input gradient of the low-precision forms, mpjax's and
the hand-written one alike, was up to 6 eps from float32's, 10 times its error at 1: a property
of the layer, not of mpjax. Its routing is decided far beyond rounding (:func:`_router_kernel`).
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
EXPERTS, TOP_K, FFN = 4, 2, 64  # the mixture of experts: each token goes to 2 of 4 experts


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
        value, the logits, the probabilities, the weighted values and the output projection;
        the mixture of experts' 8 are its backward pass's: the output's cotangent, its product
        with the router's weight, the input gradients of the two expert GEMMs, the
        nonlinearity's derivative and its product, the sum of each token's two experts' input
        gradients and the router's added to it (forward: the input, the two GEMMs, the
        nonlinearity, the router's weights, their products and the sum over the experts, 7).
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
        # The two expert GEMMs contract D then FFN (forward; FFN then D backward), and each
        # token sums its TOP_K experts (a scatter-add of their input gradients backward).
        Layer("moe", (B, T, D), D + FFN + TOP_K, 8, (B, T, D)),
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


# The params multiplied by a power of the input's magnitude, by layer and name (the module
# docstring says why): attention's query and key projections and the mixture of experts'
# router and first expert GEMM divided by it, the experts' second GEMM multiplied.
_SCALED = {
    "attention": {"query": -1, "key": -1},
    "moe": {"router": -1, "w_in": -1, "w_out": 1},
}


def _scaled(tree: Any, magnitude: float, powers: dict[str, int]) -> Any:
    """``tree`` with the leaves under a name of ``powers`` multiplied by ``magnitude`` to its
    power (1 or -1)."""
    factors = {1: magnitude, -1: 1.0 / magnitude}

    def leaf(path, x):
        where = jax.tree_util.keystr(path)
        power = next((p for name, p in powers.items() if name in where), 0)
        return x * factors[power] if power else x

    return jax.tree_util.tree_map_with_path(leaf, tree)


def _params(init: Callable[[], Any], layer: Layer) -> Callable[[float], Any]:
    """``params(magnitude)``: ``init()``'s params, those of :data:`_SCALED` scaled."""
    base = init()
    powers = _SCALED.get(layer.name)
    if powers is None:
        return lambda magnitude: base
    return lambda magnitude: _scaled(base, magnitude, powers)


def _key() -> jax.Array:
    """The key every subject is initialised from: XLA compiles the "rbg" generator several
    times faster on CPU than the default threefry."""
    return jax.random.key(0, impl="rbg")


def _eye(key, shape, dtype=jnp.float32):
    del key
    return jnp.eye(*shape, dtype=dtype)


# --- The mixture of experts' shared parts ---------------------------------------------------------


def _router_kernel() -> np.ndarray:
    """The router's ``[D, EXPERTS]`` kernel (the subjects divide it by the magnitude): expert
    ``e`` reads the two outlier channels along the angle ``20 + 90 e`` degrees, with weight 2,
    and the other channels with small random weights (0.25).

    Routing is discrete: a token whose ``TOP_K``-th and next logits nearly tie goes to other
    experts in float32 than under mpjax or by hand, and its output then differs by a whole
    expert's, far more than rounding explains. The router runs in float32 in every form, but
    its input comes through the identity projection, which the low-precision forms round to
    the compute dtype (to e4m3 under an fp8 policy); so the routing is made to depend on that
    input far less than its rounding can move it. :func:`sample` gives every token the same
    magnitude, of either sign, in its two outlier channels: the sign pattern at the angle
    ``45 + 90 q`` gives expert ``e`` the logit ``2 sqrt(2) cos(20 + 90 e - 45 - 90 q)``
    (degrees) and the bulk's share, choosing the two experts 25 and 65 degrees away, 2.4 above
    the others, which the bulk narrows to 1.7 at the least on the suite's input. An error
    ``r`` relative to each element of the input moves the difference of two experts' logits by
    at most ``r * sum_i |x_i| |w_ia - w_ib|``: less than it for every token and every chosen
    and other expert up to ``r = 0.27``, twice e4m3's eps (0.125), so every form sends every
    token to the same experts (``test_moe_routing_is_decided_far_beyond_rounding`` checks it
    at each magnitude). A random kernel of unit variance holds only to ``r = 0.03``: fp8 runs
    would flip tokens, and only tolerances looser than rounding explains would pass them,
    hiding real errors among the flips.
    """
    angles = np.deg2rad(20.0 + 90.0 * np.arange(EXPERTS))
    kernel = np.random.default_rng(4).normal(0.0, 0.25, size=(D, EXPERTS))
    kernel[0], kernel[1] = 2.0 * np.cos(angles), 2.0 * np.sin(angles)
    return kernel.astype(np.float32)


ROUTER = _router_kernel()


def _router_init(key, shape, dtype=jnp.float32):
    del key
    assert tuple(shape) == ROUTER.shape, shape
    return jnp.asarray(ROUTER, dtype)


def _expert_init(key, shape, dtype=jnp.float32):
    """An expert matrix ``[EXPERTS, fan_in, fan_out]``: its outputs of its inputs' variance."""
    return (jax.random.normal(key, shape) / np.sqrt(shape[1])).astype(dtype)


def _router_dtype(dtype: Any) -> Any:
    """The router's dtype where the layer's is ``dtype``: float32 by hand, as MoE models route
    (under mpjax the built-in rule keeps it there), as written otherwise."""
    return None if dtype is None else jnp.float32


def _ragged_dot(x, w, sizes):
    """An expert GEMM as a careful user writes it: accumulated in float32, written in the
    operands' dtype (under mpjax: a grouped GEMM in the compute dtype)."""
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def _experts(tokens, logits, w_in, w_out, dtype):
    """The mixture of experts past its router, as ``examples/gpt.py``'s ``MoE``: each token goes
    to the ``TOP_K`` most probable of the router's experts, weighted by their probabilities
    renormalized; the token-expert pairs are sorted by expert and meet the experts' weights in
    two grouped GEMMs (``lax.ragged_dot``) around a SiLU, then go back to token order, summed
    with the router's weights. ``dtype`` (by hand): the experts' operands and the combine in
    it, the routing in float32."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, chosen = jax.lax.top_k(probs, TOP_K)
    weights = weights / weights.sum(-1, keepdims=True)
    flat = chosen.reshape(-1)
    sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    rows = _cast(tokens[order // TOP_K], dtype)
    h = jax.nn.silu(_ragged_dot(rows, _cast(w_in, dtype), sizes))
    out = _ragged_dot(h, _cast(w_out, dtype), sizes)
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(-1, TOP_K, out.shape[-1])
    return jnp.sum(unsorted * weights.astype(out.dtype)[..., None], axis=1)


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


class LinenMoE(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        tokens = nn.Dense(D, kernel_init=_eye, dtype=self.dtype, name="proj")(x).reshape(-1, D)
        router_dtype = _router_dtype(self.dtype)
        router = nn.Dense(
            EXPERTS, use_bias=False, kernel_init=_router_init, dtype=router_dtype, name="router"
        )
        logits = router(_cast(tokens, router_dtype))
        w_in = self.param("w_in", _expert_init, (EXPERTS, D, FFN))
        w_out = self.param("w_out", _expert_init, (EXPERTS, FFN, D))
        return _experts(tokens, logits, w_in, w_out, self.dtype).reshape(x.shape)


_LINEN_IN_F32 = {
    "LayerNorm": ("LayerNorm_0",),
    "RMSNorm": ("RMSNorm_0",),
    "GroupNorm": ("GroupNorm_0",),
    "BatchNorm": ("BatchNorm_0",),
    "block": ("ln1", "ln2"),
    "moe": ("router",),
}


def _linen_module(layer: str, dtype: Any) -> nn.Module:
    if layer in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"):
        return LinenNorm(layer, dtype)
    classes = {
        "attention": LinenAttention,
        "embedding": LinenEmbedding,
        "loss": LinenLoss,
        "block": LinenBlock,
        "moe": LinenMoE,
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


class NnxMoE(nnx.Module):
    def __init__(self, dtype, rngs):
        self.compute = dtype
        self.proj = nnx.Linear(D, D, kernel_init=_eye, dtype=dtype, rngs=rngs)
        self.router = nnx.Linear(
            D,
            EXPERTS,
            use_bias=False,
            kernel_init=_router_init,
            dtype=_router_dtype(dtype),
            rngs=rngs,
        )
        self.w_in = nnx.Param(_expert_init(rngs.params(), (EXPERTS, D, FFN)))
        self.w_out = nnx.Param(_expert_init(rngs.params(), (EXPERTS, FFN, D)))

    def __call__(self, x):
        tokens = self.proj(x).reshape(-1, D)
        logits = self.router(_cast(tokens, _router_dtype(self.compute)))
        out = _experts(tokens, logits, self.w_in[...], self.w_out[...], self.compute)
        return out.reshape(x.shape)


_NNX_IN_F32 = {
    **{name: ("norm",) for name in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")},
    "block": ("ln1", "ln2"),
    "moe": ("router",),
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
        "moe": NnxMoE,
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


class EqxMoE(eqx.Module):
    """By hand, every array but the router's is cast (:func:`_eqx_subject`): the router reads
    its input in its weight's dtype, float32."""

    proj: eqx.nn.Linear
    router: eqx.nn.Linear
    w_in: jax.Array
    w_out: jax.Array

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.proj = _eqx_linear(k1)
        router = eqx.nn.Linear(D, EXPERTS, use_bias=False, key=k2)
        self.router = eqx.tree_at(lambda m: m.weight, router, jnp.asarray(ROUTER.T))
        self.w_in = _expert_init(k3, (EXPERTS, D, FFN))
        self.w_out = _expert_init(k4, (EXPERTS, FFN, D))

    def __call__(self, x):
        tokens = jax.vmap(self.proj)(x.reshape(-1, D))
        logits = jax.vmap(self.router)(tokens.astype(self.router.weight.dtype))
        return _experts(tokens, logits, self.w_in, self.w_out, None).reshape(x.shape)


_EQX_IN_F32 = {
    **{name: ("norm",) for name in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")},
    "block": ("ln1", "ln2"),
    "moe": ("router",),
}


def _eqx_module(layer: str) -> Any:
    key = _key()
    if layer in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"):
        model = EqxNorm(layer, key)
        return eqx.nn.make_with_state(lambda: model)() if layer == "BatchNorm" else model
    if layer == "embedding":
        return eqx.nn.Embedding(VOCAB, D, key=key)
    classes = {"attention": EqxAttention, "loss": EqxLoss, "block": EqxBlock, "moe": EqxMoE}
    return classes[layer](key)


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
    if layer == "moe":  # routes the batch's tokens together
        return model(x)
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
                cast = _cast_floating(model, compute)
                if name == "moe":  # its router stays float32, as MoE models route
                    cast = eqx.tree_at(lambda m: m.router, cast, model.router)
                model, state = cast, _cast_floating(state, compute)
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


def _moe(p, x, dtype):
    """The mixture of experts, its router under the named scope ``router`` (what autocast's
    rules match)."""
    tokens = _dense(p["proj"], x, dtype).reshape(-1, D)
    with jax.named_scope("router"):
        logits = _cast(tokens, _router_dtype(dtype)) @ p["router"]["w"]
    return _experts(tokens, logits, p["w_in"], p["w_out"], dtype).reshape(x.shape)


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
    if name == "moe":
        return _moe
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
    if name == "moe":
        return {
            "proj": dense(D, D, eye=True),
            "router": {"w": jnp.asarray(ROUTER)},
            "w_in": _expert_init(next(keys), (EXPERTS, D, FFN)),
            "w_out": _expert_init(next(keys), (EXPERTS, FFN, D)),
        }
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


# The scopes autocast keeps in float32, by layer: autocast has no built-in rules (it knows no
# module classes), so the router's rule is written as a user of a mixture of experts writes it.
_AUTOCAST_RULES = {"moe": {"router": mpjax.router_policy}}


def _autocast_subject(layer: Layer) -> Subject:
    function = _function(layer.name)
    rules = _AUTOCAST_RULES.get(layer.name)

    def build(form, policy):
        if form == "mpjax":
            fn = mpjax.autocast(lambda p, x: function(p, x, None), policy, rules=rules)
            return value_and_input_grad(fn)
        compute = _compute(form, policy)
        fn = functools.partial(function, dtype=compute)
        return value_and_input_grad(_standard_promotion(fn) if form == "hand" else fn)

    params = _params(lambda: _function_params(layer.name), layer)
    return Subject("autocast", layer, build, params, tuple(rules or ()))


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
