"""`Topology`: the interconnect of a TPU slice, a multislice, or a GPU cluster, by name.

    xs.Topology.from_name("v5e-256")      # a 16x16 v5e slice: mesh axes ("x", "y")
    xs.Topology.from_name("2xv5p-512")    # two v5p-512 slices over DCN: ("dcn", "x", "y", "z")
    xs.Topology.from_name("4xdgx-h100")   # four 8-GPU nodes: ("host", "local")

The numbers come from `tpu_configs/<hardware>.toml`, each with its public source.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

from xla_strategies.core.layout import MODEL_AXIS, STAGE_AXIS, checked_devices_per_replica
from xla_strategies.hardware.calibration import Calibration
from xla_strategies.passes.cost import model as cost_model
from xla_strategies.passes.cost.model import AxisLink

_NAME = re.compile(
    r"^(?:(?P<count>\d+)x)?(?P<hardware>v\d+[a-z]*|[a-z][\w\-]*?)(?:-(?P<slice>\d+))?$"
)
_ICI_AXES = ("x", "y", "z")


#: Set by `xla-strategies aot --topology NAME`: a strategy built for NAME's kind of hardware
#: (TPUStrategy for a TPU slice; MirroredStrategy for one GPU node, MultiWorkerMirroredStrategy
#: for several) is compile-only for NAME.
AOT_TOPOLOGY = "XLA_STRATEGIES_AOT_TOPOLOGY"


def aot_topology(kind: str) -> Topology | None:
    """The topology `xla-strategies aot` compiles this script for, when it is of `kind`
    ("tpu" or "gpu"); None otherwise."""
    name = os.environ.get(AOT_TOPOLOGY)
    if not name:
        return None
    topology = Topology.from_name(name)
    return topology if hardware_config(topology.hardware)["kind"] == kind else None


@cache
def hardware_config(hardware: str) -> dict[str, Any]:
    """The parsed `tpu_configs/<hardware>.toml`."""
    path = resources.files("xla_strategies.tpu_configs") / f"{hardware}.toml"
    if not path.is_file():
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(known_hardware())}")
    return tomllib.loads(path.read_text())


def known_hardware() -> list[str]:
    files = resources.files("xla_strategies.tpu_configs").iterdir()
    return sorted(f.name.removesuffix(".toml") for f in files if f.name.endswith(".toml"))


@dataclass(frozen=True)
class Topology:
    """Named mesh levels, slowest first, each an `AxisLink` the cost model understands."""

    name: str
    hardware: str
    axes: tuple[AxisLink, ...]
    #: each device's memory bandwidth (bytes/s), which an elementwise update is bound by;
    #: None where the hardware file gives none
    memory_bandwidth: float | None = None
    #: each device's dense bf16 matmul peak (flop/s); None where the file gives none
    peak_flops: float | None = None
    #: each device's memory (bytes), which a compiled program must fit; None where unknown
    hbm_bytes: int | None = None
    #: (rows, lanes) of the smallest per-device block the compiler keeps as a reduce-scatter
    #: or all-gather of a bucket (TPU); None where any block shape is kept
    collective_block_tile: tuple[int, int] | None = None
    #: whether the compiler runs a reduce-scatter over several torus axes as an all-reduce
    #: and a slice (TPU), so that one axis at a time moves half the bytes
    reduce_scatter_over_axes_is_all_reduce: bool = False
    #: each device's dense f32 matmul peak (flop/s; TF32 on GPUs); None: the bf16 peak
    peak_f32_flops: float | None = None
    #: XLA options tuned for this hardware (`[compiler_options]` in its file, with their
    #: sources and measurements), as (name, value) pairs, TOML's booleans kept (XLA's and
    #: libtpu's option parsers both read a bool); the TPU strategy passes them to every
    #: compile
    compiler_options: tuple[tuple[str, Any], ...] = ()
    #: whether XLA's compiler runs a layer loop's all-gathers beside compute (asynchronous),
    #: so that prefetching the next layer's gather can hide it; False where it was measured
    #: to run them synchronously (TPU v5p and v6e, libtpu 0.0.50)
    loop_all_gathers_asynchronous: bool = True
    #: whether a layer loop's all-gathers and reduce-scatters are bucketed
    #: (`combine-all-reduces`); False on TPU: XLA's compiler overlaps each weight's own
    #: gather with the compute beside it (v5e), and copies every weight out of a gathered
    #: bucket into its tiled layout (v5p, v6e)
    bucket_layer_collectives: bool = True
    #: whether `combine-all-reduces` buckets all-reduces as one tuple all-reduce (each
    #: member an operand of its own) rather than a flat buffer: on TPU, whose tiled layouts
    #: make the flat buffer a copy of every member in and out
    tuple_all_reduce_buckets: bool = False
    #: (rows, lanes) of the tile a flat collective buffer is laid out in (TPU: (8, 128)):
    #: `combine-all-reduces` pads the buffer to whole tiles (zeros, never read; XLA's TPU
    #: compiler copies a buffer of a part tile whole and zero-pads it, its `ZeroCrop`) and
    #: lays each member of whole tiles into it tile after tile; None where neither matters
    flat_buffer_tile: tuple[int, int] | None = None
    #: whether the compiler hides a replicated optimizer update's device-memory traffic
    #: behind the backward pass (TPU: it prefetches the update's operands into on-chip
    #: memory beside the gradient matmuls), so sharding the update saves no step time
    hides_update_traffic: bool = False
    #: whether `scatter-adds-as-selects{mode=auto}` and `reduce-scatters-before-loops
    #: {mode=auto}` run: measured to shrink a step under parameter sharding on TPU v5e and
    #: v6e, and to grow it on v5p (libtpu 0.0.50), where XLA's allocator placed the same
    #: peak worse
    scatter_adds_as_selects: bool = False
    reduce_scatters_before_loops: bool = False
    #: more of them (`[compiler_options_replicated_parameters]`) for steps whose parameters
    #: stay whole on every chip: measured to win there and to lose where the step gathers
    #: its parameters (`shard_parameters`)
    replicated_parameter_options: tuple[tuple[str, Any], ...] = ()
    #: what the rates above were fitted to (`[calibration]`, already applied to them);
    #: None: the datasheet's rates, uncalibrated
    calibration: Calibration | None = None

    @classmethod
    def from_name(cls, name: str) -> Topology:
        """`"v5e-256"`, `"2xv5p-512"` (multislice), `"dgx-h100"`, `"4xdgx-h100"`."""
        found = _NAME.match(name.strip().lower())
        if not found:
            raise ValueError(
                f"cannot read topology name {name!r}; expected e.g. 'v5e-256', "
                "'2xv5p-512' or '4xdgx-h100'"
            )
        count = int(found["count"] or 1)
        config = hardware_config(found["hardware"])
        if count > 1:  # settings measured apart for several slices win over the file's
            config = {**config, **config.get("multislice", {})}
        if config["kind"] == "tpu":
            axes = _tpu_axes(config, found["slice"], count, name)
        else:
            if found["slice"]:
                raise ValueError(
                    f"{name!r}: GPU nodes take a count prefix ('4x{found['hardware']}'), not a size"
                )
            axes = _node_axes(config, count)
        calibration = Calibration.of(config, f"tpu_configs/{found['hardware']}.toml")
        fitted = calibration or Calibration()
        return cls(
            name,
            found["hardware"],
            tuple(replace(a, bandwidth=a.bandwidth * fitted.link_fraction) for a in axes),
            _scaled(config.get("memory_bandwidth_bytes_per_s"), fitted.memory_fraction),
            _scaled(config.get("peak_bf16_flops_per_s"), fitted.matmul_fraction),
            config.get("hbm_bytes"),
            _tile(config, "collective_block_tile"),
            bool(config.get("reduce_scatter_over_axes_is_all_reduce", False)),
            _scaled(config.get("peak_tf32_flops_per_s"), fitted.matmul_fraction),
            compiler_options=tuple(sorted(config.get("compiler_options", {}).items())),
            loop_all_gathers_asynchronous=config.get("loop_all_gathers_asynchronous", True),
            bucket_layer_collectives=config.get("bucket_layer_collectives", True),
            tuple_all_reduce_buckets=config.get("tuple_all_reduce_buckets", False),
            flat_buffer_tile=_tile(config, "flat_buffer_tile"),
            hides_update_traffic=config.get("hides_update_traffic", False),
            scatter_adds_as_selects=config.get("scatter_adds_as_selects", False),
            reduce_scatters_before_loops=config.get("reduce_scatters_before_loops", False),
            replicated_parameter_options=tuple(
                sorted(config.get("compiler_options_replicated_parameters", {}).items())
            ),
            calibration=calibration,
        )

    @classmethod
    def for_gpu_mesh(cls, device_kind: str, mesh_axes: dict[str, int]) -> Topology | None:
        """The topology of a GPU mesh whose devices are `device_kind` (as JAX names it),
        from the node file that lists that kind; None for a kind no file lists. One axis:
        GPUs of one node (NVLink). Two axes: nodes (the network), then each node's GPUs."""
        hardware = next(
            (
                name
                for name in known_hardware()
                if device_kind in hardware_config(name).get("device_kinds", ())
            ),
            None,
        )
        model = mesh_axes.get(MODEL_AXIS, 1)
        if model > 1:  # the replica axes' topology, its fastest axis then cut
            *rest, (last, size) = [(a, s) for a, s in mesh_axes.items() if a != MODEL_AXIS]
            whole = cls.for_gpu_mesh(device_kind, {**dict(rest), last: size * model})
            return whole.split_model_axis(model) if whole else None
        if hardware is None or len(mesh_axes) not in (1, 2):
            return None
        config = hardware_config(hardware)
        sizes = list(mesh_axes.values())
        if sizes[-1] > config["gpus_per_host"]:
            return None  # more GPUs on one axis than a node has: not this node's links
        nodes = sizes[0] if len(sizes) == 2 else 1
        base = cls.from_name(f"{nodes}x{hardware}" if nodes > 1 else hardware)
        fraction = (base.calibration or Calibration()).link_fraction
        links = _node_axes(config, 2)[-len(sizes) :]  # (network, NVLink) or (NVLink,)
        axes = tuple(
            replace(link, name=name, size=size, bandwidth=link.bandwidth * fraction)
            for link, (name, size) in zip(links, mesh_axes.items(), strict=True)
        )
        return replace(base, axes=axes)

    def at_datasheet_rates(self) -> Topology:
        """This topology with the `[calibration]` fractions taken back out of its rates: the
        datasheet's peaks, which MFU is measured against and a fit starts from."""
        fitted = self.calibration
        if fitted is None:
            return self
        return replace(
            self,
            axes=tuple(replace(a, bandwidth=a.bandwidth / fitted.link_fraction) for a in self.axes),
            memory_bandwidth=_scaled(self.memory_bandwidth, 1 / fitted.memory_fraction),
            peak_flops=_scaled(self.peak_flops, 1 / fitted.matmul_fraction),
            peak_f32_flops=_scaled(self.peak_f32_flops, 1 / fitted.matmul_fraction),
            calibration=None,
        )

    def split_model_axis(self, devices_per_replica: int) -> Topology:
        """This topology with its last (fastest) axis cut in two: the replicas' part, and a
        trailing model axis of `devices_per_replica` devices that are neighbours on that
        axis (`logical_devices_per_replica`). Neither part wraps."""
        *rest, last = self.axes
        size = checked_devices_per_replica(devices_per_replica, last.name, last.size, self.name)
        if size == 1:
            return self
        replicas = replace(last, size=last.size // size, bidirectional=False)
        model = replace(last, name=MODEL_AXIS, size=size, bidirectional=False)
        return replace(self, axes=(*rest, replicas, model))

    def split_stage_axis(self, stages: int) -> Topology:
        """This topology with its first (slowest) axis cut in two: a stage axis of
        `stages` (`pipeline_stages`), placed as the mesh places it (before a model axis,
        else last), and the replicas' part. On TPUs the stages are cut from the slices
        (DCN): a stage never splits a slice's torus."""
        first, *rest = self.axes
        if stages == 1:
            return self
        if first.level == "ici":
            raise ValueError(
                f"pipeline_stages={stages}: {self.name} is one slice; stages are cut from the "
                "slices (give a multislice topology, e.g. '4xv5p-512')"
            )
        if first.size % stages:
            raise ValueError(
                f"pipeline_stages={stages} does not divide {self.name}'s {first.size} "
                f"{first.name!r} groups"
            )
        stage = replace(first, name=STAGE_AXIS, size=stages, bidirectional=False)
        axes = [replace(first, size=first.size // stages), *rest]
        at = next((i for i, a in enumerate(axes) if a.name == MODEL_AXIS), len(axes))
        return replace(self, axes=(*axes[:at], stage, *axes[at:]))  # as the mesh orders it

    @property
    def devices_per_replica(self) -> int:
        """Devices per replica: the model axis's size (1 without one)."""
        return self.mesh_axes.get(MODEL_AXIS, 1)

    @property
    def slice_count(self) -> int:
        """How many slices (or nodes) the topology joins over its slowest network."""
        groups = self.mesh_axes.get("dcn", self.mesh_axes.get("host", 1))
        return groups * self.mesh_axes.get(STAGE_AXIS, 1)

    @property
    def libtpu_name(self) -> str:
        """One slice's name as XLA's TPU compiler takes it (`v5e:16x16`, `v4:2x2x1`)."""
        config = hardware_config(self.hardware)
        if config["kind"] != "tpu":
            raise ValueError(f"{self.name} is not a TPU topology")
        shape = [a.size for a in self.axes if a.level == "ici" and a.name != MODEL_AXIS]
        shape[-1] *= self.devices_per_replica  # the model axis is cut from the last torus axis
        return f"{self.hardware}:{'x'.join(map(str, shape))}"

    @property
    def libtpu_wraparound(self) -> tuple[bool, bool, bool]:
        """Per torus dimension (three, as XLA's TPU compiler takes them), whether one slice
        wraps around. The compiler picks its collective algorithms by it: on a v5p-512
        torus an all-gather runs as `3DAllGatherOnMajorDim`, on the same chips without
        the wraparound as an all-reduce of zero-padded blocks."""
        found = _NAME.match(self.name.strip().lower())
        wraps = hardware_config(self.hardware)["slices"][found["slice"]]["wraparound"]
        return tuple(bool(w) for w in [*wraps, False, False][:3])

    @property
    def mesh_axes(self) -> dict[str, int]:
        """Axis name -> size, slowest level first (the device mesh's order)."""
        return {a.name: a.size for a in self.axes}

    @property
    def num_devices(self) -> int:
        return math.prod(a.size for a in self.axes)

    def axis_links(self, axes: tuple[str, ...] | None = None) -> list[AxisLink]:
        names = tuple(self.mesh_axes) if axes is None else axes
        unknown = [a for a in names if a not in self.mesh_axes]
        if unknown:
            raise ValueError(
                f"{self.name} has no axis {unknown[0]!r}; its axes are {list(self.mesh_axes)}"
            )
        return [a for a in self.axes if a.name in names]

    def collective_time(
        self, op: str, nbytes: float, axes: tuple[str, ...] | None = None, algorithm: str = "best"
    ) -> float:
        """Estimated seconds for `op` ("all_reduce", "reduce_scatter", "all_gather") of
        `nbytes` per participant over `axes` (all by default)."""
        return cost_model.collective_time(op, nbytes, self.axis_links(axes), algorithm)

    def lower_bound(self, op: str, nbytes: float, axes: tuple[str, ...] | None = None) -> float:
        """The bandwidth/latency bound no algorithm beats."""
        return cost_model.lower_bound(op, nbytes, self.axis_links(axes))

    def __str__(self) -> str:
        shape = "x".join(f"{a.name}{a.size}" for a in self.axes)
        return f"{self.name} ({shape})"


def _scaled(rate: float | None, fraction: float) -> float | None:
    return None if rate is None else rate * fraction


def _tile(config: dict[str, Any], key: str) -> tuple[int, int] | None:
    """A (rows, lanes) tile the hardware file gives under `key`; None where it gives none."""
    tile = config.get(key)
    return tuple(tile) if tile else None


def _tpu_axes(
    config: dict[str, Any], slice_size: str | None, count: int, name: str
) -> list[AxisLink]:
    if slice_size is None or slice_size not in config["slices"]:
        known = ", ".join(f"{config['name']}-{s}" for s in config["slices"])
        raise ValueError(f"unknown slice {name!r}; known {config['name']} slices: {known}")
    layout = config["slices"][slice_size]
    ici = config["ici"]
    latency = ici["hop_latency_s"] + config["collective_step_overhead_s"]
    axes = [
        AxisLink(axis, size, ici["link_bandwidth_bytes_per_s"], latency, wrap, "ici")
        for axis, size, wrap in zip(_ICI_AXES, layout["shape"], layout["wraparound"], strict=False)
    ]
    if count > 1:
        dcn = config["dcn"]
        per_chip = dcn["bandwidth_bytes_per_s_per_host"] / config["chips_per_host"]
        axes.insert(0, AxisLink("dcn", count, per_chip, dcn["latency_s"], False, "dcn"))
    return axes


# Per node kind: devices per host, the local table, the levels of the two axes, and the
# bandwidth key. A CPU host's emulated devices talk through gloo, each its own rank.
_NODE_KINDS = {
    "gpu": ("gpus_per_host", "nvlink", ("nvlink", "infiniband"), "bandwidth_bytes_per_s_per_gpu"),
    "cpu": ("devices_per_host", "local", ("shm", "dcn"), "bandwidth_bytes_per_s_per_device"),
}


def _node_axes(config: dict[str, Any], nodes: int) -> list[AxisLink]:
    per_host, local_table, (local_level, host_level), bandwidth = _NODE_KINDS[config["kind"]]
    local, network = config[local_table], config["network"]
    efficiency = config.get("scatter_efficiency", 1.0)
    local_axis = AxisLink(
        "local",
        config[per_host],
        local[bandwidth],
        local["latency_s"],
        False,
        local_level,
        efficiency,
    )
    host_axis = AxisLink(
        "host", nodes, network[bandwidth], network["latency_s"], False, host_level, efficiency
    )
    return [host_axis, local_axis] if nodes > 1 else [local_axis]
