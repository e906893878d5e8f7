"""The layout vocabulary: where an array lives and what each replica sees of it, and the
mesh axis-name prefixes that mark per-replica stacks and state held split."""

from __future__ import annotations

import enum
from typing import Any

import jax.numpy as jnp
import numpy as np

#: Stacked per-replica values live on a mesh whose axis names carry this prefix.
STACKED_PREFIX = "stacked:"
#: Mirrored state a pass holds split across the replicas (weight-update sharding) lives on a
#: mesh whose axis names carry this prefix, so it never looks like a split batch.
SHARDED_PREFIX = "sharded:"
#: The mesh axis a replica spans when it has several devices (logical devices, tensor
#: parallelism): left to XLA's partitioner, never a replica axis. Also under the prefixes.
MODEL_AXIS = "model"
#: The mesh axis of pipeline stages (`pipeline_stages`): each replica's layers split over
#: it; left to XLA's partitioner outside the stage program, never a replica axis.
STAGE_AXIS = "stage"


def replica_axes(axis_names: Any) -> tuple[str, ...]:
    """The replica axes among a mesh's `axis_names`: all but the model and stage axes."""
    return tuple(a for a in axis_names if str(a).rpartition(":")[2] not in (MODEL_AXIS, STAGE_AXIS))


def checked_devices_per_replica(
    value: Any, fastest: str = "", fastest_size: int = 0, of: str = "the mesh"
) -> int:
    """`logical_devices_per_replica` checked where it enters (the strategies' meshes, the
    topology's cost model, the CLI's reader): a positive int that divides the fastest axis
    (`fastest`, of `fastest_size` devices, of the mesh or topology `of`; unchecked where
    `fastest_size` is 0), from which the model axis is cut."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"logical_devices_per_replica must be a positive int, not {value!r}")
    if fastest_size and fastest_size % value:
        raise ValueError(
            f"logical_devices_per_replica={value} does not divide {of}'s fastest axis "
            f"{fastest!r} ({fastest_size} devices); use a divisor of {fastest_size}"
        )
    return int(value)


def model_dim(spec: Any) -> int | None:
    """The dimension a `PartitionSpec` of a strategy's mesh (or its sharded mesh) splits
    over the model axis, alone or after replica axes; None where it splits none."""
    for dim, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if any(str(a).rpartition(":")[2] == MODEL_AXIS for a in names if a is not None):
            return dim
    return None


class Layout(enum.Enum):
    """Where an array lives and what each replica sees of it."""

    MIRRORED = "mirrored"  # whole, on every replica
    SPLIT = "split"  # a global batch: dim 0 split across the replicas
    STACKED = "stacked"  # one value per replica, stacked on a leading replica axis


def refuse_foreign_split(array: Any, sharding: Any) -> None:
    """A batch another strategy split (its mesh's replica axes on dim 0) would pass here as
    mirrored, every replica the whole batch: an error instead. State another strategy
    holds split or stacked (its reserved axis names) is a value, read whole."""
    first = sharding.spec[0] if sharding.spec else None
    axes = first if isinstance(first, tuple) else (first,)
    if first is None or sharding.is_fully_replicated:
        return
    if any(str(a).startswith((SHARDED_PREFIX, STACKED_PREFIX)) for a in axes):
        return
    raise ValueError(
        f"an array of shape {tuple(array.shape)} is split on its first dimension over another "
        f"mesh's axes {list(axes)} (another strategy's batch?); this strategy would give every "
        "replica all of it. Distribute batches with this strategy "
        "(experimental_distribute_dataset, or jax.ShapeDtypeStruct with "
        "sharding=strategy.split_sharding() for a compile-only one), or pass host arrays"
    )


def is_stacked(array: Any) -> bool:
    """Whether `array` holds per-replica values stacked on a leading replica axis, for
    any strategy: it lives on a stacked mesh (every axis named `STACKED_PREFIX...`). Whether
    it is stacked over a given strategy's replicas is `Strategy.layout`'s question."""
    sharding = getattr(array, "sharding", None)
    axes = getattr(getattr(sharding, "mesh", None), "axis_names", ())
    stacked_mesh = bool(axes) and all(str(a).startswith(STACKED_PREFIX) for a in axes)
    return stacked_mesh and bool(sharding.spec) and sharding.spec[0] is not None


def fold_stacked(values: Any, where: str) -> Any:
    """Per-replica values (stacked on a leading replica axis) as one value, as
    tf.distribute reads a `SyncOnRead` variable: a floating value's mean over the replicas,
    in its dtype; an integer or bool value's common value, and a ValueError naming `where`
    when the replicas differ, since integers have no mean to fold them into."""
    if jnp.issubdtype(values.dtype, jnp.inexact):
        return jnp.mean(values, axis=0).astype(values.dtype)
    rows = np.asarray(values)
    if not (rows == rows[0]).all():
        raise ValueError(
            f"{where} holds a different {rows.dtype} value on each replica, and integers have "
            "no mean to fold them into one; read them with strategy.experimental_local_results"
        )
    return rows[0]
