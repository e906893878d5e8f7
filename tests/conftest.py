"""Every test process sees 8 emulated CPU devices, as the design asks (docs/architecture.md)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # the Keras tests run Keras 3 on JAX

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_report_header(config):
    # Two tested JAX releases run this suite (`make test`, `make test-oldest-jax`): say which.
    import sys

    return f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, Python {sys.version.split()[0]}"
