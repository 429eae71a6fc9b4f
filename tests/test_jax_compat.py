"""mpjax.jax_compat on the running JAX: what each function reads from real equations.

CI runs these on the oldest and the newest supported JAX, where the params differ (scan's
counts against flat trees, bool against jax.Inline, ``manual_axes`` against
``newly_manual_axes``, the two ``get_bind_params`` conventions); each test pins the value that
the rest of mpjax relies on.
"""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax import jax_compat
from mpjax.casting import regions

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3])
W = jnp.arange(5.0)
X = jnp.ones((7, 3))


def _eqns(fn, *args, primitive):
    """The top-level equations of ``fn``'s jaxpr that bind ``primitive``."""
    eqns = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == primitive]
    assert eqns, f"no {primitive} equation"
    return eqns


def _eqn(fn, *args, primitive):
    (eqn,) = _eqns(fn, *args, primitive=primitive)
    return eqn


def _shapes(atoms):
    return [tuple(a.aval.shape) for a in atoms]


def _evaluate(closed, *args):
    return jax.extend.core.jaxpr_as_fun(closed)(*args)


def test_scan_params_split_the_inputs_into_consts_carries_and_xs():
    def fn(w, init, xs):
        def body(carry, x):
            a, n = carry
            return (a * 2 + w.sum() + x.sum(), n + 1), x * 2

        return lax.scan(body, init, xs, reverse=True, unroll=2)

    init = (jnp.ones(2), jnp.int32(0))
    eqn = _eqn(fn, W, init, X, primitive="scan")
    p = jax_compat.scan_params(eqn)
    n_c, n_k = p.num_consts, p.num_carry
    assert (n_c, n_k) == (1, 2)
    consts, carry, xs = eqn.invars[:n_c], eqn.invars[n_c : n_c + n_k], eqn.invars[n_c + n_k :]
    assert _shapes(consts) == [(5,)] and _shapes(carry) == [(2,), ()] and _shapes(xs) == [(7, 3)]
    assert (p.length, p.reverse, p.unroll) == (7, True, 2)
    # The body takes consts, carries, xs and returns the carries, then the ys.
    assert _shapes(p.jaxpr.jaxpr.invars) == [(5,), (2,), (), (3,)]
    assert _shapes(p.jaxpr.jaxpr.outvars) == [(2,), (), (3,)]
    carry_out = _evaluate(p.jaxpr, W, jnp.ones(2), jnp.int32(4), jnp.ones(3))
    np.testing.assert_allclose(carry_out[0], [15.0, 15.0])
    assert int(carry_out[1]) == 5


def test_scan_params_of_a_fori_loop_count_the_index_as_a_carry():
    eqn = _eqn(lambda w: lax.fori_loop(0, 3, lambda i, c: c * w, w), W, primitive="scan")
    p = jax_compat.scan_params(eqn)
    assert p.num_carry == 2 and len(eqn.invars) == p.num_consts + 2  # (i, c), no xs
    assert p.length == 3 and p.reverse is False


def test_while_params_split_cond_consts_body_consts_and_carries():
    lim, scale, shift = jnp.float32(100.0), jnp.ones(3) * 2, jnp.ones((3,))

    def fn(x):
        return lax.while_loop(
            lambda c: c[0].sum() < lim,
            lambda c: (c[0] * scale + shift, c[1] + 1),
            (x, jnp.zeros((2, 2))),
        )

    eqn = _eqn(fn, jnp.ones(3), primitive="while")
    p = jax_compat.while_params(eqn)
    assert (p.cond_nconsts, p.body_nconsts) == (1, 2)
    assert _shapes(eqn.invars[p.cond_nconsts + p.body_nconsts :]) == [(3,), (2, 2)]
    assert _shapes(p.cond_jaxpr.jaxpr.invars) == [(), (3,), (2, 2)]
    assert _shapes(p.body_jaxpr.jaxpr.invars) == [(3,), (3,), (3,), (2, 2)]
    (keep_going,) = _evaluate(p.cond_jaxpr, lim, jnp.ones(3), jnp.zeros((2, 2)))
    assert bool(keep_going)


