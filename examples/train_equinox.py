"""Train a small byte-level transformer, written in plain Equinox, under an mpjax policy.

The model is ordinary Equinox code (``eqx.nn.MultiheadAttention``, ``LayerNorm``, ``MLP``);
``mpjax.equinox.apply_policy`` runs it in mixed precision without changing it, and the train
step is the usual Equinox one: optax over ``eqx.filter(model, eqx.is_inexact_array)``, with
``mpjax.equinox.filter_value_and_grad`` scaling the loss and ``mpjax.loss_scaling`` unscaling
the gradients and skipping non-finite steps. The data is the Python standard library's own
``.py`` sources (every machine with Python has them). A few minutes on two CPU cores:

    python examples/train_equinox.py                           # mixed_float16, dynamic scaling
    python examples/train_equinox.py --policy mixed_bfloat16 --steps 400 --seed 1
    python examples/train_equinox.py --policy float32 --json run.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import sysconfig
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax
import mpjax.equinox

VOCAB = 256  # bytes
CORPUS_BYTES = 2_000_000
VAL_BYTES = 200_000  # the tail of the corpus
VAL_BATCHES = 16


# ----------------------------------------------------------------------------- the model


class Block(eqx.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each residual."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, d_model: int, n_heads: int, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(d_model), eqx.nn.LayerNorm(d_model)
        self.attn = eqx.nn.MultiheadAttention(n_heads, d_model, key=k1)
        self.mlp = eqx.nn.MLP(
            d_model, d_model, 4 * d_model, depth=1, activation=jax.nn.gelu, key=k2
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.norm1)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=causal)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    """Byte embeddings and learned positions, ``n_layers`` blocks, a final norm and a head."""

    embed: eqx.nn.Embedding
    positions: jax.Array
    blocks: tuple[Block, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, d_model: int, n_layers: int, n_heads: int, context: int, *, key: jax.Array):
        keys = jax.random.split(key, n_layers + 3)
        self.embed = eqx.nn.Embedding(VOCAB, d_model, key=keys[0])
        self.positions = 0.02 * jax.random.normal(keys[1], (context, d_model))
        self.blocks = tuple(Block(d_model, n_heads, key=k) for k in keys[2:-1])
        self.norm = eqx.nn.LayerNorm(d_model)
        self.head = eqx.nn.Linear(d_model, VOCAB, key=keys[-1])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed)(tokens) + self.positions[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss_fn(model, tokens: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy, in nats, of a batch of sequences (computed in f32)."""
    logits = jax.vmap(model)(tokens[:, :-1]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


# ----------------------------------------------------------------------------- data


def load_corpus(max_bytes: int = CORPUS_BYTES) -> np.ndarray:
    """The standard library's ``.py`` sources as bytes, files in a fixed shuffled order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    chunks, total = [], 0
    for i in np.random.default_rng(1234).permutation(len(files)):
        chunks.append(files[i].read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def batch(data: np.ndarray, rng: np.random.Generator, size: int, length: int) -> jax.Array:
    starts = rng.integers(0, data.size - length - 1, size)
    return jnp.asarray(np.stack([data[s : s + length + 1] for s in starts]), jnp.int32)


# ----------------------------------------------------------------------------- training


def make_optimizer(policy: mpjax.Policy, steps: int, lr: float) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps, lr / 100)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    # float16 needs a loss scale; it is harmless elsewhere, but bf16 and f32 do without.
    return mpjax.loss_scaling(tx, "dynamic") if policy.needs_loss_scaling else tx


def train(
    policy: str = "mixed_float16",
    *,
    steps: int = 300,
    seed: int = 0,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    context: int = 64,
    batch_size: int = 16,
    lr: float = 3e-3,
    log_every: int = 50,
    log=print,
) -> dict:
    """Trains the model and returns its record: the policy, the logged train losses, the final
    validation loss (nats per byte), and the loss scale and skipped steps (float16)."""
    resolved = mpjax.get_policy(policy)
    data = load_corpus()
    train_data, val_data = data[:-VAL_BYTES], data[-VAL_BYTES:]
    model = Transformer(d_model, n_layers, n_heads, context, key=jax.random.key(seed))
    model = mpjax.equinox.apply_policy(model, resolved)
    tx = make_optimizer(resolved, steps, lr)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, tokens):
        # The loss times the loss scale (when the optimizer has one), differentiated.
        loss, grads = mpjax.equinox.filter_value_and_grad(loss_fn)(opt_state, model, tokens)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    evaluate = eqx.filter_jit(loss_fn)
    rng = np.random.default_rng(seed)
    losses, start = [], time.perf_counter()
    for i in range(1, steps + 1):
        model, opt_state, loss = step(model, opt_state, batch(train_data, rng, batch_size, context))
        if i % log_every == 0 or i == steps:
            losses.append((i, float(loss)))
            mpjax.check_overflow(opt_state)  # raises if float16 keeps overflowing
            info = mpjax.loss_scaling_info(opt_state)
            log(
                f"step {i:5d}  loss {float(loss):.4f}  scale {float(info.loss_scale):g}  "
                f"{time.perf_counter() - start:.0f}s"
            )
    val_rng = np.random.default_rng(10_000)  # the same held-out batches for every run
    val = [
        float(evaluate(model, batch(val_data, val_rng, batch_size, context)))
        for _ in range(VAL_BATCHES)
    ]
    info = mpjax.loss_scaling_info(opt_state)
    return {
        "policy": str(resolved),
        "seed": seed,
        "steps": steps,
        "train_losses": losses,
        "val_loss": float(np.mean(val)),
        "loss_scale": float(info.loss_scale),
        "skipped_steps": int(info.skipped_steps),
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_float16", help="an mpjax policy")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--json", help="write the run's record here")
    args = parser.parse_args(argv)
    record = train(args.policy, steps=args.steps, seed=args.seed, log_every=args.log_every)
    print(
        f"{record['policy']}: validation loss {record['val_loss']:.4f} nats/byte "
        f"({record['val_loss'] / math.log(2):.3f} bits/byte)"
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
