"""The measurements that need a GPU, in one call, each result written the moment it exists.

A session lent a GPU runs one command, which runs the parts of one task in order and writes
each part's JSON to ``--out`` as its rows land, so a call cut short by its time limit loses
nothing it had measured; ``progress.log`` says when each part and row started and how long it
took, and ``session.json`` what each part did:

    python benchmarks/gpu_session.py --issue clock --out $OUT   # the step against PyTorch AMP
    python benchmarks/gpu_session.py --issue fp8 --out $OUT     # fp8 against bf16, GPU tests
    python benchmarks/gpu_session.py --issue quantized --out $OUT  # quantized Adam states

The parts (``--parts`` picks others, in the order given):

- ``env``: the GPU, its driver, CUDA (the driver's, the CUDA plugin's and PyTorch's), cuDNN,
  and the versions of jax, jaxlib, flax, optax, numpy and torch.
- ``small``: the benchmark's rows ``bf16_mpjax``, ``bf16_hand``, ``bf16_autocast``,
  ``f16_dynamic``, ``torch_bf16_sdpa`` and ``torch_f16_sdpa`` (PyTorch f16 with GradScaler)
  on the ``small`` preset, batch 16 x 1024: compile time, step time (median and min of 20),
  tokens/s, MFU, peak memory, and each JAX row's plan as XLA compiled it on this GPU.
- ``medium``: ``bf16_mpjax`` and ``torch_bf16_sdpa`` on ``medium``, layers scanned, batch 8.
- ``moe``: ``bf16_mpjax`` (the experts' GEMMs grouped: JAX's Mosaic GPU kernels),
  ``bf16_hand`` (``lax.ragged_dot`` written by hand: XLA's dense GEMMs) and ``fp8_mpjax``
  (mpjax's fp8 grouped kernels on Hopper) on ``small-moe``, layers scanned, batch 8.
- ``quantized_small``: ``bf16_sr`` (bf16 params with stochastic rounding, f32 Adam moments)
  and the same with bf16 moments and with 8-bit (``dynamic8``, ``e4m3``) and 4-bit
  (``dynamic4``) blockwise quantized moments, on ``small``, batch 16 x 1024: what
  :func:`mpjax.quantized_state` costs a GPU step, and how many kernels its compiled plan has.
- ``fp8_medium``: ``bf16_mpjax``, ``fp8_mpjax``, ``fp8_delayed_mpjax``, ``fp8_autocast`` and
  ``torch_bf16_sdpa`` on ``medium``, layers scanned, batch 8; the fp8 rows' MFU against both
  the bf16 and the fp8 peak.
- ``plans``: each JAX row's real plan (GEMM operand dtypes and libraries, cuDNN attention
  calls, scatter dtypes) next to the deviceless one committed in
  ``benchmarks/results/h100_plan/``, with what differs and why it may.
- ``gpu_tests``: ``pytest -m gpu`` (cuDNN attention against XLA's, fp8 GEMMs against their CPU
  emulation, loss scaling's skip on a real overflow, the example's step under each policy),
  its JUnit report and the tolerances the tests saw.
- ``diagnose``: ``benchmarks/benchmark_diagnose.py`` on ``small``: ``mpjax.diagnose`` and the
  ``PrecisionMonitor`` against a plain step.

Every row, test run and benchmark runs in a subprocess; this process never starts a JAX
backend, so each subprocess has the whole GPU. ``--budget-s`` is the call's time: a part or row
starts only while the time its like needs is left, and none runs past the budget, so the call
ends with what was done written. ``--rehearse`` runs every part end to end on a CPU (the
``tiny`` preset, a few steps): what only a GPU can measure (its name, the compiled GPU plan,
the GPU tests) is recorded as not on this device, and the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import benchmark_train_step as bench  # noqa: E402

COMMITTED_PLANS = ROOT / "benchmarks" / "results" / "h100_plan"
GPU_TESTS = "tests/test_gpu.py"
NOT_ON_DEVICE = "not on this device"


@dataclasses.dataclass(frozen=True)
class RowsPart:
    """A part that times benchmark rows: ``keys`` on ``preset`` (``scan_layers``), ``batch``
    sequences per step. ``row_s`` is about what one row takes on an H100 (compile and steps),
    ``rehearse_row_s`` on a CPU with the rehearsal's settings."""

    keys: tuple[str, ...]
    preset: str
    batch: int
    scan_layers: bool
    row_s: float = 120.0
    rehearse_row_s: float = 60.0
    rehearse_experts: int = 0  # the rehearsal's tiny model gets this many experts


