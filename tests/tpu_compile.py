"""Compiling for a TPU on a machine without one: libtpu describes a v5p topology, and
``jax.jit(fn).lower(*args).compile()`` for arguments placed on it gives the optimized TPU HLO.

The tests that do this skip where libtpu is not installed; ``MPJAX_REQUIRE_TPU_PLAN`` in the
environment (see conftest.py) turns that into an error.
"""

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax

TOPOLOGY = "v5p:2x2x1"  # four v5p chips


@functools.cache
def mesh() -> jax.sharding.Mesh:
    """A one-axis mesh ``("x",)`` over the chips of :data:`TOPOLOGY`."""
    return mpjax.plan_mesh(TOPOLOGY, (4,), ("x",))


def tpu_compile_unavailable() -> str | None:
    """Why this machine cannot compile for a TPU, or None when it can."""
    return mpjax.plan_unavailable(TOPOLOGY)


def on_tpu(shape: tuple[int, ...], dtype, spec: P | None = None) -> jax.ShapeDtypeStruct:
    """An argument of ``shape`` and ``dtype`` on the TPU mesh, replicated unless ``spec``."""
    sharding = NamedSharding(mesh(), P() if spec is None else spec)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def tpu_hlo(fn, *args) -> str:
    """The optimized TPU HLO of ``jax.jit(fn)`` for ``args`` (from :func:`on_tpu`)."""
    return jax.jit(fn).lower(*args).compile().as_text()