def test_cond_branches_take_the_operands_after_the_index():
    fn = lambda x: lax.cond(x.sum() > 0, lambda a: a * 3, lambda a: -a, x)  # noqa: E731
    eqn = _eqn(fn, jnp.ones(3), primitive="cond")
    branches = jax_compat.cond_branches(eqn)
    assert len(branches) == 2 and eqn.invars[0].aval.dtype == np.int32
    # Branch 0 is the false branch.
    np.testing.assert_array_equal(_evaluate(branches[0], jnp.ones(3))[0], -jnp.ones(3))
    np.testing.assert_array_equal(_evaluate(branches[1], jnp.ones(3))[0], 3 * jnp.ones(3))


def test_cond_platforms_are_those_of_a_platform_dependent_cond_only():
    def per_platform(x):
        return lax.platform_dependent(x, cuda=jnp.cos, tpu=jnp.cos, default=jnp.sin)

    eqn = _eqn(per_platform, W, primitive="cond")
    assert jax_compat.cond_platforms(eqn) == (("cuda", "tpu"), None)
    plain = _eqn(lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), W, primitive="cond")
    assert jax_compat.cond_platforms(plain) is None


def test_lowering_platform_names_the_default_backend_as_platform_dependent_does():
    # jax.default_backend() says "gpu" on a CUDA GPU; platform_dependent's branches say "cuda".
    platform = jax_compat.lowering_platform()
    assert platform in {"cpu", "cuda", "rocm", "tpu"}

    def per_platform(x):
        return lax.platform_dependent(x, **{platform: jnp.cos}, default=jnp.sin)

    eqn = _eqn(per_platform, W, primitive="cond")
    assert jax_compat.cond_platforms(eqn) == ((platform,), None)
    np.testing.assert_array_equal(per_platform(W), jnp.cos(W))


def test_current_scope_names_are_the_scopes_of_the_trace_in_progress():
    seen = {}

    def fn(x):
        seen["top"] = jax_compat.current_scope_names()
        with jax.named_scope("outer"), jax.named_scope("inner"):
            seen["inner"] = jax_compat.current_scope_names()
            jax.jit(nested)(x)  # a nested trace starts a fresh name stack
            return jnp.sin(x)

    def nested(y):
        seen["jit"] = jax_compat.current_scope_names()
        return y

    jax.make_jaxpr(jax.grad(fn))(1.0)
    assert seen == {"top": (), "inner": ("outer", "inner"), "jit": ()}


@pytest.mark.parametrize("inline", [False, True])
def test_jit_params_recreate_the_same_jit(inline):
    def named(x, y):
        return x * y

    fn = jax.jit(named, donate_argnums=(1,), keep_unused=True, inline=inline)
    eqns = [
        e
        for e in jax.make_jaxpr(lambda x, y: fn(x, y))(W, W).jaxpr.eqns
        if e.primitive.name == "jit"
    ]
    if inline and not eqns:
        pytest.skip("before jax 0.11, jit(inline=True) leaves no jit equation to read")
    (eqn,) = eqns
    p = jax_compat.jit_params(eqn)
    assert (p.name, p.donate_argnums, p.keep_unused) == ("named", (1,), True)
    np.testing.assert_array_equal(_evaluate(p.jaxpr, W, W)[0], W * W)

    def body(x, y):
        return x * y

    body.__name__ = p.name
    again = jax.jit(
        body, donate_argnums=p.donate_argnums, keep_unused=p.keep_unused, inline=p.inline
    )
    rebuilt = _eqn(lambda x, y: again(x, y), W, W, primitive="jit")
    for name in ("name", "donated_invars", "keep_unused", "inline"):
        assert rebuilt.params[name] == eqn.params[name], name


def test_remat_params_read_back_policy_and_prevent_cse():
    policy = jax.checkpoint_policies.nothing_saveable
    fn = jax.checkpoint(lambda x: jnp.sin(x) * 2, policy=policy, prevent_cse=False)
    (eqn,) = [
        e for e in jax.make_jaxpr(fn)(W).jaxpr.eqns if e.primitive.name in ("remat2", "checkpoint")
    ]
    p = jax_compat.remat_params(eqn)
    assert p.policy is policy and p.prevent_cse is False
    np.testing.assert_allclose(_evaluate(p.jaxpr, W)[0], jnp.sin(W) * 2)


