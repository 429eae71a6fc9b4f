"""The benchmark runs end to end on CPU and writes its rows; the optimizer rows keep the bytes
per parameter their setup implies; the PyTorch peer is the same model as the example GPT (same
parameter count, same logits from the same params) and its rows are skipped cleanly where torch
is not installed."""

import importlib.metadata
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import gpt_reduction_length, tolerance

import mpjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import benchmark_diagnose  # noqa: E402
import benchmark_train_step as bench  # noqa: E402
import gpt  # noqa: E402
import train_transformer as tt  # noqa: E402

try:
    import torch
    import torch_gpt
except ImportError:  # the PyTorch peer's tests skip; the skip path is tested
    torch = torch_gpt = None

ROW_KEYS = {
    "framework",
    "policy",
    "attention",
    "matmul_kind",
    "compile_s",
    "step_s_median",
    "step_s_min",
    "step_s_max",
    "tokens_per_s",
    "model_flops_per_step",
    "achieved_flops_per_s",
    "peak_flops_per_s",
    "mfu",
    "compiled_memory_bytes",
    "peak_bytes_in_use",
    "optimizer",
    "bytes_per_param",
    "param_bytes_per_param",
    "state_bytes_per_param",
    "memory_parts",
    "final_loss",
    "plan",
}
# An untrained model guesses bytes about uniformly: ln(256) nats, give or take its init.
FIRST_LOSS = math.log(256)


def _run(tmp_path, variants):
    argv = ["--steps", "1", "--warmup", "0", "--out-dir", str(tmp_path), "--variants", *variants]
    bench.main(argv)
    return json.loads((tmp_path / "cpu_tiny.json").read_text())


@pytest.mark.slow
def test_jax_rows_have_every_column_and_the_run_records_its_setup(tmp_path):
    report = _run(tmp_path, ["bf16_mpjax", "bf16_hand_naive"])
    assert report["config"]["scan_layers"] is False and report["config"]["remat"] == "none"
    for key in ("bf16_mpjax", "bf16_hand_naive"):
        row = report["results"][key]
        assert set(row) == ROW_KEYS, key
        assert row["framework"] == "jax" and row["matmul_kind"] == "bf16"
        assert row["final_loss"] == pytest.approx(FIRST_LOSS, abs=0.3)
        # f32 params and f32 Adam: 4 + 8 bytes, and a step counter.
        assert row["bytes_per_param"] == pytest.approx(12, abs=1e-4)
        assert row["param_bytes_per_param"] == 4 and row["optimizer"].startswith("AdamW")
        assert [r["part"] for r in row["memory_parts"]] == ["params", "count", "mu", "nu"]
    assert report["results"]["bf16_hand_naive"]["attention"] == "naive"
    assert report["results"]["bf16_mpjax"]["attention"] == "fused"
    table = (tmp_path / "cpu_tiny.md").read_text()
    assert "vs PyTorch bf16 SDPA (min)" in table and "| bytes/param |" in table
    # On a CPU a row records a GPU plan only when asked for one (--plan h100).
    assert report["config"]["plan"] == "auto"
    assert all(report["results"][k]["plan"] is None for k in ("bf16_mpjax", "bf16_hand_naive"))
    assert "Plan of each row" not in table


# ------------------------------------------------------------------------------ GPU plans

NO_GPU_PLAN = mpjax.plan_unavailable()


@pytest.mark.slow
@pytest.mark.skipif(NO_GPU_PLAN is not None, reason=f"the plan cannot compile: {NO_GPU_PLAN}")
def test_plan_only_records_what_each_row_runs_on_an_h100(tmp_path):
    """``--plan-only`` compiles each JAX row for an H100 without running it: bf16 rows put
    every matmul FLOP on bf16, the fp8 rows (current and delayed scaling) three fp8 GEMMs per
    dense layer, cuDNN attention forward and backward in all."""
    keys = ("bf16_mpjax", "fp8_mpjax", "fp8_delayed_mpjax")
    bench.main(["--plan-only", "--out-dir", str(tmp_path), "--variants", *keys, "torch_bf16_sdpa"])
    report = json.loads((tmp_path / "cpu_tiny_plan.json").read_text())
    assert set(report["results"]) == set(keys)  # PyTorch rows have no plan
    n_layer = tt.TrainConfig().model_config().n_layer
    bf16, fp8, delayed = (report["results"][k]["plan"] for k in keys)
    assert bf16["source"] == fp8["source"] == delayed["source"] == "deviceless h100"
    assert bf16["flop_share"]["bfloat16"] == 1.0 and bf16["fp8_gemms"] == 0
    for plan in (fp8, delayed):
        assert plan["fp8_gemms"] == 3 * 4 * n_layer and plan["flop_share"]["fp8"] >= 0.8
    assert delayed["flop_share"] == fp8["flop_share"]  # the same GEMMs, other scales
    for plan in (bf16, fp8, delayed):
        assert plan["attention_forward"] >= n_layer and plan["attention_backward"] == n_layer
        assert plan["scatter_dtypes"] == ["float32"]
    table = (tmp_path / "cpu_tiny_plan.md").read_text()
    assert "| mixed_bfloat16_fp8, mpjax.linen.apply_policy | deviceless h100 |" in table


