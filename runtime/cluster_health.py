"""Which peer workers are alive, so a dead peer is a Python error naming it, never an
abort.

Left to itself, JAX's distributed client ends every survivor (SIGABRT) a few seconds after
the coordination service sees a task die, whatever the survivor is doing then: an
emergency checkpoint is killed half-way. `MultiWorkerMirroredStrategy` starts the cluster
with JAX's recoverable tasks instead, so the survivors live on. A step that fails because
a peer closed its connection raises `UnavailableError`, naming the dead workers where the
coordination service already knows them; the user's handler runs to the end, and the
process exits with the user's status.

The service confirms a death only after its heartbeat timeout
(`CommunicationOptions(timeout_seconds=...)`): its list of live tasks is a barrier that
waits until every live task has asked. A watcher thread asks it continually, so a death
is named on stderr as soon as it is confirmed, and every step after that raises at once.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from xla_strategies.core.errors import UnavailableError

# How long the coordinator lets the service's last shutdown reply travel before it exits.
_REPLY_SECONDS = 0.5
# What a collective says when its peer's process has ended.
_PEER_GONE = ("closed by peer", "reset by peer", "Connection refused", "Broken pipe")
_dead: list[int] = []  # confirmed by the watcher
_lost: list[str] = []  # the collective error of the first step a dead peer failed
_leaving = threading.Event()  # this process is shutting the cluster down: stop watching


def _client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


def _ask_service() -> list[int]:
    """The workers the service does not count as alive (blocks until it can tell)."""
    client = _client()
    if client is None or jax.process_count() == 1:
        return []
    everyone = list(range(jax.process_count()))
    try:
        live = set(client.get_live_nodes(everyone))
    except Exception:  # noqa: BLE001 - the service itself is gone: it runs in worker 0
        return [0]
    return [w for w in everyone if w not in live]


def wait_until_others_left(seconds: float) -> None:
    """At exit: block until the service counts every other worker gone (each has shut its
    client down), asking again for up to `seconds`. One answer is not enough: the
    service's list of live tasks is a barrier, and a peer's watcher may still be inside its
    last call, which completes the barrier with everyone alive. Then a short wait, so the
    service's reply to the last worker's shutdown leaves this process before the process
    (and the service in it) ends; a worker whose reply is lost is aborted by JAX.

    Asked in this thread: Python refuses to start a thread at interpreter shutdown, where
    this runs. Each answer is bounded by the service's heartbeat timeout, after which a
    peer that neither asks nor leaves counts as dead."""
    deadline = time.monotonic() + seconds
    others = set(range(1, jax.process_count()))
    while time.monotonic() < deadline:
        gone = set(_ask_service())
        if others <= gone or 0 in gone:  # 0: the service itself cannot answer
            break
    time.sleep(_REPLY_SECONDS)


def known_dead() -> list[int]:
    """The dead workers the watcher has confirmed (empty while all are alive)."""
    return list(_dead)


def unavailable(cause: BaseException | None = None) -> UnavailableError | None:
    """The error for a step once a peer worker is gone: one the watcher confirmed, or one
    whose connection `cause` (the step's own failure) says closed. None otherwise."""
    if cause is None:
        dead = known_dead()
        if not dead and not _lost:
            return None
    elif _dead or any(s in str(cause) for s in _PEER_GONE):
        # Named only if the watcher already knows: the service confirms a death only after
        # its heartbeat timeout, and the user's handler (an emergency save before a
        # preemption ends the process) must not wait for that.
        dead = known_dead()
        _lost.append(str(cause).splitlines()[0])
    else:
        return None
    _record_exit_status()  # the process now ends through `exit_if_peer_lost`
    who = _who(dead) if dead else "a peer worker (which one, the service has not yet confirmed)"
    why = f" ({_lost[0]})" if _lost else ""
    return UnavailableError(
        f"{who} of {jax.process_count()} stopped (died or was preempted), so this step "
        f"cannot run{why}. This process keeps running: save what you need, exit, and "
        "restart every worker to resume from the last checkpoint"
    )


def dispatched(run: Callable[[], Any], complete: bool) -> Any:
    """`run()` (one step's dispatch), its outputs waited for when `complete`; a failure
    because a peer worker died is an `UnavailableError` naming it."""
    try:
        outputs = run()
        if complete:
            wait_for(outputs)
        return outputs
    except jax.errors.JaxRuntimeError as exc:
        gone = unavailable(exc)
        if gone is None:
            raise
        raise gone from exc


def wait_for(outputs: Any) -> None:
    """Block until a step's `outputs` are computed, raising their error. A collective
    whose peer died may never return (gloo waits on a rank that will not come): once the
    watcher confirms a death, this raises `UnavailableError` while it still waits."""
    done = concurrent.futures.Future()
    _in_thread(lambda: jax.block_until_ready(outputs), done)
    while True:
        try:
            done.result(timeout=0.2)
            return
        except concurrent.futures.TimeoutError:
            if _dead:
                _stuck.append(done)
                raise unavailable() from None


# Steps whose collective never returned. Such a collective cannot be cancelled, and the
# runtime's teardown at exit would end the process with std::terminate.
_stuck: list[concurrent.futures.Future] = []
_exit_status: list[Any] = []


def _record_exit_status() -> None:
    """Remember the status `sys.exit` is called with from now on."""
    if getattr(sys.exit, "_records_status", False):
        return
    original = sys.exit

    def exit_recording(status: Any = None) -> None:
        _exit_status.append(status)
        original(status)

    exit_recording._records_status = True  # type: ignore[attr-defined]
    sys.exit = exit_recording


def exit_if_peer_lost() -> None:
    """At exit, once a peer worker has died: flush and end the process now, with the
    status given to `sys.exit` (1 after an uncaught exception). The runtime's teardown is
    not safe then: a collective may still be stuck on the dead peer, and a thread still
    inside a call to the coordination service (asking which peer died) is ended by Python's
    finalization mid-call, which aborts the process (std::terminate, SIGABRT), under load
    even after the user's handler has finished."""
    if not (_dead or _lost or any(not f.done() for f in _stuck)):
        return
    status = _exit_status[-1] if _exit_status else (1 if _uncaught() else 0)
    if status is None:
        status = 0
    elif not isinstance(status, int):  # sys.exit("message"), as Python prints it
        print(status, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _uncaught() -> bool:
    return getattr(sys, "last_exc", None) is not None or hasattr(sys, "last_value")


def _in_thread(fn: Callable[[], Any], done: concurrent.futures.Future) -> None:
    """`fn()` in a daemon thread (one that never returns must not hold up the exit)."""

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            done.set_exception(exc)

    threading.Thread(target=run, name="xla_strategies step wait", daemon=True).start()


def _who(dead: list[int]) -> str:
    return ", ".join(f"worker {w}" for w in dead)


def start_watching() -> None:
    """Start the thread that names a dead peer on stderr once the service confirms it."""
    threading.Thread(target=_watch, name="xla_strategies cluster health", daemon=True).start()


def stop_watching() -> None:
    """This process is leaving the cluster: peers that leave now are not deaths."""
    _leaving.set()


def _watch() -> None:
    while not _leaving.wait(1.0):
        dead = _ask_service()
        if dead and not _leaving.is_set():
            _dead.extend(dead)
            print(
                f"xla_strategies: {_who(dead)} of {jax.process_count()} stopped (died or "
                "was preempted); this process keeps running, and its next step raises "
                "xs.errors.UnavailableError",
                file=sys.stderr,
                flush=True,
            )
            return
