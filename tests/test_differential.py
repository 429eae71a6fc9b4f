"""The differential numerics suite: every layer mpjax decides the precision of, in every
framework, under every policy family, across the dtype's range, against float32 and against
the same model written by hand in low precision.

Each subject (``tests/differential.py``) runs forward and backward (the gradient with respect
to its input, a fixed cotangent on its output) as written in float32, under mpjax, and by hand
in the compute dtype, at input magnitudes from 1e-4 to the largest whose float32 result the
dtype holds (a few thousand before a norm in float16), with outliers. mpjax must:

- stay finite wherever float32 is;
- land within the tolerance of float32 that rounding allows: ``roundings * eps`` of the compute
  dtype (each rounding of a value into it is off by at most half an eps, relative), plus the
  float32 accumulation over the reduction length (``tests/tolerances.py``);
- be no worse than the hand-written model by more than one rounding (``eps``): a change that
  lets a norm square its float16 input, or a softmax run in float16, fails here;
- run every floating op of a module a built-in rule keeps in float32 in float32 or wider,
  forward and backward (read from the jaxpr).

A failure names the subject (framework and layer), the policy, the magnitude, the quantity and,
from the jaxpr and the precision doctor, the op.

Errors are relative in the L2 norm over the array, computed in float64.
"""

from __future__ import annotations

import functools
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import FRAMEWORKS, LAYERS, TOP_K, B, T, sample, subject, value_and_input_grad
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerances import tolerance

import mpjax
from mpjax import jax_compat
from mpjax.casting.op_categories import DEFAULT_OP_CATEGORIES, F32_FOR_RANGE
from mpjax.casting.regions import innermost
from mpjax.inspection.matmuls import iter_equations

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
E5M2 = np.dtype(jnp.float8_e5m2)
MAGNITUDES = {
    F16: (1e-4, 1e-2, 1.0, 100.0, 1000.0, 4096.0),
    BF16: (1e-4, 1.0, 1e3, 1e5),
    F32: (1e-4, 1.0, 1e3, 1e5),
}
# The relative error of one rounding in a float32 matmul at each precision, on the platform
# that rounds most: bf16_3x (and "high", which is bf16_3x on a TPU) keeps about 16 bits of each
# operand; "default" is one bf16 pass on a TPU; TF32 keeps 10 bits.
PRECISION_EPS = {
    "highest": float(jnp.finfo(jnp.float32).eps),
    "high": 2.0**-16,
    "bf16_3x": 2.0**-16,
    "default": float(jnp.finfo(jnp.bfloat16).eps),
    "tf32": 2.0**-10,
    "bf16": float(jnp.finfo(jnp.bfloat16).eps),
}
F32_POLICIES = tuple(
    str(mpjax.get_policy("float32").with_f32_matmul_precision(name)) for name in PRECISION_EPS
)
POLICIES = ("mixed_float16", "mixed_bfloat16", "mixed_bfloat16_fp8", *F32_POLICIES)
# The subjects whose matmuls a float32 policy's precision decides (a norm has only the identity
# matmul in front of it).
PRECISION_LAYERS = ("attention", "loss", "block")
# Equations that compute nothing of a module's own: a cast, and the sum of the gradients of a
# value the module and its caller both use (JAX adds them in the value's dtype where they
# meet, which may be in the module's scope).
NOT_COMPUTE = frozenset({"convert_element_type", "add_any"})


@functools.cache
def compiled(framework: str, layer: str, form: str, policy: str):
    """The jitted value and input gradient of a form (the float32 one serves every policy)."""
    if form == "f32":
        policy = POLICIES[0]
    if form == "hand":  # written in the compute dtype: fp8's is bfloat16's
        policy = compute_dtype(policy).name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an emulated fp8 matmul warns once; not the point here
        return eqx.filter_jit(subject(framework, layer).build(form, policy))


def arguments(framework, layer, magnitude):
    s = subject(framework, layer)
    x = sample(magnitude, s.layer.shape)
    ct = np.random.default_rng(3).normal(size=s.layer.out_shape).astype(np.float32)
    return s.params(magnitude), x, ct


