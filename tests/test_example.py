"""The GPT training example: data pipeline, train steps per policy, resume, data parallelism."""

import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402
import train_transformer as tt  # noqa: E402
from tolerances import assert_close_in_norm, gpt_reduction_length, tolerance  # noqa: E402

import mpjax  # noqa: E402
from mpjax.inspection.matmuls import iter_equations  # noqa: E402

# A model small enough that each compile takes a second or two on a shared CPU.
SMALL = gpt.GPTConfig(block_size=16, n_layer=1, n_head=2, d_model=32)


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    """60 kB of real Python source (the default corpus, capped)."""
    return tt.load_corpus(None, max_bytes=60_000)


@pytest.fixture(scope="module")
def text_file(corpus, tmp_path_factory) -> pathlib.Path:
    """The same bytes as a file, for --data, so runs do not walk the whole stdlib."""
    path = tmp_path_factory.mktemp("data") / "corpus.py"
    path.write_bytes(corpus.tobytes())
    return path


def _cfg(text_file, tmp_path, **overrides) -> tt.TrainConfig:
    base = dict(
        n_layer=SMALL.n_layer,
        n_head=SMALL.n_head,
        d_model=SMALL.d_model,
        seq_len=SMALL.block_size,
        batch_size=8,
        steps=6,
        warmup_steps=2,
        lr=1e-2,
        eval_interval=3,
        eval_batches=2,
        log_interval=1,
        ckpt_interval=0,
        data=str(text_file),
        sample_bytes=0,
        progress=False,
        out=str(tmp_path / "run"),
        policy="float32",
        num_devices=1,
    )
    base.update(overrides)
    return tt.TrainConfig(**base)


# ----------------------------------------------------------------------------- data


@pytest.mark.slow
def test_default_corpus_is_the_stdlib_sources_and_deterministic():
    a = tt.load_corpus(None, max_bytes=200_000)
    b = tt.load_corpus(None, max_bytes=200_000)
    assert a.dtype == np.uint8 and a.shape == (200_000,)
    np.testing.assert_array_equal(a, b)
    assert b"import " in a.tobytes() and b"def " in a.tobytes()
    files = tt.default_corpus_files()
    assert files == sorted(files) and len(files) > 100
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)


def test_split_is_disjoint_and_covers_the_corpus():
    data = np.arange(1000, dtype=np.int64).astype(np.uint8)
    train, val = tt.split_corpus(data, 0.1)
    assert len(train) == 900 and len(val) == 100
    np.testing.assert_array_equal(np.concatenate([train, val]), data)
    with pytest.raises(ValueError, match="--val-fraction"):
        tt.split_corpus(data, 1.5)


def test_batches_are_seeded_windows_with_shifted_targets():
    data = np.frombuffer(bytes(range(256)) * 8, dtype=np.uint8)
    x, y = tt.sample_batch(data, np.random.default_rng(3), (2, 4), 16)
    assert x.shape == y.shape == (2, 4, 16) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
    # Each window is a contiguous run of the corpus: here, consecutive byte values.
    np.testing.assert_array_equal(y, (x + 1) % 256)
    x2, _ = tt.sample_batch(data, np.random.default_rng(3), (2, 4), 16)
    np.testing.assert_array_equal(x, x2)
    with pytest.raises(ValueError, match="--seq-len"):
        tt.sample_batch(data[:10], np.random.default_rng(0), (1,), 16)


def test_data_flag_takes_a_file_or_a_folder(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_bytes(b"world")
    (tmp_path / ".hidden").write_bytes(b"SECRET")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    folder = tt.load_corpus(str(tmp_path)).tobytes()
    assert sorted([folder[:6], folder[6:]]) == sorted([b"hello ", b"world"])
    assert tt.load_corpus(str(tmp_path / "a.txt")).tobytes() == b"hello "
    assert tt.load_corpus(str(tmp_path / "a.txt"), max_bytes=3).tobytes() == b"hel"
    with pytest.raises(ValueError, match="--data"):
        tt.load_corpus(str(tmp_path / "missing"))


def test_unigram_baseline_is_the_byte_entropy():
    uniform = np.arange(256 * 4).astype(np.uint8)
    assert tt.unigram_cross_entropy(uniform, uniform) == pytest.approx(np.log(256))
    # Add-one smoothing: byte 0 seen twice, byte 1 once, 254 bytes never: 259 counts in all.
    train, val = np.array([0, 0, 1], np.uint8), np.array([0, 1], np.uint8)
    expected = -(np.log(3 / 259) + np.log(2 / 259)) / 2
    assert tt.unigram_cross_entropy(train, val) == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- train steps


# The attention each mode's tests use. The model's default, fused attention, is
# jax.nn.dot_product_attention, whose XLA path (the one a CPU runs) computes the gradient of its
# score matmul from an f32 cotangent and the bf16 keys; under strict promotion JAX cannot
# compile that for a model whose dtypes are set by hand. Under mpjax (module rules, autocast)
# the casting engine runs those matmuls in bf16, so they take the default.
ATTENTION = {"mpjax": "fused", "autocast": "fused", "hand": "naive"}


@functools.cache  # each (policy, mode, attention) is built, initialized and jitted once
def _setup(policy_name, mode="mpjax", attention=None):
    cfg = tt.TrainConfig(policy=policy_name, steps=10, warmup_steps=2, lr=1e-2)
    policy = mpjax.get_policy(policy_name)
    config = dataclasses.replace(SMALL, attention=attention or ATTENTION[mode])
    model = tt.build_model(config, policy, mode)
    tx = tt.make_optimizer(cfg, policy)
    state = tt.init_state(model, tx, seed=0, seq_len=SMALL.block_size)
    return policy, model, tx, state, jax.jit(tt.make_train_step(model, tx))


def _batch(corpus, accum, batch, seed=0):
    return tt.sample_batch(corpus, np.random.default_rng(seed), (accum, batch), SMALL.block_size)


def _expected_param_dtype(path, policy, mode):
    # Under module rules the model's LayerNorms keep f32 params whatever the policy stores.
    is_norm = any(getattr(k, "key", "").startswith("ln") for k in path)
    return np.dtype(jnp.float32) if mode == "mpjax" and is_norm else policy.param_dtype


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy_name, mode",
    [
        ("float32", "mpjax"),
        ("mixed_bfloat16", "mpjax"),
        ("bfloat16", "mpjax"),
        ("mixed_float16", "mpjax"),
        ("float16", "mpjax"),  # fused attention in float16 compiles on the CPU too
        ("mixed_bfloat16", "hand"),
        ("bfloat16", "hand"),
        ("float16", "hand"),
        ("mixed_bfloat16", "autocast"),
        ("mixed_float16", "autocast"),
    ],
)
def test_train_steps_under_each_policy(policy_name, mode, corpus):
    policy, model, tx, state, step = _setup(policy_name, mode)
    x, y = _batch(corpus, 1, 8)
    losses = []
    for _ in range(3):
        state, metrics = step(state, x, y)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses  # same batch three times: the loss must go down
    assert int(state.step) == 3
    for path, p in jax.tree.leaves_with_path(state.params):
        assert p.dtype == _expected_param_dtype(path, policy, mode), jax.tree_util.keystr(path)
    # The jaxpr says which dtype every matmul ran in, forward and backward.
    grad_fn = jax.grad(lambda p: tt.loss_fn(model, p, x[0], y[0]))
    report = mpjax.inspect_matmuls(grad_fn)(state.params)
    compute = policy.compute_dtype.name
    assert len(report) > 0
    assert set(report.operand_dtypes()) == {(compute, compute)}, str(report)
    # Forward matmuls write the compute dtype. Through mpjax a weight's gradient is written in
    # the policy's reduce dtype; the hand-written model's in the compute dtype, as JAX does.
    outs = {compute}
    if mode != "hand" and policy.reduce_dtype != policy.compute_dtype:
        outs.add(policy.reduce_dtype.name)
    assert {m.out_dtype.name for m in report} == outs, str(report)
    # The loss itself comes from f32 logits whatever the compute dtype.
    loss = jax.eval_shape(lambda p: tt.loss_fn(model, p, x[0], y[0]), state.params)
    assert loss.dtype == jnp.float32

    # Loss scaling where the policy computes in float16 (auto), nowhere else.
    states = [
        x for x in jax.tree.leaves(state.opt_state, is_leaf=_is_loss_scaling) if _is_loss_scaling(x)
    ]
    info = mpjax.loss_scaling_info(state.opt_state)
    if policy.compute_dtype == jnp.float16:
        assert len(states) == 1 and isinstance(states[0].loss_scale, mpjax.DynamicLossScale)
        assert info.loss_scale.dtype == jnp.float32 and float(info.loss_scale) == 2.0**15
        assert int(info.skipped_steps) == 0 and float(metrics["loss_scale"]) == 2.0**15
    else:
        assert states == [] and float(metrics["loss_scale"]) == 1.0
    # An f32 master copy (and so f32 Adam moments) exactly where params are stored narrower.
    masters = [x for x in jax.tree.leaves(state.opt_state, is_leaf=_is_master) if _is_master(x)]
    moments = {a.dtype for a in jax.tree.leaves(state.opt_state) if a.ndim >= 1}
    if policy_name in ("bfloat16", "float16"):
        assert len(masters) == 1
        assert {a.dtype for a in jax.tree.leaves(masters[0].master)} == {np.dtype(jnp.float32)}
        assert moments == {np.dtype(jnp.float32)}
    else:
        assert masters == [] and moments == {policy.param_dtype}


