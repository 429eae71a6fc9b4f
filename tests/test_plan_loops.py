"""TPU estimates of steps that loop (mpjax.planning.loops): each scan's body counted its
trip count times, checked against the same step with its scans unrolled by `unroll=True` or by
hand; no estimate for a loop whose trip count is known only when it runs."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax.planning import loops
from mpjax.planning.devices import plan_unavailable

TPU_REASON = plan_unavailable("v5p")
needs_libtpu = pytest.mark.skipif(
    TPU_REASON is not None, reason=f"the plan cannot compile for a TPU: {TPU_REASON}"
)


def layer(h, w):
    return jnp.tanh(h @ w[0]) @ w[1], None


def step(ws, x, unroll=1):
    """An SGD step of an MLP whose layers run in a scan, as written (``unroll=1``) or unrolled
    by the scan itself (``unroll=True``): the same program without its loop."""

    def loss(ws):
        h, _ = jax.lax.scan(layer, x, ws, unroll=unroll)
        return jnp.square(h.astype(jnp.float32)).mean()

    return jax.tree.map(lambda w, g: w - 0.1 * g, ws, jax.grad(loss)(ws))


def planned(unroll, target="v5p", sharding=None, x_sharding=None):
    ws = jax.ShapeDtypeStruct((6, 2, 512, 512), jnp.bfloat16, sharding=sharding)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=x_sharding)
    stepped = jax.jit(step, static_argnums=2, donate_argnums=0)
    return mpjax.plan(stepped, target)(ws, x, unroll)


@needs_libtpu
def test_a_scanned_step_is_estimated_as_its_unrolled_twin_with_its_own_memory():
    scanned, unrolled = planned(1), planned(True)
    # The estimate is the unrolled program's, compiled as the scanned step was.
    assert scanned.estimated_seconds == pytest.approx(unrolled.estimated_seconds, rel=1e-6)
    assert scanned.modelled_flops == pytest.approx(unrolled.modelled_flops, rel=1e-6)
    assert scanned.bytes_accessed == pytest.approx(unrolled.bytes_accessed, rel=1e-6)
    # The forward scan and its transpose, six layers each; the compiled loops count one.
    assert [(loop.trips, loop.counted, loop.modelled) for loop in scanned.loops] == [
        (6, 1, True),
        (6, 1, True),
    ]
    assert "transpose" in scanned.loops[1].name
    # Memory and the HLO are the scanned program's: its loops are still there.
    assert scanned.loop_trips == (6, 6) and unrolled.loop_trips == ()
    assert scanned.memory != unrolled.memory
    assert "the estimate counts every iteration of the step's 2 scans (6 iterations)" in (
        scanned.summary()
    )
    assert json.loads(json.dumps(scanned.to_dict()))["loops"][0] == {
        "name": scanned.loops[0].name,
        "trips": 6,
        "counted": 1,
        "modelled": True,
        "why": "",
    }


@needs_libtpu
def test_nested_scans_count_their_trips_times_their_parents():
    def nested(ws, x):
        def block(h, w):  # two layers per block, three blocks
            return jax.lax.scan(layer, h, w)[0], None

        return jnp.square(jax.lax.scan(block, x, ws)[0].astype(jnp.float32)).mean()

    def by_hand(ws, x):  # the same layers, in Python loops
        h = x
        for b in range(3):
            h = jax.lax.scan(layer, h, ws[b], unroll=True)[0]
        return jnp.square(h.astype(jnp.float32)).mean()

    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    ws = jax.ShapeDtypeStruct((3, 2, 2, 512, 512), jnp.bfloat16)
    scanned = mpjax.plan(jax.grad(nested), "v5p")(ws, x)
    unrolled = mpjax.plan(jax.grad(by_hand), "v5p")(ws, x)
    # The outer scans (forward, backward) and the inner ones in each, counted 3 x 2 times.
    assert sorted(loop.trips for loop in scanned.loops) == [2, 2, 3, 3]
    assert scanned.modelled_flops == pytest.approx(unrolled.modelled_flops, rel=0.01)
    # The same layers, the outer loops unrolled by the scan rather than by Python.
    assert scanned.estimated_seconds == pytest.approx(unrolled.estimated_seconds, rel=0.05)


@needs_libtpu
def test_a_sharded_scanned_step_is_estimated_with_its_shardings_and_donation():
    mesh = mpjax.plan_mesh("v5p:2x2x1", (4,), ("fsdp",))
    batch = NamedSharding(mesh, P("fsdp"))
    fsdp = NamedSharding(mesh, P(None, None, "fsdp"))
    scanned, unrolled = (planned(u, "v5p:2x2x1", fsdp, batch) for u in (1, True))
    assert scanned.collectives and all(loop.modelled for loop in scanned.loops)
    assert scanned.estimated_seconds == pytest.approx(unrolled.estimated_seconds, rel=1e-6)


@needs_libtpu
def test_a_scan_unrolled_already_needs_no_second_compile(monkeypatch):
    compiles = []
    monkeypatch.setattr(loops, "_compile", lambda *a: compiles.append(a) or {})
    p = planned(True)
    assert p.loops == () and compiles == [] and p.estimated_seconds is not None


@needs_libtpu
def test_a_while_loop_gets_no_estimate_and_the_plan_says_why():
    def until_small(x):
        return jax.lax.while_loop(lambda h: jnp.abs(h).max() > 1, lambda h: jnp.tanh(h @ h), x)

    p = mpjax.plan(until_small, "v5p")(jax.ShapeDtypeStruct((256, 256), jnp.bfloat16))
    assert p.estimated_seconds is None and p.mfu() is None
    assert [(loop.trips, loop.modelled) for loop in p.loops] == [(None, False)]
    assert "no time estimate: the step runs a while_loop" in p.summary()
    assert "known only when it runs" in p.summary()
