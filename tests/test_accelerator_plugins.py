"""With libtpu installed (the `[tpu]` extra) on a machine without TPU chips, importing the
library and starting JAX prints none of libtpu's start-up errors, and TPU topology
compiles still load libtpu."""

import subprocess
import sys

import pytest

pytest.importorskip("libtpu")

LIBTPU_START_UP = ("TPU_ACCELERATOR_TYPE", "InitGoogle", "TPU_WORKER_HOSTNAMES")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    environment = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environment, **env},
    )


def test_starting_jax_without_tpu_chips_does_not_start_libtpu():
    done = _run("import xla_strategies, jax; print(jax.default_backend())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu"
    assert not [
        line for line in done.stderr.splitlines() if any(w in line for w in LIBTPU_START_UP)
    ]


def test_asking_for_the_tpu_backend_without_chips_says_why():
    done = _run("import xla_strategies, jax; jax.devices()", JAX_PLATFORMS="tpu")
    assert done.returncode != 0
    assert "this machine has no TPU chips" in done.stderr


def test_a_topology_compile_still_loads_libtpu():
    code = (
        "import xla_strategies, jax, jax.numpy as jnp\n"
        "from jax.experimental import topologies\n"
        "topology = topologies.get_topology_desc('v5e:2x2', 'tpu')\n"
        "print(len(topology.devices), topology.devices[0].platform)\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4", "tpu"]