@jax.custom_jvp
def _sin(x):
    return jnp.sin(x)


_sin.defjvp(lambda primals, tangents: (_sin(primals[0]), tangents[0] * 10))


@jax.custom_vjp
def _cube(x):
    return x**3


_cube.defvjp(lambda x: (_cube(x), x), lambda x, ct: (ct * 100,))


@pytest.mark.parametrize(
    "fn, primitive, primal",
    [
        (_sin, "custom_jvp_call", jnp.sin),
        (_cube, "custom_vjp_call", lambda x: x**3),
    ],
)
def test_call_jaxpr_is_the_primal_of_a_custom_derivative(fn, primitive, primal):
    eqn = _eqn(fn, W, primitive=primitive)
    np.testing.assert_allclose(_evaluate(jax_compat.call_jaxpr(eqn), W)[0], primal(W), rtol=1e-6)


def test_call_primitives_are_what_grad_of_checkpoint_makes():
    def loss(w):
        inner = jax.checkpoint(
            lambda w: lax.scan(lambda c, x: (jnp.sin(c * w), x), W, None, length=2)[0].sum()
        )
        return inner(w)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(W).jaxpr
    calls = [e for e, _ in _walk(jaxpr) if e.primitive.name in jax_compat.CALL_PRIMITIVES]
    assert calls, sorted({e.primitive.name for e, _ in _walk(jaxpr)})
    for eqn in calls:
        args = [jnp.full(v.aval.shape, 0.5, v.aval.dtype) for v in eqn.invars]
        expected = jax_compat.bind_equation(eqn, args)
        got = _evaluate(jax_compat.call_jaxpr(eqn), *args)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn, jaxpr
        for sub in jax_compat.sub_jaxprs(eqn):
            yield from _walk(sub)


def test_shard_map_params_recreate_the_same_shard_map():
    mesh = jax.make_mesh((4, 2), ("d", "m"), axis_types=(AxisType.Auto,) * 2)
    fn = jax.shard_map(
        lambda a, b: a * b.sum(),
        mesh=mesh,
        in_specs=(P("d"), P()),
        out_specs=P("d"),
        axis_names={"d"},
        check_vma=False,
    )
    args = (jnp.ones((8, 3)), jnp.ones(3))
    eqn = _eqn(fn, *args, primitive="shard_map")
    p = jax_compat.shard_map_params(eqn)
    assert p.kwargs["axis_names"] == {"d"} and p.kwargs["check_vma"] is False
    assert p.kwargs["mesh"] == mesh and p.kwargs["out_specs"] == (P("d"),)
    again = jax.shard_map(lambda *xs: tuple(_evaluate(p.jaxpr, *xs)), **p.kwargs)
    rebuilt = _eqn(again, *args, primitive="shard_map")
    assert {k: v for k, v in rebuilt.params.items() if k != "jaxpr"} == {
        k: v for k, v in eqn.params.items() if k != "jaxpr"
    }
    np.testing.assert_array_equal(jax.jit(again)(*args)[0], jax.jit(fn)(*args))


def test_missing_param_raises_naming_it():
    eqn = _eqn(lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), W, primitive="cond")
    renamed = eqn.replace(params={"cases": eqn.params["branches"]})
    with pytest.raises(jax_compat.UnsupportedJaxError, match="'cond'.*'branches'"):
        jax_compat.cond_branches(renamed)


def test_bind_equation_rebinds_with_new_params():
    a, b = jnp.ones((2, 3), BF16), jnp.ones((3, 4), BF16)
    eqn = _eqn(lambda a, b: a @ b, a, b, primitive="dot_general")
    assert jax_compat.preferred_element_type(eqn) in (None, BF16)
    (out,) = jax_compat.bind_equation(eqn, [a, b])
    assert out.dtype == BF16 and out.shape == (2, 4)
    params = {**eqn.params, "preferred_element_type": F32}
    (out,) = jax_compat.bind_equation(eqn, [a, b], params)
    assert out.dtype == F32
    wide = _eqn(
        lambda a, b: lax.dot(a, b, preferred_element_type=F32), a, b, primitive="dot_general"
    )
    assert jax_compat.preferred_element_type(wide) == F32
    assert jax_compat.preferred_element_type(_eqn(jnp.sin, W, primitive="sin")) is None


