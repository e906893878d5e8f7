"""`CentralStorageStrategy`: one device holds the parameters; the local devices compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from xla_strategies.distribute.cross_device_ops import reduce_to_one_changes
from xla_strategies.distribute.strategy import Strategy
from xla_strategies.hardware.devices import resolve_device, resolve_devices
from xla_strategies.step.step_strategy import PipelineChanges


class CentralStorageStrategy(Strategy):
    """Synchronous training with the parameters on one device.

    The parameters and optimizer state live on the parameter device between steps
    (`replicate` puts them there, and a step's new state comes back there). Each step
    copies them to the compute devices, every compute device runs the forward and backward
    pass on its slice of the batch, the gradients are reduced *to* one device (a tree of
    point-to-point sends, not an all-reduce) and the optimizer update runs there, inside
    one XLA program. The results equal `MirroredStrategy`'s on the same data.

    Args:
        compute_devices: the replicas (default: all local devices).
        parameter_device: where the state lives. Default: the host CPU when the compute
            devices are accelerators, else the first compute device. When it is one of the
            compute devices, the gradients are reduced to it and the update runs on it.
            Otherwise (the host CPU beside GPUs or TPUs) they are reduced to the first
            compute device, which runs the update, and the new state is copied to the
            parameter device: one XLA program cannot span the CPU and the accelerators.
    """

    pipeline_label = "central_storage"
    shards_weight_updates = False

    def __init__(
        self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None
    ) -> None:
        devices = resolve_devices(compute_devices, "compute_devices")
        if parameter_device is None:
            on_cpu = devices[0].platform == "cpu"
            chosen = devices[0] if on_cpu else jax.local_devices(backend="cpu")[0]
        else:
            chosen = resolve_device(parameter_device, "parameter_device")
        super().__init__(devices)
        self.parameter_device = chosen
        # The replica that receives the gradients and computes the update.
        self.update_device = chosen if chosen in devices else devices[0]
        self.root = devices.index(self.update_device)

    def pipeline_changes(self) -> PipelineChanges:
        """The gradients reduced to the update device; nothing sharded (one device
        updates)."""
        return reduce_to_one_changes(self.root, broadcast_outputs=False)

    def sub_strategy(self, replicas: int) -> CentralStorageStrategy:
        """The first `replicas` compute devices, with the same parameter device."""
        return CentralStorageStrategy(self.devices[:replicas], self.parameter_device)

    @property
    def compute_devices(self) -> tuple[Any, ...]:
        return self.devices

    def state_sharding(self) -> jax.sharding.Sharding:
        """The state lives on the parameter device; each step copies it out."""
        return SingleDeviceSharding(self.parameter_device)

    def root_copy(self, array: jax.Array) -> jax.Array:
        """The new state as the update device computed it (the other replicas' copies are
        stale), on the parameter device."""
        new = next(s.data for s in array.addressable_shards if s.device == self.update_device)
        if self.update_device == self.parameter_device:
            return new
        return jax.device_put(new, self.parameter_device)

    def __repr__(self) -> str:
        return (
            f"CentralStorageStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"parameter_device={self.parameter_device})"
        )
