"""`MultiWorkerMirroredStrategy`: synchronous data parallelism across hosts.

Each worker process runs the same script with its own `TF_CONFIG`. The strategy starts
`jax.distributed` (the coordinator is the chief, or worker 0), uses gloo collectives on CPU
hosts, and lays the devices out as a ("host", "local") mesh so reductions can be
decomposed per level. Per-host input goes through `distribute_datasets_from_function`.
"""

from __future__ import annotations

import atexit
import math
from dataclasses import dataclass

import jax
import numpy as np

from xla_strategies.cluster import SimpleClusterResolver, TFConfigClusterResolver
from xla_strategies.passes import DEFAULT_PIPELINE
from xla_strategies.passes.pipeline import PassPipeline, fill_options
from xla_strategies.passes.transforms.combine_all_reduces import CombineAllReduces
from xla_strategies.reduce_op import ReduceOp
from xla_strategies.strategy import Strategy
from xla_strategies.topology import Topology


@dataclass(frozen=True)
class CommunicationOptions:
    """Attributes:
    timeout_seconds: bounds start-up (waiting for every worker) and the heartbeats that
        detect a dead peer, so a lost worker becomes an error, never a hang.
    bytes_per_pack: the combine-all-reduces bucket size; 0 keeps the strategy's choice.
    """

    timeout_seconds: float | None = None
    bytes_per_pack: int = 0

    def __post_init__(self) -> None:
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {self.timeout_seconds}")
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must not be negative, got {self.bytes_per_pack}")


class MultiWorkerMirroredStrategy(Strategy):
    """One replica per device of every worker; gradients reduced across all of them."""

    pipeline_label = "multi_worker"
    default_pipeline = DEFAULT_PIPELINE + ",decompose-all-reduces"

    def __init__(
        self,
        cluster_resolver: SimpleClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
    ) -> None:
        self.cluster_resolver = cluster_resolver or TFConfigClusterResolver()
        self.communication_options = communication_options or CommunicationOptions()
        _start_distributed(self.cluster_resolver, self.communication_options)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        grid = np.asarray(devices, dtype=object).reshape(jax.process_count(), -1)
        super().__init__(grid, ("host", "local"))

    def pipeline(
        self, gradient_reduction: ReduceOp | None, spec: str | PassPipeline | None = None
    ) -> PassPipeline:
        pipeline = super().pipeline(gradient_reduction, spec)
        pack = self.communication_options.bytes_per_pack
        if not pack:
            return pipeline
        setting = f"CommunicationOptions(bytes_per_pack={pack})"
        return fill_options(pipeline, CombineAllReduces, setting, threshold_bytes=pack)

    @property
    def topology(self) -> Topology | None:
        """On CPU hosts, the gloo profile fitted by benchmarks/multi_worker.py, when the
        hosts have as many devices as it was fitted for; None elsewhere (no estimates)."""
        if self.devices[0].platform != "cpu" or jax.process_count() == 1:
            return None  # one worker: no network level to model
        topology = Topology.from_name(f"{jax.process_count()}xcpu-gloo")
        return topology if topology.mesh_axes.get("local") == jax.local_device_count() else None

    @property
    def worker_index(self) -> int:
        return jax.process_index()

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(workers={jax.process_count()}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def _start_distributed(resolver: SimpleClusterResolver, options: CommunicationOptions) -> None:
    """Start `jax.distributed` once per process, with gloo collectives on CPU hosts."""
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = max(1, math.ceil(options.timeout_seconds)) if options.timeout_seconds else 300
    try:
        jax.distributed.initialize(
            coordinator_address=resolver.coordinator_address,
            num_processes=resolver.num_processes,
            process_id=resolver.process_id,
            initialization_timeout=timeout,
            heartbeat_timeout_seconds=timeout,
            shutdown_timeout_seconds=timeout,
        )
    except Exception as exc:
        raise RuntimeError(
            f"worker {resolver.process_id} of {resolver.num_processes} could not join the cluster "
            f"at {resolver.coordinator_address} (timeout {timeout} s): {str(exc).splitlines()[0]}"
        ) from exc
    atexit.register(_shutdown)


def _shutdown() -> None:
    """Leave the cluster at exit. A barrier first, so a worker that finishes early waits
    for the others here rather than timing out in the shutdown barrier."""
    try:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("xla_strategies shutdown")
    finally:
        jax.distributed.shutdown()
