"""`xs.experimental.coordinator`, as `tf.distribute.experimental.coordinator`."""

from xla_strategies.runtime.parameter_server.coordinator import (
    ClusterCoordinator,
    PerWorkerValues,
    RemoteValue,
)

__all__ = ["ClusterCoordinator", "PerWorkerValues", "RemoteValue"]