def test_bind_equation_keeps_the_custom_rule_of_a_custom_jvp_call():
    # The jvp rule travels as a subfun: bound again, the equation still differentiates by it.
    eqn = _eqn(_sin, W, primitive="custom_jvp_call")
    rebound = lambda x: jax_compat.bind_equation(eqn, [x])[0]  # noqa: E731
    np.testing.assert_allclose(rebound(W), jnp.sin(W), rtol=1e-6)
    np.testing.assert_array_equal(jax.grad(lambda x: rebound(x).sum())(W), jnp.full(5, 10.0))


def test_bind_equation_of_a_scan():
    fn = lambda init, x: lax.scan(lambda c, xi: (c + xi, c * 2), init, x)  # noqa: E731
    eqn = _eqn(fn, jnp.zeros(3), X, primitive="scan")
    outs = jax_compat.bind_equation(eqn, [jnp.zeros(3), X])
    expected = fn(jnp.zeros(3), X)
    np.testing.assert_array_equal(outs[0], expected[0])
    np.testing.assert_array_equal(outs[1], expected[1])


def test_scope_names_leave_out_transforms_and_name_stack_keeps_them():
    def loss(x):
        with jax.named_scope("outer"), jax.named_scope("inner"):
            return jnp.sum(jnp.sin(x))

    eqns = jax.make_jaxpr(jax.grad(loss))(W).jaxpr.eqns
    cos = next(e for e in eqns if e.primitive.name == "cos")
    assert jax_compat.scope_names(cos) == ("outer", "inner")
    assert jax_compat.name_stack(cos) == "jvp(outer)/inner"
    transposed = [e for e in eqns if "transpose" in jax_compat.name_stack(e)]
    assert transposed
    for eqn in transposed:
        assert jax_compat.name_stack(eqn) == "transpose(jvp(outer))/inner"
        assert jax_compat.scope_names(eqn) == ("outer", "inner")
    top = _eqn(jnp.sin, W, primitive="sin")
    assert jax_compat.scope_names(top) == () and jax_compat.name_stack(top) == ""


def test_is_tracer():
    seen = []
    jax.jit(lambda x: seen.append(jax_compat.is_tracer(x)) or x)(W)
    jax.grad(lambda x: seen.append(jax_compat.is_tracer(x)) or x.sum())(W)
    assert seen == [True, True]
    assert not jax_compat.is_tracer(W) and not jax_compat.is_tracer(np.ones(2))
    assert not jax_compat.is_tracer(1.0)


def test_literals_dropvars_and_sub_jaxprs():
    def fn(x):
        (_, ys) = lax.scan(lambda c, xi: (c + xi, c * 2.0), jnp.zeros(3), x)
        return ys

    jaxpr = jax.make_jaxpr(fn)(X).jaxpr
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    # An unused output is a DropVar before jax 0.10.1; since, it is a Var that nothing reads.
    assert [jax_compat.is_dropvar(v) for v in scan.outvars] == [JAX_VERSION < (0, 10, 1), False]
    (body,) = jax_compat.sub_jaxprs(scan)
    mul = next(e for e in body.eqns if e.primitive.name == "mul")
    assert [jax_compat.is_literal(a) for a in mul.invars] == [False, True]
    assert jax_compat.sub_jaxprs(mul) == []
    loop = _eqn(
        lambda x: lax.while_loop(lambda c: c.sum() < 9, lambda c: c + 1, x), W, primitive="while"
    )
    assert len(jax_compat.sub_jaxprs(loop)) == 2
    branches = _eqn(lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), W, primitive="cond")
    assert len(jax_compat.sub_jaxprs(branches)) == 2