def test_pure_bfloat16_without_master_weights_keeps_bfloat16_adam_moments():
    cfg = tt.TrainConfig(policy="bfloat16", master_weights=False)
    policy = mpjax.get_policy(cfg.policy)
    params = jax.eval_shape(  # hand mode: every param bf16 (module rules keep norms f32)
        lambda: tt.build_model(SMALL, policy, "hand").init(
            jax.random.key(0), jnp.zeros((1, SMALL.block_size), jnp.int32)
        )["params"]
    )
    opt_state = jax.eval_shape(tt.make_optimizer(cfg, policy).init, params)
    assert not any(_is_master(x) for x in jax.tree.leaves(opt_state, is_leaf=_is_master))
    moments = {a.dtype for a in jax.tree.leaves(opt_state) if a.ndim >= 1}
    assert moments == {np.dtype(jnp.bfloat16)}


def _hand_params(policy):
    return jax.eval_shape(  # hand mode: every param in the policy's param dtype
        lambda: tt.build_model(SMALL, policy, "hand").init(
            jax.random.key(0), jnp.zeros((1, SMALL.block_size), jnp.int32)
        )["params"]
    )


def _states(tree, cls):
    return [
        x for x in jax.tree.leaves(tree, is_leaf=lambda y: isinstance(y, cls)) if isinstance(x, cls)
    ]


@pytest.mark.parametrize(
    "flags, want",
    [
        # (rounding of the params, compensation dtype, mu/nu dtypes, bytes/param of the state)
        (dict(param_rounding="stochastic"), ("stochastic", None, ("bfloat16", "float32"), 8.0)),
        (dict(param_rounding="kahan"), ("kahan", "bfloat16", ("float32", "float32"), 10.0)),
        (
            dict(
                param_rounding="stochastic",
                mu_dtype="bf16",
                nu_dtype="bf16",
                state_rounding="stochastic",
            ),
            ("stochastic", None, ("bfloat16", "bfloat16"), 4.0),
        ),
    ],
)
def test_optimizer_precision_flags_build_the_state_they_name(flags, want):
    rounding, compensation, (mu_dtype, nu_dtype), state_bytes = want
    if "mu_dtype" not in flags:  # without --mu-dtype, Adam's own moments: f32 on f32 copies
        mu_dtype = "float32"
    cfg = tt.TrainConfig(policy="bfloat16", master_weights=False, **flags)
    policy = mpjax.get_policy(cfg.policy)
    params = _hand_params(policy)
    tx = tt.make_optimizer(cfg, policy)
    opt_state = jax.eval_shape(tx.init, params)
    (lpp,) = _states(opt_state, mpjax.LowPrecisionParamsState)
    assert not _states(opt_state, mpjax.MasterWeightsState)
    comp = {a.dtype.name for a in jax.tree.leaves(lpp.compensation)}
    assert comp == ({compensation} if compensation else set())
    assert isinstance(lpp.key, jax.ShapeDtypeStruct) == (rounding == "stochastic")
    (adam,) = _states(opt_state, optax.ScaleByAdamState)
    assert {a.dtype.name for a in jax.tree.leaves(adam.mu)} == {mu_dtype}
    assert {a.dtype.name for a in jax.tree.leaves(adam.nu)} == {nu_dtype}
    report = mpjax.memory_report(params, opt_state)
    assert report.param_bytes / report.param_count == 2.0
    # Up to the int32 counters and uint32 keys: a few bytes in a model of 10^4 params.
    assert report.state_bytes / report.param_count == pytest.approx(state_bytes, abs=0.01)
    assert rounding in tt.describe_optimizer(cfg, policy)


def test_optimizer_precision_flags_compose_with_master_weights_and_loss_scaling():
    cfg = tt.TrainConfig(policy="bfloat16", mu_dtype="bf16", nu_dtype="f32", loss_scale="dynamic")
    policy = mpjax.get_policy(cfg.policy)
    opt_state = jax.eval_shape(tt.make_optimizer(cfg, policy).init, _hand_params(policy))
    assert len(_states(opt_state, mpjax.MasterWeightsState)) == 1
    assert len(_states(opt_state, mpjax.LossScalingState)) == 1
    (adam,) = _states(opt_state, optax.ScaleByAdamState)
    assert {a.dtype.name for a in jax.tree.leaves(adam.mu)} == {"bfloat16"}
    assert {a.dtype.name for a in jax.tree.leaves(adam.nu)} == {"float32"}
    assert "mu bf16, nu f32" in tt.describe_optimizer(cfg, policy)


@pytest.mark.parametrize(
    "fmt, bits, block, state_bytes",
    # Bytes of Adam's two moments a param: codes, plus an f32 absmax per block of each.
    [("dynamic8", 8, 32, 2 + 8 / 32), ("e4m3", 8, 32, 2 + 8 / 32), ("dynamic4", 4, 16, 1 + 8 / 16)],
)
def test_state_format_flag_stores_adam_moments_quantized_inside_loss_scaling(
    fmt, bits, block, state_bytes
):
    argv = ["--policy", "bfloat16", "--no-master-weights", "--param-rounding", "stochastic"]
    argv += ["--state-format", fmt, "--state-block-size", str(block), "--loss-scale", "dynamic"]
    cfg = tt.parse_args([*argv, "--state-rounding", "stochastic"])
    policy = mpjax.get_policy(cfg.policy)
    # Wide enough that the matrices reach quantized_state's min_size of 4096 elements.
    config = dataclasses.replace(SMALL, d_model=128, n_head=2)
    params = jax.eval_shape(
        lambda: tt.build_model(config, policy, "hand").init(
            jax.random.key(0), jnp.zeros((1, config.block_size), jnp.int32)
        )["params"]
    )
    opt_state = jax.eval_shape(tt.make_optimizer(cfg, policy).init, params)
    (lpp,) = _states(opt_state, mpjax.LowPrecisionParamsState)
    (scaling,) = _states(lpp.inner_state, mpjax.LossScalingState)
    (quantized,) = _states(scaling, mpjax.QuantizedState)  # inside loss scaling
    assert isinstance(quantized.key, jax.ShapeDtypeStruct)  # stochastic: a key in the state
    (adam,) = _states(quantized.inner_state, optax.ScaleByAdamState)
    large = [a for a in jax.tree.leaves(params) if a.size >= 4096]
    for field, signed in (("mu", True), ("nu", False)):
        tree = getattr(adam, field)
        stored = _states(tree, mpjax.QuantizedArray)
        # Every param of 4096 elements or more (the matrices); the biases and norms stay f32.
        assert len(stored) == len(large) > 0
        assert {(q.format.name, q.format.bits, q.block_size, q.signed) for q in stored} == {
            (fmt, bits, block, signed)
        }
    quantized_params = sum(np.prod(q.shape) for q in _states(adam.mu, mpjax.QuantizedArray))
    stored_bytes = sum(q.nbytes for q in _states(adam, mpjax.QuantizedArray))
    assert stored_bytes / quantized_params == pytest.approx(state_bytes)
    report = mpjax.memory_report(params, opt_state)
    assert report.param_bytes / report.param_count == 2.0
    assert report.state_bytes < 4 * report.param_count  # less than bf16 moments
    assert f"moments {fmt} in blocks of {block} (stochastic rounding)" in tt.describe_optimizer(
        cfg, policy
    )


def test_state_format_refuses_moment_dtypes_and_blocks_without_a_format(capsys):
    for argv, message in [
        (["--state-format", "dynamic8", "--mu-dtype", "bf16"], "pass one of them"),
        (["--state-format", "e4m3", "--nu-dtype", "bf16"], "--nu-dtype"),
        (["--state-block-size", "64"], "--state-format"),
        (["--state-format", "dynamic4", "--state-block-size", "96"], "--state-block-size"),
        (["--state-format", "int8"], "--state-format"),
    ]:
        with pytest.raises(SystemExit):
            tt.parse_args(argv)
        assert message in capsys.readouterr().err, argv


@pytest.mark.slow
def test_quantized_state_run_resumes_bit_identically(text_file, tmp_path):
    # The codes, absmaxes and rounding key are orbax arrays like any other state.
    cfg = _cfg(
        text_file,
        tmp_path,
        steps=4,
        ckpt_interval=2,
        d_model=64,
        policy="bfloat16",
        mode="hand",
        attention="naive",
        master_weights=False,
        param_rounding="stochastic",
        state_format="dynamic4",
        state_block_size=32,
        state_rounding="stochastic",
    )
    straight = tt.train(cfg)
    assert _states(straight["state"].opt_state, mpjax.QuantizedArray)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
    resumed = tt.train(dataclasses.replace(cfg, resume=True))
    for a, b in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(resumed["state"])):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_stochastic_rounding_run_resumes_bit_identically(text_file, tmp_path):
    # The rounding keys live in the optimizer state: a resumed run draws what the straight
    # run drew.
    cfg = _cfg(
        text_file,
        tmp_path,
        steps=6,
        ckpt_interval=3,
        policy="bfloat16",
        mode="hand",  # every param bf16, norms included
        attention="naive",  # the hand-written model's fused gradient needs standard promotion
        master_weights=False,
        param_rounding="stochastic",
        mu_dtype="bfloat16",
        nu_dtype="bfloat16",
        state_rounding="stochastic",
    )
    straight = tt.train(cfg)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    resumed = tt.train(dataclasses.replace(cfg, resume=True))
    for a, b in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(resumed["state"])):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert {a.dtype for a in jax.tree.leaves(straight["state"].params)} == {np.dtype(jnp.bfloat16)}
    assert all(0.0 <= r["unmoved"] <= 1.0 for r in straight["history"])


