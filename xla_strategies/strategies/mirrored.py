"""`MirroredStrategy`: synchronous data parallelism over the local devices of one host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xla_strategies.distribute.cross_device_ops import CrossDeviceOps, ReductionToOneDevice
from xla_strategies.distribute.strategy import Strategy
from xla_strategies.hardware.devices import resolve_devices
from xla_strategies.hardware.topology import Topology
from xla_strategies.step.step_strategy import PipelineChanges
from xla_strategies.strategies.gpu_nodes import compile_only_nodes


class MirroredStrategy(Strategy):
    """One replica per device in `devices` (default: all local devices).

    Parameters are mirrored on every device, each replica gets a slice of the global batch,
    and gradients are reduced across replicas (MEAN by default) inside one XLA program.
    `cross_device_ops` (`xs.NcclAllReduce`, `xs.HierarchicalCopyAllReduce`,
    `xs.ReductionToOneDevice`) picks how the passes rewrite those reductions
    (`xla_strategies.distribute.cross_device_ops`); None keeps the default pipeline.

    `topology="dgx-h100", compile_only=True` lays the strategy out on the GPUs XLA's GPU
    compiler describes for one such node, on a machine without them
    (`pip install 'xla-strategies[gpu]'`): a step's `lower(...).compile()` returns a GPU
    executable, and calling it is an error. `xla-strategies aot --topology dgx-h100` makes
    every MirroredStrategy of a script compile-only for that node.

    `logical_devices_per_replica=k` makes each replica span k neighbouring devices (a
    trailing "model" axis; `num_replicas_in_sync` is the device count / k). Inside the
    step a value is whole; the shardings the step declares over "model" lay it out.
    `layout_map` (a `keras.distribution.LayoutMap` naming "model") lays out the variables
    of a Keras model built under `scope()`.

    `pipeline_stages=S` splits each replica's layers over S devices (a "stage" axis cut
    from the first devices; `num_replicas_in_sync` is the device count / (S * k)): a
    gradient the step takes with `jax.grad` or `jax.value_and_grad` of a model whose layers
    are a scan over stacked weights runs as a pipeline schedule
    (`compile(microbatches=, schedule=)`).
    """

    pipeline_label = "mirrored"

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        *,
        topology: Topology | str | None = None,
        compile_only: bool = False,
        logical_devices_per_replica: int = 1,
        layout_map: Any = None,
        pipeline_stages: int = 1,
    ) -> None:
        node, gpus = compile_only_nodes("MirroredStrategy", topology, compile_only, several=False)
        if gpus is not None and devices is not None:
            raise ValueError(
                "MirroredStrategy(compile_only=True) takes the node's GPUs, not devices"
            )
        devices = gpus if gpus is not None else resolve_devices(devices)
        self.cross_device_ops = cross_device_ops
        k = logical_devices_per_replica
        if cross_device_ops is None:
            super().__init__(
                devices, ("replica",), node is not None, k, layout_map, pipeline_stages
            )
            return
        if not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                "cross_device_ops must be an xs.NcclAllReduce, xs.HierarchicalCopyAllReduce "
                f"or xs.ReductionToOneDevice, got {type(cross_device_ops).__name__}"
            )
        if pipeline_stages != 1:
            raise ValueError(
                "pipeline_stages splits the layers over the strategy's own stage axis; "
                "cross_device_ops chooses the mesh itself: give one of them"
            )
        super().__init__(*cross_device_ops.mesh(devices), node is not None, k, layout_map)
        cross_device_ops.changes(self.devices)  # a bad choice fails here, not at compile
        # the update runs on one device: there is no update to shard
        self.shards_weight_updates = not isinstance(cross_device_ops, ReductionToOneDevice)

    def pipeline_changes(self) -> PipelineChanges:
        if self.cross_device_ops is None:
            return PipelineChanges()
        return self.cross_device_ops.changes(self.devices)

    def sub_strategy(self, replicas: int) -> MirroredStrategy:
        k, stages = self.logical_devices_per_replica, self.pipeline_stages
        devices = self._mesh.devices.reshape(stages, -1)[:, : replicas * k].reshape(-1)
        return MirroredStrategy(
            list(devices),
            self.cross_device_ops,
            logical_devices_per_replica=k,
            pipeline_stages=stages,
        )
