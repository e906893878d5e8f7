"""Multi-worker faults are Python errors, never aborts: a survivor of a dead peer is told
which worker died, stays alive while its handler saves, and exits with its own status; a
worker that never starts, or a coordinator port another program holds, is an
UnavailableError in every started worker within the timeout. Real processes on loopback,
bounded in time."""

from __future__ import annotations

import json
import re
import socket
import time

import numpy as np

from tests import multiprocess
from tests.multiprocess import run_workers
from tests.workers.statuses import CAUGHT_STATUS

HANDLER_SECONDS = 20  # an emergency checkpoint of a large model
START_SECONDS = 30  # a worker's Python and JAX start-up on a busy 2-core machine


def test_a_peers_death_is_an_error_naming_it_and_the_survivors_handler_finishes(tmp_path):
    out = tmp_path / "emergency.npy"
    survivor, killed = run_workers(
        [
            "tests/workers/peer_death.py",
            "--out",
            str(out),
            "--handler-seconds",
            str(HANDLER_SECONDS),
            "--timeout",
            "10",
        ],
        kill=(1, 2),
        timeout=240,
    )
    assert killed.killed_at == 2
    text = survivor.output
    assert survivor.process.returncode == 7, text[-3000:]  # the user's status, no SIGABRT
    # the step raises as soon as its collective fails; which worker died, the
    # coordination service confirms within its heartbeat timeout (10 s here)
    assert re.search(r"CAUGHT at [\d.]+ UnavailableError: .* of 2 stopped", text), text[-3000:]
    assert re.search(r"NEXT STEP UnavailableError: .* of 2 stopped", text), text[-3000:]
    assert "xla_strategies: worker 1 of 2 stopped" in text, text[-3000:]
    assert f"SAVED after {HANDLER_SECONDS}" in text and np.load(out).shape == (4,)
    caught = float(re.search(r"CAUGHT at ([\d.]+)", text).group(1))
    print(f"peer death to the survivor's error: {caught - killed.killed_time:.2f} s")
    # at once where the collective fails on the closed connection (JAX 0.12's gloo); at
    # most the heartbeat timeout (10 s) and the watcher's poll where it waits (JAX 0.10)
    assert caught - killed.killed_time < 10 + 8


# start-up faults: every started process raises UnavailableError within the timeout


def test_a_worker_that_never_starts_is_an_unavailable_error_within_the_timeout():
    started = time.time()
    (alone,) = run_workers(["tests/workers/join.py", "--timeout", "5"], start=[0], timeout=120)
    text = alone.output
    assert alone.process.returncode == CAUGHT_STATUS, text[-3000:]  # not SIGABRT
    assert re.search(r"CAUGHT at [\d.]+ UnavailableError: worker 0 of 2 could not join", text)
    assert "worker 1 of 2 did not check in within 5 s" in text, text[-3000:]
    caught = float(re.search(r"CAUGHT at ([\d.]+)", text).group(1))
    assert caught - started < 5 + START_SECONDS, text[-3000:]


def test_a_coordinator_port_in_use_is_an_unavailable_error_in_every_worker(monkeypatch):
    configs = multiprocess.tf_configs(2)
    monkeypatch.setattr(multiprocess, "tf_configs", lambda count: configs)
    address = json.loads(configs[0])["cluster"]["worker"][0]
    host, port = address.rsplit(":", 1)
    with socket.create_server((host, int(port))):  # another program listens on the port
        started = time.time()
        workers = run_workers(["tests/workers/join.py", "--timeout", "5"], timeout=120)
    for worker in workers:
        text = worker.output
        assert worker.process.returncode == CAUGHT_STATUS, text[-3000:]  # not SIGSEGV
        assert f"could not join the cluster at {address}" in text, text[-3000:]
        caught = float(re.search(r"CAUGHT at ([\d.]+)", text).group(1))
        assert caught - started < 5 + START_SECONDS, text[-3000:]
    assert f"its port {port} is in use by another program" in workers[0].output
    assert "another program answers on the coordinator's port" in workers[1].output


def test_a_worker_that_starts_late_within_the_timeout_joins():
    workers = run_workers(
        ["tests/workers/join.py", "--timeout", "20", "--late-worker", "1", "--delay", "6"],
        timeout=180,
    )
    for worker in workers:
        assert worker.process.returncode == 0, worker.output[-3000:]
        assert "JOINED 3 on 4 replicas" in worker.output, worker.output[-3000:]
