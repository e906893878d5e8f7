"""TPUStrategy's logical devices: each replica is one core here, so one logical device.

tf.distribute's TPUStrategy can give a replica several cores (a `DeviceAssignment` with
`num_cores_per_replica > 1`) and lay a tensor out across them inside the step. A compiled
step here is traced per replica with every mesh axis manual (`shard_map`), so within a
replica there is nothing to lay a tensor out on, and a replica spanning several cores
cannot be expressed. With one core per replica tf.distribute's calls still have their
meaning, and these functions give it: logical device 0 is the replica's core, a split over
one logical device keeps the tensor whole, replication is the tensor itself. Anything that
needs more logical devices is an error that says what to use instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: Logical devices (cores) per replica.
LOGICAL_DEVICES_PER_REPLICA = 1

_MODEL_PARALLEL_INSTEAD = (
    "a replica here is one core, so model parallelism within a replica is not provided; "
    "shard the state across replicas instead (compile(shard_parameters=True)), or use "
    "jax.jit with NamedShardings for tensor parallelism"
)


def check_device_assignment(device_assignment: Any) -> None:
    """Accept None, or an assignment of one core per replica (`num_cores_per_replica`)."""
    if device_assignment is None:
        return
    cores = getattr(device_assignment, "num_cores_per_replica", None)
    if cores != LOGICAL_DEVICES_PER_REPLICA:
        raise NotImplementedError(
            f"experimental_device_assignment with num_cores_per_replica={cores}: "
            + _MODEL_PARALLEL_INSTEAD
        )


def assign_to_logical_device(tensor: Any, logical_device_id: int) -> Any:
    """`tensor` on logical device `logical_device_id` of its replica (only 0 exists)."""
    if not isinstance(logical_device_id, int) or not (
        0 <= logical_device_id < LOGICAL_DEVICES_PER_REPLICA
    ):
        raise ValueError(
            f"logical_device_id={logical_device_id!r} is out of range: each replica has "
            f"{LOGICAL_DEVICES_PER_REPLICA} logical device; " + _MODEL_PARALLEL_INSTEAD
        )
    return tensor


def split_to_logical_devices(tensor: Any, partition_dimensions: Sequence[int]) -> Any:
    """`tensor` split along its dimensions over the replica's logical devices: the number
    of parts (the product of `partition_dimensions`) must be the logical device count."""
    import numpy as np

    dims = list(partition_dimensions)
    rank = np.ndim(tensor)
    if len(dims) != rank or any(not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(
            f"partition_dimensions={dims} must give a positive int for each of the "
            f"tensor's {rank} dimensions"
        )
    if math.prod(dims) != LOGICAL_DEVICES_PER_REPLICA:
        raise ValueError(
            f"partition_dimensions={dims} split the tensor into {math.prod(dims)} parts, but "
            f"each replica has {LOGICAL_DEVICES_PER_REPLICA} logical device; "
            + _MODEL_PARALLEL_INSTEAD
        )
    return tensor


def replicate_to_logical_devices(tensor: Any) -> Any:
    """`tensor` on every logical device of its replica: the tensor itself."""
    return tensor
