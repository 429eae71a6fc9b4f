"""The one-call GPU session script (benchmarks/gpu_session.py): its CPU rehearsal runs each
task's parts end to end and writes each part's JSON; a budget too short stops it between parts
with what was done kept; real plans are compared with the committed deviceless ones field by
field, saying which differences autotuning explains."""

import json
import pathlib
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import benchmark_train_step as bench  # noqa: E402
import gpu_session  # noqa: E402

ROW_FIELDS = {
    "compile_s",
    "step_s_median",
    "step_s_min",
    "tokens_per_s",
    "mfu",
    "peak_bytes_in_use",
    "plan",
}


def _plan(**changes):
    plan = {
        "source": "deviceless h100",
        "device": "NVIDIA H100 80GB HBM3",
        "flop_share": {"bfloat16": 1.0, "float16": 0.0, "fp8": 0.0, "float32": 0.0},
        "gemms": 219,
        "fp8_gemms": 0,
        "gemm_libraries": ["triton"],
        "attention_forward": 18,
        "attention_backward": 18,
        "scatter_dtypes": ["float32"],
        "fusions": 1432,
        "custom_calls": 36,
    }
    return plan | changes


def test_a_plan_is_compared_field_by_field_and_only_autotuning_is_expected():
    same = gpu_session.compare_plans(_plan(), _plan())
    assert same["differ"] == {} and same["unexpected"] == []
    assert set(same["same"]) == set(gpu_session.PLAN_FIELDS)
    tuned = _plan(gemm_libraries=["cublaslt", "triton"], fusions=1400, custom_calls=90)
    result = gpu_session.compare_plans(tuned, _plan())
    assert set(result["differ"]) == {"gemm_libraries", "fusions", "custom_calls"}
    assert result["unexpected"] == []
    assert result["differ"]["fusions"] == {
        "real": 1400,
        "committed": 1432,
        "why": gpu_session.AUTOTUNED,
        "expected": True,
    }
    moved = _plan(fp8_gemms=12, scatter_dtypes=["bfloat16"], gemm_kinds=[])
    result = gpu_session.compare_plans(moved, _plan())
    assert result["unexpected"] == ["fp8_gemms", "scatter_dtypes"]
    assert "before" in result["differ"]["fp8_gemms"]["why"]


def test_the_committed_plan_comes_from_this_jax_version_or_else_the_newest():
    here = gpu_session.committed_plan("small", "bf16_mpjax", "0.8.1")
    assert here["file"] == "benchmarks/results/h100_plan/jax-0.8.1/cpu_small_plan.json"
    assert here["plan"]["flop_share"]["bfloat16"] == 1.0 and here["jax"] == "0.8.1"
    other = gpu_session.committed_plan("medium", "fp8_mpjax", "0.99.0")
    assert other["jax"] == "0.12.0.1" and other["plan"]["fp8_gemms"] > 0
    assert (
        "no committed plan of torch_bf16_sdpa on small"
        in (gpu_session.committed_plan("small", "torch_bf16_sdpa", "0.8.1")["missing"])
    )


H100_ENV = {
    "device": {"kind": "NVIDIA H100 80GB HBM3", "platform": "gpu"},
    "versions": {"jax": "0.12.0.1"},
}


