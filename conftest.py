"""Test configuration: 8 fake CPU devices and strict dtype promotion for every test."""

import os

# Must happen before jax is imported anywhere: sharding tests need 8 devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Silent upcasts (bf16 + f32 -> f32) are the bugs mixed precision is about; make them errors.
jax.config.update("jax_numpy_dtype_promotion", "strict")
