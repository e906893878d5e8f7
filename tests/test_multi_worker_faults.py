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


def _run_until_a_peer_dies(tmp_path, kill, *extra):
    """Two workers training; worker 1 killed at `kill`. The survivor, its handler done."""
    out = tmp_path / "emergency.npy"
    argv = ["tests/workers/peer_death.py", "--out", str(out), "--timeout", "10"]
    handler = ["--handler-seconds", str(HANDLER_SECONDS)]
    survivor, killed = run_workers([*argv, *handler, *extra], kill=(1, kill), timeout=240)
    assert killed.killed_at == kill
    text = survivor.output
    assert survivor.process.returncode == 7, text[-3000:]  # the user's status, no SIGABRT
    assert re.search(r"NEXT STEP UnavailableError: .* of 2 stopped", text), text[-3000:]
    assert "xla_strategies: worker 1 of 2 stopped" in text, text[-3000:]
    assert f"SAVED after {HANDLER_SECONDS}" in text and np.load(out).shape == (4,)
    caught = float(re.search(r"CAUGHT at ([\d.]+)", text).group(1))
    print(f"peer death to the survivor's error: {caught - killed.killed_time:.2f} s")
    return text, caught - killed.killed_time


def test_a_peers_death_is_an_error_naming_it_and_the_survivors_handler_finishes(tmp_path):
    text, seconds = _run_until_a_peer_dies(tmp_path, 2)
    caught = re.search(r"CAUGHT at [\d.]+ UnavailableError: (.*) of 2 stopped.*", text)
    assert caught, text[-3000:]
    if "cannot run (" in caught.group(0):  # the collective error that stopped the step
        # the step raised as soon as its collective failed on the closed connection (0.05 s
        # here): sooner than the service can confirm which worker died (its 10 s heartbeat
        # timeout), and without waiting for the input thread, which waits on the dead peer
        assert seconds < 10
    else:  # the survivor was waiting for the next batch (1 run in 10 here), as below
        assert caught.group(1) == "worker 1" and seconds < 10 + 20


def test_a_peer_that_dies_while_its_survivor_waits_for_the_next_batch_is_named(tmp_path):
    # the survivor is in no step: it waits for the dead peer to agree on the next batch
    text, seconds = _run_until_a_peer_dies(tmp_path, "STALLED", "--stall-at", "3")
    assert "STEP 2" in text and "STEP 3" not in text, text[-3000:]
    caught = r"CAUGHT at [\d.]+ UnavailableError: worker 1 of 2 stopped \(died or was preempted\)"
    assert re.search(caught, text), text[-3000:]
    # once the service confirms the death (its 10 s heartbeat timeout, then its barrier of
    # live tasks), never the input's own timeout of 600 s
    assert seconds < 10 + 20


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


def test_a_coordinator_port_in_use_is_an_unavailable_error_in_every_worker():
    configs = multiprocess.tf_configs(2)
    address = json.loads(configs[0])["cluster"]["worker"][0]
    host, port = address.rsplit(":", 1)
    with socket.create_server((host, int(port))):  # another program listens on the port
        started = time.time()
        argv = ["tests/workers/join.py", "--timeout", "5"]
        workers = run_workers(argv, timeout=120, configs=configs)
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