def test_closed_accepts_open_and_closed_jaxprs():
    closed = jax.make_jaxpr(lambda x: x * W)(W)
    assert jax_compat.closed(closed) is closed
    remat = next(
        e
        for e in jax.make_jaxpr(jax.checkpoint(jnp.sin))(W).jaxpr.eqns
        if e.primitive.name in ("remat2", "checkpoint")
    )
    rebuilt = jax_compat.closed(remat.params["jaxpr"])
    np.testing.assert_allclose(_evaluate(rebuilt, W)[0], jnp.sin(W))


def test_retyped_keeps_sharding_and_changes_dtype_and_weak_type():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.ones((8, 2), BF16), jax.sharding.NamedSharding(mesh, P("d")))
    like = jax.core.ShapedArray((8, 2), F32, weak_type=True)
    with jax.set_mesh(mesh):
        aval = jax_compat.retyped(x, like)
    assert aval.dtype == F32 and aval.weak_type and aval.shape == (8, 2)
    assert aval.sharding.spec == jax.typeof(x).sharding.spec == P("d", None)
    strong = jax_compat.retyped(jnp.ones(2, F32), jnp.ones(2, BF16))
    assert strong.dtype == BF16 and not strong.weak_type
    assert jax_compat.weakly_typed(strong).weak_type and not strong.weak_type


def test_trace_at_avals():
    avals = [jax.core.ShapedArray((2, 3), BF16), jax.core.ShapedArray((3,), F32)]
    closed = jax_compat.trace_at(lambda a, b: (a.astype(F32) * b).sum(axis=0), avals)
    assert [(a.shape, a.dtype) for a in closed.in_avals] == [((2, 3), BF16), ((3,), F32)]
    assert [(a.shape, a.dtype) for a in closed.out_avals] == [((3,), F32)]


def test_ref_like_wraps_in_a_ref_only_where_the_template_is_one():
    value = jnp.ones(3, BF16)
    assert jax_compat.ref_like(jnp.zeros(3), value) is value
    ref = jax_compat.ref_like(jax.new_ref(jnp.zeros(3)), value)
    assert jax_compat.is_ref(ref) and not jax_compat.is_ref(value)
    assert ref[...].dtype == BF16
    np.testing.assert_array_equal(ref[...], value)


def _located(x):
    return jnp.sin(x) * 2.0


def test_backward_equations_and_source_locations_are_read_off_the_name_stack_and_traceback():
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(_located(x))))(X).jaxpr
    backward = {e.primitive.name for e in jaxpr.eqns if jax_compat.is_backward(e)}
    forward = {e.primitive.name for e in jaxpr.eqns if not jax_compat.is_backward(e)}
    assert "sin" in forward and "cos" in forward  # cos is the linearization, computed forward
    assert "mul" in backward and "sin" not in backward
    (sin,) = [e for e in jaxpr.eqns if e.primitive.name == "sin"]
    assert jax_compat.source_location(sin).startswith(f"{__file__}:")
    assert "(_located)" in jax_compat.source_location(sin)


def test_a_bound_equation_keeps_the_source_location_it_was_traced_at():
    (sin,) = _eqns(_located, X, primitive="sin")
    rebound = jax.make_jaxpr(lambda x: jax_compat.bind_equation(sin, [x]))(X).jaxpr.eqns[0]
    assert jax_compat.source_location(rebound) == jax_compat.source_location(sin)

    def cast(x):
        with jax_compat.traced_at(sin):
            return x.astype(jnp.bfloat16)

    (converted,) = jax.make_jaxpr(cast)(X).jaxpr.eqns
    assert jax_compat.source_location(converted) == jax_compat.source_location(sin)


def _module_output(x):
    return regions.output_boundary(jnp.sin(x), jnp.float16)  # the module's call


def test_an_operation_mpjax_writes_is_located_at_the_line_outside_mpjax_that_led_to_it():
    # The output boundary's marker is written in mpjax/casting/regions.py, for the module called here.
    (marker,) = _eqns(_module_output, X, primitive="name")
    location = jax_compat.source_location(marker)
    assert location.startswith(f"{__file__}:") and "(_module_output)" in location
    line = jax_compat.source_location(_eqn(_module_output, X, primitive="sin")).split(":")[1]
    assert location.split(":")[1] == line


