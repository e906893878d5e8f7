"""Splitting global batches across replicas: each leaf is split on axis 0 and placed on the
replicas' devices as one global `jax.Array` sharded over the replica axis."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from xla_strategies.trees import map_arrays

if TYPE_CHECKING:
    from xla_strategies.strategy import Strategy


class DistributedDataset:
    """Iterable of per-replica batches; each `iter()` starts a new pass over `dataset`."""

    def __init__(self, strategy: Strategy, dataset: Iterable[Any]) -> None:
        if not isinstance(dataset, Iterable):
            raise TypeError(f"dataset must be iterable, got {type(dataset).__name__}")
        self._strategy = strategy
        self._dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self._dataset):
            yield distribute_batch(self._strategy, batch, f"dataset element {index}")


def distribute_batch(strategy: Strategy, batch: Any, where: str) -> Any:
    """Place one global batch: every leaf split on axis 0 across the replicas."""
    sharding = NamedSharding(strategy.mesh, strategy.input_spec(True))
    replicas = strategy.num_replicas_in_sync

    def place(array: Any, path: str) -> jax.Array:
        if np.ndim(array) == 0:
            raise ValueError(f"{path} is a scalar; a global batch needs a leading batch dimension")
        if array.shape[0] % replicas:
            raise ValueError(
                f"{path} has a global batch of {array.shape[0]}, which does not divide across "
                f"{replicas} replicas; use a global batch size that is a multiple of {replicas}"
            )
        return jax.device_put(array, sharding)

    return map_arrays(place, batch, where)