def test_plan_table_shows_each_plan_and_why_a_row_has_none():
    plan = {
        "source": "autotuned",
        "flop_share": {"bfloat16": 0.25, "float16": 0.0, "fp8": 0.75, "float32": 0.0},
        "gemms": 51,
        "fp8_gemms": 48,
        "attention_forward": 4,
        "attention_backward": 4,
        "scatter_dtypes": ["float32"],
        "fusions": 300,
    }
    tpu = plan | {
        "source": "deviceless v5p",
        "memory": {"temp_bytes": 2.5e9, "fits": True},
        "estimated_step_s": 0.1024,
        "estimated_mfu": 0.33,
        "roofline_step_s": 0.0337,
    }
    gpu = {"roofline_step_s": 0.02, "fusion_bytes": 2.5e9, "fusion_step_s": 0.00075}
    too_big = {"source": "deviceless v5e", "compiled": False}
    too_big["memory"] = {"temp_bytes": 19.9e9, "fits": False}
    report = {
        "results": {
            "fp8_mpjax": {"plan": plan},
            "bf16_mpjax": {"plan": "no plugin"},
            "f32": {"plan": too_big},
            "bf16_hand": {"plan": tpu},
            "bf16_autocast": {"plan": plan | gpu},
        }
    }
    lines = bench.plan_table(report)
    by_name = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    fp8_row = by_name[next(v.name for v in bench.VARIANTS if v.key == "fp8_mpjax")]
    assert (
        "| 25.0% | 0.0% | 75.0% | 0.0% | 51 (48) | 4 / 4 | float32 | 300 | - | - | - | - | - | - |"
        in fp8_row
    )
    tpu_row = by_name[next(v.name for v in bench.VARIANTS if v.key == "bf16_hand")]
    assert tpu_row.endswith("| 2.50 GB (fits) | 102.4 ms | 33.0% | 33.7 ms | - | - |")
    gpu_row = by_name[next(v.name for v in bench.VARIANTS if v.key == "bf16_autocast")]
    assert gpu_row.endswith("| 20.0 ms | 2.50 GB, 0.75 ms | 20.8 ms |")
    f32_row = by_name[next(v.name for v in bench.VARIANTS if v.key == "f32")]
    assert "19.90 GB (does not fit)" in f32_row and f32_row.count("|") == lines[-1].count("|")
    no_plan = by_name[next(v.name for v in bench.VARIANTS if v.key == "bf16_mpjax")]
    assert "| no plan: no plugin |" in no_plan and no_plan.count("|") == lines[-1].count("|")
    assert bench.plan_table({"results": {"f32": {"plan": None}}}) == []


NO_TPU_PLAN = mpjax.plan_unavailable("v5p")


@pytest.mark.slow
@pytest.mark.skipif(NO_TPU_PLAN is not None, reason=f"the plan cannot compile: {NO_TPU_PLAN}")
def test_plan_only_records_the_estimated_step_and_memory_on_a_tpu(tmp_path):
    """``--plan v5p --plan-only`` compiles each JAX row for a v5p chip: every row gets XLA's
    estimated step time and the MFU of the model FLOPs at it, the temporaries against the
    chip's memory, and the roofline bound; bf16 rows put every matmul FLOP on bf16."""
    keys = ("f32", "bf16_mpjax", "bf16_hand")
    bench.main(["--plan", "v5p", "--plan-only", "--out-dir", str(tmp_path), "--variants", *keys])
    report = json.loads((tmp_path / "cpu_tiny_plan.json").read_text())
    for key in keys:
        plan = report["results"][key]["plan"]
        assert plan["source"] == "deviceless v5p" and plan["platform"] == "tpu"
        assert plan["estimated_step_s"] > 0 and 0 < plan["estimated_mfu"] < 1
        assert 0 < plan["roofline_step_s"] and plan["memory"]["fits"]
    assert report["results"]["bf16_mpjax"]["plan"]["flop_share"]["bfloat16"] == 1.0
    table = (tmp_path / "cpu_tiny_plan.md").read_text()
    assert "estimated step" in table and "deviceless v5p" in table


