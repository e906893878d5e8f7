"""Every test process sees 8 emulated CPU devices, as DESIGN.md asks."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
