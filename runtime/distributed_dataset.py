"""Distributed datasets: global batches split over the replica axis and prefetched to devices.

A background thread pulls batches from the user's iterable and prepares them on the host
(checks, partial-batch policy); the consuming thread starts their (asynchronous) device
copies `buffer_size` batches ahead of the step, as flax's `prefetch_to_device` does.
Each `iter()` is one pass (epoch) over the dataset.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from xla_strategies.runtime.host_batch import SKIP, HostBatch, prepare
from xla_strategies.runtime.input_options import InputContext, InputOptions
from xla_strategies.runtime.prefetch import EMPTY, Producer

if TYPE_CHECKING:
    from xla_strategies.strategy import Strategy


class DistributedDataset:
    """`strategy.experimental_distribute_dataset(dataset)`: every host reads the same global
    batches and places its own replicas' slices."""

    def __init__(
        self, strategy: Strategy, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> None:
        if not isinstance(dataset, Iterable):
            raise TypeError(f"dataset must be iterable, got {type(dataset).__name__}")
        self._dataset = dataset
        self._options = options or InputOptions()
        self._sharding = NamedSharding(strategy.mesh, strategy.input_spec(True))
        self._divisor = strategy.num_replicas_in_sync

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._dataset, self._options, self._divisor, self._place)

    def _place(self, array: np.ndarray) -> jax.Array:
        if jax.process_count() == 1:
            return jax.device_put(array, self._sharding)
        return jax.make_array_from_callback(array.shape, self._sharding, lambda index: array[index])


class DistributedDatasetFromFunction:
    """`strategy.distribute_datasets_from_function(dataset_fn)`: `dataset_fn` runs once per
    host with its `InputContext` and returns that host's part of each global batch."""

    def __init__(
        self,
        strategy: Strategy,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> None:
        self._context = InputContext(
            num_input_pipelines=jax.process_count(),
            input_pipeline_id=jax.process_index(),
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        self._dataset = dataset_fn(self._context)
        if not isinstance(self._dataset, Iterable):
            raise TypeError(
                f"dataset_fn must return an iterable, got {type(self._dataset).__name__}"
            )
        self._options = options or InputOptions()
        self._sharding = NamedSharding(strategy.mesh, strategy.input_spec(True))

    @property
    def input_context(self) -> InputContext:
        return self._context

    def __iter__(self) -> DistributedIterator:
        ctx = self._context
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return DistributedIterator(self._dataset, self._options, local_replicas, self._place)

    def _place(self, array: np.ndarray) -> jax.Array:
        global_shape = (array.shape[0] * self._context.num_input_pipelines, *array.shape[1:])
        return jax.make_array_from_process_local_data(self._sharding, array, global_shape)


class DistributedIterator:
    """One pass over a distributed dataset. A context manager; `close()` stops its thread.

    `get_state()` / `set_state()` save and restore the position after the last batch this
    iterator returned (not the ones prefetched), so training resumes at the next batch. When
    the dataset's own iterator has `get_state`/`set_state` (grain), its state is used;
    otherwise resuming re-reads the dataset from its start and skips what was consumed.
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        options: InputOptions,
        divisor: int,
        place: Callable[[np.ndarray], jax.Array],
    ) -> None:
        self._dataset, self._options, self._place_array = dataset, options, place
        self._transform = functools.partial(
            _prepare_numbered, divisor=divisor, policy=options.partial_batch
        )
        self._position, self._returned, self._source_state = 0, 0, None
        self._pending: deque[tuple[int, Any, Any]] = deque()
        self._producer: Producer | None = None
        self._source: Iterator[Any] | None = None
        self._exhausted = self._closed = False

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        if self._producer is None and self._source is None:
            self._start()
        if self._options.prefetch_to_device:
            if not self._pending:
                self._fill(block=True)
            if not self._pending:
                self.close()
                raise StopIteration
            position, value, state = self._pending.popleft()
            if isinstance(value, BaseException):  # raised where it happened in the stream
                self.close()
                raise value
            self._fill(block=False)  # start the next batches' device copies now
        else:
            position, host, state = self._next_unprefetched()
            value = self._placed(host)
        self._position, self._source_state = position, state
        self._returned += 1
        return value

    def _start(self) -> None:
        source = iter(self._dataset)
        skip = self._position
        if self._source_state is not None and hasattr(source, "set_state"):
            source.set_state(self._source_state)
            skip = 0
        for _ in range(skip):
            next(source)
        numbered = _numbered(source, self._position)
        if self._options.prefetch_to_device:
            self._producer = Producer(numbered, self._transform, self._options.host_buffer_size)
        else:
            self._source = numbered

    def _fill(self, block: bool) -> None:
        while len(self._pending) < self._options.buffer_size and not self._exhausted:
            try:
                item = self._producer.get(block=block and not self._pending)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as exc:  # kept until the batches before it are consumed
                self._exhausted = True
                self._pending.append((self._position, exc, None))
                return
            if item is EMPTY:
                return
            position, host, state = item
            self._pending.append((position, self._placed(host), state))

    def _next_unprefetched(self) -> tuple[int, HostBatch, Any]:
        for numbered in self._source:
            item = self._transform(numbered)
            if item is not None:
                return item
        self.close()
        raise StopIteration

    def _placed(self, host: HostBatch) -> Any:
        tree = jax.tree.map(self._place_array, host.tree)
        return tree if host.mask is None else (tree, self._place_array(host.mask))

    # state and lifetime

    def get_state(self) -> dict[str, Any]:
        """Where the next batch comes from: a small dict to save with a checkpoint."""
        return {"position": self._position, "batches": self._returned, "source": self._source_state}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume after the batch at which `state` was taken."""
        missing = {"position", "batches", "source"} - set(state)
        if missing:
            raise ValueError(
                f"set_state: the state lacks {sorted(missing)}; pass what get_state() returned"
            )
        self.close()
        self._position, self._returned, self._source_state = (
            state["position"],
            state["batches"],
            state["source"],
        )
        self._producer = self._source = None
        self._exhausted = self._closed = False

    def close(self) -> None:
        """Stop the background thread and drop prefetched batches. Idempotent."""
        self._closed = True
        self._pending.clear()
        if self._producer is not None:
            self._producer.close()

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.close()


def _numbered(source: Iterator[Any], start: int) -> Iterator[tuple[int, Any, Any]]:
    """(position after this item, item, the source's state after it, if it keeps one)."""
    position = start
    for item in source:
        position += 1
        yield position, item, source.get_state() if hasattr(source, "get_state") else None


def _prepare_numbered(numbered: tuple[int, Any, Any], divisor: int, policy: str) -> tuple | None:
    """A module function, not a method: the producer thread must not hold the iterator."""
    position, batch, state = numbered
    host = prepare(batch, divisor, policy, f"dataset element {position - 1}")
    return None if host is SKIP else (position, host, state)