# ------------------------------------------------------------------- optimizer precision

# Bytes per bf16 and per f32 param element of each part of the state each optimizer row
# builds. Under the "bfloat16" policy the example's model (mpjax mode) keeps its norm params in
# f32; the f32 row has only f32 params. Other parts (step counters, rounding keys) are scalars.
EXPECTED_PARTS = {
    "f32": {"params": (4, 4), "mu": (4, 4), "nu": (4, 4)},
    "bf16_master": {"params": (2, 4), "master": (4, 0), "mu": (4, 4), "nu": (4, 4)},
    # optax's Adam on bf16 params keeps its moments in the params' dtypes.
    "bf16_nearest": {"params": (2, 4), "mu": (2, 4), "nu": (2, 4)},
    "bf16_sr": {"params": (2, 4), "mu": (4, 4), "nu": (4, 4)},
    "bf16_kahan": {"params": (2, 4), "compensation": (2, 0), "mu": (4, 4), "nu": (4, 4)},
    "bf16_sr_state_bf16": {"params": (2, 4), "mu": (2, 2), "nu": (2, 2)},
    "bf16_master_state_bf16": {"params": (2, 4), "master": (4, 0), "mu": (2, 2), "nu": (2, 2)},
}
SETUP = bench.Setup("tiny", 16, None, steps=1, warmup=0, scan_layers=False, remat="none")


@pytest.fixture(scope="module")
def bf16_counts():
    """(bf16, f32) param elements of the example's tiny model under the bfloat16 policy."""
    cfg = tt.TrainConfig(policy="bfloat16")
    mcfg = cfg.model_config()
    model = tt.build_model(mcfg, mpjax.get_policy("bfloat16"), "mpjax")
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    sizes = {"bfloat16": 0, "float32": 0}
    for leaf in jax.tree.leaves(shapes["params"]):
        sizes[leaf.dtype.name] += leaf.size
    assert sizes["bfloat16"] + sizes["float32"] == mcfg.num_params()
    assert 0 < sizes["float32"] < sizes["bfloat16"] / 50  # the norms' scales and biases
    return sizes["bfloat16"], sizes["float32"]


@pytest.fixture(scope="module")
def optimizer_memory():
    """Each optimizer row's memory report, from the train state the benchmark builds for it."""
    reports = {}
    for key in bench.OPTIMIZER_KEYS:
        variant = next(v for v in bench.VARIANTS if v.key == key)
        *_, state = bench.build_jax_variant(variant, SETUP)
        reports[key] = mpjax.memory_report(state.params, state.opt_state)
    return reports


def _expected_bytes(key, counts):
    n16, n32 = counts
    return {part: b16 * n16 + b32 * n32 for part, (b16, b32) in EXPECTED_PARTS[key].items()}


def test_optimizer_rows_are_the_listed_keys():
    assert set(bench.OPTIMIZER_KEYS) == set(EXPECTED_PARTS)
    keys = [v.key for v in bench.VARIANTS]
    assert len(keys) == len(set(keys)) and set(bench.OPTIMIZER_KEYS) <= set(keys)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(EXPECTED_PARTS))
def test_optimizer_rows_hold_the_bytes_their_setup_implies(key, bf16_counts, optimizer_memory):
    report = optimizer_memory[key]
    n = sum(bf16_counts)
    assert report.param_count == n
    for part, want in _expected_bytes(key, bf16_counts).items():
        assert report.part_bytes(part) == want, (key, part)
    rest = report.total_bytes - sum(_expected_bytes(key, bf16_counts).values())
    assert 0 < rest <= 64, report  # a step counter, and a key per stochastic rounding
    fields = bench.memory_fields(report)
    assert fields["bytes_per_param"] == pytest.approx(
        sum(_expected_bytes(key, bf16_counts).values()) / n, abs=1e-4
    )
    assert fields["param_bytes_per_param"] + fields["state_bytes_per_param"] == pytest.approx(
        fields["bytes_per_param"]
    )
    assert fields["memory_parts"] == report.to_dict()["rows"]


