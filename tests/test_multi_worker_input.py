"""Workers whose input differs never hang: datasets of different lengths end together,
parts of different sizes and different local device counts are errors naming each
worker's. Real processes on loopback, bounded in time."""

from __future__ import annotations

import pytest

from tests.multiprocess import run_workers


def _run(*flags: str) -> list:
    return run_workers(["tests/workers/input_faults.py", *flags], timeout=120)


def test_datasets_of_different_lengths_end_at_the_shortest_on_every_worker():
    workers = _run("--batches", "6", "3")
    for w in workers:
        assert w.process.returncode == 0, w.output[-3000:]
        assert "BATCHES 3" in w.output, w.output[-3000:]
    assert "the epoch ends at batch 3 on every worker" in workers[0].output


def test_parts_of_different_sizes_are_an_error_on_every_worker():
    workers = _run("--rows", "32", "16")
    for w in workers:
        assert w.process.returncode == 3, w.output[-3000:]
        assert "ERROR ValueError: the workers' parts of batch 0 differ in shape" in w.output
        assert "worker 0: [[[32, 4]" in w.output and "worker 1: [[[16, 4]" in w.output


@pytest.mark.parametrize("devices", [("4", "2")])
def test_different_local_device_counts_are_a_start_up_error(devices):
    workers = _run("--devices", *devices)
    for w in workers:
        assert w.process.returncode == 3, w.output[-3000:]
        assert "worker 0 has 4 local devices, worker 1 has 2" in w.output, w.output[-3000:]