def evaluate(framework, layer, form, policy, magnitude):
    """``(output, input gradient)`` of a form at ``magnitude``, as float64 numpy arrays."""
    # The hand-written forms mix dtypes as Flax and JAX's own attention do, under JAX's
    # standard promotion (the suite's is strict), which their compilation needs too.
    promotion = "standard" if form == "hand" else jax.config.jax_numpy_dtype_promotion
    with warnings.catch_warnings(), jax.numpy_dtype_promotion(promotion):
        warnings.simplefilter("ignore")
        y, g = compiled(framework, layer, form, policy)(*arguments(framework, layer, magnitude))
    return np.asarray(y, np.float64), np.asarray(g, np.float64)


def hand_written(framework, layer, policy, magnitude):
    """The hand-written form's results, or None where this backend cannot run it: NNX's
    float16 attention asks for a float16 x float16 -> float32 dot algorithm, which XLA's CPU
    lacks (mpjax is then held to the float32 bound alone)."""
    try:
        return evaluate(framework, layer, "hand", policy, magnitude)
    except ValueError as error:
        if "is not supported by dot_general on CPU" not in str(error):
            raise
        return None


def relative_error(actual, desired) -> float:
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.linalg.norm(actual - desired) / max(np.linalg.norm(desired), 1e-300))


def compute_dtype(policy) -> np.dtype:
    return np.dtype(mpjax.get_policy(policy).compute_dtype)


def rounding(policy) -> float:
    """The relative error of one rounding of a value in the policy's matmuls: eps of the
    compute dtype, of e5m2 (the gradients' format) where matmuls run in fp8, and of the
    float32 matmul precision (``PRECISION_EPS``) where they run in float32."""
    p = mpjax.get_policy(policy)
    if p.fp8 is not None:
        return float(jnp.finfo(E5M2).eps)
    if np.dtype(p.compute_dtype) == F32:
        return PRECISION_EPS[p.f32_matmul_precision]
    return float(jnp.finfo(p.compute_dtype).eps)


def allowed(layer, policy) -> float:
    """The largest relative error against float32 that rounding explains (module docstring)."""
    return LAYERS[layer].roundings * rounding(policy) + tolerance(
        np.float32, LAYERS[layer].reduction_length
    )


def magnitudes(policy):
    return MAGNITUDES[compute_dtype(policy)]


def holds(policy, reference) -> bool:
    """Whether the compute dtype can hold a float32 result (its largest value, with a margin
    of 2 for the rounding on the way): a gradient past float16's 65504 is no test of mpjax."""
    return bool(np.abs(reference).max() <= float(jnp.finfo(compute_dtype(policy)).max) / 2)


