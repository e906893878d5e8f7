"""The background threads of a failed asynchronous save, let go so the process can exit.

Orbax runs an asynchronous save as threads that wait for each other's signals (the
directory is created, the arrays are written, ...). When one of them fails early, the
others wait on for a signal that never comes, as long as orbax's save timeout (ten
minutes), and they are not daemon threads: the process could not exit. Measured with
orbax 0.12: a retried save whose temporary directory another process's clean-up deleted
left four such threads. Once the failure has been raised, each thread of that save (by
orbax's operation id) is cancelled and given the signals it waits for, so it returns
without running its part.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable

# How long the failed save's threads get to return once released.
_RELEASE_SECONDS = 5.0


def running() -> set[threading.Thread]:
    """The threads alive now (taken before a save, to know which ones it started)."""
    return set(threading.enumerate())


def current_operation() -> str | None:
    """Orbax's id of the latest save started in this process (None: an orbax without)."""
    try:
        from orbax.checkpoint._src.futures import synchronization
    except ImportError:
        return None
    return synchronization.OperationIdGenerator.get_current_operation_id()


def release(before: Iterable[threading.Thread], operation: str | None) -> None:
    """Cancel and unblock the orbax signalling threads of save `operation` (any save,
    when None) started since `before`; another manager's save goes on."""
    try:
        from orbax.checkpoint._src.futures import future
    except ImportError:  # an orbax without signalling threads: nothing waits on a signal
        return
    known = set(before)
    waiting = [
        t
        for t in threading.enumerate()
        if t not in known
        and hasattr(t, "cancel")
        and hasattr(t, "_receive_signals")
        and operation in (None, getattr(t, "_operation_id", None))
    ]
    for thread in waiting:
        thread.cancel()
        with contextlib.suppress(Exception):  # the signals are for this save alone
            future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
    deadline = time.monotonic() + _RELEASE_SECONDS
    for thread in waiting:
        # Thread.join itself: orbax's join raises for a cancelled thread
        threading.Thread.join(thread, timeout=max(0.0, deadline - time.monotonic()))