def test_matmul_precisions_are_params_that_dot_general_and_conv_take_and_read_back():
    x, img, k = jnp.ones((2, 2)), jnp.ones((1, 3, 4, 4)), jnp.ones((2, 3, 3, 3))
    dot = jax.make_jaxpr(lambda a: a @ a)(x).jaxpr.eqns[0]
    conv = jax.make_jaxpr(lambda i, k: lax.conv(i, k, (1, 1), "SAME"))(img, k).jaxpr.eqns[0]
    assert jax_compat.takes_precision(dot) and jax_compat.takes_precision(conv)
    for eqn, args in [(dot, (x, x)), (conv, (img, k))]:
        assert jax_compat.precision_left_default(eqn)
        assert jax_compat.precision_name(eqn) == "default"
        for name in jax_compat.MATMUL_PRECISIONS:
            params = jax_compat.with_precision(eqn, None, name)
            if params is None:  # "default", and the algorithms a convolution cannot take
                assert name == "default" or eqn is conv
                continue
            rebound = jax.make_jaxpr(
                lambda *a, eqn=eqn, params=params: jax_compat.bind_equation(eqn, a, params)
            )(*args)
            (new,) = rebound.jaxpr.eqns
            expected = {"bf16_3x": "high"}.get(name, name) if eqn is conv else name
            assert jax_compat.precision_name(new) == expected


@pytest.mark.parametrize(
    "precision, name, left_default",
    [
        (None, "default", True),
        (lax.Precision.DEFAULT, "default", True),
        (lax.Precision.HIGHEST, "highest", False),
        ((lax.Precision.HIGH, lax.Precision.DEFAULT), "high,default", False),
        (lax.DotAlgorithmPreset.DEFAULT, "default", False),
        (lax.DotAlgorithmPreset.BF16_BF16_F32_X6, "bf16_bf16_f32_x6", False),
        (lax.DotAlgorithmPreset.TF32_TF32_F32, "tf32", False),
    ],
)
def test_precision_name_reads_what_the_code_wrote(precision, name, left_default):
    x = jnp.ones((2, 2))
    (eqn,) = jax.make_jaxpr(lambda a: jnp.dot(a, a, precision=precision))(x).jaxpr.eqns
    assert jax_compat.precision_name(eqn) == name
    assert jax_compat.precision_left_default(eqn) == left_default


