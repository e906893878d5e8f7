"""`CentralStorageStrategy`: one device holds the parameters; the local devices compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from xla_strategies.devices import resolve_device, resolve_devices
from xla_strategies.strategy import Strategy

BUCKET_BYTES = 32 << 20


class CentralStorageStrategy(Strategy):
    """Synchronous training with the update on one parameter device.

    The parameters and optimizer state live on the parameter device between steps
    (`replicate` puts them there, and a step's new state comes back there). Each step
    copies them to the compute devices, every compute device runs the forward and backward
    pass on its slice of the batch, the gradients are reduced *to* the parameter device (a
    tree of point-to-point sends, not an all-reduce) and the optimizer update runs there,
    inside one XLA program. The results equal `MirroredStrategy`'s on the same data.

    Args:
        compute_devices: the replicas (default: all local devices).
        parameter_device: where the parameters live and the update is computed (default:
            the first compute device). It must be one of the compute devices, so that the
            step stays one XLA program: one program cannot span the host CPU and the
            accelerators.
    """

    pipeline_label = "central_storage"

    def __init__(
        self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None
    ) -> None:
        devices = resolve_devices(compute_devices, "compute_devices")
        chosen = (
            devices[0]
            if parameter_device is None
            else resolve_device(parameter_device, "parameter_device")
        )
        if chosen not in devices:
            raise ValueError(
                f"parameter_device={chosen} is not one of the compute devices "
                f"({', '.join(map(str, devices))}); the step is one XLA program over the "
                "compute devices, so the parameters must live on one of them"
            )
        super().__init__(devices)
        self.parameter_device = chosen
        self.root = devices.index(chosen)
        # Rewrite the reductions before bucketing, so the broadcasts are bucketed too. Big
        # buckets: XLA combines all-reduces but not collective permutes, and every bucket
        # costs 2 log2(N) rounds (one bucket: 79.8 ms a step, 64 KiB buckets: 85.5 ms,
        # benchmarks/README.md).
        self.default_pipeline = (
            "insert-reductions,hoist-all-reduces,reassociate-all-reduces,"
            f"reduce-to-one-device{{root={self.root} broadcast-outputs=false}},"
            f"combine-all-reduces{{threshold-bytes={BUCKET_BYTES}}}"
        )

    @property
    def compute_devices(self) -> tuple[Any, ...]:
        return self.devices

    def state_sharding(self) -> jax.sharding.Sharding:
        """The state lives on the parameter device; each step copies it out."""
        return SingleDeviceSharding(self.parameter_device)

    def root_copy(self, array: jax.Array) -> jax.Array:
        """The parameter device's copy of a step's new state (the others are stale)."""
        return next(s.data for s in array.addressable_shards if s.device == self.parameter_device)

    def __repr__(self) -> str:
        return (
            f"CentralStorageStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"parameter_device={self.parameter_device})"
        )
