"""Precision regions: named scopes that carry a policy, read back by the casting engine."""

import jax
import jax.numpy as jnp
import numpy as np

import mpjax
from mpjax.casting import regions

F32, BF16, F16 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def test_scope_names_round_trip_and_the_innermost_region_wins():
    policy = mpjax.get_policy("mixed_float16")
    name = regions.scope_name(policy, "blocks/0/attn")
    assert name == "mpjax[p=f32,c=f16,o=f32]blocks/0/attn"
    found = regions.innermost(["model", name, "dense", regions.FULL_PRECISION_SCOPE, "x"])
    assert found == regions.Region(None)  # full precision, inside the region
    assert regions.innermost(["model", name, "dense"]) == regions.Region(policy, "blocks/0/attn")
    assert regions.innermost(["model", "dense"]) is None


def test_autocast_runs_each_region_under_its_policy_forward_and_backward():
    def f(w, x):
        with regions.region(mpjax.get_policy("float32"), "head"):
            y = x @ w
        with regions.region(mpjax.get_policy("mixed_float16"), "body"):
            y = y @ w
        return (x @ w + y).sum()

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    report = mpjax.inspect_matmuls(jax.grad(mpjax.autocast(f, "mixed_bfloat16")))(w, x)
    by_region = {}
    for m in report:
        by_region.setdefault(m.region, set()).add(m.operand_dtypes)
    assert by_region == {"head": {(F32, F32)}, "body": {(F16, F16)}, None: {(BF16, BF16)}}


def test_an_output_boundary_casts_what_the_engine_computed():
    bf16_out = mpjax.get_policy("p=f32,c=bf16,o=bf16")

    def f(w, x):
        with regions.region(bf16_out, "layer"):
            y = regions.output_boundary(x @ w, bf16_out.output_dtype)
        return y

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    jaxpr = jax.make_jaxpr(f)(w, x)
    assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general", "name"]  # an identity
    assert f(w, x).dtype == F32  # outside the engine, nothing is cast
    out = mpjax.autocast(f, "float32", rules=None)(w, x)
    assert out.dtype == F32  # autocast's own output cast (policy float32) comes last
    inner = jax.make_jaxpr(mpjax.autocast(lambda w, x: f(w, x) * 1, "p=f32,c=bf16,o=bf16"))(w, x)
    assert "name" not in [e.primitive.name for e in inner.jaxpr.eqns]  # consumed by the engine
    assert regions.boundary_dtype("mpjax_output:float16") == F16
    assert regions.boundary_dtype("something_else") is None
