"""Resolving the `device`/`devices` arguments the strategies take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def resolve_device(device: Any, argument: str) -> jax.Device:
    """A `jax.Device`, an index into `jax.devices()`, or a name like ``"cpu:3"``."""
    all_devices = jax.devices()
    if isinstance(device, jax.Device):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        if 0 <= device < len(all_devices):
            return all_devices[device]
        raise ValueError(
            f"{argument}={device} is out of range: there are {len(all_devices)} devices"
        )
    if isinstance(device, str):
        by_name = {f"{d.platform}:{d.id}": d for d in all_devices}
        key = device.lower().lstrip("/").replace("device:", "")
        if key in by_name:
            return by_name[key]
        raise ValueError(f"{argument}={device!r} names no device; known: {', '.join(by_name)}")
    raise TypeError(
        f"{argument} must be a jax.Device, an int or a name like 'cpu:0', "
        f"got {type(device).__name__}"
    )


def resolve_devices(devices: Sequence[Any] | None, argument: str = "devices") -> list[jax.Device]:
    """All local devices by default; otherwise each entry resolved, no duplicates."""
    if devices is None:
        return list(jax.local_devices())
    if isinstance(devices, str | jax.Device | int):
        raise TypeError(
            f"{argument} must be a sequence of devices, got a single {type(devices).__name__}"
        )
    resolved = [resolve_device(d, f"{argument}[{i}]") for i, d in enumerate(devices)]
    if not resolved:
        raise ValueError(f"{argument} is empty; give at least one device")
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"{argument} lists a device more than once: {resolved}")
    return resolved


def emulate_cpu_devices(count: int = 8) -> None:
    """Give JAX's CPU backend `count` devices, so multi-replica code runs without
    accelerators. Call before JAX first runs; a machine with GPUs or TPUs still uses them.
    Leaves an `xla_force_host_platform_device_count` in XLA_FLAGS alone."""
    import os

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", count)