@pytest.mark.parametrize(
    "key, fmt, state_bytes",
    [
        ("bf16_sr_state_dynamic8", "dynamic8", 2 + 8 / 256),
        ("bf16_sr_state_e4m3", "e4m3", 2 + 8 / 256),
        ("bf16_sr_state_dynamic4", "dynamic4", 1 + 8 / 128),
    ],
)
@pytest.mark.slow
def test_quantized_state_rows_store_the_small_presets_matrices_quantized(key, fmt, state_bytes):
    assert key in bench.QUANTIZED_STATE_KEYS
    variant = next(v for v in bench.VARIANTS if v.key == key)
    setup = bench.Setup("small", 16, None, steps=1, warmup=0, scan_layers=False, remat="none")
    cfg, policy, _, _, state = bench.build_jax_variant(variant, setup, abstract=True)
    assert cfg.state_format == fmt and cfg.state_rounding == "stochastic"
    quantized = [
        x
        for x in jax.tree.leaves(
            state.opt_state, is_leaf=lambda y: isinstance(y, mpjax.QuantizedArray)
        )
        if isinstance(x, mpjax.QuantizedArray)
    ]
    # Two moments of every matrix (d_model 768 is three blocks of 256, six of 128).
    matrices = [a for a in jax.tree.leaves(state.params) if a.ndim == 2]
    assert len(quantized) == 2 * len(matrices) and {q.format.name for q in quantized} == {fmt}
    report = mpjax.memory_report(state.params, state.opt_state)
    # The norms' and biases' f32 params and moments add about a thousandth of a byte.
    assert report.state_bytes / report.param_count == pytest.approx(state_bytes, abs=0.01)
    assert report.bytes_per_param <= 4.1
    assert f"moments {fmt}" in tt.describe_optimizer(cfg, policy)


@pytest.mark.slow
def test_optimizer_rows_order_by_bytes(optimizer_memory):
    per_param = {k: r.bytes_per_param for k, r in optimizer_memory.items()}
    assert per_param["f32"] == pytest.approx(12, abs=1e-4)
    assert per_param["bf16_master"] == pytest.approx(14, abs=0.01)
    assert per_param["bf16_sr_state_bf16"] == pytest.approx(6, abs=0.01)
    assert per_param["bf16_master_state_bf16"] == pytest.approx(10, abs=0.01)
    assert (
        per_param["bf16_sr_state_bf16"]
        < per_param["bf16_master_state_bf16"]
        < per_param["bf16_kahan"]
        < per_param["bf16_master"]
    )
    assert per_param["bf16_sr"] < per_param["bf16_kahan"]


@pytest.mark.slow
def test_optimizer_row_of_the_runner(tmp_path, bf16_counts, optimizer_memory):
    """An optimizer row end to end (bf16 params with Kahan compensation: the quickest of them
    to compile; the stochastic-rounding rows compile several times longer on CPU)."""
    key = "bf16_kahan"
    report = _run(tmp_path, [key])
    row = report["results"][key]
    assert set(row) == ROW_KEYS
    assert row["memory_parts"] == optimizer_memory[key].to_dict()["rows"]
    n16, n32 = bf16_counts
    assert row["bytes_per_param"] == pytest.approx(12, abs=1e-4)
    assert row["param_bytes_per_param"] == pytest.approx((2 * n16 + 4 * n32) / (n16 + n32))
    variant = next(v for v in bench.VARIANTS if v.key == key)
    policy = mpjax.get_policy("bfloat16")
    assert row["optimizer"] == tt.describe_optimizer(SETUP.train_config(variant), policy)
    assert "no master weights, kahan param updates" in row["optimizer"]
    assert row["policy"] == str(policy)
    assert row["final_loss"] == pytest.approx(FIRST_LOSS, abs=0.3)
    assert report["variants"][key]["param_rounding"] == "kahan"
    assert report["variants"][key]["master_weights"] is False
    table = (tmp_path / "cpu_tiny.md").read_text()
    assert "| bfloat16 params, Kahan compensation, f32 Adam | " in table
    assert "| 12.00 |" in table


