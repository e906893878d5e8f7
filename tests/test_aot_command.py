"""`xla-strategies aot` cannot hang or lie: a time limit, no orphaned script, no summary
from an earlier run or of a step that is not a TPU one, and `python -c` programs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")

REPO = Path(__file__).resolve().parents[1]

_TPU_STEP = textwrap.dedent(
    """
    import jax.numpy as jnp, numpy as np
    import xla_strategies as xs
    strategy = xs.{strategy}
    step = strategy.compile(lambda w, x: w - 0.1 * jnp.mean(x) * w)
    batches = strategy.experimental_distribute_dataset([np.ones((8, 4), np.float32)])
    step(strategy.replicate(np.ones(4, np.float32)), next(iter(batches)))
    """
)


def _aot_command(out: Path, *command: str, timeout_s: str = "240") -> list[str]:
    return [
        sys.executable, "-m", "xla_strategies.cli.main", "aot", "--topology", "v5e-4",
        "--out", str(out), "--timeout", timeout_s, "--", *command,
    ]  # fmt: skip


def _aot(out: Path, *command: str, timeout_s: str = "240") -> subprocess.CompletedProcess:
    return subprocess.run(
        _aot_command(out, *command, timeout_s=timeout_s),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_aot_runs_python_dash_c_and_does_not_reprint_an_earlier_runs_summary(tmp_path):
    out = tmp_path / "aot"
    code = _TPU_STEP.format(strategy='TPUStrategy("v5e-4")')
    first = _aot(out, "python", "-c", code)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step <lambda> on v5e-4" in first.stdout
    assert "XLA compiling for v5e-4" in first.stderr  # progress while it compiles
    # the releases that compiled it and the tuned XLA options baked into it, recorded
    assert "compiler          jax " in first.stdout and "libtpu 0.0." in first.stdout
    assert "estimate          uncalibrated: v5e's datasheet rates" in first.stdout
    failed = _aot(out, "python", "-c", "raise SystemExit(3)")
    assert failed.returncode == 3
    assert "memory per chip" not in failed.stdout, failed.stdout


def test_aot_says_when_the_script_compiled_no_tpu_step(tmp_path):
    done = _aot(tmp_path / "aot", "python", "-c", _TPU_STEP.format(strategy="MirroredStrategy()"))
    assert done.returncode == 1
    assert "compiled no TPU step (it compiled <lambda> for cpu)" in done.stderr
    assert "memory per chip" not in done.stdout


def test_aot_stops_a_script_that_never_compiles_within_its_timeout(tmp_path):
    started = time.monotonic()
    done = _aot(tmp_path / "aot", "python", "-c", "while True: pass", timeout_s="3")
    assert done.returncode == 124
    assert "did not finish within --timeout 3 s" in done.stderr
    assert time.monotonic() - started < 60


def _aot_beside_a_sleeping_script(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """`aot` running a script that sleeps, and the script's process id."""
    marker = tmp_path / "pid"
    script = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    aot = subprocess.Popen(
        _aot_command(tmp_path / "aot", "python", "-c", script),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline and aot.poll() is None, "the script never started"
        time.sleep(0.2)
    return aot, int(marker.read_text())


def _gone_within(pid: int, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_sigterm_to_aot_ends_the_users_script_too(tmp_path):
    aot, script_pid = _aot_beside_a_sleeping_script(tmp_path)
    aot.send_signal(signal.SIGTERM)
    assert aot.wait(timeout=60) == 128 + signal.SIGTERM
    _gone_within(script_pid, 30, "the user's script outlived aot")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = (
        Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
    )
    return state not in ("Z", "X")  # a zombie has ended


def test_aot_says_when_the_script_compiled_nothing_at_all(tmp_path):
    done = _aot(tmp_path / "aot", "python", "-c", "print('no step here')")
    assert done.returncode == 1
    assert "the script compiled no TPU step; for v5e-4 it must build" in done.stderr, done.stderr
    assert "not a directory" not in done.stderr


def test_aot_says_what_the_script_is_doing_while_it_waits(tmp_path):
    command = _aot_command(tmp_path / "aot", "python", "-c", "import time; time.sleep(4)")
    command[command.index("--timeout") : command.index("--timeout")] = ["--progress-every", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "xla-strategies aot: still running after 1 s of --timeout 240 s" in done.stderr
    assert "last: no step has started compiling yet" in done.stderr, done.stderr


def test_sigkill_to_aot_ends_the_users_script_too(tmp_path):
    """A SIGKILL cannot be caught: the kernel ends the script when aot dies."""
    aot, script_pid = _aot_beside_a_sleeping_script(tmp_path)
    aot.kill()
    aot.wait(timeout=60)
    _gone_within(script_pid, 30, "the user's script outlived a SIGKILLed aot")


def test_python_dash_m_runs_the_command_line_by_either_name():
    for module in ("xla_strategies", "xla_strategies.cli"):
        done = subprocess.run(
            [sys.executable, "-m", module, "report", "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "--logical-devices-per-replica" in done.stdout
