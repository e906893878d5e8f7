"""`TPUStrategy`: synchronous training on a TPU slice or multislice, ICI/DCN-aware.

The mesh has one axis per ICI torus dimension ("x", "y"[, "z"]), plus "dcn" across slices,
so the compiler can decompose each reduction along the interconnect (decompose-all-reduces,
driven by the topology's cost model). With `emulate=True` the same mesh is laid out on
emulated CPU devices, so the program and passes run on a machine without TPUs. With
`compile_only=True` the mesh is of the devices XLA's TPU compiler (libtpu) describes for
the topology: steps lower and compile for the real slice on any machine, and nothing runs.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax
import numpy as np

from xla_strategies.distribute.strategy import Strategy
from xla_strategies.hardware.topology import Topology, aot_topology
from xla_strategies.passes import DecomposeAllReduces
from xla_strategies.step.step_strategy import PipelineChanges
from xla_strategies.strategies.logical_devices import (
    assign_to_logical_device,
    cores_per_replica,
    replicate_to_logical_devices,
    split_to_logical_devices,
)
from xla_strategies.strategies.mirrored import MirroredStrategy


class TPUStrategy(Strategy):
    """Data parallelism over every chip of a TPU slice (or slices).

    Args:
        topology: a `Topology` or its name ("v5e-16", "2xv5p-512"). Detected from the TPU
            devices when None; required with `emulate`.
        emulate: lay the topology out on emulated CPU devices (as many as it has chips).
        compile_only: lay it out on the devices XLA's TPU compiler describes for it, on a
            machine with or without TPUs (`pip install 'xla-strategies[tpu]'`): a step's
            `lower(...).compile()` returns a TPU executable, and calling it is an error.
            `xla-strategies aot --topology NAME` makes every TPUStrategy of a script
            compile-only for NAME (`hardware.topology.AOT_TOPOLOGY`).
        tpu_cluster_resolver: kept as `cluster_resolver` (`xs.cluster_resolver.TPUClusterResolver`).
        logical_devices_per_replica: chips each replica spans (tf's logical devices):
            a trailing "model" axis of that many neighbours on the fastest torus axis,
            which XLA's partitioner splits the replica's work over. 1 by default.
        layout_map: a Keras `keras.distribution.LayoutMap` naming "model", for the
            variables of a Keras model built under `scope()`.
        experimental_device_assignment: None, or tf's assignment: its
            `num_cores_per_replica` is `logical_devices_per_replica`.
        pipeline_stages: slices each replica's layers are split over (a "stage" axis
            cut from the slices, over DCN); see `MirroredStrategy`. 1 by default.
        experimental_spmd_xla_partitioning: kept for tf.distribute's signature; a replica
            spanning several chips is always partitioned by XLA's SPMD partitioner.
        generation_compiler_options: compile every step with the XLA options tuned for
            the chips' generation (`[compiler_options]` in `tpu_configs/<generation>.toml`,
            each with its source and measurement). True by default; a step's own
            `compile(compiler_options=...)` win name by name.
    """

    pipeline_label = "tpu"

    def __init__(
        self,
        topology: Topology | str | None = None,
        emulate: bool = False,
        compile_only: bool = False,
        *,
        tpu_cluster_resolver: Any = None,
        experimental_device_assignment: Any = None,
        experimental_spmd_xla_partitioning: bool = False,
        logical_devices_per_replica: int = 1,
        layout_map: Any = None,
        generation_compiler_options: bool = True,
        pipeline_stages: int = 1,
    ) -> None:
        k = cores_per_replica(experimental_device_assignment, logical_devices_per_replica)
        self.cluster_resolver = tpu_cluster_resolver
        self.experimental_spmd_xla_partitioning = experimental_spmd_xla_partitioning
        if not isinstance(generation_compiler_options, bool):
            raise TypeError(
                "generation_compiler_options must be True or False, got "
                f"{generation_compiler_options!r}"
            )
        self.generation_compiler_options = generation_compiler_options
        if aot := aot_topology("tpu"):  # `xla-strategies aot`: the script's own topology
            topology, emulate, compile_only = aot, False, True
        if isinstance(topology, str):
            topology = Topology.from_name(topology)
        if emulate and compile_only:
            raise ValueError("TPUStrategy: emulate and compile_only exclude each other")
        if emulate:
            devices = _emulated_devices(topology)
        elif compile_only:
            devices = _slice_mesh(topology, _compile_only_devices(topology))
        else:
            tpus = [d for d in jax.devices() if d.platform == "tpu"]
            topology = _check_tpus(topology, tpus)
            devices = _slice_mesh(topology, tpus)
        split = topology.split_model_axis(k).split_stage_axis(pipeline_stages)
        axes = tuple(topology.mesh_axes)
        super().__init__(devices, axes, compile_only, k, layout_map, pipeline_stages)
        self._topology = split
        self._topology_whole = topology

    # tf.distribute's logical devices: the model axis (`xla_strategies.strategies.logical_devices`)

    def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
        return assign_to_logical_device(tensor, logical_device_id, self.logical_devices_per_replica)

    def experimental_split_to_logical_devices(
        self, tensor: Any, partition_dimensions: list[int]
    ) -> Any:
        return split_to_logical_devices(
            tensor, partition_dimensions, self.logical_devices_per_replica
        )

    def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
        return replicate_to_logical_devices(tensor, self.logical_devices_per_replica)

    def with_pipeline_stages(self, stages: int) -> TPUStrategy | None:
        """These slices with `stages` pipeline stages across them (compile-only), for the
        planner; None where the topology cannot be cut so (one slice, or a count that
        does not divide the slices)."""
        if stages == self.pipeline_stages:
            return self
        return self._laid_out(stages, self.logical_devices_per_replica)

    def with_logical_devices_per_replica(self, k: int) -> TPUStrategy | None:
        """This slice with `k` chips per replica (compile-only, or emulated), for the
        planner; None where `k` does not divide the slice's fastest axis."""
        if k == self.logical_devices_per_replica:
            return self
        return self._laid_out(self.pipeline_stages, k)

    def _laid_out(self, stages: int, k: int) -> TPUStrategy | None:
        """A compile-only strategy on these chips with `stages` and `k` chips per replica;
        None where the topology cannot be cut so, or the chips are this process's own."""
        whole = self._topology_whole
        try:
            whole.split_model_axis(k).split_stage_axis(stages)
        except ValueError:
            return None
        if not self.compile_only:
            return None  # the chips are the ones this process drives: one layout
        return TPUStrategy(
            whole,
            compile_only=True,
            logical_devices_per_replica=k,
            generation_compiler_options=self.generation_compiler_options,
            pipeline_stages=stages,
        )

    @property
    def topology(self) -> Topology:
        """The slice's topology; with a model axis, its fastest axis cut in two."""
        return self._topology

    def compiler_options(self, gathers_parameters: bool = False) -> dict[str, Any]:
        """The base's, and on TPU chips (real or compile-only) the generation's tuned XLA
        options: those for every step, and for a step that does not gather its parameters
        (`shard_parameters`) those measured to win only there. Emulated CPU devices take
        none of them."""
        options = super().compiler_options()
        if self.generation_compiler_options and self.devices[0].platform == "tpu":
            options.update(self._topology.compiler_options)
            if not gathers_parameters:
                options.update(self._topology.replicated_parameter_options)
        return options

    def sub_strategy(self, replicas: int) -> Strategy:
        """Part of a slice is no torus of its own: its first `replicas` replicas run the
        batch as a `MirroredStrategy`."""
        k = self.logical_devices_per_replica
        return MirroredStrategy(self.devices[: replicas * k], logical_devices_per_replica=k)

    def pipeline_changes(self) -> PipelineChanges:
        """Reductions are decomposed along the ICI and DCN axes."""
        return PipelineChanges(add=(DecomposeAllReduces(),))

    def __repr__(self) -> str:
        only = ", compile_only=True" if self.compile_only else ""
        replicas = f"num_replicas_in_sync={self.num_replicas_in_sync}"
        return f"TPUStrategy({self._topology}, {replicas}{self._logical_devices_shown()}{only})"


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


