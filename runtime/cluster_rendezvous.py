"""Every worker checks in with the coordinator before JAX's distributed service starts, so
a start-up fault is an `UnavailableError` in every process, within the timeout.

Left to JAX, a start-up fault ends the process from C++: a worker that never starts makes
each started one abort (SIGABRT, DEADLINE_EXCEEDED) after the initialization timeout, and
a coordinator port that another program holds made worker 0 crash with a segmentation
fault within a second (measured with JAX 0.12). So worker 0 first binds the coordinator's
port itself (a port in use is refused here, naming the address) and waits on it for every
other worker to check in, over plain TCP, for at most the timeout. It answers each one
`go` once all are in, or names the missing ones, and then releases the port to JAX. A
worker that cannot reach worker 0 in time, or finds another program on its port, raises
too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

from xla_strategies.core.errors import UnavailableError

_GREETING = b"xla_strategies rendezvous 1\n"
# How long a worker that has checked in waits for worker 0's answer beyond the timeout.
_ANSWER_MARGIN_SECONDS = 5.0
_RETRY_SECONDS = 0.2


def check_in(address: str, process_id: int, num_processes: int, timeout: float) -> None:
    """Meet every worker at `address` (worker 0 listens there) within `timeout` seconds.

    Raises:
        UnavailableError: the port is in use, a worker did not check in, or worker 0
            could not be reached; the message names the address and the missing workers.
    """
    if num_processes <= 1:
        return
    host, _, port = address.rpartition(":")
    where = f"worker {process_id} of {num_processes} could not join the cluster at {address}"
    if process_id == 0:
        _gather(int(port), num_processes, timeout, where)
    else:
        _report(host.strip("[]"), int(port), process_id, num_processes, timeout, where)


def _listen(port: int, where: str) -> socket.socket:
    """The coordinator's port, bound on every interface as JAX's service binds it."""
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as exc:
        raise UnavailableError(
            f"{where}: its port {port} is in use by another program "
            f"({os.strerror(exc.errno) if exc.errno else exc}); free the port or give the "
            "chief another one in TF_CONFIG"
        ) from exc


def _gather(port: int, count: int, timeout: float, where: str) -> None:
    """Worker 0: wait for the other workers' check-ins, then answer them all."""
    deadline = time.monotonic() + timeout
    arrived: dict[int, socket.socket] = {}
    with _listen(port, where) as server:
        try:
            while len(arrived) < count - 1 and time.monotonic() < deadline:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except OSError:  # the timeout
                    continue
                task = _greet(conn, count, deadline)
                if task is None or task in arrived:
                    conn.close()  # not a worker of this cluster, or one already in
                else:
                    arrived[task] = conn
            missing = sorted(set(range(1, count)) - set(arrived))
            answer = f"missing {','.join(map(str, missing))}\n" if missing else "go\n"
            for conn in arrived.values():
                with contextlib.suppress(OSError):
                    conn.sendall(answer.encode())
            for conn in arrived.values():  # let them close first: the port stays free
                with contextlib.suppress(OSError):
                    conn.settimeout(_ANSWER_MARGIN_SECONDS)
                    conn.recv(1)
        finally:
            for conn in arrived.values():
                conn.close()
    if missing:
        raise UnavailableError(f"{where}: {_missing(missing, count, timeout)}")


def _greet(conn: socket.socket, count: int, deadline: float) -> int | None:
    """A new connection's task id, once it has said which it is (None: not a worker of
    this cluster)."""
    try:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        conn.sendall(_GREETING)
    except OSError:
        return None
    words = _line(conn).split()
    if len(words) != 3 or words[0] != "task" or words[2] != str(count) or not words[1].isdigit():
        return None
    task = int(words[1])
    return task if 0 < task < count else None


def _report(host: str, port: int, task: int, count: int, timeout: float, where: str) -> None:
    """Worker `task`: check in with worker 0 and wait for its answer."""
    deadline = time.monotonic() + timeout
    foreign = False  # something answered on the port, but not as worker 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 and foreign:
            raise UnavailableError(
                f"{where}: another program answers on the coordinator's port, not worker 0 "
                "of this cluster; free the port or give the chief another one in TF_CONFIG"
            )
        if left <= 0:
            raise UnavailableError(
                f"{where}: worker 0 (the coordinator) did not answer within {timeout:g} s "
                "(not started, failed, or not reachable from here)"
            )
        try:
            conn = socket.create_connection((host, port), timeout=left)
        except OSError:
            time.sleep(min(_RETRY_SECONDS, max(0.0, left)))
            continue
        with conn:
            if _line(conn) == _GREETING.decode().strip():
                conn.sendall(f"task {task} {count}\n".encode())
                conn.settimeout(timeout + _ANSWER_MARGIN_SECONDS)
                return _answered(_line(conn), count, timeout, where)
            foreign = True
        time.sleep(_RETRY_SECONDS)


def _answered(answer: str, count: int, timeout: float, where: str) -> None:
    """Raise unless worker 0 said `go`."""
    if answer == "go":
        return
    if answer.startswith("missing "):
        missing = [int(w) for w in answer.split()[1].split(",")]
        raise UnavailableError(f"{where}: {_missing(missing, count, timeout)}")
    raise UnavailableError(f"{where}: worker 0 stopped before every worker had checked in")


def _missing(missing: list[int], count: int, timeout: float) -> str:
    names = ", ".join(f"worker {w}" for w in missing)
    return (
        f"{names} of {count} did not check in within {timeout:g} s (not started, failed, "
        "or cannot reach worker 0); start every worker of TF_CONFIG's cluster"
    )


def _line(conn: socket.socket) -> str:
    """One line from `conn` (empty when it closed or timed out first)."""
    data = b""
    with contextlib.suppress(OSError):
        while not data.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip()