def test_a_real_plan_is_set_beside_the_committed_one_with_what_differs_and_why():
    gemm_kinds = [
        {"lhs": "bfloat16", "rhs": "bfloat16", "library": "cublaslt", "gemms": 200, "flops": 9},
        {"lhs": "bfloat16", "rhs": "bfloat16", "library": "triton", "gemms": 19, "flops": 1},
    ]
    real = _plan(source="autotuned", gemm_libraries=["cublaslt", "triton"], gemm_kinds=gemm_kinds)
    row = {"plan": real}
    result = gpu_session.plan_comparison("small", "bf16_mpjax", row, H100_ENV)
    assert result["committed"]["jax"] == "0.12.0.1" and result["notes"] == []
    assert set(result["differ"]) == {"gemm_libraries"} and result["unexpected"] == []
    h200 = {**H100_ENV, "versions": {"jax": "0.13.0"}}
    notes = gpu_session.plan_comparison(
        "small", "bf16_mpjax", {"plan": real | {"device": "NVIDIA H200"}}, h200
    )["notes"]
    assert notes == [
        "committed with jax 0.12.0.1, run with 0.13.0",
        "compiled for NVIDIA H100 80GB HBM3, run on NVIDIA H200",
    ]
    line = gpu_session.plan_line("small", "bf16_mpjax", row | {"plan_vs_committed": result})
    assert line.startswith(
        "| small | bf16_mpjax | autotuned: 200 bfloat16xbfloat16 cublaslt, 19 bfloat16xbfloat16 "
        "triton; cuDNN attention 18 / 18; scatters float32 | "
        "benchmarks/results/h100_plan/jax-0.12.0.1/cpu_small_plan.json | flop_share, "
    )
    assert line.endswith("| gemm_libraries: ['cublaslt', 'triton'] vs ['triton'] (autotuning) |")
    cpu = {"device": {"kind": "cpu", "platform": "cpu"}, "versions": {"jax": "0.12.0.1"}}
    none = gpu_session.plan_comparison("small", "bf16_mpjax", {"plan": None}, cpu)
    assert none["real"] == "not on this device: cpu (a GPU's compile has it)"
    assert "| not on this device: cpu" in gpu_session.plan_line(
        "small", "x", {"plan_vs_committed": none}
    )


def test_fp8_rows_have_their_mfu_against_the_bf16_and_the_fp8_peak():
    row = {"mfu": 0.5, "achieved_flops_per_s": 989e12 / 2}
    fields = gpu_session.fp8_mfu("fp8_delayed_mpjax", row, H100_ENV)
    assert fields["mfu_bf16_peak"] == 0.5 and fields["fp8_peak_flops_per_s"] == 1979e12
    assert fields["mfu_fp8_peak"] == pytest.approx(989 / 2 / 1979)
    assert gpu_session.fp8_mfu("bf16_mpjax", row, H100_ENV) == {}
    a100 = {**H100_ENV, "device": {"kind": "NVIDIA A100-SXM4-80GB", "platform": "gpu"}}
    assert gpu_session.fp8_mfu("fp8_mpjax", row, a100)["mfu_fp8_peak"] is None


def test_each_issue_runs_its_parts_in_the_order_it_asks_for():
    assert gpu_session.ISSUES["clock"] == ("env", "small", "plans", "medium", "moe")
    moe = gpu_session.ROWS["moe"]
    assert moe.keys == ("bf16_mpjax", "bf16_hand", "fp8_mpjax") and moe.preset == "small-moe"
    assert gpu_session.ISSUES["fp8"] == ("env", "fp8_medium", "plans", "gpu_tests", "diagnose")
    assert gpu_session.ISSUES["quantized"] == ("env", "quantized_small", "plans", "small")
    quantized = gpu_session.ROWS["quantized_small"]
    assert quantized.keys == ("bf16_sr", *bench.QUANTIZED_STATE_KEYS)
    assert quantized.preset == "small" and quantized.batch == 16
    small, fp8 = gpu_session.ROWS["small"], gpu_session.ROWS["fp8_medium"]
    assert small.preset == "small" and small.batch == 16 and not small.scan_layers
    assert {"torch_bf16_sdpa", "torch_f16_sdpa", "f16_dynamic"} <= set(small.keys)
    assert fp8.preset == "medium" and fp8.batch == 8 and fp8.scan_layers
    assert set(small.keys + fp8.keys + quantized.keys) <= {v.key for v in bench.VARIANTS}


def test_mpjax_and_the_example_are_imported_from_this_tree():
    """A GPU image has no mpjax installed: the session imports it from the working tree."""
    root = pathlib.Path(gpu_session.__file__).resolve().parents[1]
    assert str(root) in sys.path and str(root / "examples") in sys.path


