"""Running N worker processes on loopback, each with its own TF_CONFIG, for tests.

Joins them with a timeout, hands back each one's exit code and output, and can kill a
chosen worker when it reports a chosen step (a line `STEP <n>` on its output).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).parents[1]


@dataclass
class Worker:
    index: int
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    killed_at: int | str | None = None
    killed_time: float | None = None  # time.time() of the kill

    @property
    def output(self) -> str:
        return "".join(self.lines)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def tf_configs(count: int) -> list[str]:
    """One TF_CONFIG per worker: a cluster of `count` workers on loopback."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(count)]
    return [
        json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}})
        for i in range(count)
    ]


# What a worker prints when another program took its cluster's port first: the ports
# `tf_configs` picks are free when picked, and a busy test run may take one before the
# workers bind it
PORT_TAKEN = "free the port or give the chief another one in TF_CONFIG"
PORT_ATTEMPTS = 3


def run_workers(
    argv: list[str],
    count: int = 2,
    timeout: float = 240,
    kill: tuple[int, int | str] | None = None,
    start: list[int] | None = None,
    kill_signal: int = signal.SIGKILL,
    configs: list[str] | None = None,
) -> list[Worker]:
    """Run `python argv...` as `count` workers (only those in `start`, if given); send
    `kill_signal` to worker `kill[0]` when it prints `STEP kill[1]` (or the line
    `kill[1]`, a string). Returns when all have exited. Without `configs` (their
    TF_CONFIGs), the workers run on fresh loopback ports, and again on others, up to
    `PORT_ATTEMPTS` times, where another program took a port first."""
    for _ in range(1 if configs else PORT_ATTEMPTS):
        workers = _run(argv, configs or tf_configs(count), timeout, kill, start, kill_signal)
        if not any(PORT_TAKEN in w.output for w in workers):
            break
    return workers


def _run(
    argv: list[str],
    configs: list[str],
    timeout: float,
    kill: tuple[int, int | str] | None,
    start: list[int] | None,
    kill_signal: int,
) -> list[Worker]:
    workers = []
    for index in start if start is not None else range(len(configs)):
        env = {**os.environ, "TF_CONFIG": configs[index], "JAX_PLATFORMS": "cpu"}
        process = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        workers.append(Worker(index, process))
    readers = [
        threading.Thread(target=_read, args=(w, kill, kill_signal), daemon=True) for w in workers
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in workers:
                other.process.kill()
            outputs = "\n".join(f"--- worker {w.index}\n{w.output[-3000:]}" for w in workers)
            raise TimeoutError(f"workers did not finish within {timeout} s\n{outputs}") from None
    for reader in readers:
        reader.join(timeout=5)
    return workers


def _read(worker: Worker, kill: tuple[int, int | str] | None, kill_signal: int) -> None:
    if kill:
        signal_line = kill[1] if isinstance(kill[1], str) else f"STEP {kill[1]}"
    for line in worker.process.stdout:
        worker.lines.append(line)
        if kill and worker.index == kill[0] and line.strip() == signal_line:
            os.kill(worker.process.pid, kill_signal)
            worker.killed_at, worker.killed_time = kill[1], time.time()


def check(workers: list[Worker]) -> None:
    """Raise with every failed worker's output."""
    failed = [w for w in workers if w.process.returncode != 0]
    if failed:
        text = "\n".join(
            f"--- worker {w.index} (exit {w.process.returncode})\n{w.output[-4000:]}"
            for w in failed
        )
        raise AssertionError(f"{len(failed)} worker(s) failed:\n{text}")