def test_unmoved_fraction_counts_param_elements_a_step_left_unchanged():
    old = {"a": jnp.zeros(6, jnp.bfloat16), "b": jnp.ones((2, 3))}
    new = {"a": old["a"].at[:3].set(1.0), "b": old["b"]}
    assert float(tt.unmoved_fraction(old, new)) == pytest.approx(9 / 12)
    assert float(tt.unmoved_fraction(old, old)) == 1.0


def _is_loss_scaling(x):
    return isinstance(x, mpjax.LossScalingState)


def _is_master(x):
    return isinstance(x, mpjax.MasterWeightsState)


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(corpus):
    _, _, _, state, step = _setup("float32")
    x, y = _batch(corpus, 2, 4)
    s_acc, m_acc = step(state, x, y)
    s_big, m_big = step(state, x.reshape(1, 8, -1), y.reshape(1, 8, -1))
    # The same sums over the 8 x 16 tokens, in two halves or at once.
    rtol = tolerance(np.float32, 8 * SMALL.block_size + gpt_reduction_length(SMALL) + 256)
    np.testing.assert_allclose(m_acc["loss"], m_big["loss"], rtol=rtol)
    # Adam's first update is the gradient over its own size, about lr whatever its size: in
    # norm (tests/tolerances.py), twice the sums (forward and backward), twice again (Adam's
    # ratio of two gradients).
    for (path, a), b, start in zip(
        jax.tree.leaves_with_path(s_acc.params),
        jax.tree.leaves(s_big.params),
        jax.tree.leaves(state.params),
    ):
        a, b, start = (np.asarray(v, np.float64) for v in (a, b, start))
        assert_close_in_norm(a - start, b - start, 4 * rtol, jax.tree_util.keystr(path))


@pytest.mark.slow
def test_sampling_returns_the_prompt_then_the_requested_bytes():
    _, model, _, state, _ = _setup("float32")
    generate = tt.make_generate(model, 40)  # longer than block_size: the window slides
    prompt = jnp.asarray(np.frombuffer(b"def ", np.uint8).astype(np.int32))
    out = generate(state.params, prompt, jax.random.key(0), jnp.float32(0.8))
    assert out.shape == (44,) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:4], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < 256
    np.testing.assert_array_equal(
        out, generate(state.params, prompt, jax.random.key(0), jnp.float32(0.8))
    )
    cfg = tt.TrainConfig(sample_bytes=8, sample_prompt="def ")
    assert tt.sample_text(model, state.params, cfg, jax.random.key(0)).startswith("def ")


# ----------------------------------------------------------------------------- the train loop


@pytest.mark.slow
def test_resume_continues_bit_identically(text_file, tmp_path):
    # mixed_float16: the dynamic loss scale's growth counter moves every step, so the
    # loss-scale state must round-trip through the checkpoint too.
    cfg = _cfg(text_file, tmp_path, steps=6, ckpt_interval=3, policy="mixed_float16")
    straight = tt.train(cfg)
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.name.isdigit()) == ["3", "6"]
    # Pretend the run died after step 3: drop the later checkpoint, then resume.
    shutil.rmtree(ckpt_dir / "6")
    resumed = tt.train(dataclasses.replace(cfg, resume=True))
    assert int(resumed["state"].step) == 6
    for a, b in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(resumed["state"])):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in straight["history"][3:]]
    log = [json.loads(row) for row in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    # Resuming with other settings would not continue the same run: refused, naming the field.
    with pytest.raises(ValueError, match="lr"):
        tt.train(dataclasses.replace(cfg, resume=True, lr=1e-3))
    # And a fresh run must not silently overwrite existing checkpoints.
    with pytest.raises(ValueError, match="--resume"):
        tt.train(cfg)


@pytest.mark.slow
def test_data_parallel_on_8_devices_matches_one_device(text_file, tmp_path):
    assert jax.device_count() >= 8  # conftest gives 8, or the count XLA_FLAGS asks for
    one = tt.train(_cfg(text_file, tmp_path / "one", steps=4, num_devices=1))
    eight = tt.train(_cfg(text_file, tmp_path / "eight", steps=4, num_devices=8))
    params = eight["state"].params
    assert all(
        len(p.sharding.device_set) == 8 and p.sharding.is_fully_replicated
        for p in jax.tree.leaves(params)
    )
    # The sums over the batch split over 8 devices, and the rest in other orders.
    rtol = tolerance(np.float32, 8 * SMALL.block_size + gpt_reduction_length(SMALL) + 256)
    np.testing.assert_allclose(
        [r["loss"] for r in eight["history"]], [r["loss"] for r in one["history"]], rtol=rtol
    )
    # In norm, from where they started, four times that: see the gradient accumulation test.
    cfg, policy = _cfg(text_file, tmp_path / "start"), mpjax.get_policy("float32")
    model = tt.build_model(cfg.model_config(), policy, cfg.mode)
    start = tt.init_state(model, tt.make_optimizer(cfg, policy), cfg.seed, cfg.seq_len)
    for (path, a), b, p0 in zip(
        jax.tree.leaves_with_path(params),
        jax.tree.leaves(one["state"].params),
        jax.tree.leaves(start.params),
    ):
        a, b, p0 = (np.asarray(v, np.float64) for v in (a, b, p0))
        assert_close_in_norm(a - p0, b - p0, 4 * rtol, jax.tree_util.keystr(path))
    with pytest.raises(ValueError, match="--batch-size"):
        tt.train(_cfg(text_file, tmp_path / "bad", batch_size=6, num_devices=8))


@pytest.mark.slow
def test_diverging_run_stops_with_a_clear_message(text_file, tmp_path):
    with pytest.raises(tt.TrainingStopped, match="loss is nan"):
        tt.train(_cfg(text_file, tmp_path, lr=1e30, warmup_steps=0, grad_clip=0.0))


@pytest.mark.slow
def test_persistent_overflow_stops_the_run(text_file, tmp_path):
    # A static scale of 1e30 overflows float16 in every backward pass: every step is skipped.
    cfg = _cfg(
        text_file,
        tmp_path,
        policy="mixed_float16",
        loss_scale="static:1e30",
        max_consecutive_skips=3,
        steps=10,
    )
    with pytest.raises(tt.TrainingStopped, match="Stopped at step 3") as info:
        tt.train(cfg)
    assert isinstance(info.value.__cause__, mpjax.PersistentOverflowError)
    log = [json.loads(row) for row in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in log] == [1, 2]
    assert all(r["loss_scale"] == float(np.float32(1e30)) for r in log)


@pytest.mark.slow
def test_command_line_runs_end_to_end_and_logs_each_logged_step(text_file, tmp_path):
    argv = [
        "--n-layer",
        "1",
        "--d-model",
        "32",
        "--n-head",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--steps",
        "6",
        "--warmup-steps",
        "1",
        "--log-interval",
        "2",
        "--eval-interval",
        "3",
        "--num-devices",
        "1",
        "--data",
        str(text_file),
        "--out",
        str(tmp_path / "cli"),
        "--sample-bytes",
        "12",
        "--no-progress",
        "--mode",
        "autocast",
    ]
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_transformer.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "final val loss" in out and "unigram baseline" in out and "nats/byte" in out
    assert "--- sample (temperature 0.8) ---\ndef " in out
    run = tmp_path / "cli"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["6"]
    log = [json.loads(row) for row in (run / "log.jsonl").read_text().splitlines()]
    # Logged: every log_interval-th step, every evaluation, and the last step.
    assert [r["step"] for r in log] == [2, 3, 4, 6]
    assert [("val_loss" in r) for r in log] == [False, True, False, True]
    assert all(np.isfinite(r["loss"]) and r["loss_scale"] == 1.0 for r in log)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_val_loss"] == log[-1]["val_loss"]
    assert summary["unigram_baseline"] > 2.0  # bytes of Python source: several nats
    assert f"final val loss {summary['final_val_loss']:.4f} nats/byte" in out
    # The summary says what ran as the banner does: f32 params need no master copy, although
    # the settings (config) ask for one wherever params are stored narrower.
    assert f"optimizer: {summary['optimizer']};" in out
    assert summary["master_weights"] is False and summary["config"]["master_weights"] is True
    assert "no master weights needed (f32 params)" in summary["optimizer"]


@pytest.mark.parametrize(
    "flags, says, master",
    [
        ([], "no master weights needed (f32 params)", False),
        (["--no-master-weights"], "no master weights", False),
        (["--policy", "bfloat16"], "f32 master weights", True),
        (["--policy", "bfloat16", "--no-master-weights"], "no master weights", False),
    ],
)
def test_the_banner_says_whether_master_weights_ran(flags, says, master):
    cfg = tt.parse_args(flags)
    policy = mpjax.get_policy(cfg.policy)
    text = tt.describe_optimizer(cfg, policy)
    assert says in text and tt.uses_master_weights(cfg, policy) is master
    if not master:
        assert "f32 master weights" not in text


def test_bad_flags_are_rejected_naming_the_flag(capsys):
    for argv, flag in [
        (["--loss-scale", "sometimes"], "--loss-scale"),
        (["--loss-scale", "static:-2"], "--loss-scale"),
        (["--loss-scale", "static:big"], "--loss-scale"),
        (["--policy", "float13"], "float13"),
        (["--warmup-steps", "900", "--steps", "100"], "--warmup-steps"),
        (["--preset", "huge"], "--preset"),
        (["--mode", "magic"], "--mode"),
        (["--steps", "0"], "--steps"),
        # Stochastic or Kahan updates replace the f32 master copy, of bf16/f16 params only.
        (["--policy", "bfloat16", "--param-rounding", "stochastic"], "--no-master-weights"),
        (["--no-master-weights", "--param-rounding", "kahan"], "--param-rounding"),
        (["--param-rounding", "up"], "--param-rounding"),
        (["--mu-dtype", "float8_e4m3fn"], "--mu-dtype"),
        (["--nu-dtype", "double-ish"], "--nu-dtype"),
        (["--state-rounding", "down"], "--state-rounding"),
    ]:
        with pytest.raises(SystemExit):
            tt.parse_args(argv)
        assert flag in capsys.readouterr().err
    cfg = tt.parse_args(["--policy", "p=f32,c=bf16,o=f32", "--steps", "5", "--warmup-steps", "1"])
    assert mpjax.get_policy(cfg.policy) == mpjax.MIXED_BFLOAT16


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(
            "mpjax",
            marks=pytest.mark.xfail(
                tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12),
                strict=True,
                reason="jax 0.8.1's XLA keeps more converts in the CPU HLO of the mpjax step "
                "than of the hand-written one (848 against 820; jax 0.12's, 205 against "
                "222); compiled for a v5p the two steps are the same program "
                "(tests/test_tpu_plan.py)",
            ),
        ),
        "autocast",
    ],
)
def test_train_step_costs_no_more_converts_than_the_hand_written_bf16_model(mode, corpus):
    """The example transformer's compiled train step (forward, backward, AdamW) under module
    rules or autocast has no more converts than with dtype=bf16 written by hand, and runs the
    same matmuls in the same dtypes (with the attention written out, which hand-set dtypes
    run in bf16 throughout)."""
    x, y = _batch(corpus, 1, 8)
    converts, matmuls = {}, {}
    for name in ("hand", mode):
        _, model, tx, state, _ = _setup("mixed_bfloat16", name, "naive")
        converts[name] = mpjax.hlo_op_counts(tt.make_train_step(model, tx))(state, x, y)["convert"]
        grad_fn = jax.grad(lambda p: tt.loss_fn(model, p, x[0], y[0]))  # noqa: B023 (used here)
        matmuls[name] = mpjax.inspect_matmuls(grad_fn)(state.params).operand_dtypes()
    assert converts[mode] <= converts["hand"], converts
    assert (
        matmuls[mode]
        == matmuls["hand"]
        == {("bfloat16", "bfloat16"): sum(matmuls["hand"].values())}
    )


