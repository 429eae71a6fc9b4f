"""Policy values, casting, parsing, errors and jmp interop."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpjax
from mpjax import Policy, get_policy

F32, BF16, F16, F64 = (np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))
FLOATS = [F16, BF16, F32, F64]
TARGETS = [F16, BF16, F32]
CAST_METHODS = ["cast_to_param", "cast_to_compute", "cast_to_output"]


def _policy_casting_to(method, target):
    """A policy whose `method` casts to `target` while the other two dtypes differ from it."""
    other = F32 if target != F32 else BF16
    fields = {
        "cast_to_param": (target, other, other),
        "cast_to_compute": (other, target, other),
        "cast_to_output": (other, other, target),
    }[method]
    return Policy(*fields)


# ---------------------------------------------------------------------------------------------
# The value itself


def test_dtypes_are_normalized_from_any_spelling():
    spelled = Policy("float32", jnp.bfloat16, np.dtype("float32"))
    assert spelled == Policy(F32, BF16, F32)
    assert all(isinstance(d, np.dtype) for d in spelled._dtypes())


def test_policy_is_frozen_and_hashable():
    policy = get_policy("mixed_bfloat16")
    with pytest.raises(AttributeError):
        policy.compute_dtype = F16
    assert hash(policy) == hash(get_policy("p=f32,c=bf16,o=f32"))
    assert len({policy, get_policy("params=float32,compute=bfloat16,output=float32")}) == 1


def test_repr_and_str_are_readable_and_str_round_trips():
    policy = get_policy("mixed_float16")
    assert (
        repr(policy) == "Policy(param_dtype=float32, compute_dtype=float16, output_dtype=float32)"
    )
    assert str(policy) == "p=f32,c=f16,o=f32"
    for spec in ["float32", "bf16", "mixed_bfloat16", "p=f16,c=f16,o=f32", "c=float8_e4m3fn"]:
        policy = get_policy(spec)
        assert get_policy(str(policy)) == policy


def test_with_methods_replace_one_dtype():
    base = get_policy("float32")
    assert base.with_param_dtype("bf16") == Policy(BF16, F32, F32)
    assert base.with_compute_dtype(jnp.float16) == Policy(F32, F16, F32)
    assert base.with_output_dtype("bfloat16") == Policy(F32, F32, BF16)
    assert base == Policy(F32, F32, F32), "with_* must not mutate"
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point dtype, got int32"):
        base.with_compute_dtype(jnp.int32)


def test_policy_is_not_a_pytree():
    policy = get_policy("mixed_bfloat16")
    assert jax.tree.leaves(policy) == [policy]


def test_policy_as_static_argument_traces_once_per_distinct_policy():
    traces = []

    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x)

    jf = jax.jit(f, static_argnums=1)
    x = jnp.ones(3)
    assert jf(x, get_policy("mixed_bfloat16")).dtype == BF16
    assert jf(x, get_policy("p=f32,c=bf16,o=f32")).dtype == BF16  # equal policy: cache hit
    assert len(traces) == 1
    assert jf(x, get_policy("mixed_float16")).dtype == F16
    assert len(traces) == 2


def test_policy_captured_by_jitted_function():
    policy = get_policy("mixed_float16")
    out = jax.jit(lambda x: policy.cast_to_output(policy.cast_to_compute(x) * 2))(jnp.ones(2))
    assert out.dtype == F32


# ---------------------------------------------------------------------------------------------
# Casting


# jax arrays are f64 only with jax_enable_x64, which the suite leaves off.
SOURCES = [("numpy", d) for d in FLOATS] + [("jax", d) for d in FLOATS if d != F64]


@pytest.mark.parametrize("method", CAST_METHODS)
@pytest.mark.parametrize("target", TARGETS, ids=lambda d: d.name)
@pytest.mark.parametrize("kind, source", SOURCES, ids=lambda v: getattr(v, "name", v))
def test_casting_table(method, target, kind, source):
    policy = _policy_casting_to(method, target)
    values = np.array([1.5, -2.25, 0.0], dtype=source)
    leaf = values if kind == "numpy" else jnp.asarray(values, dtype=source)
    out = getattr(policy, method)(leaf)
    assert out.dtype == target
    assert isinstance(out, np.ndarray if kind == "numpy" else jax.Array)
    np.testing.assert_array_equal(np.asarray(out, np.float32), values.astype(np.float32))


def _mixed_tree():
    return {
        "w": jnp.ones((2, 3), jnp.float32),
        "np_w": np.ones(3, np.float16),
        "np_scalar": np.float32(2.0),
        "nested": [jnp.zeros(2, jnp.bfloat16), (jnp.arange(3), None)],
        "ints": jnp.arange(4, dtype=jnp.int32),
        "np_ints": np.arange(3),
        "bools": jnp.array([True, False]),
        "complex": jnp.ones(2, jnp.complex64),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(0),
        "name": "layer",
        "py_float": 1.5,
        "py_int": 3,
        "none": None,
    }


@pytest.mark.parametrize("method", CAST_METHODS)
def test_nested_tree_casts_only_floating_array_leaves(method):
    policy = _policy_casting_to(method, F16)
    tree = _mixed_tree()
    out = getattr(policy, method)(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert out["w"].dtype == F16 and out["np_w"].dtype == F16
    assert out["np_scalar"].dtype == F16
    assert out["nested"][0].dtype == F16
    for name in [
        "ints",
        "np_ints",
        "bools",
        "complex",
        "key",
        "raw_key",
        "name",
        "py_float",
        "py_int",
        "none",
    ]:
        assert out[name] is tree[name], name
    assert out["nested"][1][0] is tree["nested"][1][0]


def test_leaf_already_in_target_dtype_is_returned_as_is():
    x = jnp.ones(3, jnp.bfloat16)
    assert get_policy("bf16").cast_to_compute(x) is x


def test_weakly_typed_scalars_are_left_alone():
    weak = jnp.asarray(1.5)
    assert jax.typeof(weak).weak_type
    assert get_policy("bf16").cast_to_compute(weak) is weak


@pytest.mark.parametrize("method", CAST_METHODS)
def test_cast_is_identical_under_jit(method):
    policy = _policy_casting_to(method, BF16)
    # jit turns numpy leaves into jax arrays (int64 into int32): compare on what jit sees.
    tree = {k: v for k, v in _mixed_tree().items() if k not in ("name", "none")}
    tree = jax.tree.map(
        lambda x: jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x, tree
    )
    eager = getattr(policy, method)(tree)
    jitted = jax.jit(getattr(policy, method))(tree)
    assert jax.tree.structure(eager) == jax.tree.structure(jitted)
    for path_leaf_e, leaf_j in zip(jax.tree.leaves_with_path(eager), jax.tree.leaves(jitted)):
        path, leaf_e = path_leaf_e
        if jax.dtypes.issubdtype(jnp.asarray(leaf_j).dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(leaf_e), jax.random.key_data(leaf_j))
            continue
        # jit returns arrays where eager returns Python scalars; dtypes of arrays must agree.
        if not isinstance(leaf_e, (int, float)):
            assert np.asarray(leaf_e).dtype == leaf_j.dtype, path
        else:
            assert jax.typeof(leaf_j).weak_type, path
        np.testing.assert_array_equal(np.asarray(leaf_e), np.asarray(leaf_j))


def test_cast_floating_rejects_non_floating_target():
    with pytest.raises(ValueError, match="dtype must be a floating-point dtype, got int32"):
        mpjax.cast_floating(jnp.ones(2), jnp.int32)


# ---------------------------------------------------------------------------------------------
# Parsing


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("float32", (F32, F32, F32)),
        ("f32", (F32, F32, F32)),
        ("full", (F32, F32, F32)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("bf16", (BF16, BF16, BF16)),
        ("float16", (F16, F16, F16)),
        ("f16", (F16, F16, F16)),
        ("half", (F16, F16, F16)),
        ("float64", (F64, F64, F64)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("mixed_float16", (F32, F16, F32)),
        ("  mixed_bfloat16  ", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32, c=bf16, o=f32", (F32, BF16, F32)),
        ("p = f32 , c = f16", (F32, F16, F16)),
        ("o=f32,c=bf16,p=f32", (F32, BF16, F32)),
        # jmp's defaults: params f32, compute follows params, output follows compute.
        ("c=bf16", (F32, BF16, BF16)),
        ("p=bf16", (BF16, BF16, BF16)),
        ("o=bf16", (F32, F32, BF16)),
        ("p=f16,o=f32", (F16, F16, F32)),
        ("c=float8_e4m3fn,o=f32", (F32, np.dtype(jnp.float8_e4m3fn), F32)),
    ],
)
def test_grammar(spec, expected):
    assert get_policy(spec) == Policy(*expected)


@pytest.mark.parametrize(
    "spec",
    ["p=f32,c=bf16,o=f32", "c=bf16", "p=f16,o=f32", "bf16", "f32", "half", "float16", "full"],
)
def test_grammar_agrees_with_jmp(spec):
    theirs = jmp.get_policy(spec)
    if spec == "half" and theirs.compute_dtype != jnp.float16:
        pytest.skip("jmp maps 'half' to bfloat16 on this backend")
    assert get_policy(spec) == Policy.from_jmp(theirs)


@pytest.mark.parametrize(
    "value", [jnp.bfloat16, jnp.float16, np.float32, np.dtype("float32"), jnp.dtype("bfloat16")]
)
def test_dtype_objects_make_uniform_policies(value):
    dtype = np.dtype(value)
    assert get_policy(value) == Policy(dtype, dtype, dtype)


def test_policy_passes_through_unchanged():
    policy = Policy(F32, BF16, F32)
    assert get_policy(policy) is policy


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "Empty policy string.*mixed_bfloat16"),
        ("   ", "Empty policy string"),
        ("mixed_bf", "Unknown policy 'mixed_bf'.*mixed_bfloat16, mixed_float16.*bfloat16"),
        ("int32", "Unknown policy 'int32'.*float32"),
        ("x=f32", "Unknown key 'x'.*Valid keys: p, params, c, compute, o, output"),
        ("p=f32,compute_dtype=bf16", "Unknown key 'compute_dtype'.*Valid keys"),
        ("p=f33", "Unknown dtype name 'f33' for params dtype \\(p=\\).*Valid names: float32"),
        ("c=int32", "Unknown dtype name 'int32' for compute dtype.*Valid names"),
        ("p=bool", "Unknown dtype name 'bool'.*Valid names"),
        ("p=f32,p=bf16", "Duplicate key 'p'.*params dtype is given more than once"),
        ("p=f32,params=bf16", "Duplicate key 'params'.*params dtype is given more than once"),
        ("c=bf16,compute=f16", "Duplicate key 'compute'"),
        ("p=f32,", "Malformed entry '' in policy 'p=f32,'.*key=dtype"),
        ("p=f32,,c=bf16", "Malformed entry ''"),
        ("p=", "Malformed entry 'p='"),
        ("=f32", "Malformed entry '=f32'"),
        ("p=f32;c=bf16", "Unknown dtype name 'f32;c=bf16'"),
        (
            "p=float8_e4m3fn",
            "param_dtype float8_e4m3fn is too narrow.*float32, bfloat16 or float16",
        ),
        ("float8_e5m2", "param_dtype float8_e5m2 is too narrow"),
    ],
)
def test_grammar_errors_name_the_bad_part(spec, message):
    with pytest.raises(ValueError, match=message):
        get_policy(spec)


@pytest.mark.parametrize(
    "spec, suggested",
    [
        ("mixed_bfloa16", "'mixed_bfloat16'"),
        ("mixed_bf16", "'mixed_bfloat16'"),
        ("mixed_bfloat16_mxpf8", "'mixed_bfloat16_mxfp8'"),
        ("bfloat61", "'bfloat16'"),
        ("p=f32,c=bflaot16", "'bfloat16'"),
    ],
)
def test_a_misspelled_policy_gets_the_closest_names(spec, suggested):
    with pytest.raises(ValueError, match=f"Did you mean {suggested}") as error:
        get_policy(spec)
    assert "Use a preset" in str(error.value) or "Valid names" in str(error.value)


def test_a_policy_far_from_every_name_gets_no_guess():
    with pytest.raises(ValueError) as error:
        get_policy("xyz")
    assert "Did you mean" not in str(error.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (jnp.int32, F32, F32),
            "param_dtype must be a floating-point dtype, got int32.*Valid names",
        ),
        ((F32, jnp.bool_, F32), "compute_dtype must be a floating-point dtype, got bool"),
        ((F32, F32, jnp.int8), "output_dtype must be a floating-point dtype, got int8"),
        ((F32, jnp.complex64, F32), "compute_dtype must be a floating-point dtype, got complex64"),
        ((jnp.float8_e4m3fn, BF16, F32), "param_dtype float8_e4m3fn is too narrow"),
        (("f33", F32, F32), "Unknown dtype name 'f33' for param_dtype"),
    ],
)
def test_constructor_errors(args, message):
    with pytest.raises(ValueError, match=message):
        Policy(*args)


def test_constructor_rejects_non_dtypes_with_type_error():
    with pytest.raises(
        TypeError, match="param_dtype must be a floating dtype.*got 3.5 of type float"
    ):
        Policy(3.5, F32, F32)


@pytest.mark.parametrize("value", [3, None, ["p=f32"], {"p": "f32"}])
def test_get_policy_rejects_other_types(value):
    with pytest.raises(
        TypeError, match=r"Cannot make a policy from .* of type .*Pass a Policy, a jmp.Policy"
    ):
        get_policy(value)


def test_a_large_object_is_not_spelled_out_in_the_error():
    with pytest.raises(TypeError) as error:
        get_policy(list(range(10_000)))
    assert len(str(error.value)) < 300


@pytest.mark.parametrize("value", [3, None, "p=f32,c=bf16,o=f32", {"param_dtype": "f32"}])
def test_from_jmp_rejects_what_is_not_a_jmp_style_policy_naming_the_argument(value):
    with pytest.raises(
        TypeError, match=r"Policy.from_jmp\(policy\): policy must be a jmp.Policy .*got "
    ):
        Policy.from_jmp(value)


def test_get_policy_rejects_non_floating_dtype_objects():
    with pytest.raises(ValueError, match="param_dtype must be a floating-point dtype, got int32"):
        get_policy(jnp.int32)


# ---------------------------------------------------------------------------------------------
# jmp interop


@pytest.mark.parametrize(
    "spec", ["mixed_bfloat16", "mixed_float16", "float32", "p=bf16,c=bf16,o=f32"]
)
def test_jmp_round_trip(spec):
    policy = get_policy(spec)
    theirs = policy.to_jmp()
    assert isinstance(theirs, jmp.Policy)
    assert (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype) == policy._dtypes()
    assert get_policy(theirs) == policy
    assert Policy.from_jmp(theirs) == policy
    # str(policy) is valid jmp grammar, read the same way by jmp.
    assert Policy.from_jmp(jmp.get_policy(str(policy))) == policy


def test_jmp_and_mpjax_cast_arrays_alike():
    tree = {"w": jnp.ones(2), "n": jnp.arange(2), "h": np.ones(2, np.float16)}
    ours = get_policy("mixed_bfloat16")
    theirs = ours.to_jmp()
    for method in CAST_METHODS:
        a, b = getattr(ours, method)(tree), getattr(theirs, method)(tree)
        assert jax.tree.map(lambda x: x.dtype, a) == jax.tree.map(lambda x: x.dtype, b)


def test_to_jmp_without_jmp_names_the_extra(monkeypatch):
    monkeypatch.setattr(mpjax.policy, "jmp", None)
    message = r'^Policy.to_jmp\(\) needs jmp.*pip install "mpjax\[jmp\]"'
    with pytest.raises(ImportError, match=message):
        get_policy("mixed_bfloat16").to_jmp()


def test_any_jmp_style_policy_object_is_a_policy():
    class Duck:
        param_dtype, compute_dtype, output_dtype = jnp.float32, jnp.bfloat16, jnp.float16

    assert isinstance(Duck(), mpjax.policy.JmpStylePolicy)
    assert get_policy(Duck()) == Policy(F32, BF16, F16)
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point dtype, got int32"):
        get_policy(
            type("Bad", (), {"param_dtype": F32, "compute_dtype": np.int32, "output_dtype": F32})()
        )


# ---------------------------------------------------------------------------------------------
# is_floating: the one "is this floating" predicate


@pytest.mark.parametrize(
    "x, expected",
    [
        (jnp.bfloat16, True),
        (np.float16, True),
        (F64, True),
        (jnp.float8_e4m3fn, True),
        (jnp.ones(2), True),
        (np.ones(2, np.float16), True),
        (np.float32(1), True),
        (jax.ShapeDtypeStruct((2,), jnp.bfloat16), True),
        (jax.typeof(jnp.ones(())), True),
        (jnp.int32, False),
        (np.arange(2), False),
        (jnp.ones(2, bool), False),
        (jnp.ones(2, jnp.complex64), False),
        (jax.random.key(0), False),
        (1.0, False),
        (None, False),
        ("float32", False),
    ],
)
def test_is_floating(x, expected):
    assert mpjax.policy.is_floating(x) is expected


def test_is_floating_under_jit_sees_tracers():
    seen = []
    jax.jit(lambda x, n: seen.append((mpjax.policy.is_floating(x), mpjax.policy.is_floating(n))))(
        jnp.ones(2), jnp.arange(2)
    )
    assert seen == [(True, False)]


# ---------------------------------------------------------------------------------------------
# Bad input, and properties of the grammar


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: get_policy(np.longdouble),
            ValueError,
            r"param_dtype must be a dtype JAX computes in, got float128",
        ),
        (
            lambda: Policy(None, jnp.float32, jnp.float32),
            TypeError,
            r"param_dtype must be a floating dtype .*; got None\.",
        ),
        (
            lambda: Policy(jnp.float32, np.longdouble, jnp.float32),
            ValueError,
            r"compute_dtype must be a dtype JAX computes in",
        ),
    ],
)
def test_dtypes_jax_cannot_compute_in_are_rejected_naming_the_field(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16", "float32", "bfloat16"])
def test_to_jmp_policy_prints_and_parses_back(name):
    policy = get_policy(name)
    jmp_policy = policy.to_jmp()
    text = str(jmp_policy)
    assert text.startswith("p=") and get_policy(text) == policy
    assert get_policy(jmp_policy) == policy
    assert jmp_policy.cast_to_compute(jnp.ones(2)).dtype == policy.compute_dtype


FLOATS = ["float16", "bfloat16", "float32", "float64"]


@settings(max_examples=60, deadline=None)
@given(
    param=st.sampled_from(FLOATS), compute=st.sampled_from(FLOATS), output=st.sampled_from(FLOATS)
)
def test_every_policy_round_trips_through_its_string_and_jmps(param, compute, output):
    policy = Policy(param, compute, output)
    assert get_policy(str(policy)) == policy
    short = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}
    assert get_policy(f"p={short[param]},c={short[compute]},o={short[output]}") == policy
    assert get_policy(f"c={short[compute]},p={short[param]},o={short[output]}") == policy
    assert get_policy(policy.to_jmp()) == policy


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=30))
def test_any_string_parses_or_raises_value_error(text):
    try:
        policy = get_policy(text)
    except ValueError:
        return
    assert isinstance(policy, Policy)
    assert get_policy(str(policy)) == policy


# ---------------------------------------------------------------------------------------------
# The precision of float32 matmuls


def test_f32_matmuls_are_true_f32_unless_a_policy_opts_into_a_fast_mode():
    for spec in ["float32", "mixed_bfloat16", "p=f32,c=f16", jnp.float32]:
        assert get_policy(spec).f32_matmul_precision == "highest"
    fast = get_policy("p=f32,c=f32,o=f32,f32_matmul=tf32")
    assert fast.f32_matmul_precision == "tf32"
    assert fast == get_policy("float32").with_f32_matmul_precision("tf32")
    assert fast == Policy(F32, F32, F32, f32_matmul_precision="tf32")
    assert fast != get_policy("float32") and hash(fast) != hash(get_policy("float32"))
    assert jax.tree.leaves(fast) == [fast]


def test_f32_matmul_precision_is_printed_when_not_the_default_and_round_trips():
    assert str(get_policy("float32")) == "p=f32,c=f32,o=f32"
    for name in ["high", "default", "bf16_3x", "tf32", "bf16"]:
        policy = get_policy("mixed_bfloat16_fp8").with_f32_matmul_precision(name)
        assert str(policy) == f"p=f32,c=bf16,o=f32,fp8=current,f32_matmul={name}"
        assert repr(policy).endswith(f", fp8='current', f32_matmul_precision='{name}')")
        assert get_policy(str(policy)) == policy
        # A precision region's name carries its policy, precision included.
        assert (
            mpjax.casting.regions.innermost([mpjax.casting.regions.scope_name(policy)]).policy
            == policy
        )


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: get_policy("p=f32,f32_matmul=fast"),
            ValueError,
            r"The f32_matmul= entry of policy 'p=f32,f32_matmul=fast': unknown precision 'fast'\. Valid names: highest, high, default, bf16_3x, tf32, bf16",
        ),
        (
            lambda: get_policy("p=f32,f32_matmul=high,f32_matmul=tf32"),
            ValueError,
            "Duplicate key 'f32_matmul'",
        ),
        (
            lambda: Policy(F32, F32, F32, f32_matmul_precision="HIGHEST"),
            ValueError,
            r"Policy\(f32_matmul_precision=...\): unknown precision 'HIGHEST'",
        ),
        (
            lambda: Policy(F32, F32, F32, f32_matmul_precision=jax.lax.Precision.HIGHEST),
            TypeError,
            r"Policy\(f32_matmul_precision=...\) must be one of the names highest, .*; got .*HIGHEST.* of type Precision\.",
        ),
        (
            lambda: get_policy("float32").with_f32_matmul_precision(None),
            TypeError,
            r"with_f32_matmul_precision\(precision\) must be one of the names",
        ),
    ],
)
def test_f32_matmul_precision_errors_name_the_argument_and_the_valid_names(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_jmp_has_no_f32_matmul_precision_so_from_jmp_gives_true_f32():
    fast = get_policy("float32").with_f32_matmul_precision("bf16")
    theirs = fast.to_jmp()
    assert (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype) == fast._dtypes()
    assert Policy.from_jmp(theirs) == get_policy("float32")
    assert Policy.from_jmp(theirs).f32_matmul_precision == "highest"
