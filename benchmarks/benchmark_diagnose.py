"""What the precision doctor costs on the example GPT, measured side by side in one run.

1. ``mpjax.diagnose`` of the model's loss (forward and backward, under the policy and in
   float32) against a plain jitted forward+backward of the same loss, same batch: the first
   call of each (tracing and compiling included: what a user waits for; JAX's caches are
   cleared before each, so none reuses what another compiled) and a later call (all compiled:
   the diagnosis evaluates equation by equation, each kernel compiled once for the layers
   that share it).
2. ``mpjax.PrecisionMonitor`` in the example's kind of train step (forward, backward, AdamW):
   the plain jitted step, the wrapped step on a step between checks and on a check step (each
   waiting for its callbacks: the modules' values and gradients), interleaved, each the median
   of several; the overhead of checking every N steps is
   ``((N - 1) * between + check) / (N * plain) - 1``.

    python benchmarks/benchmark_diagnose.py                      # small preset, CPU: minutes
    python benchmarks/benchmark_diagnose.py --preset tiny

Results go to benchmarks/results/<platform>_diagnose_<preset>.json. Background load on a
shared machine moves the times by several percent.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import jax
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_transformer  # noqa: E402
from gpt import PRESETS  # noqa: E402

import mpjax  # noqa: E402


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def _batch(key, batch_size, seq_len):
    tokens = jax.random.randint(key, (batch_size, seq_len + 1), 0, 256)
    return tokens[:, :-1], tokens[:, 1:]


def diagnose_cost(model, params, batches) -> dict:
    """First and later call of diagnose and of a plain jitted forward+backward, one batch each
    (the same batches for both)."""

    def loss(params, x, y):
        return train_transformer.loss_fn(model, params, x, y)

    plain = jax.jit(jax.value_and_grad(loss))
    # The loss function holds the wrapped model: its own rules apply, the default is unused.
    doctors = {
        "diagnose": mpjax.diagnose(loss, policy="float32"),
        "diagnose_ranges_only": mpjax.diagnose(loss, policy="float32", compare=False),
    }
    fns = {"plain": plain, **doctors}
    (x, y), later_batches = batches[0], batches[1:]
    times: dict[str, list[float]] = {k: [] for k in fns}
    for name, fn in fns.items():
        jax.clear_caches()
        times[name].append(_timed(fn, params, x, y)[0])
    for fn in fns.values():  # compile again what clearing the caches dropped, untimed
        jax.block_until_ready(fn(params, x, y))
    for x, y in later_batches:
        for name, fn in fns.items():
            times[name].append(_timed(fn, params, x, y)[0])
    first = {k: v[0] for k, v in times.items()}
    later = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {
        "first_call_s": first,
        "later_call_s": later,
        "ratio_first_call": {k: first[k] / first["plain"] for k in doctors},
        "ratio_later_call": {k: later[k] / later["plain"] for k in doctors},
    }


def monitor_overhead(model, params, batches, every: int, repeats: int) -> dict:
    tx = optax.adamw(1e-4)

    def train_step(params, opt_state, x, y):
        def loss(p):
            return train_transformer.loss_fn(model, p, x, y)

        value, grads = jax.value_and_grad(loss)(params)
        # optax's Adam computes b1 ** count with an int32 count, which
        # jax_numpy_dtype_promotion="strict" (the tests') rejects, as in the example's step.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    monitor = mpjax.PrecisionMonitor(every=every)
    jitted = jax.jit(train_step)
    wrapped = monitor.wrap(train_step)
    opt_state = tx.init(params)
    x, y = batches[0]

    def plain(i, *args):
        return jitted(*args)

    def timed(fn, i):
        seconds = _timed(fn, i, params, opt_state, x, y)[0]
        jax.effects_barrier()
        return seconds

    for fn, i in ((plain, 1), (wrapped, 1), (wrapped, 0)):  # compile all three
        timed(fn, i)
    times: dict[str, list[float]] = {"plain": [], "between": [], "check": []}
    for _ in range(repeats):
        times["plain"].append(timed(plain, 1))
        times["between"].append(timed(wrapped, 1))
        times["check"].append(timed(wrapped, 0))
    median = {k: statistics.median(v) for k, v in times.items()}
    overhead = ((every - 1) * median["between"] + median["check"]) / (every * median["plain"]) - 1
    return {
        "step_s": median,
        "every": every,
        "overhead_every": overhead,
        "between_vs_plain": median["between"] / median["plain"] - 1,
        "modules_measured": len(monitor.latest()),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="small")
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batches", type=int, default=3, help="diagnose calls (first + later)")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps of each kind")
    parser.add_argument("--only", choices=("diagnose", "monitor"), help="run one part")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    config = PRESETS[args.preset]
    policy = mpjax.get_policy(args.policy)
    model = train_transformer.build_model(config, policy, "mpjax")
    keys = jax.random.split(jax.random.key(0), args.batches)
    batches = [_batch(k, args.batch_size, args.seq_len) for k in keys]
    params = jax.jit(model.init)(jax.random.key(1), batches[0][0])["params"]
    result = {
        "preset": args.preset,
        "policy": str(policy),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "platform": jax.devices()[0].platform,
        "device": jax.devices()[0].device_kind,
        "machine": platform.machine(),
        "jax": jax.__version__,
    }
    if args.only != "monitor":
        result["diagnose"] = diagnose_cost(model, params, batches)
    if args.only != "diagnose":
        result["monitor"] = monitor_overhead(model, params, batches, args.every, args.repeats)
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{result['platform']}_diagnose_{args.preset}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