def test_pallas_flash_attention_is_a_forward_and_two_backward_kernels_interpreted_here():
    """The kernel's signature (heads-first operands, ``causal``, ``sm_scale``, the default
    block sizes with backward blocks) and the interpreter that runs it on a CPU."""
    q, k, v = (
        jax.random.normal(key, (1, 1, 128, 64)) for key in jax.random.split(jax.random.key(0), 3)
    )

    def loss(q, k, v):
        out = jax_compat.pallas_flash_attention(q, k, v, is_causal=True, scale=0.125)
        return out.sum()

    def kernels(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
            else:  # a kernel's own jaxpr is not walked
                for sub in jax_compat.sub_jaxprs(eqn):
                    yield from kernels(getattr(sub, "jaxpr", sub))

    gradient = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    assert len(list(kernels(gradient))) == 3  # forward (with softmax statistics), dK/dV, dQ
    with jax_compat.pallas_tpu_interpreted():
        out = jax.jit(
            lambda q, k, v: jax_compat.pallas_flash_attention(q, k, v, is_causal=True, scale=1.0)
        )(q, k, v)
    # The first query attends to the first key only.
    np.testing.assert_array_equal(out[0, 0, 0], v[0, 0, 0])
    assert jax_compat.PALLAS_BLOCK == 128


def test_the_axes_a_value_is_partitioned_over_as_traced_come_from_the_jit_input_shardings():
    # On jax 0.8.1 and 0.12 alike, a value traced from an input sharded on a 2 x 2 mesh (its
    # computed descendants too) is partitioned over both axes, an axis of one device left out;
    # inside a shard_map over one axis, only the other; a value traced from nothing sharded,
    # over none.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2, 1), ("a", "b", "c"))
    sharded = jax.device_put(jnp.ones((8, 2)), jax.sharding.NamedSharding(mesh, P("a")))
    seen = []

    def f(x):
        seen.append(jax_compat.partitioned_axes(jnp.tanh(x) * 2))
        return x

    def manual_a(x):
        inner = jax.shard_map(
            f,
            mesh=jax_compat.traced_mesh(x),
            in_specs=P("a"),
            out_specs=P("a"),
            axis_names={"a"},
            check_vma=False,
        )
        return inner(x)

    jax.jit(f)(sharded)
    jax.jit(manual_a)(sharded)
    jax.jit(f)(jnp.ones((8, 2)))
    assert seen == [{"a": 2, "b": 2}, {"b": 2}, {}]
    assert jax_compat.partitioned_axes(jnp.ones(3)) == {}
    assert jax_compat.traced_mesh(jnp.ones(3)) is None


def test_the_platform_a_value_is_traced_for_comes_from_its_sharding():
    # A value traced from an input placed on devices names their platform (an ahead-of-time
    # compile names its compile-only devices' platform the same way); one traced from a plain
    # array, or outside jit, names none.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("a",))
    placed = jax.device_put(jnp.ones((4,)), jax.sharding.NamedSharding(mesh, P("a")))
    seen = []

    def f(x):
        seen.append(jax_compat.traced_platform(x * 2))
        return x

    jax.jit(f)(placed)
    assert seen == ["cpu"]
    assert jax_compat.traced_platform(jnp.ones(3)) is None


def test_a_bf16_dot_with_an_f32_result_runs_on_the_cpu_on_widened_operands():
    """XLA's CPU runtime lacks some bf16 x bf16 -> f32 dots (a gradient the reduce dtype
    writes in f32): the weight gradients of this Flax model failed with "Unsupported element
    type for DotThunk::Execute: BF16 x BF16 = F32" on jax 0.8.1 and 0.12. Lowered for the CPU
    with mpjax imported, such a dot takes f32 operands; the products of bf16 values are exact
    in f32, so the result is the bf16 dot's."""
    import flax.linen as nn
    import optax

    jax_compat.widen_narrow_dots_on_cpu()
    jax_compat.widen_narrow_dots_on_cpu()  # once is enough: a second call changes nothing

    def dot(a, b):
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)

    a, b = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
    text = jax.jit(dot).lower(a, b).as_text()
    assert "stablehlo.convert" in text and "tensor<4x8xbf16>" in text
    assert re.search(
        r"stablehlo.dot_general %\S+, %\S+, .*: \(tensor<4x8xf32>, tensor<8x2xf32>\)", text
    )

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(x)

    model = mpjax.linen.apply_policy(Attention(), "mixed_bfloat16")
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    params = model.init(jax.random.key(1), x)
    tx = optax.sgd(0.1)

    @jax.jit
    def step(params):
        grads = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(params)
        return optax.apply_updates(params, tx.update(grads, tx.init(params))[0])

    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(step(params)))


def test_the_block_scaled_matmul_primitive_is_what_scaled_matmul_traces_to():
    data = jnp.ones((1, 32, 64), jnp.float8_e4m3fn)
    scales = jnp.ones((1, 32, 2), jnp.float8_e8m0fnu)
    jaxpr = jax.make_jaxpr(jax.nn.scaled_matmul)(data, data, scales, scales)
    names = {eqn.primitive.name for eqn, *_ in mpjax.inspection.matmuls.walk_jaxpr(jaxpr.jaxpr)}
    assert jax_compat.BLOCK_SCALED_MATMUL in names


