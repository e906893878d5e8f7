"""TPUStrategy's logical devices: the devices one replica spans, as tf.distribute has them.

tf.distribute's TPUStrategy gives a replica several cores (a `DeviceAssignment` with
`num_cores_per_replica > 1`), and a step lays a tensor out across them with
`experimental_split_to_logical_devices` and its siblings. Here those cores are the model
axis of the strategy's mesh (`logical_devices_per_replica`). Each call is a sharding
constraint over that axis, which XLA's SPMD partitioner follows; the values are the same
as on one device, as in tf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from xla_strategies.core.layout import MODEL_AXIS


def cores_per_replica(device_assignment: Any, logical_devices_per_replica: int) -> int:
    """The cores per replica that tf's `experimental_device_assignment` asks for (its
    `num_cores_per_replica`), reconciled with `logical_devices_per_replica`."""
    if device_assignment is None:
        return logical_devices_per_replica
    cores = getattr(device_assignment, "num_cores_per_replica", None)
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(
            "experimental_device_assignment must have a positive int num_cores_per_replica, "
            f"got {cores!r}"
        )
    if logical_devices_per_replica not in (1, cores):
        raise ValueError(
            f"experimental_device_assignment has num_cores_per_replica={cores}, but "
            f"logical_devices_per_replica={logical_devices_per_replica}; give one of them"
        )
    return cores


def assign_to_logical_device(tensor: Any, logical_device_id: int, devices: int) -> Any:
    """`tensor` for logical device `logical_device_id` of its replica's `devices`. JAX's
    partitioner has no public single-device placement, so the tensor is kept whole on
    every device of the replica: the values are tf's, the placement is replication."""
    if not isinstance(logical_device_id, int) or not 0 <= logical_device_id < devices:
        raise ValueError(
            f"logical_device_id={logical_device_id!r} is out of range: each replica has "
            f"{devices} logical device{'s' if devices > 1 else ''} (0 to {devices - 1})"
        )
    return replicate_to_logical_devices(tensor, devices)


def split_to_logical_devices(tensor: Any, partition_dimensions: Sequence[int], devices: int) -> Any:
    """`tensor` split over its replica's `devices` logical devices: dimension i into
    `partition_dimensions[i]` parts, whose product must be the device count (tf's rule).
    One dimension can be split (the model axis is one mesh axis)."""
    dims = list(partition_dimensions)
    shape = np.shape(tensor)
    if len(dims) != len(shape) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims
    ):
        raise ValueError(
            f"partition_dimensions={dims} must give a positive int for each of the "
            f"tensor's {len(shape)} dimensions"
        )
    if math.prod(dims) != devices:
        raise ValueError(
            f"partition_dimensions={dims} split the tensor into {math.prod(dims)} parts, but "
            f"each replica has {devices} logical device{'s' if devices > 1 else ''}"
        )
    uneven = [i for i, (size, parts) in enumerate(zip(shape, dims, strict=True)) if size % parts]
    if uneven:
        i = uneven[0]
        raise ValueError(
            f"partition_dimensions={dims}: dimension {i} of the tensor ({shape[i]}) does not "
            f"split into {dims[i]} equal parts"
        )
    split = [i for i, d in enumerate(dims) if d > 1]
    if len(split) > 1:
        raise NotImplementedError(
            f"partition_dimensions={dims} split dimensions {split}; the {devices} logical "
            "devices of a replica form one mesh axis, so one dimension can be split over "
            "them"
        )
    if not split:
        return tensor  # one logical device: nothing to lay out
    spec = PartitionSpec(*[MODEL_AXIS if i == split[0] else None for i in range(len(dims))])
    return jax.lax.with_sharding_constraint(tensor, spec)


def replicate_to_logical_devices(tensor: Any, devices: int) -> Any:
    """`tensor` whole on every logical device of its replica."""
    if devices == 1:
        return tensor
    return jax.lax.with_sharding_constraint(tensor, PartitionSpec())