def test_torch_rows_are_skipped_with_the_install_command_when_torch_is_absent(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(bench, "torch_available", lambda: False)
    report = _run(tmp_path, ["torch_bf16_sdpa", "torch_f16_sdpa"])
    for key in ("torch_bf16_sdpa", "torch_f16_sdpa"):
        assert report["results"][key] == {"skipped": bench.TORCH_MISSING}
    assert 'pip install -e ".[bench]"' in bench.TORCH_MISSING
    table = (tmp_path / "cpu_tiny.md").read_text()
    assert "| PyTorch autocast f16 + GradScaler, SDPA | skipped: torch is not installed" in table


def test_torch_available_says_whether_torch_imports():
    assert bench.torch_available() is (torch is not None)


# ----------------------------------------------------------------------------- with torch

needs_torch = pytest.mark.skipif(torch is None, reason="the PyTorch peer needs torch (bench extra)")

CONFIG = gpt.GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32)


@needs_torch
@pytest.mark.parametrize("tied", [True, False])
def test_torch_model_has_the_flax_models_parameter_count(tied):
    cfg = gpt.GPTConfig(tie_embeddings=tied)
    model = torch_gpt.GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def _flax_to_torch(params, model):
    """Copies the Flax GPT's params into the PyTorch GPT (kernels transposed)."""

    def t(x):
        return torch.from_numpy(np.asarray(x, np.float32).copy())

    state = {"wte.weight": t(params["wte"]["embedding"]), "wpe": t(params["wpe"]["embedding"])}
    for i in range(model.cfg.n_layer):
        h = params[f"h{i}"]
        for ln in ("ln1", "ln2"):
            state[f"blocks.{i}.{ln}.weight"] = t(h[ln]["scale"])
            state[f"blocks.{i}.{ln}.bias"] = t(h[ln]["bias"])
        for name, (group, layer) in {
            "qkv": ("attn", "qkv"),
            "attn_proj": ("attn", "proj"),
            "fc": ("mlp", "fc"),
            "mlp_proj": ("mlp", "proj"),
        }.items():
            state[f"blocks.{i}.{name}.weight"] = t(h[group][layer]["kernel"]).T.contiguous()
            state[f"blocks.{i}.{name}.bias"] = t(h[group][layer]["bias"])
    state["ln_f.weight"] = t(params["ln_f"]["scale"])
    state["ln_f.bias"] = t(params["ln_f"]["bias"])
    if "head" in params:
        state["head.weight"] = t(params["head"]["kernel"]).T.contiguous()
    model.load_state_dict(state, strict=True)


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("tied", [True, False])
def test_torch_model_computes_the_flax_models_logits(attention, tied):
    cfg = gpt.GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32, tie_embeddings=tied)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
    params = gpt.GPT(cfg).init(jax.random.key(0), tokens)["params"]
    want = gpt.GPT(cfg).apply({"params": params}, tokens)
    model = torch_gpt.GPT(cfg, attention)
    _flax_to_torch(params, model)
    with torch.no_grad():
        got = model(torch.from_numpy(tokens))
    # The same sums in PyTorch's order: within the f32 bound of the reductions a logit goes
    # through (tests/tolerances.py), relative to the logits' size.
    rtol = tolerance(np.float32, gpt_reduction_length(cfg))
    atol = rtol * float(np.abs(want).max())
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=rtol, atol=atol)


@needs_torch
def test_torch_init_has_the_flax_models_scales():
    model = torch_gpt.GPT(gpt.GPTConfig(n_layer=4, d_model=128))
    stds = {name: float(p.detach().std()) for name, p in model.named_parameters()}
    assert stds["wte.weight"] == pytest.approx(0.02, rel=0.05)
    assert stds["wpe"] == pytest.approx(0.01, rel=0.05)
    assert stds["blocks.0.attn_proj.weight"] == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert stds["blocks.0.qkv.weight"] == pytest.approx(0.02, rel=0.05)
    assert float(model.blocks[0].qkv.bias.detach().abs().max()) == 0.0
    assert float(model.ln_f.weight.detach().min()) == 1.0


