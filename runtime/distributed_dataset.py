"""Distributed datasets: global batches split over the replica axis and prefetched to devices.

A background thread pulls batches from the user's iterable and prepares them on the host
(checks, partial-batch policy); with `prefetch_to_device`, a second one copies them to the
devices `buffer_size` batches ahead of the step (`DistributedIterator`). Each `iter()` is
one pass (epoch) over the dataset.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from xla_strategies.core.errors import OutOfRangeError
from xla_strategies.core.trees import abstract_like
from xla_strategies.runtime.host_batch import SKIP, HostBatch, prepare
from xla_strategies.runtime.input_agreement import agreed, host_shapes
from xla_strategies.runtime.input_options import InputContext, InputOptions, InputReplicationMode
from xla_strategies.runtime.prefetch import Producer, stop_all

if TYPE_CHECKING:
    from xla_strategies.core.strategy_like import StrategyLike


class DistributedDataset:
    """`strategy.experimental_distribute_dataset(dataset)`: every host reads the same global
    batches and places its own replicas' slices."""

    def __init__(
        self, strategy: StrategyLike, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> None:
        if not isinstance(dataset, Iterable):
            raise TypeError(f"dataset must be iterable, got {type(dataset).__name__}")
        self._dataset = dataset
        self._options = options or InputOptions()
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise ValueError(
                "InputReplicationMode.PER_REPLICA needs a function to call per replica: use "
                "strategy.distribute_datasets_from_function(dataset_fn, options)"
            )
        self._sharding = NamedSharding(strategy.mesh, strategy.input_spec(True))
        self._divisor = strategy.num_replicas_in_sync
        self._abstract = strategy.compile_only

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._dataset, self._options, self._divisor, self._place)

    def _place(self, array: np.ndarray) -> jax.Array | jax.ShapeDtypeStruct:
        if self._abstract:  # a compile-only strategy's batches are abstract
            return abstract_like(array, self._sharding)
        if jax.process_count() == 1:
            return jax.device_put(array, self._sharding)
        return jax.make_array_from_callback(array.shape, self._sharding, lambda index: array[index])


