"""examples/train_equinox.py: its plain Equinox transformer runs every matmul in the compute
dtype and its norms and softmax in f32, forward and backward, under mixed_bfloat16 and
mixed_float16; the script trains with dynamic loss scaling (a slow test runs it)."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax

eqx = pytest.importorskip("equinox")
mpe = pytest.importorskip("mpjax.equinox")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_equinox  # noqa: E402

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


@pytest.mark.parametrize(
    "policy, compute",
    [pytest.param("mixed_bfloat16", BF16, marks=pytest.mark.slow), ("mixed_float16", F16)],
)
def test_every_matmul_runs_in_the_compute_dtype_and_norms_and_softmax_in_f32(policy, compute):
    model = train_equinox.Transformer(32, 2, 4, 16, key=jax.random.key(0))
    wrapped = mpe.apply_policy(model, policy)
    tokens = jnp.zeros((2, 17), jnp.int32)
    grad = eqx.filter_grad(train_equinox.loss_fn)
    forward = mpjax.inspect_matmuls(train_equinox.loss_fn)(wrapped, tokens)
    backward = mpjax.inspect_matmuls(grad)(wrapped, tokens)
    assert len(forward) == 2 * 8 + 1  # per block q, k, v, scores, values, out, 2 MLP; head
    for report in (forward, backward):
        assert {m.operand_dtypes for m in report} == {(compute, compute)}, report
    for fn in (train_equinox.loss_fn, grad):
        found = [
            (e.primitive.name, np.dtype(e.invars[0].aval.dtype))
            for e, _ in mpjax.inspection.matmuls.iter_equations(fn, wrapped, tokens)
            if e.primitive.name in ("rsqrt", "exp", "log")
        ]
        assert [n for n, _ in found].count("rsqrt") >= 5  # 2 norms per block and the final one
        assert {dtype for _, dtype in found} == {F32}, found
    rows = {row.path: row for row in mpjax.describe(wrapped)().rows}
    assert rows["blocks[1].norm2"].policy == mpjax.norm_policy(policy)


@pytest.mark.slow  # a subprocess that trains
def test_the_script_trains_under_mixed_float16_with_dynamic_loss_scaling(tmp_path):
    out = tmp_path / "run.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_equinox.py"), "--steps", "60"]
        + ["--log-every", "20", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "validation loss" in result.stdout
    record = json.loads(out.read_text())
    assert record["policy"] == "p=f32,c=f16,o=f32"
    # An untrained model is near ln(256) = 5.5 nats per byte; 60 steps learn the byte
    # frequencies and some of their context.
    assert record["val_loss"] < 0.6 * math.log(256), record
    assert len(record["train_losses"]) == 3 and record["loss_scale"] >= 1
    assert record["skipped_steps"] < 10
