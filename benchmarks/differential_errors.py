"""The differential numerics suite's errors as a table: per layer, framework and policy, the
worst relative error of mpjax and of the hand-written low-precision model against float32,
over the suite's input magnitudes, output and input gradient.

The subjects, magnitudes and bounds are the suite's (``tests/differential.py``,
``tests/test_differential.py``); this script prints what the tests assert, with the numbers.

    python benchmarks/differential_errors.py                       # every case, some minutes
    python benchmarks/differential_errors.py --frameworks linen --policies mixed_float16

It writes ``differential_errors.json`` and ``.md`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
from importlib.metadata import version

# The suite's setting: strict promotion, 8 CPU devices (conftest.py), before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))  # mpjax from this tree
sys.path.insert(0, str(_ROOT / "tests"))

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

import test_differential as suite  # noqa: E402
from differential import FRAMEWORKS, LAYERS  # noqa: E402


def worst_errors(framework: str, layer: str, policy: str) -> dict:
    """The worst errors of one case over the magnitudes the suite tests, with its bound."""
    worst = {"mpjax": [0.0, 0.0], "hand": [0.0, 0.0]}
    for magnitude in suite.magnitudes(policy):
        ref = suite.evaluate(framework, layer, "f32", policy, magnitude)
        forms = {
            "mpjax": suite.evaluate(framework, layer, "mpjax", policy, magnitude),
            "hand": suite.hand_written(framework, layer, policy, magnitude),
        }
        for form, result in forms.items():
            for k in (0, 1):
                if result is None:
                    worst[form][k] = None
                elif worst[form][k] is not None and suite.holds(policy, ref[k]):
                    error = suite.relative_error(result[k], ref[k])
                    worst[form][k] = max(worst[form][k], error)
    return {
        "framework": framework,
        "layer": layer,
        "policy": policy,
        "mpjax": {"output": worst["mpjax"][0], "input_gradient": worst["mpjax"][1]},
        "hand": {"output": worst["hand"][0], "input_gradient": worst["hand"][1]},
        "allowed": suite.allowed(layer, policy),
    }


def _cell(x) -> str:
    return "-" if x is None else f"{x:.2g}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| framework | layer | policy | mpjax output | by hand | mpjax gradient | by hand "
        "| allowed |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m, h = r["mpjax"], r["hand"]
        lines.append(
            f"| {r['framework']} | {r['layer']} | {r['policy']} | {_cell(m['output'])} "
            f"| {_cell(h['output'])} | {_cell(m['input_gradient'])} "
            f"| {_cell(h['input_gradient'])} | {_cell(r['allowed'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument(
        "--policies", nargs="+", default=list(suite.POLICIES), choices=suite.POLICIES
    )
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("."))
    args = parser.parse_args(argv)
    rows, start = [], time.perf_counter()
    for framework, layer, policy in suite.cases():
        chosen = framework in args.frameworks and layer in args.layers
        if not chosen or policy not in args.policies or suite.skip_reason(policy):
            continue
        rows.append(worst_errors(framework, layer, policy))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    environment = {
        "python": platform.python_version(),
        **{name: version(name) for name in ("jax", "jaxlib", "flax", "equinox")},
        "machine": platform.machine(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "differential_errors.json").write_text(
        json.dumps({"environment": environment, "rows": rows}, indent=1) + "\n"
    )
    (args.out_dir / "differential_errors.md").write_text(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
