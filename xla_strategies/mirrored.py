"""`MirroredStrategy`: synchronous data parallelism over the local devices of one host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xla_strategies.devices import resolve_devices
from xla_strategies.strategy import Strategy


class MirroredStrategy(Strategy):
    """One replica per device in `devices` (default: all local devices).

    Parameters are mirrored on every device, each replica gets a slice of the global batch,
    and gradients are reduced across replicas (MEAN by default) inside one XLA program.
    """

    pipeline_label = "mirrored"

    def __init__(self, devices: Sequence[Any] | None = None) -> None:
        super().__init__(resolve_devices(devices))

    def sub_strategy(self, replicas: int) -> MirroredStrategy:
        return MirroredStrategy(self.devices[:replicas])
