"""Checkpoints that no second process and no kill -9 can corrupt: one writer per
directory, readers beside it, and kills during deletions and overwrites. Real processes
(tests/workers/checkpoint_writer.py), bounded in time. The randomised kills repeat
`KILLS` times here and `KILLS_SLOW` times in `make test-slow`."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import xla_strategies as xs
from tests.workers.checkpoint_writer import REFUSED_STATUS, state, tag_of

ROOT = Path(__file__).parents[2]
LEAVES, SIZE = 16, 1024
KILLS, KILLS_SLOW = 2, 20
KILLED_LEAVES = 64  # many files, so that a deletion takes long enough to be killed in


def _start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers.checkpoint_writer", *argv],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_line(process: subprocess.Popen, prefix: str, timeout: float = 120) -> list[str]:
    """The lines `process` printed up to the first that starts with `prefix`."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix) or time.monotonic() > deadline:
            return lines
    raise AssertionError(f"the worker ended before {prefix!r}:\n{''.join(lines)[-3000:]}")


def _finish(process: subprocess.Popen, timeout: float = 120) -> str:
    out, _ = process.communicate(timeout=timeout)
    return out


def _every_listed_step_restores(directory: Path, leaves: int = LEAVES) -> list[int]:
    """Open `directory` as the next run would and restore every listed step; each must
    hold one writer's values for that step (tags may differ by overwrites' 1000s)."""
    with xs.CheckpointManager(directory, xs.OneDeviceStrategy()) as manager:
        steps = manager.all_steps()
        for step in steps:
            try:
                restored = manager.restore(step=step, target=state(0.0, leaves, SIZE))
            except xs.CheckpointError as exc:
                raise AssertionError(
                    f"listed step {step} of {steps} does not restore: {exc}"
                ) from exc
            tag = tag_of(step, restored)
            assert tag is not None and tag % 1000 in (0.25, 0.75), f"step {step} mixes values"
    return steps


def test_a_second_writer_is_refused_naming_the_first_and_no_step_mixes(tmp_path):
    # the first holds the directory after its step 2 until the second has run: a loaded
    # machine that starts the second late cannot find the first done
    directory, go = tmp_path / "checkpoints", tmp_path / "go"
    first = _start("write", str(directory), "--steps", "30", "--pause", "0.05",
                   "--hold-until", str(go))  # fmt: skip
    _wait_for_line(first, "STEP 2")
    second = _start("write", str(directory), "--steps", "30", "--tag", "0.75")
    out = _finish(second)
    go.touch()
    assert second.returncode == REFUSED_STATUS, out[-3000:]
    host = socket.gethostname()
    assert f"locked by process {first.pid} on {host}" in out, out[-3000:]
    assert "read_only=True" in out, out[-3000:]
    assert "DONE" in _finish(first)
    assert first.returncode == 0
    assert _every_listed_step_restores(directory) == list(range(1, 31))


@pytest.mark.parametrize("max_to_keep", [100, 3])
def test_a_reader_beside_a_writer_never_deletes_and_always_reads_whole_steps(tmp_path, max_to_keep):
    """An evaluator restores the latest step while the trainer saves asynchronously (and,
    with max_to_keep=3, deletes the step the evaluator may be reading)."""
    writer = _start(
        "write", str(tmp_path), "--steps", "40", "--async-save", "--max-to-keep", str(max_to_keep)
    )
    _wait_for_line(writer, "STEP 1")
    reader = _start("read", str(tmp_path), "--seconds", "6")
    read_out, write_out = _finish(reader), _finish(writer)
    assert writer.returncode == 0 and "DONE" in write_out, write_out[-3000:]
    assert reader.returncode == 0 and "DONE" in read_out, read_out[-3000:]
    assert "BAD" not in read_out, read_out[-3000:]
    assert read_out.count("READ") >= 3, read_out[-3000:]
    steps = _every_listed_step_restores(tmp_path)
    assert steps == list(range(1, 41))[-max_to_keep:]


def _kill_at_random(tmp_path: Path, mode: str, seed: int, *argv: str) -> list[int]:
    """Start a writer, kill -9 it at a random moment after its third save, then check
    the directory as the restarted run sees it."""
    process = _start(mode, str(tmp_path), *argv)
    _wait_for_line(process, "STEP 3")
    time.sleep(random.Random(seed).uniform(0.0, 1.0))
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    return _every_listed_step_restores(tmp_path, KILLED_LEAVES)


