"""The example's FSDP and data parallelism: where arrays live, and that sharding changes
nothing but memory (the same losses as one device)."""

import dataclasses
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import assert_close_in_norm, gpt_reduction_length, tolerance

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


@pytest.mark.slow
@pytest.mark.parametrize("policy_name", ["float32", "mixed_float16"])
def test_fsdp_on_8_devices_trains_like_one_device(policy_name):
    want, one = _run(policy_name, jax.devices()[:1], 1)
    got, sharded = _run(policy_name, jax.devices()[:8], 4)
    _, initial = _run(policy_name, jax.devices()[:1], 1, steps=0)
    rtol = _reordered_rtol(policy_name, CONFIG, tokens=8 * CONFIG.block_size)
    np.testing.assert_allclose(got, want, rtol=rtol)
    # A gradient goes through those sums twice (forward and backward), and Adam's update is a
    # ratio of gradients: each update, and so how far the params moved in all, may change by
    # 4 * rtol of itself. Compared in norm: Adam divides by each gradient's own size, so a
    # gradient within rounding noise of zero moves its param by a full step either way. The
    # qkv bias is left out: the gradient of its key part is 0 in exact arithmetic (the softmax
    # ignores a shift shared by every key), so all of it is such noise.
    for (path, a), b, start in zip(
        jax.tree.leaves_with_path(sharded.params),
        jax.tree.leaves(one.params),
        jax.tree.leaves(initial.params),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        if not name.endswith("['qkv']['bias']"):
            a, b, start = (np.asarray(x, np.float64) for x in (a, b, start))
            assert_close_in_norm(a - start, b - start, 4 * rtol, name)
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


# ----------------------------------------------------------------------------- processes

SCRIPT = ROOT / "examples" / "train_transformer.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# The model of _flags.
FLAGS_CONFIG = gpt.GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=64)


def _flags(data, out, *extra):
    return [
        *("--n-layer", "1", "--d-model", "64", "--n-head", "2", "--seq-len", "16"),
        *("--batch-size", "8", "--steps", "4", "--warmup-steps", "1", "--log-interval", "1"),
        *("--eval-interval", "2", "--eval-batches", "2", "--ckpt-interval", "2"),
        *("--policy", "mixed_float16", "--fsdp", "2", "--sample-bytes", "8", "--no-progress"),
        *("--data", str(data), "--out", str(out)),
        *extra,
    ]


