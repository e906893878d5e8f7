"""`InputOptions` and `InputContext`: how batches are fed, and what each host's pipeline is."""

from __future__ import annotations

from dataclasses import dataclass

PARTIAL_BATCH_POLICIES = ("error", "drop", "pad")


@dataclass(frozen=True)
class InputOptions:
    """How a distributed dataset feeds the replicas.

    Attributes:
        prefetch_to_device: copy batches to the devices ahead of the step, from a
            background thread, so the step never waits on host-to-device copies.
        buffer_size: batches already on device ahead of the step.
        host_buffer_size: batches prepared on the host (converted, checked, padded) by the
            background thread ahead of the device copies, as in grain's two-stage device_put.
        partial_batch: what to do with a batch whose size does not divide across the
            replicas (typically the last one): ``"error"`` (default) raises naming the
            sizes, ``"drop"`` skips it, ``"pad"`` pads it with zeros to the next multiple
            and yields ``(batch, mask)`` for every batch, `mask` a boolean per example.
    """

    prefetch_to_device: bool = True
    buffer_size: int = 2
    host_buffer_size: int = 2
    partial_batch: str = "error"

    def __post_init__(self) -> None:
        if self.buffer_size < 1:
            raise ValueError(f"InputOptions.buffer_size must be at least 1, got {self.buffer_size}")
        if self.host_buffer_size < 1:
            raise ValueError(
                f"InputOptions.host_buffer_size must be at least 1, got {self.host_buffer_size}"
            )
        if self.partial_batch not in PARTIAL_BATCH_POLICIES:
            raise ValueError(
                f"InputOptions.partial_batch must be one of {PARTIAL_BATCH_POLICIES}, "
                f"got {self.partial_batch!r}"
            )


@dataclass(frozen=True)
class InputContext:
    """What one host's input pipeline is, as `tf.distribute.InputContext`.

    Attributes:
        num_input_pipelines: how many pipelines (hosts) feed the replicas.
        input_pipeline_id: this pipeline's index, 0 .. num_input_pipelines - 1.
        num_replicas_in_sync: replicas across all hosts.
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id={self.input_pipeline_id} is out of range for "
                f"{self.num_input_pipelines} input pipelines"
            )
        if self.num_replicas_in_sync % self.num_input_pipelines:
            raise ValueError(
                f"{self.num_replicas_in_sync} replicas do not divide across "
                f"{self.num_input_pipelines} input pipelines"
            )

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica gets; raises if the global batch does not divide."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size {global_batch_size} does not divide across "
                f"{self.num_replicas_in_sync} replicas"
            )
        return global_batch_size // self.num_replicas_in_sync

    def get_per_host_batch_size(self, global_batch_size: int) -> int:
        """The batch this pipeline must produce each step."""
        per_replica = self.get_per_replica_batch_size(global_batch_size)
        return per_replica * self.num_replicas_in_sync // self.num_input_pipelines
