"""A background producer: a daemon thread fills a bounded queue from an iterator.

The thread holds no reference to its owner, so an abandoned iterator is garbage collected
and its `stop()` (from `__del__`) stops the thread without waiting for it. At exit every
producer still running is stopped and waited for (a few seconds in all): a thread still
inside JAX when the interpreter finalizes aborts the process. An exception in the
producer is passed through the queue and re-raised in the consumer with its original
traceback.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_END = object()
_POLL_SECONDS = 0.05
#: how long the exit waits, in all, for the input threads still running
_EXIT_SECONDS = 5.0
# Every running input thread and its producer, held here (the producers, not their
# owners): the exit must stop and wait for the thread of an abandoned one too.
_threads: dict[threading.Thread, Producer] = {}


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Producer:
    """Runs `transform` over `source` on a daemon thread, `size` results ahead."""

    def __init__(
        self,
        source: Iterator[Any],
        transform: Callable[[Any], Any],
        size: int,
        stop: threading.Event | None = None,
    ) -> None:
        """`stop`: the event that stops the thread, for a source that waits on it too."""
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self._stop = stop if stop is not None else threading.Event()
        self._thread = threading.Thread(
            target=_produce,
            args=(source, transform, self._queue, self._stop),
            name="xla_strategies-input",
            daemon=True,
        )
        self._thread.start()
        for ended in [t for t in _threads if not t.is_alive()]:
            del _threads[ended]
        _threads[self._thread] = self

    def get(self) -> Any:
        """The next result; raises StopIteration at the end, or the producer's exception."""
        item = self._queue.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failure):
            note = "raised in the input pipeline's background thread"
            if note not in getattr(item.exc, "__notes__", ()):
                item.exc.add_note(note)
            raise item.exc
        return item

    def results(self) -> Iterator[Any]:
        """Iterate over the results, e.g. as the source of a next stage."""
        while True:
            try:
                yield self.get()
            except StopIteration:
                return

    def stop(self) -> None:
        """Ask the thread to stop, without waiting for it: the thread may be inside a
        blocking call (a read that waits on a dead peer worker), and a finalizer or an
        exception on its way to the user's handler must not wait with it."""
        self._stop.set()
        self._wake_next_stage()

    def _wake_next_stage(self) -> None:
        """Wake a next stage blocked on `get`: nothing more is coming."""
        try:
            self._queue.put_nowait(_END)
        except queue.Full:  # a full queue: the next stage is not waiting on it
            pass

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a stopped thread to end."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:  # unblock a producer waiting for room in the queue
                self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                pass
            self._thread.join(timeout=_POLL_SECONDS)
        self._wake_next_stage()


def stop_all(producers: list[Producer], timeout: float) -> None:
    """Stop `producers` (upstream first, so each next stage sees its end), then wait up
    to `timeout` seconds in all for their threads. Each finishes at most the item its
    source is producing."""
    for producer in producers:
        producer.stop()
    deadline = time.monotonic() + timeout
    for producer in producers:
        producer.join(max(0.0, deadline - time.monotonic()))


@atexit.register
def _stop_at_exit() -> None:
    """Stop every input thread, then wait for them: one left inside a JAX call (a
    transfer to the device) while the interpreter finalizes aborts the process
    (std::terminate), after a preemption's save had succeeded."""
    stop_all(list(_threads.values()), _EXIT_SECONDS)


def _produce(
    source: Iterator[Any], transform: Callable[[Any], Any], out: queue.Queue, stop: threading.Event
) -> None:
    try:
        for raw in source:
            if stop.is_set():
                return
            item = transform(raw)
            if item is not None and not _put(out, item, stop):
                return
        _put(out, _END, stop)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        _put(out, _Failure(exc), stop)


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False
