"""`InputOptions` and `InputContext`: how batches are fed, and what each host's pipeline is."""

from __future__ import annotations

import enum
from dataclasses import dataclass

PARTIAL_BATCH_POLICIES = ("error", "drop", "pad")


class InputReplicationMode(enum.Enum):
    """Who calls `distribute_datasets_from_function`'s `dataset_fn`, as in tf.distribute:
    once per worker (host) for that worker's part of each batch, or once per replica for
    that replica's part."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


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

    tf.distribute's names are accepted too, and set the fields above:
    `experimental_fetch_to_device` is `prefetch_to_device`,
    `experimental_per_replica_buffer_size` is `buffer_size` (batches, each holding every
    replica's part), `experimental_replication_mode` says who calls
    `distribute_datasets_from_function`'s `dataset_fn` (`InputReplicationMode`).
    `experimental_place_dataset_on_device=True` has no meaning here (batches are made on
    the host, by Python) and is an error.
    """

    prefetch_to_device: bool = True
    buffer_size: int = 2
    host_buffer_size: int = 2
    partial_batch: str = "error"
    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int | None = None

    def __post_init__(self) -> None:
        self._take_tf_names()
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

    def _take_tf_names(self) -> None:
        """Set our fields from tf.distribute's names, where given (None: not given)."""
        mode = self.experimental_replication_mode
        try:
            object.__setattr__(self, "experimental_replication_mode", InputReplicationMode(mode))
        except ValueError:
            raise ValueError(
                "InputOptions.experimental_replication_mode must be an InputReplicationMode, "
                f"got {mode!r}"
            ) from None
        if self.experimental_place_dataset_on_device:
            raise ValueError(
                "InputOptions.experimental_place_dataset_on_device=True: batches are made "
                "on the host by Python, so there is no dataset to place on a device; "
                "prefetch_to_device (experimental_fetch_to_device) copies them ahead instead"
            )
        for ours, theirs, default in (
            ("prefetch_to_device", "experimental_fetch_to_device", True),
            ("buffer_size", "experimental_per_replica_buffer_size", 2),
        ):
            given, mine = getattr(self, theirs), getattr(self, ours)
            if given is not None and mine not in (default, given):
                raise ValueError(
                    f"InputOptions: {ours}={mine!r} and {theirs}={given!r} disagree; "
                    "they are the same setting, give one of them"
                )
            if given is not None:
                object.__setattr__(self, ours, given)


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
