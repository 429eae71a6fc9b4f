"""What each ingredient of NVIDIA's NVFP4 training recipe does to one dense layer's GEMMs:
the relative error of the output, the input gradient and the weight gradient against float32,
for one draw of the stochastic rounding and for the mean of many draws (its bias), under
``mpjax.block_scaled.dot_general`` with the recipe, without it, and without each ingredient.

The layer is ``x @ w`` with ``x`` of shape ``[tokens, d_in]`` and ``w`` of ``[d_in, d_out]``,
its inputs shaped like a language model's: activations N(0, 1) with a few outlier channels and
a few outlier tokens (``--outlier`` times larger, as the channels a transformer's activations
grow and the "attention sink" tokens whose activations are massive), weights
N(0, 0.02), and output gradients N(0, 1) times a log-normal per token (a few tokens carry most
of the gradient), scaled to 1e-3. Each case is the same inputs; only the rounding changes.

    python benchmarks/nvfp4_gradient_errors.py          # about a minute on 2 CPU cores
    python benchmarks/nvfp4_gradient_errors.py --outlier 1 --out-dir /tmp/x

It prints a table and writes ``nvfp4_gradient_errors.json`` and ``.md`` to ``--out-dir``.
The block-scaled GEMMs are emulated on a CPU (exactly: the quantized values and scales are
those a Blackwell GPU multiplies; the products are summed in float32).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
import warnings
from importlib.metadata import version

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))  # mpjax from this tree

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mpjax import block_scaled  # noqa: E402

# Emulated on a CPU, exactly (the module docstring): the warning that says so is known here.
warnings.filterwarnings("ignore", category=block_scaled.EmulationWarning)

# The recipe and each ablation, as dot_general's flags.
CASES = {
    "NVFP4, none of the recipe": dict(
        hadamard=False, stochastic_rounding=False, weight_blocks_2d=False
    ),
    "NVFP4, the recipe": dict(hadamard=True, stochastic_rounding=True, weight_blocks_2d=True),
    "the recipe less the Hadamard transforms": dict(
        hadamard=False, stochastic_rounding=True, weight_blocks_2d=True
    ),
    "the recipe less stochastic rounding": dict(
        hadamard=True, stochastic_rounding=False, weight_blocks_2d=True
    ),
    "the recipe less 16 x 16 weight tiles": dict(
        hadamard=True, stochastic_rounding=True, weight_blocks_2d=False
    ),
}
PARTS = ("output", "input_gradient", "weight_gradient")
_DIMS = (((1,), (0,)), ((), ()))


def inputs(tokens: int, d_in: int, d_out: int, outlier: float, seed: int) -> tuple:
    """The layer's activations, weights and output gradient (float32), as the module docstring
    describes them."""
    kx, kw, kg, kt, kc, ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(kx, (tokens, d_in))
    channels = jax.random.choice(kc, d_in, (max(1, d_in // 64),), replace=False)
    x = x.at[:, channels].multiply(outlier)
    sinks = jax.random.choice(ks, tokens, (max(1, tokens // 256),), replace=False)
    x = x.at[sinks].multiply(outlier)
    w = 0.02 * jax.random.normal(kw, (d_in, d_out))
    per_token = jnp.exp(jax.random.normal(kt, (tokens, 1)))
    g = 1e-3 * per_token * jax.random.normal(kg, (tokens, d_out))
    return x, w, g


def relative(a: jax.Array, ref: jax.Array) -> float:
    return float(jnp.linalg.norm((a - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def measure(x, w, g, flags: dict, draws: int) -> dict:
    """The relative errors of one draw and of the mean of ``draws`` draws (different keys),
    against float32, for the output and both gradients."""

    @jax.jit
    def run(x, w, g, key):
        def layer(a, b):
            return block_scaled.dot_general(
                a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), _DIMS, "nvfp4", key=key, **flags
            )

        y, vjp = jax.vjp(layer, x, w)
        dx, dw = vjp(g.astype(y.dtype))
        return [t.astype(jnp.float32) for t in (y, dx, dw)]

    exact = [x @ w, g @ w.T, x.T @ g]
    keys = jax.random.split(jax.random.key(1), draws)
    total = [jnp.zeros_like(e) for e in exact]
    first = None
    for key in keys:
        got = run(x, w, g, key)
        first = got if first is None else first
        total = [t + r for t, r in zip(total, got, strict=True)]
    mean = [t / draws for t in total]
    return {
        part: {"one_draw": relative(one, ref), "mean_of_draws": relative(avg, ref)}
        for part, one, avg, ref in zip(PARTS, first, mean, exact, strict=True)
    }


def markdown(report: dict) -> str:
    config = report["config"]
    lines = [
        f"NVFP4 GEMMs of one `x @ w` layer ({config['tokens']} tokens, {config['d_in']} -> "
        f"{config['d_out']}, outlier channels x{config['outlier']:g}, seed {config['seed']}): "
        "relative error (Frobenius norm) against float32, for one draw of the stochastic "
        f"rounding and for the mean of {config['draws']} draws.",
        "",
        "| case | output | input gradient | weight gradient | weight gradient, mean of draws |"
        " input gradient, mean of draws |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, errors in report["results"].items():
        lines.append(
            f"| {name} | {errors['output']['one_draw']:.4f} | "
            f"{errors['input_gradient']['one_draw']:.4f} | "
            f"{errors['weight_gradient']['one_draw']:.4f} | "
            f"{errors['weight_gradient']['mean_of_draws']:.4f} | "
            f"{errors['input_gradient']['mean_of_draws']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--d-out", type=int, default=256)
    parser.add_argument("--outlier", type=float, default=100.0)
    parser.add_argument("--draws", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("."))
    args = parser.parse_args(argv)
    for name in ("tokens", "d_in", "d_out"):
        if getattr(args, name) <= 0 or getattr(args, name) % 16:
            parser.error(f"--{name.replace('_', '-')} must be a positive multiple of 16")
    if args.draws <= 0:
        parser.error("--draws must be positive")
    start = time.perf_counter()
    x, w, g = inputs(args.tokens, args.d_in, args.d_out, args.outlier, args.seed)
    results = {name: measure(x, w, g, flags, args.draws) for name, flags in CASES.items()}
    report = {
        "config": {
            k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
        },
        "versions": {
            "python": platform.python_version(),
            **{name: version(name) for name in ("jax", "jaxlib")},
        },
        "seconds": time.perf_counter() - start,
        "results": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "nvfp4_gradient_errors.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out_dir / "nvfp4_gradient_errors.md").write_text(table)
    print(table)
    return report


if __name__ == "__main__":
    main()