def _compile_only_devices(topology: Topology | None) -> list[Any]:
    """The chips XLA's TPU compiler describes for `topology`, one device per chip."""
    if topology is None:
        raise ValueError("TPUStrategy(compile_only=True) needs a topology, e.g. 'v5e-256'")
    if importlib.util.find_spec("libtpu") is None:
        raise ImportError(
            "TPUStrategy(compile_only=True) compiles with XLA's TPU compiler, which the "
            "libtpu package provides: pip install 'xla-strategies[tpu]'"
        )
    from jax.experimental import topologies

    description = topologies.get_topology_desc(
        topology_name=topology.libtpu_name,
        platform="tpu",
        num_slices=topology.slice_count,
        wrap=topology.libtpu_wraparound,  # the real slice's torus links, not a mesh's
    )
    # libtpu describes v4 without megacore, a device per TensorCore: one per chip
    return [d for d in description.devices if getattr(d, "core_on_chip", 0) == 0]


# Real TPUs below: runs where jax.devices() are TPU chips.


def _check_tpus(topology: Topology | None, tpus: list[Any]) -> Topology:
    if not tpus:
        kinds = sorted({d.platform for d in jax.devices()})
        raise RuntimeError(
            f"TPUStrategy found no TPU devices (JAX sees {', '.join(kinds)}); on a machine "
            "without TPUs use TPUStrategy('<topology>', emulate=True), e.g. 'v5e-16', or "
            "compile_only=True"
        )
    topology = topology or _detect(tpus)
    if topology.num_devices != len(tpus):
        raise ValueError(
            f"{topology} has {topology.num_devices} chips but JAX sees {len(tpus)} TPUs"
        )
    return topology


def _slice_mesh(topology: Topology, tpus: list[Any]) -> np.ndarray:
    """The chips laid out as the topology's mesh axes, as on the real slices."""
    from jax.experimental import mesh_utils

    sizes = topology.mesh_axes
    ici = [size for axis, size in sizes.items() if axis != "dcn"]
    if "dcn" in sizes:
        dcn = [sizes["dcn"]] + [1] * len(ici)
        return mesh_utils.create_hybrid_device_mesh([1, *ici], dcn, tpus)
    return mesh_utils.create_device_mesh(ici, tpus)


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
