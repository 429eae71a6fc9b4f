"""Test configuration: 8 fake CPU devices and strict dtype promotion for every test."""

import os

import pytest

# Must happen before jax is imported anywhere: sharding tests need 8 devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Silent upcasts (bf16 + f32 -> f32) are the bugs mixed precision is about; make them errors.
jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_sessionstart(session):
    """With ``MPJAX_REQUIRE_GPU_PLAN`` set (as CI's newest suite sets it), a missing CUDA
    plugin is an error rather than a reason to skip the tests that compile for an H100."""
    if not os.environ.get("MPJAX_REQUIRE_GPU_PLAN"):
        return
    from mpjax.gpu_plan import gpu_plan_unavailable  # after jax is configured above

    reason = gpu_plan_unavailable()
    if reason is not None:
        raise pytest.UsageError(
            f"MPJAX_REQUIRE_GPU_PLAN is set, but mpjax.gpu_plan cannot run: {reason}"
        )