def test_the_gpu_marker_is_registered_and_marks_every_test_the_part_runs():
    """``-m gpu`` (the part's selection) replaces addopts' ``-m 'not slow'``; the marker is
    registered, and every test of the file the part runs carries it."""
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(marker.startswith("gpu: ") for marker in ini["markers"])
    source = (ROOT / gpu_session.GPU_TESTS).read_text()
    assert "\npytestmark = pytest.mark.gpu\n" in source and "pytest.mark.slow" not in source


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "x"], "give --issue (clock, fp8, quantized) or --parts, one of them"),
        (["--issue", "clock", "--parts", "env", "--out", "x"], "one of them"),
        (["--issue", "clock"], "--out is required"),
        (["--parts", "env,gpu", "--out", "x"], "--parts takes a comma-separated list of env,"),
        (["--issue", "fp8", "--out", "x", "--budget-s", "0"], "--budget-s must be positive"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_session.main(argv)
    assert message in capsys.readouterr().err


def test_without_pytest_the_tests_part_says_how_to_bring_it(monkeypatch):
    assert gpu_session.pytest_site(None) is None  # installed here: nothing to do
    find_spec = gpu_session.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_session.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pytest" else find_spec(name, *a),
    )
    with pytest.raises(RuntimeError, match=r"pip download pytest -d \.whl/gpu\), bring them"):
        gpu_session.pytest_site(None)


