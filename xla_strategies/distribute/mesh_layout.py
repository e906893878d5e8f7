"""`MeshLayout`: a strategy's devices and mesh, and where its values live on them.

The layout questions every strategy answers the same way, given its device mesh: the
replica axes and the model axis, how a batch is split, how per-replica values are stacked,
how state held split across the replicas is told apart, and which XLA options its devices
need. `Strategy` adds the pass pipeline and tf.distribute's API on top.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_strategies.core.layout import (
    MODEL_AXIS,
    SHARDED_PREFIX,
    STACKED_PREFIX,
    STAGE_AXIS,
    Layout,
    model_dim,
    refuse_foreign_split,
    replica_axes,
)
from xla_strategies.distribute.model_axis import with_model_axis, with_stage_axis
from xla_strategies.hardware.topology import Topology
from xla_strategies.passes.bridge.layouts import replica_spec


class MeshLayout:
    """A strategy's device mesh and the layout of values on it (see `Strategy`)."""

    def __init__(
        self,
        devices: Any,
        axis_names: tuple[str, ...] = ("replica",),
        compile_only: bool = False,
        logical_devices_per_replica: int = 1,
        pipeline_stages: int = 1,
    ) -> None:
        """`devices`: a sequence (one axis) or an array with one dimension per axis name;
        `compile_only`: they are the devices a compiler describes for a topology;
        `logical_devices_per_replica`: devices each replica spans, neighbours on the
        fastest (last) axis, which become the model axis; `pipeline_stages`: stages each
        replica's layers are split over, cut from the slowest (first) axis."""
        array = np.asarray(devices, dtype=object)
        self._compile_only = compile_only
        if array.ndim != len(axis_names):
            raise ValueError(f"{len(axis_names)} mesh axes need a {len(axis_names)}-d device array")
        array, axis_names = with_model_axis(array, axis_names, logical_devices_per_replica)
        array, axis_names = with_stage_axis(array, axis_names, pipeline_stages)
        self._mesh = Mesh(array, axis_names)
        self._replica_axes = replica_axes(axis_names)
        # read for every argument of every step (`model_dim`): kept, not derived each time
        self._devices_per_replica = dict(self._mesh.shape).get(MODEL_AXIS, 1)
        self._stages = dict(self._mesh.shape).get(STAGE_AXIS, 1)
        self._stacked_mesh = Mesh(array, tuple(STACKED_PREFIX + a for a in axis_names))
        self._sharded_mesh = Mesh(array, tuple(SHARDED_PREFIX + a for a in axis_names))
        self._split_first = self.input_spec(True)[:1]
        self._stacked_first = self.stacked_sharding().spec[:1]

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(self._mesh.devices.flat)

    @property
    def num_replicas_in_sync(self) -> int:
        return self._mesh.devices.size // (self.logical_devices_per_replica * self._stages)

    @property
    def pipeline_stages(self) -> int:
        """Stages each replica's layers are split over (the stage axis's size; 1 without)."""
        return self._stages

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes replicas are laid out on: all but the model axis."""
        return self._replica_axes

    @property
    def logical_devices_per_replica(self) -> int:
        """Devices each replica spans (the model axis's size; 1 without one)."""
        return self._devices_per_replica

    def model_dim(self, array: Any) -> int | None:
        """The dimension `array` is split on over this strategy's model axis, or None."""
        sharding = getattr(array, "sharding", None)
        if self.logical_devices_per_replica == 1 or not isinstance(sharding, NamedSharding):
            return None
        ours = _same_mesh(sharding.mesh, self._mesh) or self.is_held_sharded(array)
        return model_dim(sharding.spec) if ours else None

    @property
    def topology(self) -> Topology | None:
        """The interconnect the cost model prices collectives on: on GPUs, the node's
        (`Topology.for_gpu_mesh`, from the devices' kind); None where it is unknown
        (emulated CPU devices, or hardware no `tpu_configs` file describes)."""
        first = self._mesh.devices.flat[0]
        if first.platform != "gpu":
            return None
        shape = dict(self._mesh.shape)
        if self._stages > 1:  # the stage axis is cut from the first: priced as its links
            shape.pop(STAGE_AXIS)
            shape[next(iter(shape))] *= self._stages
        whole = Topology.for_gpu_mesh(first.device_kind, shape)
        return None if whole is None else whole.split_stage_axis(self._stages)

    def compiler_options(self, gathers_parameters: bool = False) -> dict[str, Any]:
        """XLA options for this strategy's programs (`gathers_parameters`: whether the
        step gathers its parameters where used, which some tuned options depend on), on
        CPU devices:

        - When several CPU devices share a host's cores, XLA's parallel task assigner
          splits each large op across the shared thread pool, where the tasks wait behind
          device threads blocked in a collective's rendezvous: a gradient sync in 1 MiB
          buckets took 1.1 s instead of 0.17 s (benchmarks/README.md, "Gradient sync").
          Each device runs its ops whole instead.
        - With a model axis, XLA's SPMD partitioner leaves a `copy` at the root of a
          reduction's computation, and the CPU compiler's all-reduce promotion (bf16 to
          f32) then aborts the process ("Invalid binary instruction opcode copy"). The
          CPU runtime reduces bf16 itself, so the promotion is left out."""
        disabled = []
        if self.devices_share_host_cores:
            disabled.append("cpu-parallel-task-assigner")
        spans = self.logical_devices_per_replica * self._stages > 1
        if spans and self.devices[0].platform == "cpu":
            disabled.append("all-reduce-promotion")
        return {"xla_disable_hlo_passes": ",".join(disabled)} if disabled else {}

    @functools.cached_property
    def devices_share_host_cores(self) -> bool:
        """Whether several of this process's devices are CPU devices on one host's cores:
        emulated devices, whose runtime needs its step dispatch paced
        (`dispatch_pacing`) and its ops kept whole (`compiler_options`). Cached: every
        step call asks, and the mesh is fixed."""
        local = [d for d in self._mesh.devices.flat if d.process_index == jax.process_index()]
        return len(local) > 1 and local[0].platform == "cpu"

    def input_spec(self, per_replica: bool) -> PartitionSpec:
        """Per-replica inputs split dim 0 over the replica axes; mirrored ones are whole."""
        return replica_spec(self._mesh) if per_replica else PartitionSpec()

    @property
    def stacked_mesh(self) -> Mesh:
        """The mesh of stacked per-replica values: this mesh's devices, reserved axis names."""
        return self._stacked_mesh

    @property
    def sharded_mesh(self) -> Mesh:
        """The mesh of mirrored state held split across the replicas between steps."""
        return self._sharded_mesh

    def stacked_sharding(self) -> NamedSharding:
        """Where a stacked per-replica value lives: row r on replica r."""
        return NamedSharding(self._stacked_mesh, replica_spec(self._stacked_mesh))

    def layout(self, array: Any) -> Layout:
        """Whether `array` is a split batch, stacked per-replica values, or mirrored."""
        sharding = getattr(array, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return Layout.MIRRORED
        mesh, first = sharding.mesh, sharding.spec[:1]
        # Runs for every argument of every step: meshes compare by identity first, and
        # the leading specs are computed once, in __init__.
        if _same_mesh(mesh, self._mesh):
            return Layout.SPLIT if first == self._split_first else Layout.MIRRORED
        if not _same_mesh(mesh, self._stacked_mesh) or first != self._stacked_first:
            refuse_foreign_split(array, sharding)
            return Layout.MIRRORED
        if array.shape[:1] != (self.num_replicas_in_sync,):
            raise ValueError(
                f"an array of shape {tuple(array.shape)} is stacked on the strategy's "
                f"stacked mesh, but a stacked value has one row per replica "
                f"({self.num_replicas_in_sync}); split a batch with "
                "experimental_distribute_dataset instead"
            )
        return Layout.STACKED

    def is_held_sharded(self, array: Any) -> bool:
        """Whether `array` is mirrored state a step holds split across the replicas."""
        sharding = getattr(array, "sharding", None)
        return isinstance(sharding, NamedSharding) and _same_mesh(sharding.mesh, self._sharded_mesh)

    def is_per_replica(self, array: Any) -> bool:
        """Whether replicas see different parts of `array` (a split batch or stacked values)."""
        return self.layout(array) is not Layout.MIRRORED

    @property
    def compile_only(self) -> bool:
        """Whether the strategy's devices only compile (`TPUStrategy(compile_only=True)`,
        `MirroredStrategy(topology="dgx-h100", compile_only=True)`): its values are
        abstract `jax.ShapeDtypeStruct`s that carry their sharding, and its steps are
        lowered and compiled, never run."""
        return self._compile_only

    def split_sharding(self) -> NamedSharding:
        """Where a global batch lives: dim 0 split across the replicas (what
        `experimental_distribute_dataset` yields; a `jax.ShapeDtypeStruct` with it is an
        abstract batch)."""
        return NamedSharding(self._mesh, self.input_spec(True))

    def state_sharding(self) -> jax.sharding.Sharding:
        """Where state (parameters, optimizer state) lives between steps: on every replica."""
        return NamedSharding(self._mesh, PartitionSpec())


def _same_mesh(mesh: Mesh, reference: Mesh) -> bool:
    """`mesh` is `reference`: the same object, or its axis names over its devices."""
    return mesh is reference or (
        mesh.axis_names == reference.axis_names and np.array_equal(mesh.devices, reference.devices)
    )