# ----------------------------------------------------------------------------- model variants

DEEP = dataclasses.replace(SMALL, n_layer=3)


def _tokens(batch=2, config=SMALL, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, config.vocab_size, (batch, config.block_size)), jnp.int32)


def _init(config):
    return jax.jit(gpt.GPT(config).init)(jax.random.key(0), _tokens(config=config))["params"]


@pytest.mark.filterwarnings("ignore::mpjax.block_scaled.EmulationWarning")
def test_wide_edge_blocks_keep_the_first_and_last_blocks_out_of_nvfp4():
    """``--wide-edge-blocks 1 1`` under NVFP4: the first and last of 4 blocks multiply in bf16
    forward and backward, the middle two in e2m1, as NVIDIA's recipe keeps its edge blocks;
    the tied head stays bf16 as under any fp8 policy."""
    config = dataclasses.replace(SMALL, n_layer=4, d_model=64, n_head=2)
    policy = mpjax.get_policy("mixed_bfloat16_nvfp4")
    x, y = _tokens(config=config, seed=1), _tokens(config=config, seed=2)
    params = {}
    counts = {}
    for wide in ((0, 0), (1, 1)):
        model = tt.build_model(config, policy, "mpjax", wide_edge_blocks=wide)
        params = params or model.init(jax.random.key(0), x)["params"]
        with warnings.catch_warnings(record=True) as caught:  # the filters as they are
            report = mpjax.describe(model, variables={"params": params})(x)
        # The kept blocks overlap the norms' rules, the tied head's the embeddings', on purpose:
        # nothing warns of it.
        ruled = [str(w.message) for w in caught if issubclass(w.category, mpjax.RuleWarning)]
        assert not ruled, ruled
        formats = {row.path: set(dict(row.matmuls)) for row in report.rows if row.matmuls}
        narrow = {p.split("/")[0] for p, f in formats.items() if any("e2m1" in d for d in f)}
        assert narrow == ({"h0", "h1", "h2", "h3"} if wide == (0, 0) else {"h1", "h2"})
        # The kept blocks' norms keep the norm rule (f32 in, compute dtype out), as elsewhere.
        norms = {row.path: row.policy for row in report.rows if row.path.endswith(("ln1", "ln2"))}
        assert len(norms) == 8 and len(set(norms.values())) == 1, norms
        assert set(norms.values()) == {mpjax.norm_policy(policy)}, norms
        grad = jax.grad(lambda p, m=model: tt.loss_fn(m, p, x, y))
        dtypes = mpjax.inspect_matmuls(grad)(params).operand_dtypes()
        counts[wide] = sum(n for d, n in dtypes.items() if "float4_e2m1fn" in d)
    # 4 dense layers a block, 3 GEMMs each (forward and both gradients), on both operands.
    assert counts[(0, 0)] == 4 * 4 * 3 and counts[(1, 1)] == 2 * 4 * 3, counts


def test_wide_edge_blocks_are_refused_where_they_cannot_apply(capsys):
    nvfp4 = ["--policy", "mixed_bfloat16_nvfp4", "--n-layer", "4"]
    for argv, says in [
        (["--wide-edge-blocks", "1", "1"], "has none"),
        ([*nvfp4, "--wide-edge-blocks", "2", "2"], "keeps every one of the 4 blocks"),
        ([*nvfp4, "--wide-edge-blocks", "1", "1", "--mode", "autocast"], "takes --mode mpjax"),
        ([*nvfp4, "--wide-edge-blocks", "1", "1", "--scan-layers"], "--scan-layers"),
        ([*nvfp4, "--wide-edge-blocks", "1", "-1"], "must be 0 or more"),
    ]:
        with pytest.raises(SystemExit):
            tt.parse_args(argv)
        err = capsys.readouterr().err
        assert "--wide-edge-blocks" in err and says in err, err
    assert tt.parse_args([*nvfp4, "--wide-edge-blocks", "1", "2"]).wide_edge_blocks == (1, 2)


@pytest.mark.slow
def test_fused_and_naive_attention_compute_the_same_function():
    params = _init(SMALL)
    tokens = _tokens()
    logits = {
        a: gpt.GPT(dataclasses.replace(SMALL, attention=a)).apply({"params": params}, tokens)
        for a in gpt.ATTENTION
    }
    # The same sums in other orders: within the f32 bound of the reductions a logit goes
    # through, relative to the logits' size.
    rtol = tolerance(np.float32, gpt_reduction_length(SMALL))
    scale = np.abs(logits["naive"]).max()
    np.testing.assert_allclose(logits["fused"], logits["naive"], rtol=rtol, atol=rtol * scale)


def _stacked(loop_params, n_layer):
    """The loop model's params h0, h1, ... as the scanned model's h, stacked on axis 0."""
    blocks = [loop_params[f"h{i}"] for i in range(n_layer)]
    rest = {k: v for k, v in loop_params.items() if not k.startswith("h")}
    return {**rest, "h": jax.tree.map(lambda *a: jnp.stack(a), *blocks)}


