"""What the precision of float32 matmuls (``Policy.f32_matmul_precision``) becomes in the
compiled programs of a TPU and of an H100, compiled on this machine without either.

On a TPU an f32 matmul at JAX's default precision is one bf16 pass, and XLA then rounds its f32
operands to bf16 before they are all-gathered; on an Ampere or Hopper GPU it may be TF32. The
default policy's f32 matmuls are ``operand_precision={highest,highest}`` in both programs, and
the opt-in modes are the precision or dot algorithm they name. The TPU tests need libtpu and
skip without it (``MPJAX_REQUIRE_TPU_PLAN`` makes that an error); the H100 tests need JAX's
CUDA plugin (``MPJAX_REQUIRE_GPU_PLAN``). Each compiles a few small functions.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from tpu_compile import on_tpu, tpu_compile_unavailable, tpu_hlo

import mpjax
from mpjax.planning.devices import plan_unavailable

TPU_REASON = tpu_compile_unavailable()
GPU_REASON = plan_unavailable()
needs_tpu = pytest.mark.skipif(TPU_REASON is not None, reason=f"no TPU compile: {TPU_REASON}")
needs_gpu = pytest.mark.skipif(
    GPU_REASON is not None, reason=f"the plan cannot compile: {GPU_REASON}"
)

SHAPES = ((256, 512), (512, 512), (512, 256))
_RESULT_TYPE = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*([a-z0-9]+)\[")
_PRECISION = re.compile(r"(operand_precision=\{[a-z,]+\}|algorithm=[a-z0-9_]+)")


def model(x, w, v):
    """One matmul kept in f32 by ``full_precision``, one under the policy."""
    with mpjax.full_precision():
        y = jnp.tanh(x @ w)
    return y @ v


def gradient(policy):
    run = mpjax.autocast(model, policy=policy)
    return jax.grad(lambda *a: jnp.sum(run(*a).astype(jnp.float32)), argnums=(0, 1, 2))


def precisions(hlo: str, opcode: str) -> list[str]:
    """The precision of each ``opcode`` instruction of ``hlo``: its operand_precision or
    algorithm attribute, ``"-"`` for none (the platform's default)."""
    found = []
    for line in hlo.splitlines():
        if f" {opcode}(" in line:
            match = _PRECISION.search(line)
            found.append(match[1] if match else "-")
    return found


HIGHEST = "operand_precision={highest,highest}"


@needs_tpu
@pytest.mark.parametrize(
    "policy, under_policy",
    [
        ("float32", HIGHEST),
        ("p=f32,f32_matmul=default", "-"),  # what every f32 matmul was before: one bf16 pass
        ("p=f32,f32_matmul=high", "operand_precision={high,high}"),
        ("p=f32,f32_matmul=bf16_3x", "operand_precision={high,high}"),
        ("p=f32,f32_matmul=bf16", "-"),
        ("mixed_bfloat16", "-"),  # bf16 operands
    ],
)
def test_tpu_matmuls_of_f32_operands_run_at_the_policys_precision(policy, under_policy):
    args = [on_tpu(s, jnp.float32) for s in SHAPES]
    found = precisions(tpu_hlo(gradient(policy), *args), "convolution")  # TPU dots
    # Forward and backward, full_precision's matmuls at highest whatever the policy says.
    assert found.count(HIGHEST) >= 3 and set(found) == {HIGHEST, under_policy}


@needs_tpu
def test_tpu_all_gathers_fsdp_f32_weights_in_f32_at_highest_and_in_bf16_at_the_default():
    def layer(x, w):
        return jnp.tanh(x @ w)

    args = on_tpu((128, 1024), jnp.float32, P("x")), on_tpu((1024, 1024), jnp.float32, P("x"))
    gathered = {}
    for policy in ["float32", "p=f32,f32_matmul=default"]:
        run = mpjax.autocast(layer, policy=policy)
        hlo = tpu_hlo(jax.grad(lambda x, w, run=run: jnp.sum(run(x, w)), argnums=1), *args)
        gathered[policy] = {
            _RESULT_TYPE.match(line)[1]
            for line in hlo.splitlines()
            if re.search(r" all-gather(-start)?\(", line)
        }
    assert gathered == {"float32": {"f32"}, "p=f32,f32_matmul=default": {"bf16"}}


@needs_gpu
@pytest.mark.parametrize(
    "policy, under_policy",
    [
        ("float32", HIGHEST),  # no TF32
        ("p=f32,f32_matmul=default", "-"),  # TF32 on an H100
        ("p=f32,f32_matmul=tf32", "algorithm=dot_tf32_tf32_f32"),
        ("p=f32,f32_matmul=bf16_3x", "algorithm=dot_bf16_bf16_f32_x3"),
    ],
)
def test_h100_gemms_of_f32_operands_run_at_the_policys_precision(policy, under_policy):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES]
    plan = mpjax.plan(gradient(policy), target="h100")(*args)
    found = precisions(plan.hlo_text, "dot")  # the dots inside XLA's GEMM fusions
    assert found.count(HIGHEST) >= 3 and set(found) == {HIGHEST, under_policy}