class DistributedDatasetFromFunction(DistributedDataset):
    """`strategy.distribute_datasets_from_function(dataset_fn)`: `dataset_fn` runs once per
    host with its `InputContext` and returns that host's part of each global batch. With
    `InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)` it runs
    once per local replica instead, with that replica as its input pipeline, and returns
    that replica's part; the host's part is the replicas' parts in replica order."""

    def __init__(
        self,
        strategy: StrategyLike,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> None:
        self._options = options or InputOptions()
        self._context = InputContext(
            num_input_pipelines=jax.process_count(),
            input_pipeline_id=jax.process_index(),
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            self._dataset = _per_replica_datasets(strategy, dataset_fn)
        else:
            self._dataset = _called(dataset_fn, self._context)
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


def _called(dataset_fn: Callable[[InputContext], Iterable[Any]], context: InputContext) -> Any:
    dataset = dataset_fn(context)
    if not isinstance(dataset, Iterable):
        raise TypeError(f"dataset_fn must return an iterable, got {type(dataset).__name__}")
    return dataset


class _Concatenated:
    """The local replicas' datasets as one: each element is their elements concatenated
    on axis 0, in replica order (a host's part of a global batch)."""

    def __init__(self, datasets: list[Iterable[Any]]) -> None:
        self._datasets = datasets

    def __iter__(self) -> Iterator[Any]:
        for parts in zip(*self._datasets, strict=False):
            yield jax.tree.map(
                lambda *leaves: np.concatenate([np.asarray(x) for x in leaves]), *parts
            )


def _per_replica_datasets(strategy: StrategyLike, dataset_fn: Callable[..., Any]) -> _Concatenated:
    """`dataset_fn` once per local replica, each replica its own input pipeline."""
    n = strategy.num_replicas_in_sync
    local = [i for i, d in enumerate(strategy.devices) if d.process_index == jax.process_index()]
    return _Concatenated([_called(dataset_fn, InputContext(n, i, n)) for i in local])


class DistributedIterator:
    """One pass over a distributed dataset. A context manager; `close()` stops its threads.

    With `prefetch_to_device`, two background threads run ahead of the step, as in grain's
    two-stage device_put: one prepares batches on the host (`host_buffer_size` ahead), the
    other copies them to the devices (`buffer_size` ahead).

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
        self._dataset, self._options = dataset, options
        self._prepare = functools.partial(
            _prepare_numbered, divisor=divisor, policy=options.partial_batch
        )
        self._place = functools.partial(_place_numbered, place=place)
        self._position, self._returned, self._source_state = 0, 0, None
        self._stages: list[Producer] = []
        self._source: Iterator[Any] | None = None
        self._closed = False
        self._peeked: tuple[int, Any, Any] | None = None

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        position, value, state = self._peek()
        self._peeked = None
        self._position, self._source_state = position, state
        self._returned += 1
        return value

    def _peek(self) -> tuple[int, Any, Any]:
        """The next (position, batch, source state), fetched once and kept until returned."""
        if self._peeked is not None:
            return self._peeked
        if self._closed:
            raise StopIteration
        if not self._stages and self._source is None:
            self._start()
        try:
            if self._stages:
                self._peeked = self._stages[-1].get()
            else:
                self._peeked = self._place(self._next_prepared())
        except BaseException:
            self.close()
            raise
        return self._peeked

    # tf.distribute's iterator API

    def get_next(self) -> Any:
        """The next batch; at the end `xs.errors.OutOfRangeError`, as in tf.distribute."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError("End of sequence: the distributed dataset is exhausted") from None

    def get_next_as_optional(self) -> OptionalValue:
        """The next batch in an `OptionalValue`, empty at the end (never raises there)."""
        try:
            return OptionalValue(next(self), True)
        except StopIteration:
            return OptionalValue(None, False)

    @property
    def element_spec(self) -> Any:
        """The next batch's structure as `jax.ShapeDtypeStruct`s with their shardings
        (global shapes; with `partial_batch="pad"`, a `(batch, mask)` pair). Fetches the
        next batch if needed, which the next `get_next` then returns."""
        batch = self._peek()[1]
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), batch
        )

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
            host = Producer(numbered, self._prepare, self._options.host_buffer_size)
            stop = threading.Event()  # the device stage's: it ends a wait for the peers too
            prepared = agreed(host.results(), host_shapes, stop=stop)
            device = Producer(prepared, self._place, self._options.buffer_size, stop=stop)
            self._stages = [host, device]
        else:
            prepared = (item for item in map(self._prepare, numbered) if item is not None)
            self._source = agreed(prepared, host_shapes)

    def _next_prepared(self) -> tuple[int, HostBatch, Any]:
        for item in self._source:
            return item
        raise StopIteration

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
        self._position, self._returned = state["position"], state["batches"]
        self._source_state = state["source"]
        self._stages, self._source, self._closed = [], None, False
        self._peeked = None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background threads, waiting up to `timeout` seconds in all for them,
        and drop prefetched batches. Idempotent."""
        self._closed, self._peeked = True, None
        stop_all(self._stages, timeout)

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # Never waits: an iterator dropped by an exception (a step that met a dead peer)
        # is collected on the way to the user's handler, while its input thread may still
        # wait on that peer to agree on the next batch.
        try:
            for stage in getattr(self, "_stages", []):
                stage.stop()
        except Exception:  # noqa: BLE001 - at interpreter exit the modules may be gone
            pass


class OptionalValue:
    """A value or nothing, as `tf.experimental.Optional` (what `get_next_as_optional`
    returns): `has_value()`, then `get_value()`."""

    def __init__(self, value: Any, present: bool) -> None:
        self._value, self._present = value, present

    def has_value(self) -> bool:
        return self._present

    def get_value(self) -> Any:
        if not self._present:
            raise ValueError("get_value(): this optional is empty (the iterator is exhausted)")
        return self._value

    def __repr__(self) -> str:
        return f"OptionalValue({'a value' if self._present else 'empty'})"


def _numbered(source: Iterator[Any], start: int) -> Iterator[tuple[int, Any, Any]]:
    """(position after this item, item, the source's state after it, if it keeps one)."""
    position = start
    for item in source:
        position += 1
        yield position, item, source.get_state() if hasattr(source, "get_state") else None


def _place_numbered(
    item: tuple[int, HostBatch, Any], place: Callable[[np.ndarray], jax.Array]
) -> tuple:
    """Start the device copies of one prepared batch (and its mask)."""
    position, host, state = item
    tree = jax.tree.map(place, host.tree)
    return position, tree if host.mask is None else (tree, place(host.mask)), state


def _prepare_numbered(numbered: tuple[int, Any, Any], divisor: int, policy: str) -> tuple | None:
    """A module function, not a method: the producer thread must not hold the iterator."""
    position, batch, state = numbered
    host = prepare(batch, divisor, policy, f"dataset element {position - 1}")
    return None if host is SKIP else (position, host, state)
