"""The example's precision doctor flags: --diagnose-every N measures each module in the train
step every N steps into <out>/ranges.jsonl; --diagnose prints mpjax.diagnose's report."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_transformer as tt  # noqa: E402

FLAGS = dict(n_layer=1, n_head=2, d_model=32, seq_len=16, batch_size=2)


@pytest.fixture
def data(tmp_path) -> pathlib.Path:
    path = tmp_path / "corpus.py"
    path.write_bytes(b"def f(x):\n    return x * 2\n" * 400)
    return path


@pytest.mark.slow
def test_diagnose_every_writes_each_modules_ranges_next_to_the_log(data, tmp_path):
    cfg = tt.TrainConfig(
        **FLAGS,
        steps=5,
        warmup_steps=1,
        eval_interval=5,
        eval_batches=1,
        log_interval=1,
        ckpt_interval=0,
        data=str(data),
        sample_bytes=0,
        progress=False,
        out=str(tmp_path / "run"),
        policy="mixed_bfloat16",
        num_devices=1,
        diagnose_every=2,
    )
    tt.train(cfg)
    rows = [json.loads(r) for r in (tmp_path / "run" / "ranges.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {0, 2, 4}
    modules = {r["module"] for r in rows}
    assert {"h0/mlp/fc", "h0/attn/qkv", "h0/ln1"} <= modules
    # Each module's values and their gradients (the backward pass's values there).
    assert {("h0/mlp/fc", False), ("h0/mlp/fc", True)} <= {
        (r["module"], r["backward"]) for r in rows
    }
    assert all(r["nonfinite"] == 0 and r["amax"] > 0 for r in rows)
    log = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert len(log) == 5  # every step trained and logged, checks included


@pytest.mark.slow
def test_diagnose_prints_the_report_of_the_model_and_policy(data, capsys):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    tt.main(["--diagnose", "--policy", "mixed_float16", "--data", str(data), *flags])
    out = capsys.readouterr().out
    assert "precision diagnosis" in out and "h0/mlp/fc" in out
    assert "on 1 sequence of" in out  # --diagnose-batch's default
    assert "loss scale for float16 gradients" in out
    assert "verdict: " in out.rsplit("precision diagnosis", 1)[1]  # the summary comes last


@pytest.mark.slow
def test_diagnose_names_the_modules_of_scanned_layers(data, capsys):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**FLAGS, "n_layer": 2}.items()]
    tt.main(
        ["--diagnose", "--scan-layers", "--policy", "mixed_float16", "--data", str(data), *flags]
    )
    out = capsys.readouterr().out
    assert "precision diagnosis" in out and "h/mlp/fc" in out
