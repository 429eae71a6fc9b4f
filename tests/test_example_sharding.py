"""The example's FSDP and data parallelism: where arrays live, and that sharding changes
nothing but memory (the same losses as one device)."""

import dataclasses
import pathlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402
import sharding  # noqa: E402
import train_transformer as tt  # noqa: E402

import mpjax  # noqa: E402

# Widths divisible by 4, so that every matrix can be sliced over an fsdp axis of 4.
CONFIG = gpt.GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=64)


def test_param_spec_slices_the_largest_divisible_axis_of_large_arrays():
    assert sharding.param_spec((256, 64), 4) == P("fsdp", None)
    assert sharding.param_spec((64, 256), 4) == P(None, "fsdp")
    assert sharding.param_spec((2, 64, 192), 4) == P(None, None, "fsdp")  # scanned layers
    assert sharding.param_spec((64, 64), 4) == P("fsdp", None)  # ties: the first axis
    assert sharding.param_spec((256,), 4) == P()  # small: whole on every device
    assert sharding.param_spec((255, 63), 4) == P()  # nothing divisible
    assert sharding.param_spec((256, 64), 1) == P()  # no fsdp axis
    assert sharding.param_spec((), 4) == P()


def test_make_mesh_rejects_an_fsdp_size_that_does_not_divide_the_devices():
    mesh = sharding.make_mesh(jax.devices()[:8], 4)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    for fsdp in (0, 3, 16):
        with pytest.raises(ValueError, match=r"--fsdp must be a positive divisor of .*\(8\)"):
            sharding.make_mesh(jax.devices()[:8], fsdp)


@pytest.mark.parametrize(
    "coordinator, num_processes, process_id, message",
    [
        ("localhost:1234", 2, 2, r"--process-id must be in \[0, --num-processes=2\), got 2"),
        ("localhost:1234", 2, -1, r"--process-id must be in"),
        ("localhost", 2, 0, "--coordinator must be host:port, got 'localhost'"),
        (":1234", 2, 0, "--coordinator must be host:port"),
    ],
)
def test_initialize_rejects_bad_arguments_before_touching_jax(
    coordinator, num_processes, process_id, message
):
    with pytest.raises(ValueError, match=message):
        sharding.initialize(coordinator, num_processes, process_id)


def _run(policy_name, devices, fsdp, steps=3):
    """Losses and final params of ``steps`` train steps on ``devices`` with an fsdp axis of
    ``fsdp``, from the same init and the same batches."""
    cfg = tt.TrainConfig(policy=policy_name, steps=10, warmup_steps=2, lr=1e-2)
    policy = mpjax.get_policy(policy_name)
    model = tt.build_model(CONFIG, policy, "mpjax")
    tx = tt.make_optimizer(cfg, policy)
    mesh = sharding.make_mesh(devices, fsdp)
    state = tt.init_state(model, tx, seed=0, seq_len=CONFIG.block_size)
    shardings = sharding.state_shardings(state, mesh)
    state = jax.device_put(state, shardings)
    step = jax.jit(
        tt.make_train_step(model, tx),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    corpus = tt.load_corpus(None, max_bytes=20_000)
    rng = np.random.default_rng(0)
    losses = []
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(steps):
            x, y = tt.sample_batch(corpus, rng, (1, 8), CONFIG.block_size)
            batch = sharding.batch_sharding(mesh)
            state, metrics = step(
                state, sharding.global_batch(x, batch), sharding.global_batch(y, batch)
            )
            losses.append(float(metrics["loss"]))
    return losses, state


@pytest.mark.parametrize("policy_name", ["float32", "mixed_float16"])
def test_fsdp_on_8_devices_trains_like_one_device(policy_name):
    want, one = _run(policy_name, jax.devices()[:1], 1)
    got, sharded = _run(policy_name, jax.devices()[:8], 4)
    atol = 1e-3 if policy_name == "mixed_float16" else 1e-4
    np.testing.assert_allclose(got, want, rtol=2e-5)
    # Adam divides by the gradients' own size, so summation-order noise in a tiny gradient
    # moves its param by a fraction of the 1e-2 steps taken: a few 1e-5 in f32, a few 1e-4
    # with float16's 11-bit matmul results. The qkv bias is left out:
    # the gradient of its key part is 0 in exact arithmetic (the softmax ignores a shift
    # shared by every key), so Adam turns rounding noise there into full-size steps.
    for (path, a), b in zip(
        jax.tree.leaves_with_path(sharded.params), jax.tree.leaves(one.params), strict=True
    ):
        name = jax.tree_util.keystr(path)
        if not name.endswith("['qkv']['bias']"):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, err_msg=name)
    # Large params and their Adam moments really are sliced: a quarter on each device.
    kernel = sharded.params["h0"]["mlp"]["fc"]["kernel"]
    assert kernel.sharding.spec == P(None, "fsdp")
    assert kernel.addressable_shards[0].data.shape == (64, 64)
    mu = [x for x in jax.tree.leaves(sharded.opt_state) if x.shape == kernel.shape]
    assert mu and all(m.sharding.spec == P(None, "fsdp") for m in mu)
    info = mpjax.loss_scaling_info(sharded.opt_state)
    assert int(info.skipped_steps) == 0
    assert float(info.loss_scale) == (2.0**15 if policy_name == "mixed_float16" else 1.0)


def test_scanned_layers_are_sliced_along_their_widest_axis_not_the_layer_axis():
    config = dataclasses.replace(CONFIG, scan_layers=True)
    params = jax.eval_shape(
        lambda: gpt.GPT(config).init(jax.random.key(0), np.zeros((1, 16), np.int32))["params"]
    )
    mesh = sharding.make_mesh(jax.devices()[:8], 2)
    specs = jax.tree.map(lambda s: s.spec, sharding.state_shardings(params, mesh))
    assert specs["h"]["mlp"]["fc"]["kernel"] == P(None, None, "fsdp")  # [layer, 64, 256]
    assert specs["h"]["ln1"]["scale"] == P()  # [layer, 64]: small
