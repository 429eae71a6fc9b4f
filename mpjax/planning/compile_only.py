"""Tracing for devices this process does not have: what an ahead-of-time compile of an mpjax
step needs, through :func:`mpjax.plan` or a user's own ``jax.jit(step).lower(...).compile()``.

Two things mpjax traces into a step assume it runs here. Loss scaling's persistent-overflow
warning is a host callback (``jax.debug.callback``), which cannot lower for compile-only devices
(the CUDA plugin's, or libtpu's topologies): "Unknown backend: 'gpu' requested, but no platforms
that are instances of gpu are present". A step holds it only for the platforms this process has
devices of, chosen when it is lowered, so a plain ``jax.jit(step).lower(...).compile()`` for
other devices compiles, with a ``LossScalingWarning`` saying once that the warning is left out.
And a block-scaled matmul warns at trace time that this process's backend emulates it, which
says nothing of the target. :func:`compile_only` traces without both, silently; a step traced
outside it, to run on local devices, keeps the warning.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax

from mpjax import block_scaled
from mpjax.optim.loss_scaling import without_host_warnings

__all__ = ["compile_only"]


@contextlib.contextmanager
def compile_only() -> Any:
    """Traces the mpjax steps inside it for devices this process does not have: without loss
    scaling's host callback (the step still skips non-finite updates and keeps its state; only
    the warning after a long run of skipped steps is left out) and without the emulation
    warning of block-scaled matmuls.

    Lower inside it (tracing happens there; the compile may follow outside)::

        mesh = mpjax.plan_mesh("v5p:2x2x2")  # or jax.experimental.topologies' devices
        with mpjax.compile_only():
            lowered = jax.jit(step).lower(*args)  # args sharded on the mesh
        compiled = lowered.compile()

    JAX caches a function's trace by its arguments' types, not by this context, so the context
    clears JAX's caches as it starts and as it ends (``jax.clear_caches()``): a step traced
    before, to run here, is traced again without the callback, and traced again with it after.
    Everything else jitted is compiled again once. :func:`mpjax.plan` traces its own step
    without these warnings already.
    """
    jax.clear_caches()
    try:
        with without_host_warnings(), block_scaled.compiling_for_target():
            yield
    finally:
        jax.clear_caches()
