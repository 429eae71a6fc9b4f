"""How far apart two computations of the same value may land when they add in different orders.

XLA chooses the order of a reduction's additions: sharding splits a sum into partial sums, a
fused kernel or another vector width (SSE, AVX2, AVX-512) groups the terms differently, and
fast math reassociates. So a test that compares two different computations (sharded with
unsharded, fused with written out, fp8 with a reference, one device count with another) allows
the difference these bounds derive from the dtype and the reduction length, not a tolerance tuned
on one CPU. Bit-identity is for the same computation on the same devices: a resume, a skipped
step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def tolerance(dtype, reduction_length: int) -> float:
    """The most two orders of one sum may disagree, relative to the sum of its terms' magnitudes.

    A sum of ``n`` terms in any order makes ``n - 1`` roundings, each off by at most
    ``u = eps / 2`` of a partial sum no larger than ``sum |x_i|``: it lands within
    ``(n - 1) * u * sum |x_i|`` of the exact sum (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., eq. 4.4), so two orders land within ``(n - 1) * eps`` of each other.
    When the terms are products, a fused multiply-add skips a product's rounding where a
    separate multiply does not: ``u`` more on each side. Rounding each result into ``dtype``
    adds ``u`` again on each side. In all, ``(n + 1) * eps``.

    For a value that goes through several reductions in turn (a matmul, then a norm, then the
    next matmul), first-order errors add: pass the sum of their lengths. For a sum accumulated
    in float32 and rounded once into a narrower dtype (XLA's bf16 matmuls on CPU), add the two
    bounds: ``tolerance(np.float32, n) + tolerance(jnp.bfloat16, 0)``.

    Args:
      dtype: the dtype the sum rounds in.
      reduction_length: the number of terms added.

    Returns:
      The bound, relative to ``sum |x_i|`` (for terms of one sign, to the sum itself).

    >>> tolerance(np.float32, 127) == 128 * 2.0**-23
    True
    """
    return (reduction_length + 1) * float(jnp.finfo(dtype).eps)


def gpt_reduction_length(config) -> int:
    """The reduction lengths a logit of the example GPT (``examples/gpt.py``) goes through, one
    after the other, summed (for :func:`tolerance`): per block a LayerNorm, the qkv
    projection, the scores (the head size), the softmax and the weighted values (the
    sequence), the output projection, a LayerNorm and the MLP (d_model, then its hidden
    width); then the final LayerNorm and the head."""
    d, t = config.d_model, config.block_size
    block = d + d + d // config.n_head + t + t + d + d + d + config.mlp_ratio * d
    return config.n_layer * block + 2 * d


def assert_close_in_norm(actual, desired, rtol: float, err_msg: str = "") -> None:
    """``|actual - desired| <= rtol * |desired|`` in the L2 norm over all elements.

    For gradients and parameter updates: a gradient element that cancels to nearly zero keeps
    the rounding noise of its large terms, so elementwise it can differ by more than any
    ``rtol`` of itself (and Adam divides by it); over the whole array it weighs what it is
    worth.
    """
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    error, size = np.linalg.norm(actual - desired), np.linalg.norm(desired)
    assert error <= rtol * size, f"{err_msg}: |difference| {error:.3g} > {rtol:.3g} * {size:.3g}"