def test_block_scaled_matmuls_run_on_the_cpu_accumulating_in_float32():
    """The CPU lowering mpjax gives ``jax.nn.scaled_matmul`` (jax 0.8.1 has none; 0.12's
    multiplies in the output dtype): inside a jit, a bf16 result is the float32 product of the
    scaled values, rounded once."""
    from mpjax import block_scaled

    x = jax.random.normal(jax.random.key(0), (1, 64, 1024))
    w = jax.random.normal(jax.random.key(1), (1, 48, 1024))
    qx, qw = block_scaled.quantize(x), block_scaled.quantize(w)

    @jax.jit
    def matmul(qx, qw):
        return jax.nn.scaled_matmul(qx.data, qw.data, qx.scales, qw.scales, jnp.bfloat16)

    exact = np.einsum(
        "bmk,bnk->bmn",
        np.asarray(block_scaled.dequantize(qx), np.float64),
        np.asarray(block_scaled.dequantize(qw), np.float64),
    )
    got = np.asarray(matmul(qx, qw), np.float64)
    # One rounding to bf16 of each exact value (and the float32 sum's own error). jax 0.8.1
    # cannot lower it at all; the case where jax 0.12's own lowering lands farther (a bf16
    # GEMM inside a larger jit) is test_block_scaled's quantized-arithmetic test.
    bound = 2.0**-8 * np.abs(exact) + 1e-6 * np.abs(exact).max()
    assert (np.abs(got - exact) <= bound).all()


# --- Loops (mpjax.plan's estimates of steps that scan) ---------------------------------------


def _loop_step(ws, x):
    def body(h, w):
        inner = jax.lax.scan(lambda g, v: (jnp.sin(g * v), None), h, w)[0]
        return jax.checkpoint(jnp.tanh)(inner), None

    def loss(ws):
        h = jax.lax.scan(body, x, ws, unroll=2)[0]
        return jax.lax.cond(h.sum() > 0, jnp.sum, lambda h: -jnp.sum(h), h)

    return jax.jit(jax.grad(loss))(ws)


def test_loops_finds_every_scan_with_its_trips_unroll_and_parent():
    ws, x = jnp.linspace(0.1, 1.0, 5 * 3 * 4).reshape(5, 3, 4), jnp.ones(4)
    jaxpr = jax.make_jaxpr(_loop_step)(ws, x)
    loops = jax_compat.loops(jaxpr)
    outer = [i for i, loop in enumerate(loops) if loop.length == 5]
    inner = [loop for loop in loops if loop.length == 3]
    # The forward scan over blocks and its transpose, each with a scan over the inner three.
    assert len(outer) == 2 and all(loops[i].unroll == 2 for i in outer)
    assert len(inner) == 2 and {loop.parent for loop in inner} == set(outer)
    assert all(loops[i].parent is None for i in outer)
    assert any("transpose" in loops[i].name for i in outer)


def test_unrolled_sets_unroll_where_asked_and_computes_the_same():
    ws, x = jnp.linspace(0.1, 1.0, 5 * 3 * 4).reshape(5, 3, 4), jnp.ones(4)
    jaxpr = jax.make_jaxpr(_loop_step)(ws, x)
    loops = jax_compat.loops(jaxpr)
    new = jax_compat.unrolled(jaxpr, {loop.path: loop.length for loop in loops})
    assert [loop.unroll for loop in jax_compat.loops(new)] == [loop.length for loop in loops]
    # The jaxpr given is left as it was.
    assert [loop.unroll for loop in jax_compat.loops(jaxpr)] == [loop.unroll for loop in loops]
    np.testing.assert_allclose(
        jax_compat.jaxpr_function(new)(ws, x)[0], _loop_step(ws, x), rtol=1e-6
    )
    # Unrolled, the scans lower to no while loop.
    lowered = jax.jit(jax_compat.jaxpr_function(new)).lower(ws, x).as_text()
    assert "stablehlo.while" not in lowered


@pytest.mark.parametrize("length, unroll", [(6, 1), (6, 2), (7, 2), (6, 4), (6, 6), (5, 9), (4, 0)])
def test_scan_copies_counts_the_bodies_the_lowering_writes(length, unroll):
    """``scan_copies`` mirrors lax.scan's lowering; each copy of this body has one sine, written
    in place (jax 0.12) or as a call of one function that has it (jax 0.8.1)."""

    def f(x):
        return jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length, unroll=unroll)[0]

    text = jax.jit(f).lower(jnp.ones(3)).as_text()
    calls = re.findall(r"\bcall @(\w+)\(", text)
    copies = len(calls) if calls else text.count("stablehlo.sine")
    assert copies == jax_compat.scan_copies(length, unroll)
