"""JAX's accelerator plugins on machines without their accelerators, where the library
uses them only to compile for a topology (`[tpu]` and `[gpu]` extras).

- libtpu only where there is a TPU. JAX skips its CUDA backend on a machine without an
  NVIDIA GPU, but starts the TPU runtime wherever libtpu is installed, and libtpu's
  start-up then prints alarming errors about the accelerator type and worker hostnames it
  cannot find. `skip_without_chips` gives the TPU backend the same check as CUDA's: with
  no TPU chips, it fails quietly, as it already would, without starting libtpu.
- The CUDA plugin registered without a GPU. Its registration first checks the CUDA
  libraries against the driver (`cuInit`), which fails where there is no GPU, and then JAX
  has no CUDA topology to compile for. `register_cuda_without_gpus` skips that check
  (JAX's own `JAX_SKIP_CUDA_CONSTRAINTS_CHECK`) on such machines only; the CUDA backend is
  still never started there, since JAX starts it only where it sees an NVIDIA GPU.
- libtpu shared between processes without chips. libtpu takes a lock file for the first
  process that loads it, so that two processes never drive the same chips; any other
  process's topology compile then fails ("Internal error when accessing libtpu
  multi-process lockfile"). With no chips there is nothing to guard:
  `share_libtpu_without_chips` sets libtpu's own `ALLOW_MULTIPLE_LIBTPU_LOAD` there.

- libtpu's start-up words on a machine without chips. A topology compile loads libtpu,
  which asks the cloud's metadata server for the machine's accelerator type and worker
  hostnames, finds none, and prints errors a compile does not need ("Failed to find host
  bounds", "unexpected worker hostname"). `quiet_libtpu_without_chips` sets the two
  variables it asks for (`TPU_ACCELERATOR_TYPE`, `TPU_WORKER_HOSTNAMES`) to placeholders
  there: the topology is the compile's own, and the compiled programs of v5e-16, v5p-8 and
  v6e-8 steps were measured byte-identical with and without them (libtpu 0.0.42 and
  0.0.50).

Nothing changes on a machine with TPU chips (JAX's own check, the one its Cloud TPU set-up
uses), with JAX's `JAX_FORCE_TPU_INIT`, or for topology compiles
(`TPUStrategy(..., compile_only=True)`, `xla-strategies aot`), which load libtpu
themselves.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any


class NoTPUChipsError(RuntimeError):
    """The TPU backend was asked for on a machine without TPU chips."""


def skip_without_chips() -> bool:
    """Make JAX's default TPU backend check for chips before it starts libtpu. Returns
    whether it did (False where JAX's internals are not as expected: then nothing
    changes)."""
    try:
        from jax._src import xla_bridge

        registration = xla_bridge._backend_factories["tpu"]
        factory = registration.factory
    except (ImportError, AttributeError, KeyError):
        return False
    if getattr(factory, "checks_for_chips", False):
        return True

    def started_where_there_are_chips() -> Any:
        if not (_has_tpu_chips() or "JAX_FORCE_TPU_INIT" in os.environ):
            raise NoTPUChipsError("this machine has no TPU chips; libtpu was not started")
        return factory()

    started_where_there_are_chips.checks_for_chips = True  # type: ignore[attr-defined]
    xla_bridge._backend_factories["tpu"] = dataclasses.replace(
        registration, factory=started_where_there_are_chips
    )
    return True


def register_cuda_without_gpus() -> bool:
    """On a machine without an NVIDIA GPU, let the CUDA plugin (if installed) register for
    compiles. Returns whether it set JAX's skip of the CUDA check."""
    if "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in os.environ or _has_nvidia_gpu():
        return False
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return True


def share_libtpu_without_chips() -> bool:
    """On a machine without TPU chips, let every process load libtpu for topology
    compiles. Returns whether it set libtpu's `ALLOW_MULTIPLE_LIBTPU_LOAD` (a user's own
    setting stays)."""
    if "ALLOW_MULTIPLE_LIBTPU_LOAD" in os.environ or _has_tpu_chips():
        return False
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    return True


#: What libtpu asks the metadata server for: placeholders on a machine without chips
LIBTPU_PLACEHOLDERS = {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost"}


def quiet_libtpu_without_chips() -> bool:
    """On a machine without TPU chips, give libtpu the placeholders it would otherwise
    print errors about. Returns whether it set them (a user's own settings stay)."""
    if any(name in os.environ for name in LIBTPU_PLACEHOLDERS) or _has_tpu_chips():
        return False
    os.environ.update(LIBTPU_PLACEHOLDERS)
    return True


def _has_nvidia_gpu() -> bool:
    try:
        from jax._src import hardware_utils

        return bool(hardware_utils.has_visible_nvidia_gpu())
    except (ImportError, AttributeError, OSError):
        return True  # cannot tell: leave JAX's check in place


def _has_tpu_chips() -> bool:
    try:
        from jax._src import hardware_utils

        chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    except (ImportError, AttributeError, OSError):
        return True  # cannot tell: leave libtpu's own checks in place
    return chips > 0


# on import: the library's import comes before JAX starts its backends
skip_without_chips()
register_cuda_without_gpus()
share_libtpu_without_chips()
quiet_libtpu_without_chips()
