"""`strategy.experimental_distribute_values_from_function(value_fn)` and its `ValueContext`.

tf.distribute calls `value_fn(ValueContext(replica_id, num_replicas))` once per local
replica and wraps the results in a `PerReplica` value. Here the results are what a step's
varying output is: one array per leaf, stacked on a leading replica axis and sharded over
`strategy.stacked_mesh`, so row r lives on replica r. A step reads its own row,
`experimental_local_results` hands out the rows, `strategy.reduce` folds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from xla_strategies.core.trees import as_array, path_str

if TYPE_CHECKING:
    from xla_strategies.core.strategy_like import StrategyLike


@dataclass(frozen=True)
class ValueContext:
    """What `value_fn` is told about the replica it makes a value for, as
    `tf.distribute.experimental.ValueContext`.

    Attributes:
        replica_id_in_sync_group: the replica, 0 .. num_replicas_in_sync - 1.
        num_replicas_in_sync: the replicas in sync.
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.replica_id_in_sync_group < self.num_replicas_in_sync:
            raise ValueError(
                f"replica_id_in_sync_group={self.replica_id_in_sync_group} is out of range "
                f"for num_replicas_in_sync={self.num_replicas_in_sync}"
            )


def distribute_values_from_function(strategy: StrategyLike, value_fn: Callable[..., Any]) -> Any:
    """`value_fn(ValueContext)` for each of this process's replicas, stacked per leaf (see
    the module docstring). Every replica's value must have the same structure, shapes and
    dtypes, as a stacked array's rows do."""
    if not callable(value_fn):
        raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}")
    n = strategy.num_replicas_in_sync
    local = [i for i, d in enumerate(strategy.devices) if d.process_index == jax.process_index()]
    values = {i: value_fn(ValueContext(i, n)) for i in local}
    first = local[0]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(values[first])
    rows_by_leaf: list[dict[int, np.ndarray]] = [{} for _ in leaves]
    for replica, value in values.items():
        got = jax.tree_util.tree_structure(value)
        if got != treedef:
            raise ValueError(
                f"value_fn returned a {got} for replica {replica} but a {treedef} for "
                f"replica {first}; every replica's value must have the same structure"
            )
        for k, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(value)):
            where = path_str(f"value_fn(replica {replica})", path)
            rows_by_leaf[k][replica] = np.asarray(as_array(leaf, where))
    stacked = [
        _stacked_leaf(strategy, rows, path_str("value_fn(...)", path))
        for rows, (path, _) in zip(rows_by_leaf, leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, stacked)


def _stacked_leaf(strategy: StrategyLike, rows: dict[int, np.ndarray], where: str) -> Any:
    """One `[replicas, ...]` array from this process's rows, each on its replica's device."""
    shapes = {(r.shape, r.dtype) for r in rows.values()}
    if len(shapes) > 1:
        raise ValueError(
            f"{where} differs in shape or dtype across replicas ({sorted(map(str, shapes))}); "
            "a per-replica value has one shape and dtype"
        )
    ((shape, dtype),) = shapes
    global_shape = (strategy.num_replicas_in_sync, *shape)
    sharding = strategy.stacked_sharding()
    if strategy.compile_only:
        return jax.ShapeDtypeStruct(global_shape, dtype, sharding=sharding)

    def row(index: tuple[slice, ...]) -> np.ndarray:
        replicas = range(*index[0].indices(global_shape[0]))
        return np.stack([rows[r] for r in replicas])

    return jax.make_array_from_callback(global_shape, sharding, row)