def test_a_junit_report_gives_each_tests_outcome_and_the_properties_it_recorded(tmp_path):
    xml = tmp_path / "report.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="test_a" time="1.5">'
        '<properties><property name="forward_bound" value="0.03"/></properties></testcase>'
        '<testcase classname="tests.test_gpu" name="test_b" time="0.1">'
        '<failure message="assert 2 &lt;= 1">trace</failure></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c" time="0">'
        '<skipped type="pytest.skip" message="needs a CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    report = gpu_session.read_junit(xml)
    assert report["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    a, b, c = report["tests"]
    assert a == {
        "test": "tests.test_gpu::test_a",
        "outcome": "passed",
        "message": None,
        "seconds": 1.5,
        "properties": {"forward_bound": "0.03"},
    }
    assert b["message"] == "assert 2 <= 1" and c["message"] == "needs a CUDA GPU"


# --------------------------------------------------------------------- the CPU rehearsal


def _read(out, name):
    return json.loads((out / name).read_text())


def _check_rows(out, part, keys, committed=True):
    report = _read(out, f"{part}.json")
    assert report["part"] == part and report["config"]["preset"] == "tiny"
    assert report["config"]["torch_compile"] is False  # eager PyTorch rows in a rehearsal
    assert report["config"]["scan_layers"] is gpu_session.ROWS[part].scan_layers
    assert list(report["results"]) == list(keys)
    for key in keys:
        row = report["results"][key]
        if key.startswith("torch") and not bench.torch_available():
            assert row == {"skipped": bench.TORCH_MISSING}
            continue
        assert ROW_FIELDS <= set(row), key
        assert 0 < row["step_s_min"] <= row["step_s_median"] and row["compile_s"] > 0
        assert row["mfu"] is None and row["plan"] is None  # a CPU: no peak, no GPU plan
        if row["framework"] == "jax":
            real = row["plan_vs_committed"]["real"]
            assert real.startswith(gpu_session.NOT_ON_DEVICE)
            found = row["plan_vs_committed"]["committed"]
            if committed:
                assert found["plan"]["source"] == "deviceless h100"
            else:
                preset = gpu_session.ROWS[part].preset
                missing = f"no committed plan of {key} on {preset} under h100_plan/"
                assert found == {"missing": missing}
    assert (out / f"{part}.md").read_text().startswith("Train step of the `tiny` GPT")
    return report


def _check_session(out, parts):
    session = _read(out, "session.json")
    assert session["rehearsal"] is True and list(session["parts"]) == list(parts)
    for name, part in session["parts"].items():
        assert part["status"].startswith("done"), (name, part["status"])
        assert part["seconds"] > 0 or name == "plans"
    log = (out / "progress.log").read_text()
    for name in parts:
        assert f"  {name}: started" in log and f"  {name}: done" in log
    assert "session: done in" in log
    return session


def _check_env(out):
    env = _read(out, "env.json")
    assert env["device"]["platform"] == "cpu"
    assert env["gpu_name"] == env["driver"] == env["cuda_driver_api"] == gpu_session.NOT_ON_DEVICE
    assert {"jax", "jaxlib", "flax", "torch"} <= set(env["versions"])


@pytest.mark.slow
def test_the_clock_rehearsal_writes_every_part(tmp_path):
    gpu_session.main(["--issue", "clock", "--rehearse", "--out", str(tmp_path)])
    _check_session(tmp_path, gpu_session.ISSUES["clock"])
    _check_env(tmp_path)
    _check_rows(tmp_path, "small", gpu_session.ROWS["small"].keys)
    _check_rows(tmp_path, "medium", gpu_session.ROWS["medium"].keys)
    _check_rows(tmp_path, "moe", gpu_session.ROWS["moe"].keys)
    plans = _read(tmp_path, "plans.json")
    jax_rows = [k for k in gpu_session.ROWS["small"].keys if not k.startswith("torch")]
    assert set(plans) == {f"small/{k}" for k in jax_rows} | {"medium/bf16_mpjax"} | {
        "moe/bf16_mpjax",
        "moe/bf16_hand",
        "moe/fp8_mpjax",
    }
    assert plans["medium/bf16_mpjax"]["committed"]["file"].endswith("cpu_medium_plan.json")
    assert "| small | f16_dynamic | not on this device" in (tmp_path / "plans.md").read_text()


@pytest.mark.slow
def test_the_fp8_rehearsal_writes_every_part(tmp_path):
    gpu_session.main(["--issue", "fp8", "--rehearse", "--out", str(tmp_path)])
    _check_session(tmp_path, gpu_session.ISSUES["fp8"])
    _check_env(tmp_path)
    report = _check_rows(tmp_path, "fp8_medium", gpu_session.ROWS["fp8_medium"].keys)
    for key in ("fp8_mpjax", "fp8_delayed_mpjax", "fp8_autocast"):
        row = report["results"][key]
        assert row["mfu_bf16_peak"] is row["mfu_fp8_peak"] is None  # no peak for a CPU
        assert "mfu_fp8_peak" not in report["results"]["bf16_mpjax"]
    tests = _read(tmp_path, "gpu_tests.json")
    assert tests["jax_platforms"] == "cpu" and tests["exit_code"] == 0
    names = {t["test"].split("::")[1].split("[")[0] for t in tests["tests"]}
    assert len(names) == 4 and tests["counts"] == {"skipped": len(tests["tests"])}
    assert all("needs a CUDA GPU" in t["message"] for t in tests["tests"])
    diagnose = _read(tmp_path, "diagnose.json")
    assert diagnose["exit_code"] == 0
    assert set(diagnose["result"]["monitor"]["step_s"]) == {"plain", "between", "check"}


@pytest.mark.slow
def test_the_quantized_state_rehearsal_writes_every_part(tmp_path):
    parts = ["env", "quantized_small", "plans"]
    gpu_session.main(["--parts", ",".join(parts), "--rehearse", "--out", str(tmp_path)])
    _check_session(tmp_path, parts)
    keys = gpu_session.ROWS["quantized_small"].keys
    report = _check_rows(tmp_path, "quantized_small", keys, committed=False)
    for fmt, block in (("dynamic8", 256), ("e4m3", 256), ("dynamic4", 128)):
        optimizer = report["results"][f"bf16_sr_state_{fmt}"]["optimizer"]
        assert f"moments {fmt} in blocks of {block} (stochastic rounding)" in optimizer
    plans = _read(tmp_path, "plans.json")
    assert set(plans) == {f"quantized_small/{k}" for k in gpu_session.ROWS["quantized_small"].keys}


@pytest.mark.slow
def test_a_budget_too_short_stops_between_parts_and_keeps_what_was_done(tmp_path):
    """A rehearsal's environment needs about 10 s, a row about a minute: with 30 s the first
    part runs and the second is not started."""
    gpu_session.main(
        ["--parts", "env,small", "--rehearse", "--budget-s", "30"] + ["--out", str(tmp_path)]
    )
    session = _read(tmp_path, "session.json")
    assert session["parts"]["env"]["status"].startswith("done")
    assert session["parts"]["small"]["status"].startswith("not started: ")
    assert "s left of the budget, it needs about 60 s" in session["parts"]["small"]["status"]
    assert (tmp_path / "env.json").exists() and not (tmp_path / "small.json").exists()
    assert "small: not started" in (tmp_path / "progress.log").read_text()
