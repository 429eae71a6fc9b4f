"""Rounding float32 values into narrower storage: to nearest, or stochastically.

Rounding to nearest loses every change smaller than half the spacing of the narrow dtype: a
bfloat16 param at 1.0 never moves under updates of -1e-4, since 1.0 - 1e-4 rounds back to 1.0.
Stochastic rounding rounds up or down at random, with the probability of each neighbour
proportional to how close the value is to it, so the *expected* result is the value itself: a
hundred updates of -1e-4 move the param by -0.01 on average, as in float32.

The randomness is explicit. :func:`stochastic_round` takes a PRNG key; the optax
transformations that round (:func:`mpjax.state_precision`, :func:`mpjax.low_precision_params`)
carry a key in their state, made from a seed by :func:`rounding_key` and advanced by
:func:`next_rounding_keys` once per applied step, so a run is reproducible bit for bit from its
seed, and a checkpoint of the optimizer state resumes it exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax.policy import is_floating, is_low_precision, storage_dtype

__all__ = [
    "ROUNDINGS",
    "next_rounding_keys",
    "round_to",
    "rounding_key",
    "stochastic_round",
    "widen",
]

#: The roundings :func:`round_to` knows.
ROUNDINGS = ("nearest", "stochastic")


def _is_typed_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _check_key(key: Any) -> None:
    """Refuses a ``key`` that is not one PRNG key, typed or as raw key data."""
    if _is_typed_key(key):
        if key.shape != ():
            raise ValueError(
                f"stochastic_round: key must be one PRNG key, got an array of keys of shape "
                f"{key.shape}; pass one of them."
            )
        return
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32:
        if key.ndim != 1:
            raise ValueError(
                "stochastic_round: key must be one PRNG key; raw key data has one dimension "
                f"(jax.random.PRNGKey(0) has shape (2,)), got shape {key.shape}."
            )
        return
    raise TypeError(
        "stochastic_round: key must be a PRNG key (jax.random.key(0)) or raw key data "
        f"(jax.random.PRNGKey(0)), got {key!r} of type {type(key).__name__}."
    )


def _typed_key(key: jax.Array) -> jax.Array:
    """A typed PRNG key from a typed key or raw key data (``jax.random.PRNGKey(0)``)."""
    return key if _is_typed_key(key) else jax.random.wrap_key_data(key)


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """Rounds ``x`` to ``dtype`` stochastically: the expected result is ``x`` exactly.

    Each element goes to one of the two ``dtype`` values around it, the upper one with
    probability ``(x - lower) / (upper - lower)``. That probability is exact (the spacing of
    floats is a power of two) and compared with a uniform draw of 23 random bits, so for
    float32 ``x`` and a bfloat16 or float16 ``dtype`` the mean over draws is ``x`` with no
    bias at all. A value ``dtype`` holds exactly comes back unchanged, whatever the key.

    Finite values beyond ``dtype``'s largest finite value saturate to it (rounding to nearest
    would give inf); inf and NaN stay what they are. A ``dtype`` at least as wide as ``x``'s is
    a plain cast.

    Args:
      x: a floating-point array (float32 in practice).
      dtype: the dtype to round to, floating and at least 16 bits: ``jnp.bfloat16``,
        ``"bf16"``, ``jnp.float16``...
      key: a PRNG key (``jax.random.key(0)``, or raw key data such as
        ``jax.random.PRNGKey(0)``). The same key gives the same rounding.

    Returns:
      An array of ``x``'s shape in ``dtype``.

    Raises:
      TypeError: if ``x`` is not a floating-point array, or ``key`` is not a PRNG key.
      ValueError: for a ``dtype`` that is not floating or narrower than 16 bits, or several
        keys where one goes.

    >>> x = jnp.full(10_000, 1.0 - 1e-4, jnp.float32)
    >>> x.astype(jnp.bfloat16).mean(dtype=jnp.float32)  # rounding to nearest loses the -1e-4
    Array(1., dtype=float32)
    >>> r = stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted({float(v) for v in r})  # each element is one of the two neighbours
    [0.99609375, 1.0]
    >>> bool(abs(r.mean(dtype=jnp.float32) - (1.0 - 1e-4)) < 1e-5)  # unbiased
    True
    """
    dtype = storage_dtype(dtype, "dtype")
    if not is_floating(x):
        raise TypeError(
            f"stochastic_round: x must be a floating-point array, got {x!r} of type "
            f"{type(x).__name__}."
        )
    _check_key(key)
    x = jnp.asarray(x)
    if jnp.finfo(dtype).bits >= jnp.finfo(x.dtype).bits:
        return x.astype(dtype)
    big = jnp.finfo(dtype).max.astype(x.dtype)
    # Saturate finite values, so both neighbours are finite and the probability is exact.
    x = jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x)
    nearest = x.astype(dtype)
    above = nearest.astype(x.dtype) > x
    toward = jnp.where(above, -jnp.inf, jnp.inf).astype(dtype)
    other = jnp.nextafter(nearest, toward)
    lower = jnp.where(above, other, nearest).astype(x.dtype)
    upper = jnp.where(above, nearest, other).astype(x.dtype)
    # Exact: x - lower and upper - lower are exact (Sterbenz), the spacing a power of two. For
    # a value dtype holds, the probability is 0 (or NaN for inf and NaN): it stays as it is.
    # Tiny values are first scaled by a power of two (exactly): at bfloat16's smallest
    # exponents the spacing is a float32 subnormal, which XLA:CPU flushes to zero (0 / 0 would
    # round every such value down).
    scale = jnp.where(jnp.abs(x) < 2.0**-64, 2.0**64, 1.0).astype(x.dtype)
    p_upper = (x * scale - lower * scale) / (upper * scale - lower * scale)
    u = jax.random.uniform(_typed_key(key), x.shape, x.dtype)
    return jnp.where(u < p_upper, upper, lower).astype(dtype)


def widen(tree: Any) -> Any:
    """``tree`` with its floating leaves narrower than float32 cast to float32 (exactly), the
    dtype mpjax's optimizer wrappers compute in; every other leaf as it is.

    >>> widen({"w": jnp.ones(2, jnp.bfloat16), "n": jnp.arange(2)})["w"].dtype
    dtype('float32')
    """
    return jax.tree.map(lambda x: x.astype(jnp.float32) if is_low_precision(x) else x, tree)


def round_to(x: jax.Array, dtype: Any, rounding: str, key: jax.Array | None = None) -> jax.Array:
    """Rounds ``x`` to ``dtype`` with ``rounding``: ``"nearest"`` (a cast, which needs no key)
    or ``"stochastic"`` (:func:`stochastic_round`, with ``key``).

    Raises:
      ValueError: for an unknown ``rounding``, or ``"stochastic"`` without a key.

    >>> round_to(jnp.float32(1.0 - 1e-4), jnp.bfloat16, "nearest")
    Array(1, dtype=bfloat16)
    """
    if rounding == "nearest":
        return jnp.asarray(x).astype(dtype)
    if rounding == "stochastic":
        if key is None:
            raise ValueError("round_to: stochastic rounding needs a PRNG key, got key=None.")
        return stochastic_round(x, dtype, key)
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}.")


def check_rounding(rounding: Any, valid: tuple[str, ...], where: str) -> str:
    """Returns ``rounding`` if it is one of ``valid``, else raises a ``ValueError`` (a
    ``TypeError`` for a non-string) naming ``where`` and the valid choices."""
    if not isinstance(rounding, str):
        raise TypeError(
            f"{where}: rounding must be one of {valid}, got {rounding!r} of type "
            f"{type(rounding).__name__}."
        )
    if rounding not in valid:
        raise ValueError(f"{where}: rounding must be one of {valid}, got {rounding!r}.")
    return rounding


def rounding_key(seed: int | jax.Array) -> jax.Array:
    """The raw key data (a uint32 array) that a rounding transformation carries in its state.

    Raw data rather than a typed key, so any checkpointer stores it as a plain array.

    Args:
      seed: a Python or NumPy integer, or a PRNG key (typed, or raw uint32 key data).

    Raises:
      TypeError: for anything else (a float, a string, a bool).
      ValueError: for an integer outside the int64 range.

    >>> rounding_key(0)
    Array([0, 0], dtype=uint32)
    """
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        if not -(2**63) <= int(seed) < 2**63:
            raise ValueError(f"seed must be a 64-bit signed integer, got {seed!r}.")
        return jax.random.key_data(jax.random.key(int(seed)))
    if _is_typed_key(seed):
        return jax.random.key_data(seed)
    if isinstance(seed, (jax.Array, np.ndarray)) and seed.dtype == np.uint32:
        return jnp.asarray(seed)
    raise TypeError(
        f"seed must be an integer or a PRNG key (jax.random.key(n)), got {seed!r} of type "
        f"{type(seed).__name__}."
    )


def next_rounding_keys(
    key: jax.Array, count: int, advance: jax.Array | bool = True
) -> tuple[jax.Array, list[jax.Array]]:
    """Splits a carried rounding key into the key for the next step and ``count`` keys for
    this step's leaves.

    Args:
      key: the raw key data carried in a transformation's state.
      count: how many leaf keys to make.
      advance: a bool (traced or not): when False, the returned next key is ``key`` itself, so
        a step that changed nothing (skipped for overflow) leaves the state bit for bit as it
        was.

    Returns:
      ``(next_key, leaf_keys)``, ``next_key`` raw key data like ``key``.
    """
    typed = _typed_key(key)
    step_key, carried = jax.random.split(typed)
    next_key = jnp.where(advance, jax.random.key_data(carried), key)
    return next_key, list(jax.random.split(step_key, count)) if count else []
