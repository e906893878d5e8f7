"""`ClusterCoordinator`: schedules functions on the workers, asynchronously.

One dispatcher thread per worker takes closures from a shared queue, runs each on its
worker actor and records the result in the closure's `RemoteValue`. Failures:

- A worker that dies (its actor's process is killed, say) puts its closure back on the
  queue; another worker, or the same one once Ray has restarted it, runs it again. A
  closure may therefore run more than once (at-least-once), but a PS task applies the
  gradients of each step of a closure at most once. After each failure the worker's
  dispatcher waits for Ray to restart it (1 s, doubling); a worker that fails
  `MAX_FAILURES_IN_A_ROW` closures without finishing one is given up, which stderr says;
  with none left, everything fails with `UnavailableError`.
- A lost PS task fails every pending closure with `xs.errors.UnavailableError`, which
  `schedule`, `join` and `fetch` raise from then on.
- An exception raised by a scheduled function comes back from `join` and from its
  `fetch`, with the remote traceback; the closures still queued are cancelled.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from xla_strategies.core.errors import CancelledError, UnavailableError


class WorkerPool(Protocol):
    """What the coordinator needs of its strategy (`ParameterServerStrategy`): its workers,
    started."""

    def start_workers(self) -> list[Any]: ...


class RemoteValue:
    """The future result of a scheduled function."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def fetch(self, timeout: float | None = None) -> Any:
        """Wait for the result; raise the function's error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the scheduled function did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return self._done.is_set()


@dataclass
class _Closure:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    result: RemoteValue = field(default_factory=RemoteValue)
    # Unique across coordinators: the PS tasks outlive a coordinator and deduplicate by it.
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class PerWorkerDataset:
    """`dataset_fn` called on each worker; `iter()` gives a per-worker iterator to pass to
    scheduled functions, which then see that worker's own iterator."""

    _ids = itertools.count()

    def __init__(self, dataset_fn: Callable[[], Iterable[Any]]) -> None:
        self.dataset_fn = dataset_fn
        self.id = f"dataset-{next(self._ids)}"

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self)


class PerWorkerIterator:
    """Stands for each worker's own iterator; a scheduled function that is passed it gets
    the iterator of the worker it runs on. A restarted worker starts its dataset again."""

    _ids = itertools.count()

    def __init__(self, dataset: PerWorkerDataset) -> None:
        self.dataset_fn = dataset.dataset_fn
        self.id = f"{dataset.id}-iterator-{next(self._ids)}"

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "a per-worker iterator is read on the workers: pass it to coordinator.schedule"
        )

    def local(self, worker: Any) -> Any:
        if self.id not in worker.iterators:  # first use, or a restarted worker
            worker.iterators[self.id] = iter(self.dataset_fn())
        return worker.iterators[self.id]


class PerWorkerValues:
    """One value per worker, as `tf.distribute.experimental.coordinator.PerWorkerValues`:
    a scheduled function that is passed it gets the value of the worker it runs on."""

    def __init__(self, values: Sequence[Any]) -> None:
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def local(self, worker: Any) -> Any:
        if not 0 <= worker.index < len(self._values):
            raise IndexError(
                f"PerWorkerValues holds {len(self._values)} values; worker {worker.index} has none"
            )
        return self._values[worker.index]


# A worker that fails this many closures in a row without running one is given up on.
MAX_FAILURES_IN_A_ROW = 7
# After a failure, how long a worker's dispatcher first waits for Ray to restart the worker
# before it hands the worker a closure again; doubled after each failure in a row (1 + 2 +
# ... + 32 s, about a minute, before the seventh). Retried at once, a worker Ray takes a
# few seconds to restart (a loaded machine) failed five closures within a second and was
# given up for good; with 15 s of waits, one restarted beside a busy test suite was given
# up too, and never used again.
RESTART_WAIT_SECONDS = 1.0