@needs_torch
def test_lr_schedule_is_the_examples():
    cfg = tt.TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    factor = torch_gpt.lr_lambda(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    schedule = tt.make_schedule(cfg)
    for step in (0, 5, 10, 37, 99, 100):
        assert cfg.lr * factor(step) == pytest.approx(float(schedule(step)), rel=1e-5, abs=1e-12)


@pytest.mark.slow
@needs_torch
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_torch_train_step_lowers_the_loss_without_compiling(policy):
    cfg = tt.TrainConfig(steps=10, warmup_steps=2, lr=1e-2)
    step = torch_gpt.TrainStep(CONFIG, policy, "naive", "cpu", cfg, compile=False)
    x, y = (
        torch.from_numpy(a[0].astype(np.int64))
        for a in tt.sample_batch(
            tt.load_corpus(None, max_bytes=20_000), np.random.default_rng(0), (1, 8), 16
        )
    )
    losses = [float(step(x, y)) for _ in range(3)]
    assert losses[0] == pytest.approx(FIRST_LOSS, abs=0.3)
    assert losses[-1] < losses[0], losses
    assert step.scaler.is_enabled() == (policy == "mixed_float16")


@pytest.mark.slow
@needs_torch
def test_torch_rows_of_the_runner(tmp_path):
    report = _run(tmp_path, ["torch_bf16_sdpa"])
    row = report["results"]["torch_bf16_sdpa"]
    assert set(row) == ROW_KEYS
    assert row["framework"] == "torch" and row["attention"] == "sdpa"
    # f32 params and AdamW's f32 moments (autocast leaves the params f32), and step counters.
    assert row["bytes_per_param"] == pytest.approx(12, abs=0.01)
    parts = {r["part"] for r in row["memory_parts"]}
    assert parts == {"params", "step", "exp_avg", "exp_avg_sq"}
    assert row["final_loss"] == pytest.approx(FIRST_LOSS, abs=0.3)
    assert report["versions"]["torch"] == importlib.metadata.version("torch")


@pytest.mark.slow
def test_fp8_rows_build_a_step_whose_dense_matmuls_are_fp8():
    """The fp8 rows race the bf16 rows of the same run, and their train step really has fp8
    dots (e4m3/e5m2 operands) for XLA to compile to fp8 GEMMs; the delayed rows' train state
    carries the state of each of those matmuls."""
    keys = [v.key for v in bench.VARIANTS]
    assert set(bench.FP8_KEYS) <= set(keys)
    assert bench.FP8_DELAYED == tt.FP8_DELAYED
    for key in ("fp8_mpjax", "fp8_autocast", "fp8_delayed_mpjax", "fp8_delayed_autocast"):
        variant = next(v for v in bench.VARIANTS if v.key == key)
        cfg, policy, model, tx, state = bench.build_jax_variant(variant, SETUP)
        n_layer = cfg.model_config().n_layer
        assert policy.fp8 is not None
        assert policy.fp8.scaling == ("delayed" if "delayed" in key else "current")
        assert len(state.fp8) == (4 * n_layer if "delayed" in key else 0), list(state.fp8)
        x = jnp.zeros((1, 16), jnp.int32)
        # The step differentiates with respect to the fp8 state too: its next state.
        loss = lambda p, f: tt.loss_fn(model, p, x, x, f)  # noqa: B023, E731
        dots = mpjax.hlo_dots(jax.grad(loss, argnums=(0, 1)))(state.params, state.fp8)
        # Per block: qkv, proj, fc and proj, forward and both gradients; the head stays bf16.
        assert sum(d.fp8 for d in dots) == 3 * 4 * n_layer, str(dots)


@pytest.mark.slow
def test_the_diagnose_benchmark_records_both_costs_side_by_side(tmp_path):
    argv = ["--preset", "tiny", "--seq-len", "16", "--batches", "2", "--repeats", "1"]
    benchmark_diagnose.main([*argv, "--every", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu_diagnose_tiny.json").read_text())
    cost = result["diagnose"]
    for call in ("first_call_s", "later_call_s"):
        assert set(cost[call]) == {"plain", "diagnose", "diagnose_ranges_only"}
        assert all(seconds > 0 for seconds in cost[call].values())
    assert cost["ratio_later_call"]["diagnose"] == pytest.approx(
        cost["later_call_s"]["diagnose"] / cost["later_call_s"]["plain"]
    )
    monitor = result["monitor"]
    assert monitor["every"] == 2 and set(monitor["step_s"]) == {"plain", "between", "check"}
    # Every module's forward values and gradients: two rows per module.
    assert monitor["modules_measured"] > 2 * gpt.PRESETS["tiny"].n_layer


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5p:2x2x2", "h100:8"])
def test_the_comm_precision_benchmark_shows_each_reduce_dtype_on_the_wire(target, monkeypatch):
    """The FSDP step of a small GPT on 8 chips, planned under each reduce dtype: parameters are
    gathered in bf16 (f32 only for the norms, which a rule keeps in f32), and the blocks'
    weight gradients cross the network in the reduce dtype."""
    reason = mpjax.plan_unavailable(target)
    if reason is not None:
        pytest.skip(f"the plan cannot compile: {reason}")
    import benchmark_comm_precision as comm

    monkeypatch.setattr(
        comm,
        "MODEL",
        {"vocab_size": 512, "n_layer": 2, "n_head": 4, "d_model": 256, "block_size": 128},
    )
    for name, reduced in (("f32 reduce (the default)", "float32"), ("bf16 reduce", "bfloat16")):
        summary = comm.summarize(comm.plan_step(target, comm.SETTINGS[name], batch=8))
        rows = summary["collectives"]
        # The reductions of the blocks' matmul weights (the norms' are f32 under any setting).
        matmul = ("qkv", "proj", "fc")
        weight_grads = [
            r
            for r in rows
            if r["backward"]
            and r["kind"] != "all-gather"
            and any(m.startswith("h") and m.endswith(matmul) for m in r["modules"])
        ]
        assert weight_grads and {r["dtype"] for r in weight_grads} >= {reduced}, rows
        if reduced == "bfloat16":
            assert not [r for r in weight_grads if r["dtype"] == "float32"], rows
        f32_gathers = [
            r
            for r in rows
            if r["kind"] == "all-gather" and r["dtype"] == "float32" and not r["backward"]
        ]
        # What is gathered in f32 is tiny: the norms' scales and biases (2 * 2 * 256 a block).
        assert sum(r["bytes"] for r in f32_gathers) <= 8 * 2 * 2 * 256 * 4 + 2 * 256 * 4, rows
    assert "| all-gather bfloat16 forward |" in comm.markdown({"targets": {target: {"x": summary}}})


# ------------------------------------------------------------------- NVFP4's recipe, per GEMM


def test_the_nvfp4_gradient_errors_show_what_stochastic_rounding_removes(tmp_path):
    """``benchmarks/nvfp4_gradient_errors.py`` measures each recipe case's GEMMs against
    float32. Rounding to nearest is one answer whatever the key: its mean over draws is its one
    draw. Stochastic rounding of the output gradient draws a new answer per key, each further
    from float32 than rounding to nearest, whose mean comes closer: the gradient's rounding
    averages out, the other operand's stays."""
    import nvfp4_gradient_errors as errors

    report = errors.main(
        ["--tokens", "256", "--d-in", "64", "--d-out", "64", "--draws", "16"]
        + ["--out-dir", str(tmp_path)]
    )
    results = report["results"]
    assert list(results) == list(errors.CASES)
    for name, flags in errors.CASES.items():
        for part in errors.PARTS:
            one, mean = results[name][part]["one_draw"], results[name][part]["mean_of_draws"]
            assert 0 < one < 0.5 and 0 < mean < 0.5, (name, part)
            if part == "output" or not flags["stochastic_rounding"]:
                assert mean == pytest.approx(one, rel=1e-6), (name, part)
            else:
                assert mean < 0.9 * one, (name, part)
    # The forward GEMM rounds its weight by tiles or by rows, and nothing else differs.
    recipe, rows = results["NVFP4, the recipe"], results["the recipe less 16 x 16 weight tiles"]
    assert recipe["output"]["one_draw"] != rows["output"]["one_draw"]
    written = json.loads((tmp_path / "nvfp4_gradient_errors.json").read_text())
    assert written["results"] == results
    assert "| NVFP4, the recipe |" in (tmp_path / "nvfp4_gradient_errors.md").read_text()


def test_the_nvfp4_gradient_errors_take_only_blocks_of_16():
    import nvfp4_gradient_errors as errors

    with pytest.raises(SystemExit):
        errors.main(["--tokens", "100"])
