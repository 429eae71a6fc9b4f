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


def pytest_sessionstart(session):
    """The sharding tests need 8 devices. With ``MPJAX_REQUIRE_GPU_PLAN`` set (as CI's newest
    suite sets it), a missing CUDA plugin is an error rather than a reason to skip the tests
    that compile for an H100; ``MPJAX_REQUIRE_TPU_PLAN`` does the same for libtpu and the tests
    that compile for a TPU."""
    if jax.device_count() < 8:
        raise pytest.UsageError(
            f"the tests need at least 8 devices; XLA_FLAGS gives {jax.device_count()}: "
            f"{os.environ['XLA_FLAGS']!r}"
        )
    if os.environ.get("MPJAX_REQUIRE_TPU_PLAN"):
        from jax.experimental import topologies  # after jax is configured above

        try:
            topologies.get_topology_desc(topology_name="v5p:1x1x1", platform="tpu")
        except Exception as error:  # whatever JAX's TPU backend lookup raises without libtpu
            raise pytest.UsageError(
                f"MPJAX_REQUIRE_TPU_PLAN is set, but no TPU can be compiled for: {error}"
            ) from error
    if not os.environ.get("MPJAX_REQUIRE_GPU_PLAN"):
        return
    from mpjax.inspection.gpu_plan import gpu_plan_unavailable  # after jax is configured above

    reason = gpu_plan_unavailable()
    if reason is not None:
        raise pytest.UsageError(
            f"MPJAX_REQUIRE_GPU_PLAN is set, but mpjax.gpu_plan cannot run: {reason}"
        )
