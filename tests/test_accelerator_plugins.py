"""With libtpu installed (the `[tpu]` extra) on a machine without TPU chips, importing the
library and starting JAX prints none of libtpu's start-up errors, and TPU topology
compiles still load libtpu, quietly too."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("libtpu")

LIBTPU_START_UP = ("TPU_ACCELERATOR_TYPE", "InitGoogle", "TPU_WORKER_HOSTNAMES")


TOPOLOGY_COMPILE = (
    "import xla_strategies, jax, jax.numpy as jnp\n"
    "from jax.experimental import topologies\n"
    "topology = topologies.get_topology_desc('v5e:2x2', 'tpu')\n"
    "print(len(topology.devices), topology.devices[0].platform)\n"
)


def _environment(**env: str) -> dict[str, str]:
    """This process's environment as a user's shell has it: no test settings, and no
    libtpu lock sharing that an earlier import here set."""
    dropped = (
        "JAX_PLATFORMS",
        "XLA_FLAGS",
        "ALLOW_MULTIPLE_LIBTPU_LOAD",
        "TPU_ACCELERATOR_TYPE",
        "TPU_WORKER_HOSTNAMES",
    )
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **env}


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=_environment(**env),
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


def test_a_topology_compile_still_loads_libtpu_and_prints_none_of_its_start_up_errors():
    done = _run(TOPOLOGY_COMPILE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4", "tpu"]
    assert not [
        line for line in done.stderr.splitlines() if any(w in line for w in LIBTPU_START_UP)
    ], done.stderr
    strategy = _run(
        "import xla_strategies as xs\n"
        "print(xs.TPUStrategy('v5e-16', compile_only=True).num_replicas_in_sync)\n"
    )
    assert strategy.stdout.split() == ["16"], strategy.stderr
    assert "Failed to find host bounds" not in strategy.stderr, strategy.stderr
    assert "unexpected worker hostname" not in strategy.stderr, strategy.stderr


def test_a_topology_compile_runs_beside_another_process_holding_libtpu():
    # libtpu's lock file guards chips; without them a second process (here one of plain
    # JAX, which takes the lock) must not stop the library's topology compile
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, jax\n"
            "from jax.experimental import topologies\n"
            "topologies.get_topology_desc('v5e:2x2', 'tpu')\n"
            "print('holding', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
    )
    try:
        assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
        done = _run(TOPOLOGY_COMPILE)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["4", "tpu"]
    finally:
        holder.communicate(input="", timeout=60)