def narrow_ops(framework, layer, policy, f32_list=False) -> list[str]:
    """The floating ops that run narrower than float32, forward or backward, inside a module a
    built-in rule keeps in float32 (and, with ``f32_list``, anywhere, among the ops of the
    f32 category but the powers that bfloat16 runs as they come): ``"square in norm:
    float16"``."""
    s = subject(framework, layer)
    run = s.build("mpjax", policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        equations = list(iter_equations(run, *arguments(framework, layer, 1.0)))
    compute = compute_dtype(policy)
    found = []
    for eqn, _ in equations:
        name = eqn.primitive.name
        scopes = jax_compat.scope_names(eqn)
        region = innermost(scopes)
        # autocast opens no regions of its own: its rules match the named scopes themselves.
        path = "/".join(scopes) if region is None else region.path
        kept = path.split("/")[-1] in s.regions_in_f32 and name not in NOT_COMPUTE
        listed = DEFAULT_OP_CATEGORIES.get(name) == "f32" and not (
            compute == BF16 and name in F32_FOR_RANGE
        )
        if jax_compat.sub_jaxprs(eqn) or not (kept or (f32_list and listed)):
            continue
        dtypes = {np.dtype(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)}
        narrow = sorted(d.name for d in dtypes if d.kind == "f" and d.itemsize < 4)
        if narrow:
            found.append(f"{name} in {path or 'the root'}: {', '.join(narrow)}")
    return sorted(set(found))


def failures(framework, layer, policy) -> list[str]:
    """Each way mpjax misses the suite's bounds for one subject and policy, named."""
    found = []
    bound, one = allowed(layer, policy), rounding(policy)
    for m in magnitudes(policy):
        ref = evaluate(framework, layer, "f32", policy, m)
        mine = evaluate(framework, layer, "mpjax", policy, m)
        hand = hand_written(framework, layer, policy, m)
        for what, k in (("output", 0), ("input gradient", 1)):
            if not holds(policy, ref[k]):
                continue
            error = relative_error(mine[k], ref[k])
            hand_error = float("inf") if hand is None else relative_error(hand[k], ref[k])
            # Where the hand-written model itself cannot hold the value (it is not finite),
            # the dtype cannot: mpjax is then held to being no worse than it.
            limit = bound if hand is None or np.isfinite(hand_error) else float("inf")
            if error > limit or error > hand_error + one:
                found.append(
                    f"{framework} {layer} under {policy} at magnitude {m:g}: {what} is "
                    f"{error:.3g} from float32 (allowed {bound:.3g}; by hand {hand_error:.3g})"
                )
    return found


def explain(framework, layer, policy, found) -> str:
    """The failures, then the ops that ran narrower than mpjax means them to."""
    narrow = narrow_ops(framework, layer, policy, f32_list=True)
    ops = "; ".join(narrow) or "none: look at the matmuls' dtypes (mpjax.inspect_matmuls)"
    return "\n".join([*found, f"ops narrower than float32 where mpjax keeps float32: {ops}"])


PRECISION_NAMES = list(PRECISION_EPS)


@functools.cache
def runs_tf32() -> bool:
    """Whether this backend runs a TF32 dot (a GPU does; XLA's CPU refuses it)."""
    x = jnp.ones((2, 2), jnp.float32)
    try:
        jax.jit(lambda a: jnp.dot(a, a, precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32))(x)
    except ValueError:
        return False
    return True


def skip_reason(policy) -> str | None:
    """Why this backend cannot run a policy's cases, or None."""
    tf32 = F32_POLICIES[PRECISION_NAMES.index("tf32")]
    return "XLA's CPU has no TF32 dot" if policy == tf32 and not runs_tf32() else None


def cases():
    """``(framework, layer, policy)`` of every case of the suite: each layer under the float16,
    bfloat16 and fp8 policies, the layers with matmuls under each float32 precision."""
    for framework in FRAMEWORKS:
        for layer in LAYERS:
            for policy in POLICIES:
                if policy not in F32_POLICIES or layer in PRECISION_LAYERS:
                    yield framework, layer, policy


def _case(framework, layer, policy):
    marks = []
    if policy != "mixed_float16":  # float16's range is the fast suite's; the rest is slow
        marks.append(pytest.mark.slow)
    reason = skip_reason(policy)
    if reason is not None:
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(framework, layer, policy, id=f"{framework}-{layer}-{policy}", marks=marks)


CASES = [_case(*case) for case in cases()]


@pytest.mark.parametrize(("framework", "layer", "policy"), CASES)
def test_mpjax_matches_float32_and_hand_written_low_precision(framework, layer, policy):
    found = failures(framework, layer, policy)
    assert not found, explain(framework, layer, policy, found)


@pytest.mark.parametrize(("framework", "layer", "policy"), CASES)
def test_modules_kept_in_float32_run_every_floating_op_in_float32(framework, layer, policy):
    assert narrow_ops(framework, layer, policy) == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_moe_routing_is_decided_far_beyond_rounding(framework):
    """Every form of the mixture of experts sends every token to the same experts
    (``differential._router_kernel`` says why the suite needs it): at every magnitude tested, each
    chosen expert's logit exceeds each other expert's by more than an error of e4m3's eps (the
    coarsest rounding any form gives the router's input: an fp8 policy's identity projection)
    in every element of the input can move their difference."""
    e4m3 = float(jnp.finfo(jnp.float8_e4m3fn).eps)
    s = subject(framework, "moe")
    for m in sorted({m for ms in MAGNITUDES.values() for m in ms}):
        leaves = jax.tree_util.tree_flatten_with_path(s.params(m))[0]
        (kernel,) = [w for path, w in leaves if "router" in jax.tree_util.keystr(path)]
        width = s.layer.shape[-1]
        w = np.asarray(kernel, np.float64)
        w = w if w.shape[0] == width else w.T  # Equinox stores [experts, features]
        x = sample(m, s.layer.shape).reshape(-1, width).astype(np.float64)
        logits = x @ w
        ranked = np.argsort(-logits, axis=-1)
        tokens = np.arange(len(x))[:, None, None]
        chosen, others = ranked[:, :TOP_K, None], ranked[:, None, TOP_K:]
        gap = logits[tokens, chosen] - logits[tokens, others]  # [tokens, chosen, others]
        reach = np.abs(w.T[chosen] - w.T[others]) * np.abs(x)[:, None, None, :]
        moved = e4m3 * reach.sum(-1)
        assert np.all(gap > moved), f"{framework} at {m:g}: margin {np.min(gap - moved):.3g}"


# MXFP8 experts as batched block-scaled GEMMs over each expert's slots (mpjax.grouped.capacity):
# 64 token-expert pairs in 4 experts fill at most 64 rows of an expert's 128 slots (slots are
# rounded up to 128), so no row is dropped and float32's result is the one to match.
CAPACITY_POLICY = "p=f32,c=bf16,o=f32,fp8=mxfp8;capacity=1.0"


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_moe_experts_at_a_capacity_match_float32_and_hand_written_low_precision(framework):
    assert B * T * TOP_K <= 128  # every pair fits an expert's slots: nothing dropped
    run = subject(framework, "moe").build("mpjax", CAPACITY_POLICY)
    args = arguments(framework, "moe", 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = mpjax.inspect_matmuls(run)(*args).operand_dtypes()
    # Both expert GEMMs batched over the slots in MXFP8, forward and both gradients (with the
    # identity projection's three GEMMs; none grouped in bf16), the router in float32.
    assert found == {("float8_e4m3fn", "float8_e4m3fn"): 9, ("float32", "float32"): 2}, found
    found = failures(framework, "moe", CAPACITY_POLICY)
    assert not found, explain(framework, "moe", CAPACITY_POLICY, found)
    assert narrow_ops(framework, "moe", CAPACITY_POLICY) == []  # the router in float32


class DenseNorm(nn.Module):
    """An identity-initialised Dense into a norm, of any width."""

    norm: str
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        eye = lambda key, shape, dtype=jnp.float32: jnp.eye(*shape, dtype=dtype)  # noqa: E731
        h = nn.Dense(x.shape[-1], kernel_init=eye, dtype=self.dtype)(x)
        return getattr(nn, self.norm)(epsilon=1e-6, dtype=self.dtype)(h)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    norm=st.sampled_from(["LayerNorm", "RMSNorm"]),
    policy=st.sampled_from(["mixed_float16", "mixed_bfloat16"]),
    log_magnitude=st.floats(-4.0, np.log10(4096.0)),
    rows=st.integers(1, 6),
    width=st.sampled_from([8, 24, 64, 200]),
)
def test_norms_hold_at_any_magnitude_and_width(norm, policy, log_magnitude, rows, width):
    magnitude, compute = 10.0**log_magnitude, compute_dtype(policy)
    x = sample(magnitude, (rows, width), seed=rows)
    ct = np.random.default_rng(width).normal(size=(rows, width)).astype(np.float32)
    variables = jax.jit(DenseNorm(norm).init)(jax.random.key(0, impl="rbg"), x)
    forms = {
        "f32": DenseNorm(norm),
        "mpjax": mpjax.linen.apply_policy(DenseNorm(norm), policy),
        "hand": DenseNorm(norm, compute),
    }
    results = {}
    for form, model in forms.items():
        run = value_and_input_grad(functools.partial(model.apply))
        with jax.numpy_dtype_promotion("standard"):  # Flax's f16 layers mix f16 and f32
            y, g = jax.jit(run)(variables, x, ct)
        results[form] = (np.asarray(y, np.float64), np.asarray(g, np.float64))
    bound = 3 * float(jnp.finfo(compute).eps) + tolerance(np.float32, width)
    for what, k in (("output", 0), ("input gradient", 1)):
        ref = results["f32"][k]
        if not holds(policy, ref):
            continue
        error = relative_error(results["mpjax"][k], ref)
        hand = relative_error(results["hand"][k], ref)
        assert error <= bound and error <= hand + float(jnp.finfo(compute).eps), (
            f"linen {norm} of width {width} under {policy} at magnitude {magnitude:.3g}: "
            f"{what} is {error:.3g} from float32 (allowed {bound:.3g}; by hand {hand:.3g})"
        )