@pytest.mark.slow
@pytest.mark.parametrize("remat", list(gpt.REMAT_POLICIES))
def test_scanned_and_rematerialized_layers_compute_what_the_loop_computes(remat):
    """nn.scan over layers (and nn.remat of each block) changes how the model runs, not what
    it computes: given the loop's params stacked, the logits and gradients are the loop's."""
    loop_params = _init(DEEP)
    scanned = gpt.GPT(dataclasses.replace(DEEP, scan_layers=True, remat=remat))
    params = _stacked(loop_params, DEEP.n_layer)
    assert jax.tree.structure(params) == jax.tree.structure(_init(scanned.config))
    assert params["h"]["attn"]["qkv"]["kernel"].shape == (3, 32, 96)
    tokens = _tokens(config=DEEP)

    def loss(model, p):
        return model.apply({"params": p}, tokens).std()

    loop_model = gpt.GPT(dataclasses.replace(DEEP, remat=remat))
    # XLA fuses a loop body apart from the rest, so the sums may run in other orders: the
    # logits' reductions, then the std's over every logit; twice that for the gradients (the
    # backward pass runs the reductions again, transposed, and sums over the tokens).
    n_logits = 2 * DEEP.block_size * DEEP.vocab_size
    rtol = tolerance(np.float32, gpt_reduction_length(DEEP) + n_logits)
    np.testing.assert_allclose(loss(scanned, params), loss(loop_model, loop_params), rtol=rtol)
    got = jax.grad(functools.partial(loss, scanned))(params)
    want = _stacked(jax.grad(functools.partial(loss, loop_model))(loop_params), DEEP.n_layer)
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        assert_close_in_norm(a, b, 2 * rtol, jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("mode", tt.MODEL_MODES)
def test_scanned_rematerialized_blocks_run_in_bf16_forward_and_backward(mode):
    """Each way of applying the policy reaches the blocks inside nn.scan and nn.remat: every
    matmul of the gradient runs in bf16, and the jaxpr really scans and rematerializes."""
    config = dataclasses.replace(DEEP, scan_layers=True, remat="full", attention=ATTENTION[mode])
    policy = mpjax.get_policy("mixed_bfloat16")
    model = tt.build_model(config, policy, mode)
    params = model.init(jax.random.key(0), _tokens(config=config))["params"]
    assert params["h"]["mlp"]["fc"]["kernel"].shape == (3, 32, 128)
    x, y = _tokens(config=config, seed=1), _tokens(config=config, seed=2)
    grad_fn = jax.grad(lambda p: tt.loss_fn(model, p, x, y))
    report = mpjax.inspect_matmuls(grad_fn)(params)
    assert set(report.operand_dtypes()) == {("bfloat16", "bfloat16")}, str(report)
    names = {eqn.primitive.name for eqn, _ in iter_equations(grad_fn, params)}
    assert "scan" in names and names & {"remat2", "checkpoint"}, names
    assert {a.dtype for a in jax.tree.leaves(grad_fn(params))} == {np.dtype(jnp.float32)}


@pytest.mark.slow
def test_rules_by_path_reach_a_block_inside_the_scan():
    """A path rule for the scanned block's MLP runs exactly its matmuls in f32."""
    config = dataclasses.replace(DEEP, scan_layers=True, remat="dots")
    rules = mpjax.Rules(
        {"h/mlp*": "float32", gpt.LayerNorm: mpjax.norm_policy}, default="mixed_bfloat16"
    )
    model = mpjax.linen.apply_policy(gpt.GPT(config), rules)
    params = model.init(jax.random.key(0), _tokens(config=config))["params"]
    x = _tokens(config=config, seed=1)
    report = mpjax.inspect_matmuls(jax.grad(lambda p: model.apply({"params": p}, x).sum()))(params)
    # Forward: fc and proj; backward: each one's input and kernel gradients.
    assert report.operand_dtypes()[("float32", "float32")] == 2 * 3
    assert set(report.operand_dtypes()) == {("float32", "float32"), ("bfloat16", "bfloat16")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", tt.MODEL_MODES)
def test_token_rows_are_gathered_and_their_gradient_scatter_adds_in_f32(mode):
    """The token lookup's gradient scatter-adds in f32 in every mode. Its rows come from the
    table cast to bf16 under mpjax's embedding rule (what a sliced table sends between
    devices), from the f32 table by hand (the example's Embed casts the rows) and under
    autocast (whose policy returns f32); the position table is sliced, not gathered, so
    there is one gather and one scatter-add."""
    policy = mpjax.get_policy("mixed_bfloat16")
    model = tt.build_model(dataclasses.replace(SMALL, attention="naive"), policy, mode)
    params = model.init(jax.random.key(0), _tokens())["params"]
    x, y = _tokens(seed=1), _tokens(seed=2)
    eqns = [e for e, _ in iter_equations(jax.grad(lambda p: tt.loss_fn(model, p, x, y)), params)]
    # Lookups read 2-D tables (the loss's gather of the target logits reads 3-D logits).
    gathers = [e for e in eqns if e.primitive.name == "gather" and e.invars[0].aval.ndim == 2]
    scatters = [
        e for e in eqns if e.primitive.name.startswith("scatter") and e.invars[0].aval.ndim == 2
    ]
    table = (SMALL.vocab_size, SMALL.d_model)
    read = np.dtype(jnp.bfloat16 if mode == "mpjax" else jnp.float32)
    assert [(e.invars[0].aval.shape, e.invars[0].aval.dtype) for e in gathers] == [(table, read)]
    assert [(e.primitive.name, e.outvars[0].aval.dtype) for e in scatters] == [
        ("scatter-add", np.dtype(jnp.float32))
    ]
    # The tied head reads the table in bf16, as a matmul operand.
    converts = [e for e in eqns if e.primitive.name == "convert_element_type"]
    assert any(e.invars[0].aval.shape == table for e in converts)


@pytest.mark.slow
def test_weight_decay_applies_to_kernels_and_embeddings_only_even_when_stacked():
    params = _init(dataclasses.replace(DEEP, scan_layers=True, tie_embeddings=False))
    mask = tt.decay_mask(params)
    decayed = {
        jax.tree_util.keystr(path)
        for path, m in jax.tree.leaves_with_path(mask)
        if m  # stacked biases and norm scales are matrices too, but never decayed
    }
    assert decayed == {
        "['wte']['embedding']",
        "['wpe']['embedding']",
        "['head']['kernel']",
        "['h']['attn']['qkv']['kernel']",
        "['h']['attn']['proj']['kernel']",
        "['h']['mlp']['fc']['kernel']",
        "['h']['mlp']['proj']['kernel']",
    }


def test_attention_scan_and_remat_flags_reach_the_model(capsys):
    cfg = tt.parse_args(["--attention", "naive", "--scan-layers", "--remat", "dots"])
    assert (cfg.attention, cfg.scan_layers, cfg.remat) == ("naive", True, "dots")
    mcfg = cfg.model_config()
    assert (mcfg.attention, mcfg.scan_layers, mcfg.remat) == ("naive", True, "dots")
    defaults = tt.parse_args([]).model_config()
    assert (defaults.attention, defaults.scan_layers, defaults.remat) == ("fused", False, "none")
    for flag, value in (("--attention", "flash"), ("--remat", "some")):
        with pytest.raises(SystemExit):
            tt.parse_args([flag, value])
        assert f"argument {flag}: invalid choice: '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attention", "flash", "attention must be one of fused, naive, got 'flash'."),
        ("remat", "all", "remat must be one of none, full, dots, got 'all'."),
    ],
)
def test_model_config_rejects_unknown_choices(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **{field: value})


@pytest.mark.slow
def test_hand_written_bf16_model_with_fused_attention_trains_under_standard_promotion(corpus):
    """The benchmark's hand-written baseline: fused attention, dtypes set by hand, compiled
    under JAX's default (standard) promotion."""
    with jax.numpy_dtype_promotion("standard"):
        _, _, _, state, step = _setup("mixed_bfloat16", "hand", "fused")
        x, y = _batch(corpus, 1, 8)
        losses = []
        for _ in range(3):
            state, metrics = step(state, x, y)
            losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


# ----------------------------------------------------------------------------- resume and the command line


def _argv(text_file, out, *extra):
    return [
        *("--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16"),
        *("--batch-size", "8", "--lr", "0.01", "--eval-interval", "2", "--eval-batches", "1"),
        *("--log-interval", "1", "--ckpt-interval", "2", "--num-devices", "1"),
        *("--sample-bytes", "0", "--no-progress", "--data", str(text_file), "--out", str(out)),
        *extra,
    ]