ROWS = {
    "small": RowsPart(
        (
            "bf16_mpjax",
            "torch_bf16_sdpa",  # second: the ratio the clock is for lands first
            "bf16_hand",
            "bf16_autocast",
            "f16_dynamic",
            "torch_f16_sdpa",
        ),
        "small",
        16,
        False,
        row_s=90.0,
    ),
    "medium": RowsPart(("bf16_mpjax", "torch_bf16_sdpa"), "medium", 8, True),
    # Adam's moments in f32, bf16 and blockwise quantized, all with bf16 params and stochastic
    # rounding: the step-time cost of the quantized states on a GPU.
    # An H200 took 110 to 330 s a row (compiles of 60 to 230 s: optimizer rounding is many
    # small fusions to autotune).
    "quantized_small": RowsPart(
        ("bf16_sr", *bench.QUANTIZED_STATE_KEYS), "small", 16, False, row_s=330.0
    ),
    # A mixture of experts through mpjax's grouped GEMMs (bf16_mpjax) against the same model
    # written by hand with lax.ragged_dot (bf16_hand: XLA's dense GEMMs over every expert),
    # and in fp8 (fp8_mpjax: on Hopper, mpjax's own fp8 grouped kernels run for real).
    "moe": RowsPart(
        ("bf16_mpjax", "bf16_hand", "fp8_mpjax"), "small-moe", 8, True, rehearse_experts=8
    ),
    "fp8_medium": RowsPart(
        ("bf16_mpjax", "fp8_mpjax", "fp8_delayed_mpjax", "fp8_autocast", "torch_bf16_sdpa"),
        "medium",
        8,
        True,
    ),
}
# Other parts: about how long each takes on an H100 and in a CPU rehearsal.
OTHER_PARTS = {"env": (30.0, 10.0), "plans": (5.0, 5.0), "gpu_tests": (240.0, 90.0)}
OTHER_PARTS["diagnose"] = (240.0, 120.0)
PARTS = ("env", *ROWS, "plans", "gpu_tests", "diagnose")
ISSUES = {
    "clock": ("env", "small", "plans", "medium", "moe"),
    "fp8": ("env", "fp8_medium", "plans", "gpu_tests", "diagnose"),
    "quantized": ("env", "quantized_small", "plans", "small"),
}
# The rehearsal's model and timing: the tiny preset on short sequences, a few steps.
# PyTorch rows run eagerly there: Inductor's C++ compile of even this model takes minutes on
# two cores, and a GPU compiles with Triton anyway.
REHEARSAL = {"preset": "tiny", "batch": 4, "seq_len": 64, "steps": 3, "warmup": 1}
STEPS, WARMUP = 20, 3

# How the real plan of a row may differ from the deviceless one, field by field, and why.
AUTOTUNED = (
    "autotuning: on the GPU XLA times cuBLAS(Lt) against Triton for each GEMM and keeps the "
    "faster, which a deviceless compile cannot; the library chosen changes what is fused "
    "around the GEMM and how many library calls there are"
)
DECIDED_BEFORE_AUTOTUNING = (
    "not autotuning's: operand dtypes, fp8 GEMMs, cuDNN attention and scatter dtypes are "
    "decided before it; look at the JAX versions and the GPUs the two were compiled with"
)
PLAN_FIELDS = {
    "flop_share": DECIDED_BEFORE_AUTOTUNING,
    "gemms": DECIDED_BEFORE_AUTOTUNING,
    "fp8_gemms": DECIDED_BEFORE_AUTOTUNING,
    "attention_forward": DECIDED_BEFORE_AUTOTUNING,
    "attention_backward": DECIDED_BEFORE_AUTOTUNING,
    "scatter_dtypes": DECIDED_BEFORE_AUTOTUNING,
    "gemm_libraries": AUTOTUNED,
    "fusions": AUTOTUNED,
    "custom_calls": AUTOTUNED,
}


