"""The memory traffic a GPU plan counts for its fusions that are no matmul
(mpjax.planning.traffic): read from hand-written HLO, where every byte is known, and from a
deviceless H100 compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import mpjax
from mpjax.planning.devices import plan_unavailable
from mpjax.planning.hlo_text import parse_module
from mpjax.planning.targets import known_target
from mpjax.planning.traffic import fusion_bytes, fusion_traffic

REASON = plan_unavailable()
needs_compiler = pytest.mark.skipif(REASON is not None, reason=f"the plan cannot compile: {REASON}")

# A scanned layer (a loop of 3 trips) that takes its weight out of a stacked [3, 64, 64] f32
# parameter and writes its gradient into a stacked one in place, beside a GEMM fusion, a cast
# to bf16 and a fusion that writes e2m1 values (4 bits each) in the entry computation.
_HLO = """HloModule m, entry_computation_layout={}

%take (param_0: f32[3,64,64], param_1: s32[]) -> f32[64,64] {
  %param_0 = f32[3,64,64]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %flat = f32[3,4096]{1,0} bitcast(%param_0)
  %row = f32[1,4096]{1,0} dynamic-slice(%flat, %param_1, %zero), dynamic_slice_sizes={1,4096}
  ROOT %r = f32[64,64]{1,0} bitcast(%row)
}

%put (param_0: f32[3,64,64], param_1: f32[64,64], param_2: s32[]) -> f32[3,64,64] {
  %param_0 = f32[3,64,64]{2,1,0} parameter(0)
  %param_1 = f32[64,64]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %u = f32[1,64,64]{2,1,0} bitcast(%param_1)
  ROOT %dus = f32[3,64,64]{2,1,0} dynamic-update-slice(%param_0, %u, %param_2, %zero, %zero)
}

%cond (c: (s32[], f32[3,64,64], f32[3,64,64])) -> pred[] {
  %c = (s32[], f32[3,64,64], f32[3,64,64]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[3,64,64], f32[3,64,64])) -> (s32[], f32[3,64,64], f32[3,64,64]) {
  %b = (s32[], f32[3,64,64], f32[3,64,64]) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %w = f32[3,64,64]{2,1,0} get-tuple-element(%b), index=1
  %g = f32[3,64,64]{2,1,0} get-tuple-element(%b), index=2
  %layer = f32[64,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%take
  %new = f32[3,64,64]{2,1,0} fusion(%g, %layer, %i), kind=kLoop, calls=%put
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[3,64,64], f32[3,64,64]) tuple(%j, %w, %new)
}

%gemm (param_0: bf16[128,64], param_1: bf16[64,64]) -> bf16[128,64] {
  %param_0 = bf16[128,64]{1,0} parameter(0)
  %param_1 = bf16[64,64]{1,0} parameter(1)
  ROOT %d = bf16[128,64]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cast (param_0: f32[128,64]) -> bf16[128,64] {
  %param_0 = f32[128,64]{1,0} parameter(0)
  ROOT %c = bf16[128,64]{1,0} convert(%param_0)
}

%fp4 (param_0: bf16[128,64]) -> f4e2m1fn[128,64] {
  %param_0 = bf16[128,64]{1,0} parameter(0)
  ROOT %q = f4e2m1fn[128,64]{1,0} convert(%param_0)
}

ENTRY %main (x: f32[128,64], w: f32[3,64,64], g: f32[3,64,64]) -> f4e2m1fn[128,64] {
  %x = f32[128,64]{1,0} parameter(0)
  %w = f32[3,64,64]{2,1,0} parameter(1)
  %g = f32[3,64,64]{2,1,0} parameter(2)
  %start = s32[] constant(0)
  %init = (s32[], f32[3,64,64], f32[3,64,64]) tuple(%start, %w, %g)
  %loop = (s32[], f32[3,64,64], f32[3,64,64]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %xb = bf16[128,64]{1,0} fusion(%x), kind=kLoop, calls=%cast
  %wb = bf16[64,64]{1,0} constant({...})
  %y = bf16[128,64]{1,0} fusion(%xb, %wb), kind=kCustom, calls=%gemm
  ROOT %q = f4e2m1fn[128,64]{1,0} fusion(%y), kind=kLoop, calls=%fp4
}
"""

_LAYER = 64 * 64 * 4  # one layer's f32 weight or gradient
_INDEX = 4  # the loop counter, an s32


def test_each_fusion_moves_what_it_reads_and_writes():
    module = parse_module(_HLO)
    body, entry = module.computations["body"], module.entry_computation
    # A layer's weight out of the stack (seen through a bitcast): the slice, not the stack;
    # the index read whole.
    assert fusion_bytes(module, body["layer"]) == _LAYER + _INDEX + _LAYER
    # A gradient written in place: the update read and written, the stack it goes into neither
    # read nor written whole.
    assert fusion_bytes(module, body["new"]) == _LAYER + _INDEX + _LAYER
    assert fusion_bytes(module, entry["xb"]) == 128 * 64 * (4 + 2)
    assert fusion_bytes(module, entry["q"]) == 128 * 64 * 2 + 128 * 64 // 2  # e2m1 packed
    # A GEMM's fusion is the GEMM's (counted by its FLOPs), and no other instruction is a fusion.
    assert fusion_bytes(module, entry["y"]) is None
    assert fusion_bytes(module, entry["loop"]) is None


def test_a_loop_body_counts_its_trip_count_times():
    module = parse_module(_HLO)
    body, entry = module.computations["body"], module.entry_computation
    per_trip = fusion_bytes(module, body["layer"]) + fusion_bytes(module, body["new"])
    once = fusion_bytes(module, entry["xb"]) + fusion_bytes(module, entry["q"])
    assert fusion_traffic(module) == 3 * per_trip + once


@needs_compiler
def test_an_h100_plan_prices_its_fusions_at_the_memory_bandwidth():
    def f(x):
        return (jnp.tanh(x) * 2).astype(jnp.bfloat16)

    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    plan = mpjax.plan(f, "h100")(x)
    # One elementwise kernel: 4 MiB of f32 read, 2 MiB of bf16 written.
    assert plan.fusion_bytes == 1024 * 1024 * (4 + 2)
    bandwidth = known_target("h100").chip.hbm_bandwidth
    assert plan.fusion_seconds == pytest.approx(plan.fusion_bytes / bandwidth)
    assert plan.to_dict()["fusion_bytes"] == plan.fusion_bytes
    assert plan.to_dict()["fusion_seconds"] == plan.fusion_seconds


@needs_compiler
def test_the_summary_adds_the_fusions_time_to_the_matmul_roofline():
    def f(x, w):
        return jax.nn.gelu(x @ w).astype(jnp.float32)

    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    plan = mpjax.plan(f, "h100")(x, x)
    assert plan.roofline_seconds and plan.fusion_seconds
    assert "fusions that are no matmul move" in plan.summary()
    assert "none overlapped" in plan.summary()


def test_a_plan_without_a_known_target_has_no_fusion_time():
    text = _HLO
    plan = mpjax.Plan.from_hlo_text(text, device="some GPU")
    assert plan.fusion_bytes == fusion_traffic(parse_module(text))
    assert plan.fusion_seconds is None