def _kill_cases(fast: int = KILLS, total: int = KILLS_SLOW, word: str = "kill") -> list:
    """`fast` seeds for `make test`, and more for `make test-slow` (the `repeat` ids)."""
    return [
        pytest.param(seed, id=f"{word if seed < fast else 'repeat'}{seed}") for seed in range(total)
    ]


@pytest.mark.parametrize("seed", _kill_cases())
def test_a_kill_during_max_to_keep_deletion_never_leaves_a_listed_damaged_step(tmp_path, seed):
    steps = _kill_at_random(
        tmp_path,
        "write",
        seed,
        "--steps",
        "200",
        "--max-to-keep",
        "1",
        "--leaves",
        str(KILLED_LEAVES),
    )
    assert len(steps) in (1, 2), steps  # the new step may be committed before the old goes


@pytest.mark.parametrize("seed", _kill_cases(1))
def test_a_kill_during_asynchronous_saves_with_max_to_keep_never_leaves_a_listed_damaged_step(
    tmp_path, seed
):
    """Orbax deletes the old step in its background thread, after the new one commits."""
    argv = ["--steps", "200", "--max-to-keep", "1", "--leaves", str(KILLED_LEAVES)]
    steps = _kill_at_random(tmp_path, "write", seed, *argv, "--async-save")
    assert len(steps) in (1, 2), steps


@pytest.mark.parametrize("seed", _kill_cases())
def test_a_kill_during_an_overwrite_leaves_the_latest_step_whole(tmp_path, seed):
    steps = _kill_at_random(
        tmp_path, "overwrite", seed, "--steps", "200", "--leaves", str(KILLED_LEAVES)
    )
    assert steps in ([1, 2], [1, 2, 3]), steps


def test_a_step_found_incomplete_at_start_up_is_set_aside_with_a_warning(tmp_path):
    with xs.CheckpointManager(tmp_path, xs.OneDeviceStrategy(), async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, state(step + 0.25, LEAVES, SIZE))
    for path in sorted((tmp_path / "3").rglob("*"), reverse=True)[: LEAVES // 2]:
        path.unlink() if path.is_file() else None  # a deletion that was cut short
    with xs.CheckpointManager(tmp_path, xs.OneDeviceStrategy(), read_only=True) as reader:
        with pytest.warns(UserWarning, match=r"step 3 .* incomplete"):
            assert reader.all_steps() == [1, 2]
    assert (tmp_path / "3").exists()  # a reader moves nothing
    with pytest.warns(UserWarning, match=r"step 3 .* incomplete.*set aside"):
        manager = xs.CheckpointManager(tmp_path, xs.OneDeviceStrategy())
    with manager:
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        np.testing.assert_array_equal(manager.restore(target=state(0, LEAVES, SIZE))["l000"], 2.25)
    assert not (tmp_path / "3").exists()


def test_a_read_only_manager_refuses_to_save(tmp_path):
    with xs.CheckpointManager(tmp_path, xs.OneDeviceStrategy(), read_only=True) as reader:
        assert reader.latest_step() is None
        with pytest.raises(xs.CheckpointError, match=r"read_only=True"):
            reader.save(1, state(1.0, 1, 4))
    assert not any(tmp_path.iterdir())


EXIT_SECONDS = 60  # a JAX process's start-up on a busy 2-core machine, and its exit


@pytest.mark.parametrize("variant", ["race-clean-up", "beside", "close-first"])
@pytest.mark.parametrize("seed", _kill_cases(1, 10, "run"))
def test_a_retried_save_after_a_full_disk_commits_and_the_process_exits(tmp_path, variant, seed):
    """After a refused asynchronous save, a second manager is opened on the directory
    and the step is retried: the second manager is refused while the first is open, the
    retry commits, and the process exits. `race-clean-up`: the retry's clean-up of the
    failed save fails as when another process removed it first; before the failed save's
    threads were let go, the process never exited."""
    argv = [str(tmp_path)] + ([f"--{variant}"] if variant != "beside" else [])
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tests.workers.disk_full_retry", *argv],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=EXIT_SECONDS,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(f"{variant}: exited after {time.monotonic() - started:.1f} s")
    stages = {r["stage"]: r for r in map(json.loads, done.stdout.splitlines()[:-1])}
    assert "EFBIG" in stages["refused"]["error"]
    assert "the latest complete checkpoint is still step 1" in stages["refused"]["error"]
    if variant == "close-first":
        assert stages["second"]["error"] is None
    else:
        assert "is locked by process" in stages["second"]["error"]
    if variant == "race-clean-up":
        assert "ENOENT" in stages["raced"]["error"]
    assert stages["retried"] == {"stage": "retried", "latest": 2, "intact": True}
