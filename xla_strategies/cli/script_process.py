"""The user's script as a process the command line owns: a process group of its own,
ended with the command (SIGTERM, SIGINT, its timeout, and on Linux the command's own
SIGKILL), and a heartbeat while it runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any


def run_owned(
    command: list[str],
    env: dict[str, str],
    timeout: float | None,
    heartbeat: tuple[float, Any] | None = None,
) -> int | None:
    """Run `command` in a process group of its own and wait; None after `timeout` s. A
    SIGTERM or SIGINT to this process ends the group too (SIGKILL 10 s later if it is still
    there), then exits with 128 + the signal, so nothing is orphaned; on Linux the script
    is also killed when this process dies of a SIGKILL. `heartbeat`, `(seconds, call)`:
    `call(elapsed)` every that many seconds while the script runs."""
    child = subprocess.Popen(
        command, env=env, start_new_session=True, preexec_fn=_dies_with(os.getpid())
    )
    every, beat = heartbeat if heartbeat is not None else (float("inf"), None)
    started = time.monotonic()
    next_beat = started + every
    signalled: list[int] = []

    def end_group(signum: int, _frame: Any) -> None:
        signalled.append(signum)
        _signal_group(child, signal.SIGTERM)

    previous = {sig: signal.signal(sig, end_group) for sig in (signal.SIGTERM, signal.SIGINT)}
    deadline = None if timeout is None else time.monotonic() + timeout
    killed_at = None
    try:
        while (returncode := _poll(child, 0.2)) is None:
            now = time.monotonic()
            if beat is not None and now >= next_beat:
                beat(now - started)
                next_beat = now + every
            if signalled and killed_at is None:
                killed_at = now + 10
            if deadline is not None and now > deadline and killed_at is None:
                _signal_group(child, signal.SIGTERM)
                killed_at = now + 10
            if killed_at is not None and now > killed_at:
                _signal_group(child, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signalled:
        raise SystemExit(128 + signalled[0])
    return None if killed_at is not None else returncode


def _dies_with(parent: int) -> Any:
    """A `preexec_fn` that has the kernel SIGKILL the script when `parent` (this process)
    dies, however it dies (`prctl(PR_SET_PDEATHSIG)`; Linux only, elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return None

    def arm() -> None:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the line above ran
            os._exit(1)

    return arm


def _poll(child: subprocess.Popen, seconds: float) -> int | None:
    try:
        return child.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _signal_group(child: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signum)