def _launch(args, devices):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        # The count goes last: it overrides conftest's 8, and any other XLA flag carries over.
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={devices}".strip(),
    }
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _two_processes(flags):
    """Runs the script as 2 processes of 2 CPU devices each; returns process 0's stdout."""
    port = _free_port()
    procs = [
        _launch(
            [*flags, "--coordinator", f"localhost:{port}", "--num-processes", "2"]
            + ["--process-id", str(i)],
            devices=2,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return outputs[0][0]


def _losses(out):
    lines = (out / "log.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.py"
    path.write_bytes(tt.load_corpus(None, max_bytes=40_000).tobytes())
    return path


@pytest.mark.slow
def test_two_processes_train_like_one_checkpoint_and_resume(corpus_file, tmp_path):
    """2 processes x 2 CPU devices (FSDP 2 x 2 replicas) train on the same batches as one
    process with 4 devices and reach the same losses; resumed from a checkpoint after an
    interruption, they continue to the same losses again."""
    one = _launch(_flags(corpus_file, tmp_path / "one"), devices=4)
    _, err = one.communicate(timeout=300)
    assert one.returncode == 0, err[-3000:]

    out = _two_processes(_flags(corpus_file, tmp_path / "two"))
    assert "devices: 4 x cpu (2 replicas x 2 fsdp, 2 processes)" in out
    assert "done: 4 steps" in out
    want = _losses(tmp_path / "one")
    got = _losses(tmp_path / "two")
    assert sorted(got) == [1, 2, 3, 4]
    rtol = _reordered_rtol("mixed_float16", FLAGS_CONFIG, tokens=8 * 16)
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=rtol)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 4

    # Interrupted after step 2: only that checkpoint is left. Resuming continues from it.
    checkpoints = tmp_path / "two" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "4"]
    shutil.rmtree(checkpoints / "4")
    out = _two_processes(_flags(corpus_file, tmp_path / "two", "--resume"))
    assert "resuming at step 2" in out
    resumed = _losses(tmp_path / "two")
    assert sorted(resumed) == [1, 2, 3, 4]
    # The same computation on the same devices: bit for bit.
    assert [resumed[s] for s in (3, 4)] == [got[s] for s in (3, 4)]


# ----------------------------------------------------------------------------- resuming elsewhere


def _reordered_rtol(policy: str, config: gpt.GPTConfig, tokens: int) -> float:
    """How far a loss may move, relative, when only the order of its sums changes (other
    devices, other slicing): the f32 sums over the tokens, through the model and over the
    vocabulary (the log-sum-exp), as tests/tolerances.py bounds them; under mixed_float16
    also the float16 rounding of each matmul's result on the way (six per block and the
    head), where two orders may land on neighbouring values."""
    length = tokens + gpt_reduction_length(config) + config.vocab_size
    rtol = tolerance(np.float32, length)
    if policy == "mixed_float16":
        rtol += (6 * config.n_layer + 1) * tolerance(np.float16, 0)
    return rtol


# The flags of _flags in float32, each param sliced over 8 devices.
EIGHT_WAY = ("--policy", "float32", "--num-devices", "8", "--fsdp", "8", "--sample-bytes", "0")
RTOL = _reordered_rtol("float32", FLAGS_CONFIG, tokens=8 * 16)


@pytest.mark.slow
def test_an_fsdp_run_resumes_on_fewer_devices_resliced(corpus_file, tmp_path, capsys):
    """Resumed on 2 of the 8 devices that saved it, a run slices its params over 2 (the
    checkpoint's --fsdp 8 cannot) and goes on from the same state: the losses after the
    checkpoint are the straight run's up to the order of the sums."""
    out = tmp_path / "run"
    tt.main(_flags(corpus_file, out, *EIGHT_WAY))
    straight = _losses(out)
    shutil.rmtree(out / "checkpoints" / "4")
    capsys.readouterr()
    tt.main(["--resume", "--out", str(out), "--num-devices", "2"])
    printed = capsys.readouterr().out
    assert (
        "--resume: the checkpoint's --fsdp 8 does not divide the 2 devices used here: slicing "
        "params over 2 instead (pass --fsdp to choose)"
    ) in printed
    assert "devices: 2 x cpu (1 replica x 2 fsdp)" in printed and "resuming at step 2" in printed
    resumed = _losses(out)
    assert sorted(resumed) == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [resumed[s] for s in (3, 4)], [straight[s] for s in (3, 4)], rtol=RTOL, atol=0
    )


@pytest.fixture(scope="module")
def eight_device_run(corpus_file, tmp_path_factory):
    """A run on a machine with 8 devices (a process of its own), each param sliced over all 8;
    its folder and its losses."""
    out = tmp_path_factory.mktemp("eight") / "run"
    run = _launch(_flags(corpus_file, out, *EIGHT_WAY), devices=8)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    return out, _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 1])
def test_an_fsdp_run_resumes_on_a_machine_with_fewer_devices(eight_device_run, tmp_path, devices):
    """`--resume --out` alone, on a machine with fewer devices than the checkpoint's
    --num-devices and --fsdp: the run takes the devices there are, reslices its params onto
    them, and says so; no error about flags the user did not pass."""
    saved, straight = eight_device_run
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    shutil.rmtree(out / "checkpoints" / "4")  # the run stopped after step 2's checkpoint
    run = _launch(["--resume", "--out", str(out), "--no-progress"], devices=devices)
    printed, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    assert (
        f"--resume: the checkpoint's --num-devices 8 is more than the {devices} here: using "
        "them all (pass --num-devices to choose)"
    ) in printed
    assert (
        f"--resume: the checkpoint's --fsdp 8 does not divide the {devices} devices used here: "
        f"slicing params over {devices} instead (pass --fsdp to choose)"
    ) in printed
    assert f"devices: {devices} x cpu (1 replica x {devices} fsdp)" in printed
    resumed = _losses(out)
    assert sorted(resumed) == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [resumed[s] for s in (3, 4)], [straight[s] for s in (3, 4)], rtol=RTOL, atol=0
    )