def _log(out):
    return [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resume_needs_only_out_and_extends_a_finished_run(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    tt.main(_argv(text_file, out, "--steps", "4", "--policy", "mixed_float16"))
    summary = (out / "summary.json").read_text()
    first = _log(out)
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    capsys.readouterr()

    # Finished: resuming without a larger --steps trains nothing and keeps the summary.
    tt.main(["--resume", "--out", str(out)])
    assert "is finished (step 4); nothing to train" in capsys.readouterr().out
    assert (out / "summary.json").read_text() == summary

    # A larger --steps extends the run with the checkpoint's own settings (mixed_float16, the
    # tiny widths, the data): the schedule keeps its 4 steps and the extra ones run at its
    # final learning rate.
    tt.main(["--resume", "--out", str(out), "--steps", "6"])
    printed = capsys.readouterr().out
    assert "resuming at step 4" in printed and "policy: mixed_float16" in printed
    log = _log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert log[:4] == first
    final_lr = 0.01 * tt.MIN_LR_RATIO
    assert [r["lr"] for r in log[4:]] == pytest.approx([final_lr, final_lr])
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


def _without_out(text_file, *extra):
    """The tiny run of :func:`_argv` in its default folder (runs/<name>, no --out)."""
    argv = _argv(text_file, "unused", *extra)
    at = argv.index("--out")
    return argv[:at] + argv[at + 2 :]


@pytest.mark.slow
def test_the_same_command_again_reports_its_finished_run_or_continues_it(
    text_file, tmp_path, monkeypatch, capsys
):
    # People run a set-up command again (a new shell, another day): without --out the folder
    # is named after the run's settings, so the command finds its own run and never fails.
    monkeypatch.chdir(tmp_path)
    argv = _without_out(text_file, "--steps", "4", "--sample-bytes", "8")
    tt.main(argv)
    first = capsys.readouterr().out
    out = tt.parse_args(argv).out_dir()
    summary = (out / "summary.json").read_text()
    log = _log(out)

    tt.main(argv)  # finished: its results again, nothing trained or written
    again = capsys.readouterr().out
    assert f"{out} holds this command's run" in again
    assert "is finished (step 4); nothing to train" in again
    results = first[first.index("\ndone: ") :]
    assert again.endswith(results)  # the same report and the same sample
    assert (out / "summary.json").read_text() == summary and _log(out) == log

    # Interrupted (its last checkpoint and summary lost): the same command continues it from
    # the newest checkpoint left, to the same log an uninterrupted run wrote.
    shutil.rmtree(out / "checkpoints" / "4")
    (out / "summary.json").unlink()
    tt.main(argv)
    continued = capsys.readouterr().out
    assert "resuming at step 2" in continued and "done: 4 steps" in continued
    losses = [(r["step"], r["loss"], r.get("val_loss")) for r in log]
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in _log(out)] == losses

    # A folder chosen with --out is the user's: a run there still needs --resume.
    with pytest.raises(SystemExit, match="already holds a run"):
        tt.main([*argv, "--out", str(out)])


@pytest.mark.slow
def test_resume_refuses_flags_that_change_the_run_naming_each(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    tt.main(_argv(text_file, out, "--steps", "2"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        tt.main(["--resume", "--out", str(out), "--d-model", "64", "--lr", "0.5"])
    assert exit_info.value.code != 0
    err = str(exit_info.value.code)
    assert "--d-model: checkpoint None, given 64" not in err
    assert "--d-model: checkpoint 32, given 64" in err and "--lr: checkpoint 0.01, given 0.5" in err
    assert "--resume --out is enough" in err
    with pytest.raises(SystemExit, match=r"--steps: the checkpoint is at step 2, given --steps 1"):
        tt.main(["--resume", "--out", str(out), "--steps", "1"])
    # Flags that do not change the run may change.
    tt.main(["--resume", "--out", str(out), "--steps", "3", "--log-interval", "3"])
    assert [r["step"] for r in _log(out)] == [1, 2, 3]


def test_default_out_folders_keep_runs_with_other_settings_apart():
    """Without --out, each set of settings that decides the run trains into a folder of its
    own, so the README's commands run one after another; the same command finds its own run
    again (which a fresh run refuses), whatever its length, logging or devices."""
    commands = [
        [],
        ["--policy", "mixed_float16"],
        ["--mode", "autocast"],
        ["--policy", "bfloat16", "--no-master-weights"],
        ["--policy", "bfloat16", "--no-master-weights", "--param-rounding", "stochastic"],
        ["--policy", "p=f32,c=bf16,o=f32,fp8=delayed"],
        ["--fsdp", "4"],
        ["--data", "/corpora/text.txt"],
    ]
    folders = [tt.parse_args(command).out_dir() for command in commands]
    assert len(set(folders)) == len(folders), folders
    assert folders[:3] == [
        pathlib.Path("runs/tiny_mixed_bfloat16"),
        pathlib.Path("runs/tiny_mixed_float16"),
        pathlib.Path("runs/tiny_mixed_bfloat16_mode-autocast"),
    ]
    assert folders[5] == pathlib.Path("runs/tiny_pf32_cbf16_of32_fp8delayed")
    assert folders[7] == pathlib.Path("runs/tiny_mixed_bfloat16_data-text.txt")
    same = ["--mode", "mpjax", "--steps", "5", "--log-interval", "1", "--num-devices", "1"]
    assert tt.parse_args(same).out_dir() == folders[0]


def test_resume_needs_a_checkpoint_and_names_the_folder(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        tt.main(["--resume", "--out", str(out)])
    assert str(info.value.code) == (
        f"error: --resume: {out / 'checkpoints'} holds no checkpoint to continue from. To start "
        "a run there, leave --resume out."
    )
    assert not out.exists()
    # A run that saved no checkpoint (--ckpt-interval 0) cannot continue either: start it over.
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit, match=r"\(it holds log.jsonl\)\. .* and pass --overwrite\."):
        tt.main(["--resume", "--out", str(out)])
    with pytest.raises(SystemExit):
        tt.main(["--resume", "--overwrite", "--out", str(out)])
    assert (
        "--resume continues the run in --out and --overwrite deletes it" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_a_fresh_run_refuses_a_folder_with_a_run_and_overwrite_deletes_only_its_files(
    text_file, tmp_path, capsys
):
    out = tmp_path / "run"
    (out / "checkpoints" / "2").mkdir(parents=True)
    (out / "checkpoints" / "2" / "state").write_text("an earlier run's")
    (out / "log.jsonl").write_text('{"step": 2, "loss": 9.0}\n')
    (out / "summary.json").write_text("{}")
    (out / "notes.txt").write_text("the user's own")
    argv = _argv(text_file, out, "--steps", "2", "--ckpt-interval", "0")
    with pytest.raises(SystemExit) as info:
        tt.main(argv)
    assert str(info.value.code) == (
        f"error: --out {out} already holds a run (checkpoints, log.jsonl, summary.json): pass "
        "--resume to continue it, or --overwrite to delete it and start afresh, or choose "
        "another --out."
    )
    capsys.readouterr()
    tt.main([*argv, "--overwrite"])
    assert f"--overwrite: deleting the run in {out}" in capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "the user's own"
    assert not (out / "checkpoints").exists()  # --ckpt-interval 0 saved none of its own
    assert [r["step"] for r in _log(out)] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    # Now the folder holds a run without checkpoints: --overwrite is the way on.
    with pytest.raises(SystemExit, match="no checkpoint to resume from: pass --overwrite"):
        tt.main(argv)


@pytest.fixture(scope="module")
def interrupted_run(text_file, tmp_path_factory):
    """A float32 run that saved checkpoints at steps 2 and 4, and its logged steps."""
    cfg = _cfg(text_file, tmp_path_factory.mktemp("interrupted"), steps=4, ckpt_interval=2)
    return cfg, tt.train(cfg)["history"]


def _array_file(step_dir):
    """The largest of the files that hold a checkpoint's arrays (orbax's OCDBT data files)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _overwrite_with_garbage(step_dir):
    path = _array_file(step_dir)
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))


def _truncate(step_dir):
    path = _array_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# Ways a checkpoint gets damaged (a full disk, a copy cut short, a stray write), and what the
# error names: the file or folder, and the cause.
DAMAGE = {
    "garbage": (_overwrite_with_garbage, r"state: \w+: Error reading \"\S+\" in OCDBT"),
    "truncated": (_truncate, r"state: \w+: Error reading \"\S+\" in OCDBT"),
    "no tree metadata": (lambda d: (d / "state" / "_METADATA").unlink(), r"state.*_METADATA"),
    "no settings": (lambda d: (d / "meta" / "metadata").unlink(), r"meta: FileNotFoundError"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_falls_back_from_a_corrupt_checkpoint_naming_the_file(
    damage, interrupted_run, tmp_path, capfd
):
    cfg, history = interrupted_run
    out = tmp_path / "run"
    shutil.copytree(cfg.out_dir(), out)
    checkpoints = out / "checkpoints"
    corrupt, cause = DAMAGE[damage]
    corrupt(checkpoints / "4")
    # --steps 6 extends the run, so its newest checkpoint must restore.
    resumed = tt.train(dataclasses.replace(cfg, out=str(out), resume=True, steps=6))
    printed, err = capfd.readouterr()
    where = re.escape(f"{checkpoints / '4'}{os.sep}")
    assert re.search(rf"the checkpoint of step 4 is corrupt \({where}{cause}", printed), printed
    assert "does not fit" not in printed
    assert "--resume: resuming from step 2, the newest checkpoint that restores" in printed
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    # The same computation on the same devices from step 2's checkpoint: bit for bit.
    assert [r["step"] for r in resumed["history"]] == [3, 4, 5, 6]
    assert [r["loss"] for r in resumed["history"][:2]] == [r["loss"] for r in history[2:]]
    # The corrupt checkpoint is kept for a look; the run saved its own step 4 again.
    assert (checkpoints / "4.corrupt").is_dir()
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["4", "6"]


@pytest.mark.slow
def test_resume_lists_each_checkpoint_and_why_when_none_restores(interrupted_run, tmp_path):
    cfg, _ = interrupted_run
    out = tmp_path / "run"
    shutil.copytree(cfg.out_dir(), out)
    _overwrite_with_garbage(out / "checkpoints" / "4")
    (out / "checkpoints" / "2" / "meta" / "metadata").write_text("{not json")
    # In a process of its own, so that what orbax prints as it exits is seen too.
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_transformer.py")]
        + ["--resume", "--out", str(out), "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 1, result.stderr
    # Less what XLA itself logs (a flag in the caller's XLA_FLAGS it warns about, say).
    logged = result.stderr.splitlines()
    lines = [line for line in logged if not re.match(r"[IWEF]\d{4} \d\d:", line)]
    assert lines[0] == f"error: --resume: no checkpoint in {out / 'checkpoints'} restores:"
    assert lines[1].startswith(f"  step 4: {out / 'checkpoints' / '4' / 'state'}: ")
    assert "Error reading" in lines[1]
    assert lines[2] == f"  step 2: {out / 'checkpoints' / '2' / 'meta'}: JSONDecodeError: " + (
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    )
    # Nothing more: orbax's echoes of the failed reads (tracebacks) are kept off the terminal.
    assert lines[3:] == [
        "Start afresh with --overwrite (it deletes them), or train into another --out."
    ], result.stderr
    assert "Traceback" not in result.stdout


@pytest.mark.slow
def test_a_checkpoint_of_other_settings_does_not_fit_and_is_not_called_corrupt(interrupted_run):
    cfg, _ = interrupted_run
    untied = dataclasses.replace(cfg, untied=True)  # one more matrix: the output head
    policy = mpjax.get_policy(untied.policy)
    model = tt.build_model(untied.model_config(), policy, untied.mode)
    like = tt.init_state(model, tt.make_optimizer(untied, policy), 0, untied.seq_len)
    manager = tt._checkpoint_manager(cfg.out_dir() / "checkpoints")
    with pytest.raises(ValueError) as info:
        tt.restore_state(manager, 4, like)
    assert not isinstance(info.value, tt.CorruptCheckpoint)
    assert str(info.value) == (
        f"--resume: the checkpoint of step 4 in {cfg.out_dir() / 'checkpoints'} does not fit "
        "the model and optimizer these settings build: params.head.kernel is not in the "
        "checkpoint; opt_state.1.0.mu.head.kernel is not in the checkpoint; "
        "opt_state.1.0.nu.head.kernel is not in the checkpoint."
    )


def test_warmup_default_scales_to_short_runs(capsys):
    assert tt.parse_args([]).warmup() == 50
    assert tt.parse_args(["--steps", "20"]).warmup() == 2
    assert tt.parse_args(["--steps", "5"]).warmup() == 0
    with pytest.raises(SystemExit):
        tt.parse_args(["--steps", "20", "--warmup-steps", "30"])
    assert (
        "--warmup-steps must be in [0, --steps), got 30 with --steps 20" in capsys.readouterr().err
    )


def test_help_gives_every_flag_a_line_and_its_default_once(capsys):
    with pytest.raises(SystemExit):
        tt.parse_args(["--help"])
    text = capsys.readouterr().out
    for bad in ("(default: False)", "(default: True)", "(default: None)"):
        assert bad not in text
    assert text.count("(default: tied to wte) (default") == 0
    for action in tt.make_parser()._actions:
        assert action.help, action.option_strings
    assert "(default: 800)" in text and "(default: min(50, steps / 10))" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/no/such/corpus"], "error: --data '/no/such/corpus': no such file or folder"),
        (["--out", "FILE"], "is a file; give a folder for the run"),
    ],
)
def test_user_errors_are_a_message_not_a_traceback(text_file, tmp_path, extra, message):
    (tmp_path / "FILE").write_text("not a folder")
    extra = [str(tmp_path / "FILE") if a == "FILE" else a for a in extra]
    argv = _argv(text_file, tmp_path / "run", "--steps", "2") + extra
    with pytest.raises(SystemExit, match=message):
        tt.main(argv)


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy_name, mode, fp8_head",
    [
        ("mixed_bfloat16_fp8", "mpjax", False),
        ("mixed_bfloat16_fp8", "mpjax", True),
        ("mixed_bfloat16_fp8", "autocast", False),
        ("mixed_bfloat16_fp8", "autocast", True),
        (tt.FP8_DELAYED, "mpjax", False),
        (tt.FP8_DELAYED, "autocast", False),
    ],
)
def test_fp8_policy_runs_every_dense_matmul_in_fp8_but_the_head(policy_name, mode, fp8_head):
    """Under mixed_bfloat16_fp8, and with delayed scaling, the blocks' dense matmuls, scanned
    and rematerialized, run with scaled fp8 operands forward and backward; the tied head
    stays bf16 unless --fp8-head, and attention's batched matmuls stay bf16."""
    config = dataclasses.replace(DEEP, scan_layers=True, remat="full", attention="naive")
    policy = mpjax.get_policy(policy_name)
    model = tt.build_model(config, policy, mode, fp8_head=fp8_head)
    variables = model.init(jax.random.key(0), _tokens(config=config))
    x, y = _tokens(config=config, seed=1), _tokens(config=config, seed=2)
    # The step's own derivative: with respect to the delayed-scaling state too (its next state).
    grad = jax.grad(lambda p, f: tt.loss_fn(model, p, x, y, f), argnums=(0, 1))
    dots = mpjax.hlo_dots(grad)(variables["params"], variables.get(tt.FP8_COLLECTION))
    fp8_dots = [d for d in dots if d.fp8]
    # The scanned block (computed once in the loop body): qkv, proj, fc, mlp proj forward,
    # and twice as many backward; remat computes the forward again in the backward pass.
    assert len(fp8_dots) >= 3 * 4, str(dots)
    head = 3 if fp8_head else 0  # forward, input and table gradient of the tied head
    assert len([d for d in dots if d.fp8 and d.computation.startswith("main")]) == head
    # Direct fp8 GEMMs accumulate in f32 and are scaled before rounding to bf16; the rest
    # (dequantized fp8 backward GEMMs where XLA cannot take two fp8 types) are bf16, but for
    # a bf16 head's table gradient, written in f32, the reduce dtype (XLA's CPU runs it on
    # operands widened to f32).
    assert all(d.out_dtype == ("f32" if d.direct else "bf16") for d in dots if d.fp8), str(dots)
    widened = [d for d in dots if not d.fp8 and d.out_dtype == "f32"]
    assert len(widened) == (0 if fp8_head else 1), str(dots)
    assert all(d.computation.startswith("main") for d in widened), str(dots)
    assert all(d.out_dtype == "bf16" for d in dots if not d.fp8 and d not in widened), str(dots)


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy_name, flags",
    [
        ("mixed_bfloat16_fp8", {}),
        # Delayed scaling: the state is checkpointed; with accumulation, loss scaling and
        # sampling (which runs the model with the state) in the same run.
        (tt.FP8_DELAYED, {"grad_accum": 2, "loss_scale": "dynamic", "sample_bytes": 4}),
        (tt.FP8_DELAYED, {"mode": "autocast"}),
        # Blackwell's block formats, emulated on the CPU with their numbers.
        ("mixed_bfloat16_mxfp8", {}),
        ("mixed_bfloat16_nvfp4", {}),
    ],
    ids=["current", "delayed", "delayed-autocast", "mxfp8", "nvfp4"],
)
@pytest.mark.filterwarnings("ignore::mpjax.block_scaled.EmulationWarning")
def test_fp8_run_trains_and_resumes_bit_identically(text_file, tmp_path, policy_name, flags):
    cfg = _cfg(text_file, tmp_path, steps=6, ckpt_interval=3, policy=policy_name, **flags)
    straight = tt.train(cfg)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    resumed = tt.train(dataclasses.replace(cfg, resume=True))
    leaves = jax.tree.leaves(straight["state"])
    assert len(leaves) == len(jax.tree.leaves(resumed["state"]))
    for a, b in zip(leaves, jax.tree.leaves(resumed["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    losses = [r["loss"] for r in straight["history"]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    fp8 = straight["state"].fp8
    if policy_name == tt.FP8_DELAYED:
        # One amax per micro-batch in each matmul's history: 6 steps of grad_accum.
        entries = 6 * cfg.grad_accum
        assert len(fp8) == 4 * SMALL.n_layer, list(fp8)
        for site, meta in fp8.items():
            assert (meta.amax_history[:entries] > 0).all(), site
            assert (meta.amax_history[entries:] == 0).all(), site
    else:
        assert fp8 == {}


@functools.cache
def _delayed_setup(mode, loss_scale="none", policy_name=tt.FP8_DELAYED):
    cfg = tt.TrainConfig(policy=policy_name, steps=10, warmup_steps=2, lr=1e-2)
    cfg = dataclasses.replace(cfg, loss_scale=loss_scale)
    policy = mpjax.get_policy(policy_name)
    model = tt.build_model(SMALL, policy, mode)
    tx = tt.make_optimizer(cfg, policy)
    state = tt.init_state(model, tx, seed=0, seq_len=SMALL.block_size)
    return model, state, jax.jit(tt.make_train_step(model, tx))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mpjax", "autocast"])
def test_delayed_fp8_state_advances_every_step_from_its_start(mode, corpus):
    """The train state starts with each dense matmul's scales at 1 and an empty history;
    each step stores the next state (the gradient with respect to it): one more amax per
    operand in each history, newest first, and scales taken from them."""
    model, state, step = _delayed_setup(mode)
    fp8_max = np.array([448.0, 448.0, 57344.0], np.float32)  # e4m3, e4m3, e5m2
    for meta in state.fp8.values():
        assert meta.scale.dtype == meta.amax_history.dtype == jnp.float32
        assert (meta.scale == 1).all() and (meta.amax_history == 0).all()
        assert meta.amax_history.shape == (1024, 3)  # the recipe's default history
    x, y = _batch(corpus, 1, 8)
    history, losses = [state.fp8], []
    for _ in range(3):
        state, metrics = step(state, x, y)
        history.append(state.fp8)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    assert len(state.fp8) == 4 * SMALL.n_layer
    for site in state.fp8:
        before, after = history[-2][site], history[-1][site]
        # The history rolled by one: this step's amaxes in front.
        np.testing.assert_array_equal(after.amax_history[1:4], before.amax_history[:3])
        assert (after.amax_history[:3] > 0).all() and (after.amax_history[3:] == 0).all()
        # Each scale is the largest amax of its history over its format's maximum.
        largest = np.max(np.asarray(after.amax_history), axis=0)
        rtol = float(jnp.finfo(jnp.float32).eps)  # one division, rounded
        np.testing.assert_allclose(after.scale, largest / fp8_max, rtol=rtol)
        assert not np.array_equal(after.scale, history[0][site].scale), site
    # Evaluation runs the model with the state and leaves it as it is.
    loss = jax.jit(lambda p, f: tt.loss_fn(model, p, x[0], y[0], f))(state.params, state.fp8)
    assert np.isfinite(float(loss))


@pytest.mark.slow
def test_gradient_accumulation_chains_the_delayed_fp8_state_through_its_micro_batches(corpus):
    """Each micro-batch runs with the state the one before it left, so the step keeps the
    last micro-batch's state, whose history holds every micro-batch's amaxes in order."""
    model, state, step = _delayed_setup("mpjax")
    x, y = _batch(corpus, 2, 4)
    after, _ = step(state, x, y)
    grad = jax.jit(
        jax.grad(lambda p, f, x, y: tt.loss_fn(model, p, x, y, f), argnums=1)
    )  # the next state of one micro-batch
    first = grad(state.params, state.fp8, x[0], y[0])
    second = grad(state.params, first, x[1], y[1])
    # The same computation compiled apart: the activations' and gradients' amaxes may land a
    # bf16 rounding apart (rows of bf16 values); the weights' amax (row 1) is the same.
    rtol = 2 * float(jnp.finfo(jnp.bfloat16).eps)
    for site, meta in after.fp8.items():
        entries = np.asarray(meta.amax_history[:2])
        np.testing.assert_allclose(entries, second[site].amax_history[:2], rtol=rtol)
        np.testing.assert_array_equal(entries[:, 1], first[site].amax_history[0, 1])
        assert (np.asarray(meta.amax_history[2:]) == 0).all()
        # The micro-batches differ: their activations' amaxes are two entries, not one twice.
        assert entries[0, 0] != entries[1, 0] or entries[0, 2] != entries[1, 2], site


@pytest.mark.slow
def test_a_skipped_step_keeps_the_delayed_fp8_state_like_the_params(corpus):
    """A loss scale of 1e30 overflows float16 in every backward pass: loss scaling skips the
    step, and the fp8 state stays bit for bit what it was, as the params do, though the
    forward amaxes this step computed are finite (a state taken as is would have moved)."""
    model, state, step = _delayed_setup(
        "mpjax", loss_scale="static:1e30", policy_name="p=f32,c=f16,o=f32,fp8=delayed"
    )
    x, y = _batch(corpus, 1, 8)
    after, metrics = step(state, x, y)
    assert int(metrics["skipped_steps"]) == 1
    for a, b in zip(
        jax.tree.leaves((state.params, state.fp8)), jax.tree.leaves((after.params, after.fp8))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    scaled = jax.jit(jax.grad(lambda f: 1e30 * tt.loss_fn(model, state.params, x[0], y[0], f)))(
        state.fp8
    )
    assert any((meta.amax_history[0, :2] > 0).all() for meta in scaled.values())


@pytest.mark.slow
def test_delayed_fp8_state_is_replicated_under_fsdp_and_takes_global_amaxes(text_file, tmp_path):
    """Under FSDP the params are sliced, the fp8 state (here stacked over scanned layers, large
    enough to be sliced like a param) stays whole on every device; its amaxes are those of the
    whole batch, as on one device."""
    flags = dict(
        policy=tt.FP8_DELAYED, steps=3, n_layer=2, d_model=64, scan_layers=True, sample_bytes=4
    )
    one = tt.train(_cfg(text_file, tmp_path / "one", num_devices=1, **flags))
    eight = tt.train(_cfg(text_file, tmp_path / "eight", num_devices=8, fsdp=4, **flags))
    kernel = eight["state"].params["h"]["mlp"]["fc"]["kernel"]
    assert not kernel.sharding.is_fully_replicated
    assert eight["state"].fp8
    for site, meta in eight["state"].fp8.items():
        assert meta.amax_history.shape == (2, 1024, 3), site
        for a in meta:
            assert len(a.sharding.device_set) == 8 and a.sharding.is_fully_replicated, site
        # The first step's amaxes (from the same init and batch), per layer: the input's and
        # the kernel's a bf16 rounding apart at most; the gradient's reaches the matmul through
        # the bf16 residual stream's cotangent sums, one per residual add above it (two per
        # block), whose order the devices change.
        got, want = meta.amax_history[:, 2], one["state"].fp8[site].amax_history[:, 2]
        bf16 = float(jnp.finfo(jnp.bfloat16).eps)
        np.testing.assert_allclose(got[:, :2], want[:, :2], rtol=2 * bf16)
        np.testing.assert_allclose(
            got[:, 2], want[:, 2], rtol=tolerance(jnp.bfloat16, 2 * flags["n_layer"])
        )


def test_hand_mode_refuses_an_fp8_policy():
    with pytest.raises(ValueError, match="use mode 'mpjax' or 'autocast'"):
        tt.build_model(SMALL, mpjax.get_policy("mixed_bfloat16_fp8"), "hand")


@pytest.mark.parametrize(
    "policy", ["mixed_bfloat16_fp8", "p=f32, c=bf16, o=f32, fp8=current", tt.FP8_DELAYED]
)
def test_the_hand_mode_flag_error_echoes_the_policy_as_typed(policy, capsys):
    with pytest.raises(SystemExit):
        tt.parse_args(["--policy", policy, "--mode", "hand"])
    err = capsys.readouterr().err
    assert f"--policy {policy} runs matmuls in fp8" in err and "--mode mpjax" in err, err


@pytest.mark.parametrize("val, verdict", [(1.7, "1.5000 nats better"), (3.63, "0.4300 nats worse")])
def test_the_summary_says_better_or_worse_than_the_baseline(val, verdict, monkeypatch, capsys):
    summary = {
        "final_val_loss": val,
        "unigram_baseline": 3.2,
        "steps": 5,
        "tokens": 640,
        "train_time_s": 1.0,
        "compile_time_s": 1.0,
        "tokens_per_s": 640.0,
        "skipped_steps": 0,
        "final_loss_scale": 1.0,
    }
    monkeypatch.setattr(tt, "train", lambda cfg: summary)
    tt.main(["--steps", "5", "--warmup-steps", "1"])
    out = capsys.readouterr().out
    assert f"unigram baseline 3.2000 nats/byte (4.617 bits/byte): {verdict}\n" in out, out


@pytest.mark.slow
@pytest.mark.skipif(
    mpjax.plan_unavailable("v5p") is not None, reason="the plan cannot compile for a TPU here"
)
def test_the_example_plans_its_step_for_a_tpu_without_training(capsys):
    # --plan compiles the train step for the target, sharded as it would train there, and
    # prints the plan: its matmul FLOPs are the model's (the estimate the example's MFU uses),
    # less the bias and norm parameters the model's 6N counts (0.7% here). Attention is
    # Pallas's kernels on each chip's two sequences, whose nominal FLOPs the plan counts (XLA's
    # attention also recomputed the logits in the backward pass, 2 T d a token and layer).
    tt.main(["--plan", "v5p:2x2x1", "--preset", "tiny", "--batch-size", "8"])
    out = capsys.readouterr().out
    assert "TPU plan for v5p:2x2x1 (TPU v5, 4 devices)" in out
    assert "matmul FLOPs:" in out and "(bfloat16 100.0%)" in out
    assert "estimated time per call (XLA's cost model, an estimate)" in out
    mcfg = tt.TrainConfig(preset="tiny").model_config()
    assert out.count("tpu_custom_call  forward") == mcfg.n_layer, out
    assert out.count("tpu_custom_call  backward") == 2 * mcfg.n_layer
    assert "that declare no cost to XLA" in out
    tokens = 8 * mcfg.block_size / 4
    plan_flops = float(out.split("matmul FLOPs: ")[1].split("G ")[0]) * 1e9
    assert plan_flops == pytest.approx(tokens * mcfg.flops_per_token(), rel=0.01)
    with pytest.raises(SystemExit, match="multiple of the 4 devices of --plan v5p:2x2x1"):
        tt.main(["--plan", "v5p:2x2x1", "--preset", "tiny", "--batch-size", "6"])


@pytest.mark.slow
@pytest.mark.skipif(
    mpjax.plan_unavailable("v5e") is not None, reason="the plan cannot compile for a TPU here"
)
def test_a_step_too_big_for_the_target_gets_the_batch_that_fits(capsys):
    # 8,192 tiny sequences need about 17.6 GB of temporaries, more than a v5e's 16 GiB: the
    # plan says so, and which batch fits, with the accumulation that keeps the step's tokens.
    tt.main(["--plan", "v5e", "--preset", "tiny", "--batch-size", "8192"])
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "the compile stopped there" in out
    assert "--batch-size 4096 fits on v5e" in out and "--grad-accum 2 keeps 8192 sequences" in out


# --- A mixture of experts -------------------------------------------------------------------

MOE_FLAGS = ["--experts", "8", "--top-k", "2"]


def test_the_moe_option_runs_its_experts_grouped_and_its_router_in_float32():
    cfg = tt.parse_args([*MOE_FLAGS, "--n-layer", "1", "--seq-len", "16"])
    mcfg = cfg.model_config()
    assert (mcfg.n_experts, mcfg.top_k) == (8, 2) and "_experts-8" in cfg.out_dir().name
    model = tt.build_model(mcfg, mpjax.get_policy(cfg.policy), "mpjax")
    report = mpjax.describe(model)(jnp.zeros((4, 16), jnp.int32))
    moe, router = report.row("h0/moe"), report.row("h0/moe/router")
    # Two grouped GEMMs, three each with their gradients; the router at true f32.
    assert moe.matmuls == (("bf16,bf16@grouped", 6),)
    assert router.rule == "builtin: MoE router in f32"
    assert router.matmuls == (("f32,f32@highest", 3),)
    # The router's losses join the objective, not the evaluation.
    variables = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    x = jnp.ones((4, 16), jnp.int32)
    objective = tt.loss_fn(model, variables["params"], x, x)
    evaluated = tt.loss_fn(model, variables["params"], x, x, router_losses=False)
    assert 0 < float(objective - evaluated) < 0.1  # 0.01 x balance (about 1) + 0.001 x z


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--experts", "-1"], "--experts must be 0"),
        (["--experts", "4", "--top-k", "5"], "--top-k 5 must be at most the 4 experts"),
    ],
)
def test_bad_moe_flags_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        tt.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_moe_run_trains_on_the_cpu(text_file, tmp_path):
    out = tmp_path / "moe"
    summary = tt.train(tt.parse_args([*_argv(text_file, out, "--steps", "6"), *MOE_FLAGS]))
    losses = [r["loss"] for r in summary["history"]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
