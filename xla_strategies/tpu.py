"""`TPUStrategy`: synchronous training on a TPU slice or multislice, ICI/DCN-aware.

The mesh has one axis per ICI torus dimension ("x", "y"[, "z"]), plus "dcn" across slices,
so the compiler can decompose each reduction along the interconnect (decompose-all-reduces,
driven by the topology's cost model). With `emulate=True` the same mesh is laid out on
emulated CPU devices, so the program and passes run on a machine without TPUs.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from xla_strategies.passes import DEFAULT_PIPELINE
from xla_strategies.strategy import Strategy
from xla_strategies.topology import Topology


class TPUStrategy(Strategy):
    """Data parallelism over every chip of a TPU slice (or slices).

    Args:
        topology: a `Topology` or its name ("v5e-16", "2xv5p-512"). Detected from the TPU
            devices when None; required with `emulate`.
        emulate: lay the topology out on emulated CPU devices (as many as it has chips).
    """

    default_pipeline = DEFAULT_PIPELINE + ",decompose-all-reduces"
    pipeline_label = "tpu"

    def __init__(self, topology: Topology | str | None = None, emulate: bool = False) -> None:
        if isinstance(topology, str):
            topology = Topology.from_name(topology)
        if emulate:
            devices = _emulated_devices(topology)
        else:
            devices, topology = _tpu_devices(topology)
        self._topology = topology
        super().__init__(devices, tuple(topology.mesh_axes))

    @property
    def topology(self) -> Topology:
        return self._topology

    def __repr__(self) -> str:
        return f"TPUStrategy({self._topology}, num_replicas_in_sync={self.num_replicas_in_sync})"


def _emulated_devices(topology: Topology | None) -> np.ndarray:
    if topology is None:
        raise ValueError(
            "TPUStrategy(emulate=True) needs a topology, e.g. TPUStrategy('v5e-16', emulate=True)"
        )
    devices = jax.devices()
    needed = topology.num_devices
    if len(devices) < needed:
        raise ValueError(
            f"emulating {topology} needs {needed} devices but JAX has {len(devices)}; call "
            f"jax.config.update('jax_num_cpu_devices', {needed}) before JAX first runs"
        )
    return np.asarray(devices[:needed], dtype=object).reshape(tuple(topology.mesh_axes.values()))


# TPU-only below: runs where jax.devices() are TPU chips.

_GENERATIONS = {
    "tpu v4": "v4",
    "tpu v5 lite": "v5e",
    "tpu v5e": "v5e",
    "tpu v5p": "v5p",
    "tpu v5": "v5p",
    "tpu v6 lite": "v6e",
    "tpu v6e": "v6e",
}
_NAMED_BY_CORES = {"v4", "v5p"}  # their slice names count TensorCores, two per chip


def _tpu_devices(topology: Topology | None) -> tuple[np.ndarray, Topology]:
    tpus = [d for d in jax.devices() if d.platform == "tpu"]
    if not tpus:
        kinds = sorted({d.platform for d in jax.devices()})
        raise RuntimeError(
            f"TPUStrategy found no TPU devices (JAX sees {', '.join(kinds)}); on a machine "
            "without TPUs use TPUStrategy('<topology>', emulate=True), e.g. 'v5e-16'"
        )
    topology = topology or _detect(tpus)
    if topology.num_devices != len(tpus):
        raise ValueError(
            f"{topology} has {topology.num_devices} chips but JAX sees {len(tpus)} TPUs"
        )
    from jax.experimental import mesh_utils

    sizes = topology.mesh_axes
    ici = [size for axis, size in sizes.items() if axis != "dcn"]
    if "dcn" in sizes:
        dcn = [sizes["dcn"]] + [1] * len(ici)
        return mesh_utils.create_hybrid_device_mesh([1, *ici], dcn, tpus), topology
    return mesh_utils.create_device_mesh(ici, tpus), topology


def _detect(tpus: list[Any]) -> Topology:
    """The slice's name from the chips' kind, count and slice indices."""
    kind = tpus[0].device_kind.lower()
    generation = next((g for k, g in _GENERATIONS.items() if kind.startswith(k)), None)
    if generation is None:
        raise ValueError(
            f"unknown TPU kind {tpus[0].device_kind!r}; pass TPUStrategy(topology=...)"
        )
    slices = len({getattr(d, "slice_index", 0) for d in tpus})
    chips = len(tpus) // slices
    size = chips * (2 if generation in _NAMED_BY_CORES else 1)
    prefix = f"{slices}x" if slices > 1 else ""
    return Topology.from_name(f"{prefix}{generation}-{size}")