def compare_plans(real: dict, committed: dict) -> dict:
    """What differs between a row's real GPU plan and its committed deviceless one (both as
    the benchmark's ``plan`` fields): ``same`` (the fields that agree), ``differ`` (per field:
    both values, ``why`` it may, and ``expected``: whether autotuning explains it) and
    ``unexpected`` (the fields autotuning does not explain)."""
    same, differ = [], {}
    for field, why in PLAN_FIELDS.items():
        if field not in real or field not in committed:
            continue
        if real[field] == committed[field]:
            same.append(field)
        else:
            differ[field] = {
                "real": real[field],
                "committed": committed[field],
                "why": why,
                "expected": why is AUTOTUNED,
            }
    return {
        "same": same,
        "differ": differ,
        "unexpected": [f for f, d in differ.items() if not d["expected"]],
    }


def committed_plan(preset: str, key: str, jax_version: str | None) -> dict:
    """The deviceless plan committed for ``key`` on ``preset``: from the directory of this JAX
    version if it has one, else from the newest that has; ``{"plan", "file", "jax"}``, or
    ``{"missing"}``."""
    dirs = sorted(
        (d for d in COMMITTED_PLANS.glob("jax-*") if d.is_dir()),
        key=lambda d: tuple(int(x) for x in re.findall(r"\d+", d.name)),
    )
    exact = [d for d in dirs if d.name == f"jax-{jax_version}"]
    for d in exact + [d for d in dirs[::-1] if d not in exact]:
        path = d / f"cpu_{preset}_plan.json"
        if not path.exists():
            continue
        plan = json.loads(path.read_text())["results"].get(key, {}).get("plan")
        if isinstance(plan, dict):
            return {"plan": plan, "file": str(path.relative_to(ROOT)), "jax": d.name[4:]}
    return {"missing": f"no committed plan of {key} on {preset} under {COMMITTED_PLANS.name}/"}


def fp8_mfu(key: str, row: dict, env: dict) -> dict:
    """An fp8 row's MFU against the bf16 peak (the table's) and the fp8 peak; nothing for
    other rows. ``env``: the ``env`` part's result."""
    variant = next(v for v in bench.VARIANTS if v.key == key)
    if "fp8" not in variant.policy:
        return {}
    peak = bench.peak_flops(env["device"]["kind"], "fp8")
    return {
        "mfu_bf16_peak": row["mfu"],
        "fp8_peak_flops_per_s": peak,
        "mfu_fp8_peak": row["achieved_flops_per_s"] / peak if peak else None,
    }


def plan_comparison(preset: str, key: str, row: dict, env: dict) -> dict:
    """A JAX row's real plan (its ``plan``) against the deviceless one committed for
    ``preset``: ``committed`` (:func:`committed_plan`), then either ``real`` (why there is
    none) or :func:`compare_plans`' fields and ``notes`` (JAX versions or GPUs that differ)."""
    committed = committed_plan(preset, key, env["versions"].get("jax"))
    real = row.get("plan")
    result: dict = {"committed": committed}
    if not isinstance(real, dict):
        result["real"] = f"{NOT_ON_DEVICE}: {env['device']['platform']} (a GPU's compile has it)"
        return result
    result["real_device"] = real.get("device")
    if "plan" in committed:
        result |= compare_plans(real, committed["plan"])
        notes = []
        if committed["jax"] != env["versions"].get("jax"):
            notes.append(
                f"committed with jax {committed['jax']}, run with {env['versions'].get('jax')}"
            )
        if real.get("device") != committed["plan"].get("device"):
            notes.append(
                f"compiled for {committed['plan'].get('device')}, run on {real.get('device')}"
            )
        result["notes"] = notes
    return result


