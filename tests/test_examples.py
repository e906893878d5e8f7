"""examples/train_mlp.py with --checkpoint-dir: a second run resumes from the first's last
checkpoint; a SIGTERM saves and exits with the preemption code."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import xla_strategies as xs

ROOT = Path(__file__).parents[1]


def _train(tmp_path, steps):
    argv = [sys.executable, "examples/train_mlp.py", "--steps", str(steps), "--save-every", "10"]
    return subprocess.Popen(
        [*argv, "--checkpoint-dir", str(tmp_path / "ckpt")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_train_mlp_resumes_and_saves_on_sigterm(tmp_path):
    first = _train(tmp_path, 20)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0 and "starting at step 0" in out, out[-3000:]

    second = _train(tmp_path, 100_000)  # long enough to be interrupted
    lines = iter(second.stdout.readline, "")
    started = next((line for line in lines if line.startswith("starting at step")), "")
    assert started.strip() == "starting at step 20"
    time.sleep(3)
    second.send_signal(signal.SIGTERM)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == xs.PREEMPTION_EXIT_CODE, out[-3000:]
    with xs.CheckpointManager(tmp_path / "ckpt", xs.OneDeviceStrategy()) as manager:
        assert manager.latest_step() > 20  # the step in flight was saved