class ClusterCoordinator:
    """Schedule functions on `strategy`'s workers. See the module docstring for failures."""

    def __init__(self, strategy: WorkerPool) -> None:
        self.strategy = strategy
        self.workers = strategy.start_workers()
        self._queue: queue.Queue[_Closure | None] = queue.Queue()
        self._lock = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._fatal: BaseException | None = None  # lost PS task, no worker left, shut down
        self._alive = len(self.workers)
        self.completed = 0
        self.retried = 0
        self._threads = [
            threading.Thread(target=self._dispatch, args=(i,), daemon=True, name=f"xs-worker-{i}")
            for i in range(len(self.workers))
        ]
        for thread in self._threads:
            thread.start()

    # the API

    def schedule(
        self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None
    ) -> RemoteValue:
        """Queue `fn(*args, **kwargs)` to run on whichever worker is free."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        with self._lock:
            if self._fatal is not None:
                raise self._fatal
            closure = _Closure(fn, tuple(args), dict(kwargs or {}))
            self._pending += 1
        self._queue.put(closure)
        return closure.result

    def join(self, timeout: float | None = None) -> None:
        """Wait for every scheduled function; raise the first error among them."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(f"scheduled functions still running after {timeout} s")
            error, self._error = self._error, None
        if error is not None:
            raise error
        if self._fatal is not None:
            raise self._fatal

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error)."""
        with self._lock:
            if self._pending:
                return False
        self.join()
        return True

    def create_per_worker_dataset(self, dataset_fn: Callable[[], Iterable[Any]]) -> Any:
        """Each worker calls `dataset_fn()` for its own input."""
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        return PerWorkerDataset(dataset_fn)

    def fetch(self, values: Any) -> Any:
        """`RemoteValue`s (in any pytree) replaced by their results."""
        import jax

        return jax.tree.map(
            lambda v: v.fetch() if isinstance(v, RemoteValue) else v,
            values,
            is_leaf=lambda v: isinstance(v, RemoteValue),
        )

    def shutdown(self) -> None:
        """Stop the dispatchers and the worker actors (the PS tasks stay). Closures that
        have not run fail with `CancelledError`."""
        import ray

        with self._lock:
            self._fatal = self._fatal or CancelledError("the coordinator was shut down")
        for _ in self._threads:
            self._queue.put(None)
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    # dispatching

    def _dispatch(self, index: int) -> None:
        import ray

        failures_in_a_row = 0
        while (closure := self._queue.get()) is not None:
            if self._cancelled(closure):
                continue
            worker = self.workers[index]
            try:
                value = ray.get(
                    worker.run.remote(closure.fn, closure.args, closure.kwargs, closure.id)
                )
            except ray.exceptions.RayActorError as exc:
                if self._cancelled(closure):  # shut down, or the cluster is lost
                    continue
                failures_in_a_row += 1
                with self._lock:
                    self.retried += 1
                self._queue.put(closure)  # at least once: run it again elsewhere
                given_up = failures_in_a_row >= MAX_FAILURES_IN_A_ROW
                if given_up or getattr(exc, "actor_init_failed", False):
                    self._lose_worker(index, exc, failures_in_a_row)
                    return
                time.sleep(RESTART_WAIT_SECONDS * 2 ** (failures_in_a_row - 1))
                continue
            except ray.exceptions.RayTaskError as exc:
                self._fail(closure, exc.as_instanceof_cause())
            except BaseException as exc:  # noqa: BLE001 - unpicklable arguments, Ray errors
                self._fail(closure, exc)
            else:
                self._settle(closure, value=value)
            failures_in_a_row = 0

    def _lose_worker(self, index: int, exc: BaseException, failures: int) -> None:
        """Worker `index` cannot be restarted; with none left, everything fails. Said on
        stderr: the closures go on, on fewer workers."""
        print(
            f"xla_strategies: worker:{index} given up after {failures} failed closures in a "
            f"row ({type(exc).__name__}); the other workers take its closures",
            file=sys.stderr,
            flush=True,
        )
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
            if last:
                self._fatal = self._fatal or UnavailableError(
                    f"every worker task is lost; the last, worker:{index}, with "
                    f"{type(exc).__name__}"
                )
        if last:  # nobody else will drain the queue
            while True:
                try:
                    closure = self._queue.get_nowait()
                except queue.Empty:
                    return
                if closure is not None:
                    self._cancelled(closure)

    def _cancelled(self, closure: _Closure) -> bool:
        with self._lock:
            error = self._fatal or self._error
        if error is None:
            return False
        reason = self._fatal or CancelledError(
            f"cancelled because an earlier function failed: {error}"
        )
        self._settle(closure, error=reason)
        return True

    def _fail(self, closure: _Closure, error: BaseException) -> None:
        with self._lock:
            if isinstance(error, UnavailableError):
                self._fatal = self._fatal or error
            elif self._error is None:
                self._error = error
        self._settle(closure, error=error)

    def _settle(
        self, closure: _Closure, value: Any = None, error: BaseException | None = None
    ) -> None:
        """Give the closure its result (or error); `join` may be waiting for the last."""
        closure.result._set(value, error)
        with self._lock:
            self._pending -= 1
            self.completed += error is None
            self._lock.notify_all()