def plan_line(part: str, key: str, row: dict) -> str:
    """The plans table's line for one row: its real plan in short (GEMMs by operand dtypes
    and library, cuDNN attention forward/backward, scatter dtypes), the committed file, the
    fields that agree and those that differ (autotuning's or unexpected)."""
    cmp = row["plan_vs_committed"]
    committed = cmp["committed"].get("file") or cmp["committed"].get("missing")
    real = cmp.get("real")
    if real is None:
        plan = row["plan"]
        gemms = ", ".join(
            f"{g['gemms']} {g['lhs']}x{g['rhs']} {g['library']}" for g in plan["gemm_kinds"]
        )
        real = (
            f"{plan['source']}: {gemms}; cuDNN attention {plan['attention_forward']} / "
            f"{plan['attention_backward']}; scatters {', '.join(plan['scatter_dtypes']) or '-'}"
        )
    differ = "; ".join(
        f"{f}: {d['real']} vs {d['committed']} ({'autotuning' if d['expected'] else 'UNEXPECTED'})"
        for f, d in cmp.get("differ", {}).items()
    )
    same = ", ".join(cmp.get("same", [])) or "-"
    return f"| {part} | {key} | {real} | {committed} | {same} | {differ or '-'} |"


def _write_json(path: pathlib.Path, value) -> None:
    """Writes ``value`` whole or not at all: a call killed mid-write leaves the last version."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str) + "\n")
    tmp.replace(path)


def _worker_command(*args: str) -> list[str]:
    return [sys.executable, __file__, *args]


def _child_env(**extra: str) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run_command(cmd, timeout: float, env: dict | None = None):
    """Runs ``cmd`` from the repository root; returns ``(returncode or None if it timed out,
    stdout, stderr)``."""
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env or _child_env(), cwd=ROOT
        )
    except subprocess.TimeoutExpired as e:

        def text(out):
            return out.decode(errors="replace") if isinstance(out, bytes) else out or ""

        return None, text(e.stdout), text(e.stderr)
    return proc.returncode, proc.stdout, proc.stderr


def environment() -> dict:
    """This machine's accelerator and versions (run in a worker: it starts JAX's backend)."""
    import jax

    device = jax.devices()[0]
    versions = bench._versions()
    packages = (
        "jax-cuda12-plugin",
        "jax-cuda12-pjrt",
        "jax-cuda13-plugin",
        "jax-cuda13-pjrt",
        "nvidia-cuda-runtime-cu12",
        "nvidia-cudnn-cu12",
        "nvidia-cublas-cu12",
        "nvidia-cuda-runtime",
        "nvidia-cudnn-cu13",
    )
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": bench.device_info(device),
        "jax_devices": [str(d) for d in jax.devices()],
        "versions": versions,
        "compute_capability": getattr(device, "compute_capability", None),
        "gpu_name": NOT_ON_DEVICE,
        "driver": NOT_ON_DEVICE,
        "cuda_driver_api": NOT_ON_DEVICE,
    }
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.total,compute_cap"
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        ).stdout
        fields = [f.strip() for f in out.splitlines()[0].split(",")] if out.strip() else []
        if len(fields) == 4:
            env["gpu_name"], env["driver"], env["gpu_memory"], env["compute_capability"] = fields
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
        match = re.search(r"CUDA Version:\s*([\d.]+)", header)
        if match:
            env["cuda_driver_api"] = match.group(1)
    if bench.torch_available():
        import torch

        env["torch_cuda"] = torch.version.cuda or NOT_ON_DEVICE
        env["torch_cudnn"] = (
            torch.backends.cudnn.version() if torch.cuda.is_available() else NOT_ON_DEVICE
        )
        env["torch_device"] = (
            torch.cuda.get_device_name() if torch.cuda.is_available() else NOT_ON_DEVICE
        )
    return env


class Session:
    """One call's parts, run in order within the time budget, each writing to ``out``."""

    def __init__(
        self,
        out: pathlib.Path,
        budget_s: float,
        rehearse: bool,
        wheels: pathlib.Path | None = None,
    ):
        self.out, self.budget_s, self.rehearse, self.wheels = out, budget_s, rehearse, wheels
        self.start = time.monotonic()
        self.summary: dict = {
            "rehearsal": rehearse,
            "budget_s": budget_s,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "parts": {},
        }
        self.env: dict | None = None
        out.mkdir(parents=True, exist_ok=True)
        # A folder an earlier call wrote to (copied into this call's --out) keeps its parts:
        # a second call can run what the first had no time for, and the plans part reads
        # the rows of both.
        earlier = out / "session.json"
        if earlier.exists():
            self.summary["parts"] = json.loads(earlier.read_text()).get("parts", {})

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def log(self, message: str) -> None:
        elapsed = time.monotonic() - self.start
        line = f"{datetime.datetime.now(datetime.UTC):%H:%M:%S} +{elapsed:7.1f} s  {message}"
        print(line, flush=True)
        with open(self.out / "progress.log", "a") as f:
            f.write(line + "\n")

    def run(self, parts: list[str]) -> dict:
        self.log(
            f"session: parts {','.join(parts)}, budget {self.budget_s:.0f} s"
            + (", CPU rehearsal" if self.rehearse else "")
        )
        for name in parts:
            self.summary["parts"].pop(name, None)  # run again: this call's outcome replaces it
            need = self.estimate(name)
            if self.left() < need:
                why = f"not started: {self.left():.0f} s left of the budget, it needs about {need:.0f} s"
                self.summary["parts"][name] = {"status": why}
                self.log(f"{name}: {why}")
                continue
            self.log(f"{name}: started")
            t0 = time.monotonic()
            try:
                status = getattr(self, f"part_{name}")(name)
            except Exception:  # one part's failure must not cost the parts after it
                status = "failed: " + traceback.format_exc()[-2000:]
            if name in ROWS and "plans" in self.summary["parts"]:
                self.part_plans("plans")  # the rows measured after it join its table
            seconds = time.monotonic() - t0
            self.summary["parts"][name] = {"status": status, "seconds": round(seconds, 1)}
            self.log(f"{name}: {status.splitlines()[-1] if status else status} in {seconds:.1f} s")
            _write_json(self.out / "session.json", self.summary)
        self.summary["seconds"] = round(time.monotonic() - self.start, 1)
        _write_json(self.out / "session.json", self.summary)
        times = ", ".join(
            f"{k} {v['seconds']:.1f} s" if "seconds" in v else f"{k} not started"
            for k, v in self.summary["parts"].items()
        )
        self.log(f"session: done in {self.summary['seconds']:.1f} s ({times})")
        return self.summary

    def estimate(self, name: str) -> float:
        """About what part ``name`` needs to land something: one row for the row parts."""
        if name in ROWS:
            return ROWS[name].rehearse_row_s if self.rehearse else ROWS[name].row_s
        gpu_s, cpu_s = OTHER_PARTS[name]
        return cpu_s if self.rehearse else gpu_s

    # ------------------------------------------------------------------------------ parts

    def environment(self) -> dict:
        """The ``env`` part's result, measured once (other parts need the device)."""
        if self.env is None:
            code, stdout, stderr = _run_command(_worker_command("--worker-env"), self.left())
            line = next((s for s in stdout.splitlines() if s.startswith("RESULT ")), None)
            if code != 0 or line is None:
                raise RuntimeError(f"the environment worker failed (exit {code}): {stderr[-2000:]}")
            self.env = json.loads(line[len("RESULT ") :])
        return self.env

    def on_gpu(self) -> bool:
        return self.environment()["device"]["platform"] == "gpu"

    def part_env(self, name: str) -> str:
        env = self.environment()
        _write_json(self.out / "env.json", env)
        return f"done: {env['device']['kind']} ({env['device']['platform']}), jax {env['versions']['jax']}"

    def part_rows(self, name: str) -> str:
        part = ROWS[name]
        r = REHEARSAL if self.rehearse else {}
        setup = bench.Setup(
            preset=r.get("preset", part.preset),
            batch_size=r.get("batch", part.batch),
            seq_len=r.get("seq_len"),
            steps=r.get("steps", STEPS),
            warmup=r.get("warmup", WARMUP),
            scan_layers=part.scan_layers,
            remat="none",
            plan="auto",  # on a GPU, the plan of the step XLA compiled and autotuned there
            torch_compile=not self.rehearse,
            experts=part.rehearse_experts if self.rehearse else 0,
        )
        env = self.environment()
        report = bench.new_report(setup, part.keys, env["device"])
        report["part"] = name
        path = self.out / f"{name}.json"
        row_s = self.estimate(name)
        for key in part.keys:
            if self.left() < row_s:
                report["results"][key] = {
                    "skipped": f"not started: {self.left():.0f} s left, a row needs about {row_s:.0f} s"
                }
                self.log(f"{name}/{key}: {report['results'][key]['skipped']}")
                continue
            self.log(f"{name}/{key}: started")
            t0 = time.monotonic()
            row = bench.run_variant(key, setup, timeout=self.left())
            if "skipped" not in row:
                row |= fp8_mfu(key, row, env)
                if row["framework"] == "jax":
                    row["plan_vs_committed"] = plan_comparison(part.preset, key, row, env)
            report["results"][key] = row
            _write_json(path, report)
            (self.out / f"{name}.md").write_text(bench.markdown_table(report))
            what = row.get("skipped") or (
                f"step {1e3 * row['step_s_median']:.1f} ms median, {1e3 * row['step_s_min']:.1f} ms min, "
                f"compile {row['compile_s']:.1f} s"
            )
            self.log(f"{name}/{key}: {what} ({time.monotonic() - t0:.1f} s)")
        _write_json(path, report)
        (self.out / f"{name}.md").write_text(bench.markdown_table(report))
        done = [k for k, v in report["results"].items() if "skipped" not in v]
        return f"done: {len(done)} of {len(part.keys)} rows measured"

    part_small = part_medium = part_moe = part_fp8_medium = part_quantized_small = part_rows

    def part_plans(self, name: str) -> str:
        """Each JAX row's real plan next to the committed one, from the row parts written so
        far (written again after each row part that follows)."""
        plans: dict = {}
        lines = [
            "| part | row | real plan | committed | same | differs (why) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for part in ROWS:
            path = self.out / f"{part}.json"
            if not path.exists():
                continue
            for key, row in json.loads(path.read_text())["results"].items():
                if "plan_vs_committed" not in row:
                    continue
                cmp = row["plan_vs_committed"]
                plans[f"{part}/{key}"] = {"real": row["plan"], **cmp}
                lines.append(plan_line(part, key, row))
        _write_json(self.out / "plans.json", plans)
        (self.out / "plans.md").write_text("\n".join(lines) + "\n")
        unexpected = sum(len(p.get("unexpected", [])) for p in plans.values())
        return f"done: {len(plans)} rows, {unexpected} unexpected differences"

    def part_gpu_tests(self, name: str) -> str:
        """``pytest -m gpu`` with a JUnit report; on a GPU with JAX's CUDA backend first and
        the CPU beside it (the fp8 tests compare with the CPU's emulation)."""
        xml = self.out / "gpu_tests.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", GPU_TESTS, "-p", "no:cacheprovider"]
        cmd += ["-rA", "-q", f"--junitxml={xml}", "-o", "junit_logging=no"]
        platforms = "cuda,cpu" if self.on_gpu() else "cpu"
        env = _child_env(JAX_PLATFORMS=platforms)
        site = pytest_site(self.wheels)
        if site is not None:
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], site])
        code, stdout, stderr = _run_command(cmd, self.left(), env)
        (self.out / "gpu_tests.log").write_text(stdout + stderr)
        report = {"command": " ".join(cmd[1:]), "jax_platforms": platforms, "exit_code": code}
        if xml.exists():
            report |= read_junit(xml)
        _write_json(self.out / "gpu_tests.json", report)
        if code is None:
            return "timed out (what pytest wrote is kept)"
        counts = report.get("counts", {})
        return "done: " + ", ".join(f"{n} {k}" for k, n in counts.items())

    def part_diagnose(self, name: str) -> str:
        out = self.out / "diagnose"
        if self.rehearse:
            args = ["--preset", "tiny", "--seq-len", "16", "--batches", "2", "--repeats", "1"]
            args += ["--every", "2"]
        else:
            args = ["--preset", "small"]
        cmd = [sys.executable, str(ROOT / "benchmarks" / "benchmark_diagnose.py"), *args]
        code, stdout, stderr = _run_command([*cmd, "--out", str(out)], self.left())
        (self.out / "diagnose.log").write_text(stdout + stderr)
        found = sorted(out.glob("*_diagnose_*.json"))
        result = {"command": " ".join(cmd[1:]), "exit_code": code}
        if found:
            result["file"] = str(found[0].relative_to(self.out))
            result["result"] = json.loads(found[0].read_text())
        _write_json(self.out / "diagnose.json", result)
        if code != 0:
            return f"failed (exit {code}): {stderr[-500:]}"
        monitor = result["result"]["monitor"]
        ratio = result["result"]["diagnose"]["ratio_later_call"]["diagnose"]
        return (
            f"done: diagnose {ratio:.2f}x a later plain forward+backward, a check step "
            f"{monitor['step_s']['check'] / monitor['step_s']['plain']:.2f}x a plain step"
        )


