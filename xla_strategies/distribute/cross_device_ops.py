"""tf.distribute's choices of cross-device communication, as choices of compiler passes.

tf.distribute implements each `CrossDeviceOps` and `CommunicationImplementation` as its own
code. Here every reduction is compiled into the step, so each choice picks how the existing
passes rewrite the gradients' reductions, which the dump shows:

- `NcclAllReduce(num_packs=k)`: `combine-all-reduces{num-packs=k}`, k buckets of about
  equal bytes (k=0: no buckets). On GPUs XLA runs every all-reduce through NCCL anyway.
- `HierarchicalCopyAllReduce(num_packs=k)`: the devices laid out as two groups
  (`("group", "local")`, as tf's hierarchy for DGX-1 splits them), k buckets, and
  `decompose-all-reduces{force=ordered}`: reduce-scatter within each group, all-reduce of
  the shards across the groups, all-gather within each group.
- `ReductionToOneDevice(reduce_to_device)`: `reduce-to-one-device`, a tree of sends to that
  device, which then broadcasts the update's result (CentralStorageStrategy's pipeline,
  with the outputs broadcast back).
- `CommunicationImplementation` (MultiWorkerMirroredStrategy): `AUTO` lets the cost model
  decompose per level; `RING` and `NCCL` keep one flat collective over every device, which
  the platform's library runs (NCCL on GPUs; gloo on CPU hosts, where NCCL does not exist
  and, as in tf.distribute, `NCCL` falls back to the ring with a warning).

Each gives the default's numbers, up to float reassociation.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xla_strategies.hardware.devices import resolve_device
from xla_strategies.passes import (
    CombineAllReduces,
    DecomposeAllReduces,
    ReduceToOneDevice,
    ShardParameters,
    ShardWeightUpdates,
)
from xla_strategies.step.step_strategy import PipelineChanges

# Buckets of reductions to one device: big, because XLA combines all-reduces but not
# collective permutes, and every bucket costs log2(N) rounds (one bucket: 79.8 ms a step,
# 64 KiB buckets: 85.5 ms, benchmarks/README.md).
REDUCE_TO_ONE_BUCKET_BYTES = 32 << 20


class CommunicationImplementation(enum.Enum):
    """The collective implementation MultiWorkerMirroredStrategy asks for."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


#: tf.distribute's older name.
CollectiveCommunication = CommunicationImplementation


@dataclass(frozen=True)
class CommunicationOptions:
    """As `tf.distribute.experimental.CommunicationOptions`.

    Attributes:
        bytes_per_pack: the combine-all-reduces bucket size; 0 keeps the strategy's choice.
        timeout_seconds: bounds start-up (waiting for every worker) and the heartbeats that
            detect a dead peer, so a lost worker becomes an error, never a hang.
        implementation: a `CommunicationImplementation` (see the module docstring).
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {self.timeout_seconds}")
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must not be negative, got {self.bytes_per_pack}")
        if not isinstance(self.implementation, CommunicationImplementation):
            raise TypeError(
                "implementation must be a CommunicationImplementation (AUTO, RING or NCCL), "
                f"got {self.implementation!r}"
            )


def implementation_decomposes(implementation: CommunicationImplementation, platform: str) -> bool:
    """Whether the reductions are decomposed per level (AUTO) or kept as one flat
    collective that the platform's library runs (RING, NCCL)."""
    if implementation is CommunicationImplementation.NCCL and platform != "gpu":
        warnings.warn(
            f"CommunicationImplementation.NCCL needs GPUs; these are {platform} devices, so "
            "the collectives use the ring (RING) instead",
            stacklevel=3,
        )
    return implementation is CommunicationImplementation.AUTO


class CrossDeviceOps:
    """Base of `MirroredStrategy(cross_device_ops=...)`'s choices."""

    def mesh(self, devices: Sequence[Any]) -> tuple[Any, tuple[str, ...]]:
        """The strategy's devices as a mesh: the array and its axis names."""
        return list(devices), ("replica",)

    def changes(self, devices: Sequence[Any]) -> PipelineChanges:
        """What this choice changes in the default pass pipeline."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class NcclAllReduce(CrossDeviceOps):
    """All-reduce of `num_packs` buckets of the gradients (0: each gradient its own)."""

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _num_packs(num_packs)

    def changes(self, devices: Sequence[Any]) -> PipelineChanges:
        return _packed(self.num_packs)


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Reduce within two groups of devices, across the groups, and back, in `num_packs`
    buckets (0: each gradient its own)."""

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _num_packs(num_packs)

    def mesh(self, devices: Sequence[Any]) -> tuple[Any, tuple[str, ...]]:
        groups = 2 if len(devices) > 1 else 1
        if len(devices) % groups:
            raise ValueError(
                f"HierarchicalCopyAllReduce splits the devices into two groups of equal "
                f"size; {len(devices)} devices do not split"
            )
        return np.asarray(devices, dtype=object).reshape(groups, -1), ("group", "local")

    def changes(self, devices: Sequence[Any]) -> PipelineChanges:
        packed = _packed(self.num_packs)
        return PipelineChanges(
            add=(*packed.add, DecomposeAllReduces(force="ordered")), leave_out=packed.leave_out
        )


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce the gradients to `reduce_to_device` (default: the first device), which
    computes the update and broadcasts its result."""

    def __init__(
        self, reduce_to_device: Any = None, accumulation_fn: Callable[..., Any] | None = None
    ) -> None:
        if accumulation_fn is not None:
            raise ValueError(
                "ReductionToOneDevice(accumulation_fn=...): the reduction is XLA's addition "
                "inside the compiled step, so no other function can accumulate; pass None"
            )
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = None

    def changes(self, devices: Sequence[Any]) -> PipelineChanges:
        return reduce_to_one_changes(self.root(devices), broadcast_outputs=True)

    def root(self, devices: Sequence[Any]) -> int:
        if self.reduce_to_device is None:
            return 0
        device = resolve_device(self.reduce_to_device, "reduce_to_device")
        if device not in devices:
            raise ValueError(
                f"reduce_to_device={self.reduce_to_device!r} is not one of the strategy's "
                "devices; to keep the state on another device (the host CPU), use "
                "CentralStorageStrategy(parameter_device=...)"
            )
        return list(devices).index(device)


def reduce_to_one_changes(root: int, broadcast_outputs: bool) -> PipelineChanges:
    """The gradients reduced to replica `root` (before the bucketing, so broadcasts are
    bucketed too) in big buckets; nothing sharded (one device updates)."""
    return PipelineChanges(
        add=(
            ReduceToOneDevice(root=root, broadcast_outputs=broadcast_outputs),
            CombineAllReduces(threshold_bytes=REDUCE_TO_ONE_BUCKET_BYTES),
        ),
        leave_out=frozenset({ShardParameters.name, ShardWeightUpdates.name}),
    )


def _packed(num_packs: int) -> PipelineChanges:
    if num_packs == 0:
        return PipelineChanges(leave_out=frozenset({CombineAllReduces.name}))
    return PipelineChanges(add=(CombineAllReduces(num_packs=num_packs),))


def _num_packs(num_packs: Any) -> int:
    if not isinstance(num_packs, int) or isinstance(num_packs, bool) or num_packs < 0:
        raise ValueError(f"num_packs must be a non-negative integer, got {num_packs!r}")
    return num_packs
