"""Workers agree on every batch before it is placed: the same shapes, and the same end.

A global batch is assembled from every worker's part, in a collective that each worker
enters for itself. Workers whose datasets differ in length would leave one of them
waiting in that collective for a batch that never comes (a hang), and parts of different
sizes would make a global batch of a shape nobody asked for. So before each batch is
placed, each worker publishes its part's shapes (or that its data has ended) in the
cluster's key-value store and reads everyone else's:

- someone's data has ended: the epoch ends on every worker, at the same batch (the
  iterator stops; `get_next` raises `OutOfRangeError`), and each worker's surplus is said
  on stderr;
- the shapes differ: a `ValueError` on every worker naming each worker's shapes.

The store is JAX's distributed one, not a device collective, so the input threads never
race the step's collectives. Keys of finished batches are deleted as the epoch goes.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from xla_strategies.core.errors import UnavailableError
from xla_strategies.runtime import cluster_health

_END = "end"
_POLL_SECONDS = 1.0  # how often a wait for a peer's batch checks that the peer lives
_iterators = itertools.count()  # every worker makes its iterators in the same order


def agreed(
    items: Iterator[Any],
    shapes_of: Any,
    timeout_s: float = 600.0,
    stop: threading.Event | None = None,
) -> Iterator[Any]:
    """`items` (one worker's prepared batches), stopped where any worker's end is, and
    checked to have every worker's shapes; a single process is passed through. `stop`:
    once set, a wait for the other workers ends the epoch here (the input is closing)."""
    if jax.process_count() == 1:
        yield from items
        return
    from jax._src import distributed

    client = distributed.global_state.client
    prefix = f"xla_strategies/input/{next(_iterators)}"
    me, count = jax.process_index(), jax.process_count()
    for index in itertools.count():
        item = next(items, None)
        mine = _END if item is None else json.dumps(shapes_of(item))
        client.key_value_set(f"{prefix}/{index}/{me}", mine)
        theirs = [_read(client, f"{prefix}/{index}/{w}", timeout_s, w, stop) for w in range(count)]
        if stop is not None and stop.is_set():
            return  # the input is closing: no batch is waited for
        if index >= 2:  # every worker has read batch index - 2: it published index - 1
            client.key_value_delete(f"{prefix}/{index - 2}/{me}")
        if _END in theirs:
            if item is not None:
                ended = [w for w, t in enumerate(theirs) if t == _END]
                print(
                    f"xla_strategies: the epoch ends at batch {index} on every worker: the data "
                    f"of worker(s) {ended} ended there; this worker's remaining batches are "
                    "not used",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if len(set(theirs)) > 1:
            shown = "; ".join(f"worker {w}: {t}" for w, t in enumerate(theirs))
            raise ValueError(
                f"the workers' parts of batch {index} differ in shape ({shown}); each worker "
                "must give the same number of rows (the global batch size over the workers, "
                "InputContext.get_per_host_batch_size)"
            )
        yield item


def _read(
    client: Any, key: str, timeout_s: float, worker: int, stop: threading.Event | None
) -> str:
    """`key`'s value, waited for in short reads: between them, a peer the cluster's
    watcher has found dead ends the wait at once (the dead peer never publishes), and so
    does `stop` (nothing waits for the batch any more)."""
    deadline = time.monotonic() + timeout_s
    while stop is None or not stop.is_set():
        wait = max(0.001, min(_POLL_SECONDS, deadline - time.monotonic()))
        try:
            return client.blocking_key_value_get(key, int(wait * 1000))
        except Exception as exc:  # noqa: BLE001 - DEADLINE_EXCEEDED, or the store is gone
            if (gone := cluster_health.unavailable()) is not None:
                raise gone from None
            if "DEADLINE_EXCEEDED" not in str(exc) or time.monotonic() >= deadline:
                raise UnavailableError(
                    f"worker {worker} did not say within {timeout_s:g} s whether it has the "
                    f"next batch ({str(exc).splitlines()[0]}): it is stuck or gone"
                ) from None
    return _END


def host_shapes(item: tuple[int, Any, Any]) -> list:
    """The shapes and dtypes of one prepared batch (`HostBatch` in a numbered item)."""
    _, host, _ = item
    leaves = jax.tree.leaves(host.tree) + ([] if host.mask is None else [host.mask])
    return [[list(np.shape(x)), str(np.asarray(x).dtype)] for x in leaves]
