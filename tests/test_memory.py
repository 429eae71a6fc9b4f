"""memory_report: bytes per parameter of float32 Adam, master weights, low-precision params with
a narrow or quantized state and gradient accumulation, counted from arrays or from jax.eval_shape, its part
names, table and JSON form, sharded arrays, and bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax import (
    MemoryReport,
    MemoryRow,
    loss_scaling,
    low_precision_params,
    master_weights,
    memory_report,
    quantized_state,
    state_precision,
)

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)


def make_params(dtype=F32):
    return {"w": jnp.ones((32, 8), dtype), "b": jnp.zeros(8, dtype)}


N = 32 * 8 + 8  # param elements


def test_float32_adam_is_12_bytes_per_param():
    params = make_params()
    report = memory_report(params, optax.adam(1e-3).init(params))
    assert isinstance(report, MemoryReport)
    assert report.param_count == N
    assert report.rows == (
        MemoryRow("params", "f32", 4 * N),
        MemoryRow("count", "int32", 4),
        MemoryRow("mu", "f32", 4 * N),
        MemoryRow("nu", "f32", 4 * N),
    )
    assert report.param_bytes == 4 * N and report.state_bytes == 8 * N + 4
    assert report.total_bytes == 12 * N + 4
    assert report.bytes_per_param == (12 * N + 4) / N
    assert round(report.bytes_per_param, 1) == 12.0


def test_master_weights_on_bfloat16_params_is_14_bytes_per_param():
    params = make_params(BF16)
    report = memory_report(params, master_weights(optax.adam(1e-3)).init(params))
    assert report.part_bytes("params") == 2 * N
    assert report.part_bytes("master") == 4 * N
    assert report.part_bytes("mu") == report.part_bytes("nu") == 4 * N
    assert report.total_bytes - report.part_bytes("count") == 14 * N
    assert [(r.part, r.dtype) for r in report.rows] == [
        ("params", "bf16"),
        ("master", "f32"),
        ("count", "int32"),
        ("mu", "f32"),
        ("nu", "f32"),
    ]


def test_parts_of_composed_states():
    params = make_params(BF16)
    sp = state_precision(optax.adam(1e-3), "bf16", rounding="stochastic")
    kahan = memory_report(params, low_precision_params(sp, "kahan").init(params))
    assert {r.part for r in kahan.rows} == {"params", "count", "mu", "nu", "key", "compensation"}
    assert kahan.part_bytes("compensation") == 2 * N
    assert kahan.part_bytes("key") == 8  # state_precision's key; kahan carries none
    assert kahan.total_bytes == 8 * N + 8 + 4
    stochastic = memory_report(params, low_precision_params(sp, "stochastic").init(params))
    assert stochastic.part_bytes("key") == 16 and stochastic.part_bytes("compensation") == 0
    assert stochastic.total_bytes - 16 - 4 == 6 * N
    # Gradient accumulation keeps a gradient-sized accumulator under MultiSteps' acc_grads;
    # loss scaling a float32 scale and int32 counters.
    with jax.numpy_dtype_promotion("standard"):
        tx = loss_scaling(optax.MultiSteps(optax.adam(1e-3), 4))
        state = tx.init(params)
        report = memory_report(params, state)
    acc = jax.tree.leaves(state.inner_state.acc_grads)
    assert report.part_bytes("acc_grads") == sum(x.size * x.dtype.itemsize for x in acc) >= 2 * N
    assert report.part_bytes("mu") == report.part_bytes("nu") == 2 * N  # optax: params' dtype
    assert report.part_bytes("loss_scale") == 4
    assert {"applied", "skipped_steps", "mini_step", "gradient_step"} <= {
        r.part for r in report.rows
    }


@pytest.mark.parametrize(
    "name, bits, block", [("dynamic8", 8, 256), ("e4m3", 8, 256), ("dynamic4", 4, 128)]
)
@pytest.mark.slow
def test_bf16_params_and_quantized_moments_are_about_4_or_3_bytes_per_param(name, bits, block):
    # bf16 params with stochastic rounding (2 bytes) and two moments of bits / 8 bytes plus a
    # float32 absmax per block: 4 + 8 / 256 with 8-bit moments, 3 + 8 / 128 with 4-bit ones.
    params = {"w": jnp.zeros((256, 256), BF16)}
    n = 256 * 256
    tx = low_precision_params(quantized_state(optax.adam(1e-3), name), "stochastic")
    report = memory_report(params, tx.init(params))
    moment = n * bits // 8 + 4 * n // block
    assert [(r.part, r.dtype, r.bytes) for r in report.rows] == [
        ("params", "bf16", 2 * n),
        ("count", "int32", 4),
        ("mu", name, moment),
        ("nu", name, moment),
        ("key", "uint32", 8),
    ]
    expected = 2 + 2 * (bits / 8 + 4 / block)
    assert (report.total_bytes - 12) / n == expected  # 4.03125 or 3.0625
    assert report.table().splitlines()[-1].split()[-1] == f"{expected:.2f}"
    # Counted alike from jax.eval_shape, without building the state.
    abstract = jax.eval_shape(lambda: params)
    assert memory_report(abstract, jax.eval_shape(tx.init, abstract)) == report


def test_eval_shape_gives_the_same_report_as_arrays():
    params = make_params(BF16)
    tx = master_weights(state_precision(optax.adamw(1e-3), {"mu": "bf16"}))
    real = memory_report(params, tx.init(params))
    abstract_params = jax.eval_shape(lambda: make_params(BF16))
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract_state))
    assert memory_report(abstract_params, abstract_state) == real
    assert real.part_bytes("mu") == 2 * N and real.part_bytes("nu") == 4 * N


def test_sharded_arrays_count_whole():
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    sharded = jax.device_put(make_params(), NamedSharding(mesh, P()))
    sharded["w"] = jax.device_put(sharded["w"], NamedSharding(mesh, P("x")))
    tx = optax.adam(1e-3)
    assert memory_report(sharded, tx.init(sharded)) == memory_report(
        make_params(), tx.init(make_params())
    )


def test_non_floating_params_are_counted_but_not_per_param():
    params = {**make_params(), "step": jnp.zeros((), jnp.int32), "ids": jnp.arange(10)}
    report = memory_report(params, optax.sgd(0.1).init(make_params()))
    assert report.param_count == N
    assert report.part_bytes("params") == 4 * N + 4 + 40
    assert report.state_bytes == 0


def test_table_and_to_dict():
    params = make_params()
    report = memory_report(params, optax.adam(1e-3).init(params))
    table = report.table()
    assert str(report) == table
    lines = table.splitlines()
    assert lines[0].split() == ["part", "dtype", "bytes", "bytes/param"]
    assert lines[-1].split()[0] == "total"
    assert lines[-1].split()[-1] == f"{report.bytes_per_param:.2f}" == "12.02"
    assert any(line.split()[:2] == ["mu", "f32"] and line.endswith("4.00") for line in lines)
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["bytes_per_param"] == report.bytes_per_param
    assert data["param_count"] == N and data["total_bytes"] == 12 * N + 4
    assert data["rows"][2] == {"part": "mu", "dtype": "f32", "bytes": 4 * N, "bytes_per_param": 4.0}


def test_bad_input():
    with pytest.raises(ValueError, match="memory_report: params holds no floating-point array"):
        memory_report({"ids": jnp.arange(3)}, optax.EmptyState())
    with pytest.raises(ValueError, match="params holds no floating-point array"):
        memory_report({}, ())
    with pytest.raises(
        TypeError, match=r"memory_report: params\['lr'\] is 0\.1 of type float, not an array"
    ):
        memory_report({"w": jnp.ones(2), "lr": 0.1}, ())
    with pytest.raises(
        TypeError, match=r"memory_report: opt_state\[0\]\['hyper'\]\['eps'\] is 1e-08 of type float"
    ):
        memory_report({"w": jnp.ones(2)}, ({"hyper": {"eps": 1e-8}},))


def test_none_trees_and_a_part_that_is_not_a_name_are_refused_naming_them():
    params = {"w": jnp.ones(2)}
    with pytest.raises(TypeError, match=r"memory_report: params is None; pass the params tree"):
        memory_report(None, ())
    with pytest.raises(TypeError, match=r"memory_report: opt_state is None; .*an empty tuple"):
        memory_report(params, None)
    report = memory_report(params, optax.adam(1e-3).init(params))
    with pytest.raises(TypeError, match=r"part_bytes: part must be a part's name .*got None"):
        report.part_bytes(None)
