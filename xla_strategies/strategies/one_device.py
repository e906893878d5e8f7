"""`OneDeviceStrategy`: everything on one device; the reference the others are tested against."""

from __future__ import annotations

from typing import Any

from xla_strategies.distribute.strategy import Strategy
from xla_strategies.hardware.devices import resolve_device


class OneDeviceStrategy(Strategy):
    """One replica on `device` (default: the first device).

    Steps run through the same capture, pipeline and lowering as every other strategy, on a
    one-device mesh, so its numbers are the reference for multi-replica equivalence.
    """

    pipeline_label = "one_device"

    def __init__(self, device: Any = None) -> None:
        import jax

        super().__init__([resolve_device(jax.devices()[0] if device is None else device, "device")])
