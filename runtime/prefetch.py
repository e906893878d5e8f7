"""A background producer: a daemon thread fills a bounded queue from an iterator.

The thread holds no reference to its owner, so an abandoned iterator is garbage collected
and its `close()` (from `__del__`) stops the thread. An exception in the producer is passed
through the queue and re-raised in the consumer with its original traceback.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_END = object()
_POLL_SECONDS = 0.05


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Producer:
    """Runs `transform` over `source` on a daemon thread, `size` results ahead."""

    def __init__(self, source: Iterator[Any], transform: Callable[[Any], Any], size: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce,
            args=(source, transform, self._queue, self._stop),
            name="xla_strategies-input",
            daemon=True,
        )
        self._thread.start()

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

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread. It finishes at most the item its source is producing."""
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a producer waiting for room in the queue
                self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                pass
            self._thread.join(timeout=_POLL_SECONDS)
            timeout -= _POLL_SECONDS
            if timeout <= 0:
                break
        try:  # wake a next stage blocked on `get`: nothing more is coming
            self._queue.put_nowait(_END)
        except queue.Full:
            pass


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