def pytest_site(wheels: pathlib.Path | None) -> str | None:
    """Where pytest imports from when this Python has none (a GPU image may not): installed
    from the wheels in ``wheels`` into a temporary folder, whose path is returned; None when
    pytest is installed.

    Raises:
      RuntimeError: pytest is missing and ``wheels`` is None or cannot install it.
    """
    if importlib.util.find_spec("pytest") is not None:
        return None
    if wheels is None:
        raise RuntimeError(
            "pytest is not installed here: fetch its wheels where a registry is reachable "
            "(pip download pytest -d .whl/gpu), bring them in the working tree and pass "
            "--wheels .whl/gpu"
        )
    site = tempfile.mkdtemp(prefix="gpu_session_pytest_")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    proc = subprocess.run([*cmd, "--target", site, "pytest"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pytest did not install from --wheels {wheels}: {proc.stderr[-1500:]}")
    return site


def read_junit(path: pathlib.Path) -> dict:
    """The tests of a JUnit XML report: each one's outcome, message, time and recorded
    properties (the tolerances and errors it saw), and the counts by outcome."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = element.get("message")
                break
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "message": message,
                "seconds": float(case.get("time") or 0),
                "properties": props,
            }
        )
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(
            f"--parts takes a comma-separated list of {', '.join(PARTS)}; got {text!r}"
        )
    return parts


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--issue",
        choices=list(ISSUES),
        help="the parts of one task: "
        + "; ".join(f"{k}: {','.join(v)}" for k, v in ISSUES.items()),
    )
    p.add_argument("--parts", type=parse_parts, help=f"parts to run, in order: {','.join(PARTS)}")
    p.add_argument("--out", type=pathlib.Path, help="the folder the results go to")
    p.add_argument(
        "--budget-s",
        type=float,
        default=570.0,
        help="seconds this call may take: no part or row starts without the time it needs",
    )
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="a CPU rehearsal: the tiny preset, a few steps, every part end to end",
    )
    p.add_argument(
        "--wheels",
        type=pathlib.Path,
        help="a folder of wheels (pytest and what it needs) for the gpu_tests part, where this "
        "Python has no pytest",
    )
    p.add_argument("--worker-env", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_env:
        print("RESULT " + json.dumps(environment(), default=str))
        return None
    if (args.issue is None) == (args.parts is None):
        p.error(f"give --issue ({', '.join(ISSUES)}) or --parts, one of them")
    if args.out is None:
        p.error("--out is required: the folder the results go to")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive; got {args.budget_s}")
    parts = list(ISSUES[args.issue]) if args.issue else args.parts
    return Session(args.out, args.budget_s, args.rehearse, args.wheels).run(parts)


if __name__ == "__main__":
    main()
