"""Test configuration: 8 fake CPU devices and strict dtype promotion for every test."""

import os

import pytest

# Must happen before jax is imported anywhere: sharding tests need 8 devices. A count given in
# XLA_FLAGS already is kept, so the suite can run on more.
_DEVICE_COUNT = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT}=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Silent upcasts (bf16 + f32 -> f32) are the bugs mixed precision is about; make them errors.
jax.config.update("jax_numpy_dtype_promotion", "strict")


# Environment variables that turn a missing compiler into an error rather than a reason to skip
# the tests that compile for a target (CI's newest suite sets both), with the target to try.
_REQUIRED_PLANS = {"MPJAX_REQUIRE_GPU_PLAN": "h100", "MPJAX_REQUIRE_TPU_PLAN": "v5p"}


def _cpu_device_count() -> int:
    try:
        return len(jax.devices("cpu"))
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
        return 0


def pytest_sessionstart(session):
    """The sharding tests need 8 CPU devices (a GPU run, ``JAX_PLATFORMS=cuda,cpu``, keeps
    them beside the GPU). With ``MPJAX_REQUIRE_GPU_PLAN`` (or
    ``MPJAX_REQUIRE_TPU_PLAN``) set, as CI's newest suite sets them, a missing CUDA plugin (or
    libtpu) is an error rather than a reason to skip the tests that compile for an H100 (or a
    TPU)."""
    if _cpu_device_count() < 8:
        raise pytest.UsageError(
            f"the tests need at least 8 CPU devices; XLA_FLAGS gives {_cpu_device_count()}: "
            f"{os.environ['XLA_FLAGS']!r}"
        )
    from mpjax.planning.devices import plan_unavailable  # after jax is configured above

    for variable, target in _REQUIRED_PLANS.items():
        if not os.environ.get(variable):
            continue
        reason = plan_unavailable(target)
        if reason is not None:
            raise pytest.UsageError(f"{variable} is set, but mpjax.plan cannot run: {reason}")


def _no_gpu() -> str | None:
    """Why the tests marked ``gpu`` cannot run here, or None on a CUDA GPU."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if gpus:
        return None
    return (
        "needs a CUDA GPU, JAX's CUDA backend and JAX_PLATFORMS=cuda,cpu (this run's devices: "
        f"{', '.join(sorted({d.platform for d in jax.devices()}))})"
    )


def pytest_runtest_setup(item):
    """A test marked ``gpu`` measures what only a GPU shows (cuDNN, fp8 GEMMs, f16 overflow in
    its kernels): without one it skips, saying why."""
    if item.get_closest_marker("gpu") is not None:
        reason = _no_gpu()
        if reason is not None:
            pytest.skip(reason)
