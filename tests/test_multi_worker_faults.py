"""Multi-worker faults are Python errors, never aborts: a survivor of a dead peer is told
which worker died, stays alive while its handler saves, and exits with its own status.
Real processes on loopback, bounded in time."""

from __future__ import annotations

import re

import numpy as np

from tests.multiprocess import run_workers

HANDLER_SECONDS = 20  # an emergency checkpoint of a large model


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
