"""inspect_matmuls and hlo_op_counts read the real jaxpr / HLO, nested jaxprs included."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax.casting.regions import region

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def _x_w(dtype=jnp.bfloat16):
    return jnp.ones((2, 4), dtype), jnp.ones((4, 4), dtype)


@jax.custom_jvp
def _custom_matmul(x, w):
    return x @ w


@_custom_matmul.defjvp
def _custom_matmul_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return x @ w, dx @ w + x @ dw


@jax.custom_vjp
def _custom_vjp_matmul(x, w):
    return x @ w


_custom_vjp_matmul.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


# A matmul in each kind of nested jaxpr: (name, function of (x, w), its context).
NESTED = [
    ("top", lambda x, w: x @ w, ()),
    ("jit", jax.jit(lambda x, w: x @ w), ("jit",)),
    (
        "scan",
        lambda x, w: jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=2)[0],
        ("scan",),
    ),
    (
        "while",
        lambda x, w: jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w), (0, x))[
            1
        ],
        ("while",),
    ),
    ("cond", lambda x, w: jax.lax.cond(True, lambda: x @ w, lambda: x), ("cond",)),
    ("remat", lambda x, w: jax.checkpoint(lambda x: x @ w)(x), ("remat2",)),
    ("custom_jvp", _custom_matmul, ("custom_jvp_call",)),
    ("custom_vjp", _custom_vjp_matmul, ("custom_vjp_call",)),
]


@pytest.mark.parametrize("name, fn, context", NESTED)
def test_finds_matmuls_in_nested_jaxprs(name, fn, context):
    report = mpjax.inspect_matmuls(fn)(*_x_w())
    assert len(report) >= 1, name
    first = report[0]
    assert first.primitive == "dot_general"
    assert first.context == context
    assert (first.lhs_dtype, first.rhs_dtype, first.out_dtype) == (BF16, BF16, BF16)
    assert first.lhs_shape == (2, 4) and first.rhs_shape == (4, 4) and first.out_shape == (2, 4)


@pytest.mark.parametrize("name, fn, context", NESTED)
def test_a_matmul_in_a_nested_jaxpr_is_in_the_region_around_it(name, fn, context):
    # JAX starts a fresh name stack for each nested trace: the equations inside record none of
    # the scopes around it, and the region is read from those of the equations enclosing them.
    def in_region(x, w):
        with region(mpjax.get_policy("mixed_bfloat16"), "block/mlp"):
            return fn(x, w)

    report = mpjax.inspect_matmuls(in_region)(*_x_w())
    assert report and {m.region for m in report} == {"block/mlp"}, name
    assert report[0].context == context


def test_finds_matmuls_inside_shard_map():
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    fn = shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    (m,) = mpjax.inspect_matmuls(fn)(*_x_w())
    assert m.context == ("shard_map",) and m.lhs_shape == (1, 4)


def test_backward_matmuls_are_reported_with_their_dtypes():
    # An f32 accumulation type (preferred_element_type) on a bf16 dot gives f32 cotangents, so
    # the backward matmuls run with an f32 operand.
    def loss(w, x):
        y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32))

    x, w = _x_w()
    report = mpjax.inspect_matmuls(jax.grad(loss))(w, x)
    assert report[0].preferred_element_type == F32
    backward = report[1:]
    assert backward and all(F32 in m.operand_dtypes for m in backward)
    assert ("float32", "bfloat16") in report.operand_dtypes() or (
        "bfloat16",
        "float32",
    ) in report.operand_dtypes()


def test_reports_convolutions():
    x = jnp.ones((1, 8, 8, 3), jnp.bfloat16)
    k = jnp.ones((3, 3, 3, 4), jnp.bfloat16)

    def conv(x, k):
        return jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    (m,) = mpjax.inspect_matmuls(conv)(x, k)
    assert m.primitive == "conv_general_dilated" and m.out_shape == (1, 8, 8, 4)


def test_scope_comes_from_named_scopes():
    def f(x, w):
        with jax.named_scope("mlp"):
            return x @ w

    (m,) = mpjax.inspect_matmuls(f)(*_x_w())
    assert "mlp" in m.scope


def test_report_prints_a_table():
    text = str(mpjax.inspect_matmuls(lambda x, w: x @ w)(*_x_w()))
    header, rule, row = text.splitlines()
    assert header.split() == [
        "primitive",
        "lhs",
        "rhs",
        "out",
        "preferred",
        "f32",
        "precision",
        "context",
        "pass",
        "module",
        "policy",
    ]
    assert set(rule.replace(" ", "")) == {"-"}
    assert row.split()[:4] == ["dot_general", "bfloat16[2,", "4]", "bfloat16[4,"]
    assert row.split()[-3:] == ["forward", "-", "-"]  # no region: the function's own dtypes
    assert str(mpjax.inspect_matmuls(jnp.sin)(jnp.ones(2))) == "no matmuls or convolutions"


class _TwoLayersNNX(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(4, 8, rngs=rngs)
        self.fc2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


class _TwoLayersLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="fc2")(nn.relu(nn.Dense(8, name="fc1")(x)))


def _rows(report):
    return [line.split()[-3:] for line in str(report).splitlines()[2:]]


def test_the_table_names_each_module_and_its_policy_once():
    # JAX's name stack holds mpjax's region names, which repeat the policy and the path
    # (linen: 'jvp(L)/mpjax[p=f32,c=f16,o=f32]/fc1/mpjax[p=f32,c=f16,o=f32]fc1'); the table
    # shows the pass, the module's path and its policy, each once.
    x = jnp.ones((3, 4))
    policy = "p=f32,c=f16,o=f32"
    model = _TwoLayersNNX(nnx.Rngs(0))
    mpjax.nnx.set_policy(model, mpjax.Rules({"fc2": "float32"}, default="mixed_float16"))
    rows = _rows(mpjax.inspect_matmuls(nnx.grad(lambda m, x: m(x).sum()))(model, x))
    f32 = "p=f32,c=f32,o=f32"
    assert rows == [
        ["forward", "fc1", policy],
        ["forward", "fc2", f32],
        ["backward", "fc2", f32],
        ["backward", "fc2", f32],
        ["backward", "fc1", policy],
    ]
    wrapped = mpjax.linen.apply_policy(_TwoLayersLinen(), "mixed_float16")
    variables = wrapped.init(jax.random.key(0), x)
    report = mpjax.inspect_matmuls(jax.grad(lambda v: wrapped.apply(v, x).sum()))(variables)
    assert [row[1:] for row in _rows(report)] == [["fc1", policy], ["fc2", policy]] + [
        ["fc2", policy]
    ] * 2 + [["fc1", policy]]
    assert "mpjax[" not in str(report)
    assert report[0].scope.count("mpjax[") == 2  # the name stack itself is kept as data
    # Outside any region: the user's own scopes (here Flax's module names under autocast).
    plain = mpjax.autocast(lambda v: _TwoLayersLinen().apply(v, x), "mixed_float16")
    unwrapped = _TwoLayersLinen().init(jax.random.key(0), x)
    assert [m.module for m in mpjax.inspect_matmuls(plain)(unwrapped)] == [
        "_TwoLayersLinen/fc1",
        "_TwoLayersLinen/fc2",
    ]


def test_a_gradient_inside_a_jit_is_still_the_backward_pass():
    # JAX starts a fresh name stack inside a jit, so the transposed jit's own equations carry
    # no transpose: the pass is read from the equation that holds them.
    inner = jax.jit(lambda w, x: jnp.tanh(x @ w).sum())
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    report = mpjax.inspect_matmuls(jax.grad(inner))(w, x)
    assert [(m.backward, bool(m.context)) for m in report] == [(False, True), (True, True)]


def test_accepts_shape_dtype_structs():
    spec = jax.ShapeDtypeStruct((2, 4), jnp.float16), jax.ShapeDtypeStruct((4, 4), jnp.float16)
    (m,) = mpjax.inspect_matmuls(lambda x, w: x @ w)(*spec)
    assert m.lhs_dtype == np.dtype(jnp.float16)


def test_hlo_op_counts_counts_converts():
    x, w = _x_w(jnp.float32)
    plain = mpjax.hlo_op_counts(lambda x, w: x @ w, compiled=False)(x, w)
    cast = mpjax.hlo_op_counts(
        lambda x, w: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16), compiled=False
    )(x, w)
    assert plain["dot"] == cast["dot"] == 1
    assert plain["convert"] == 0 and cast["convert"] == 2
    assert mpjax.hlo_op_counts(lambda x, w: x @ w)(x, w)["dot"] >= 1


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: mpjax.hlo_op_counts(3), r"hlo_op_counts\(fn\): fn must be the function .*got 3"),
        (
            lambda: mpjax.hlo_op_counts(jnp.sin(jnp.ones(2))),
            r"fn must be the function to inspect, got Array.*hlo_op_counts\(f\)\(x\)",
        ),
        (lambda: mpjax.inspect_matmuls(3), r"inspect_matmuls\(fn\): fn must be .*got 3"),
        (lambda: mpjax.hlo_dots(None), r"hlo_dots\(fn\): fn must be .*got None"),
        (
            lambda: mpjax.inspect_matmuls(jnp.sin, primitives=None),
            r"primitives=...\) takes a set of primitive names.*got None",
        ),
        (
            lambda: mpjax.hlo_op_counts(jnp.sin, compiled="yes"),
            r"hlo_op_counts\(..., compiled=...\) must be a bool .*got 'yes' of type str",
        ),
    ],
)
def test_inspection_checks_its_arguments_when_called_not_when_lowering(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def test_every_keyword_reaches_the_function_through_the_curried_call():
    def fn(x, w, *, primitives, compiled):  # keywords named like the options
        return (x @ w) * primitives * compiled

    x, w = _x_w(jnp.float32)
    one = jnp.ones((), jnp.float32)
    (m,) = mpjax.inspect_matmuls(fn)(x, w, primitives=one, compiled=one)
    assert m.lhs_dtype == F32
    assert mpjax.hlo_op_counts(fn, compiled=False)(x, w, primitives=one, compiled=one)["dot"] == 1


def test_options_go_with_the_function():
    x, w = _x_w()
    assert (
        mpjax.inspect_matmuls(lambda x, w: x @ w, primitives=frozenset({"conv_general_dilated"}))(
            x, w
        )
        == ()
    )
    lowered = mpjax.hlo_op_counts(
        lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32), compiled=False
    )(x, w)
    assert lowered["convert"] == 2


def test_uncurried_calls_are_a_type_error_naming_the_curried_form():
    x, w = _x_w()
    curried = r"call inspect_matmuls\(fn\)\(\*args, \*\*kwargs\)"
    with pytest.raises(TypeError, match=curried):
        mpjax.inspect_matmuls(lambda x, w: x @ w, x, w)
    with pytest.raises(TypeError, match=curried):
        mpjax.inspect_matmuls(lambda x, *, w: x @ w, w=w, primitives=frozenset())
    with pytest.raises(TypeError, match=r"call hlo_op_counts\(fn\)\(\*args, \*\*kwargs\)"):
        mpjax.hlo_op_counts(lambda x, w: x @ w, x, w, compiled=False)


def test_f32_matmuls_show_the_precision_they_run_at():
    def f(x, w):
        with mpjax.full_precision():
            y = x @ w
        return y @ w

    x, w = _x_w(jnp.float32)
    plain = mpjax.inspect_matmuls(f)(x, w)
    assert [m.f32_precision for m in plain] == ["default", "default"]
    ran = mpjax.inspect_matmuls(jax.grad(lambda x, w: mpjax.autocast(f)(x, w).sum()))(x, w)
    assert {(m.lhs_dtype.name, m.f32_precision) for m in ran} == {
        ("float32", "highest"),
        ("bfloat16", None),
    }
    fast = mpjax.autocast(f, policy=mpjax.get_policy("float32").with_f32_matmul_precision("tf32"))
    report = mpjax.inspect_matmuls(fast)(x, w)
    assert [m.f32_precision for m in report] == ["highest", "tf32"]  # full_precision: highest
    rows = str(report).splitlines()[2:]
    assert "highest" in rows[0].split() and "tf32" in rows[1].split()
