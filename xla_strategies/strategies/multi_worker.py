"""`MultiWorkerMirroredStrategy`: synchronous data parallelism across hosts.

Each worker process runs the same script with its own `TF_CONFIG`. The strategy starts
`jax.distributed` (the coordinator is the chief, or worker 0), uses gloo collectives on CPU
hosts, and lays the devices out as a ("host", "local") mesh so reductions can be
decomposed per level. Per-host input goes through `distribute_datasets_from_function`.
Before JAX's service starts, every worker checks in with worker 0 (`cluster_rendezvous`),
so a worker that never starts, or a coordinator port in use, is an `UnavailableError` in
every started worker within the timeout, not an abort.
"""

from __future__ import annotations

import atexit
import math
from collections import Counter
from typing import Any

import jax
import numpy as np

from xla_strategies.cluster_resolver.tf_config import SimpleClusterResolver, TFConfigClusterResolver
from xla_strategies.core.errors import UnavailableError
from xla_strategies.distribute.cross_device_ops import (
    CommunicationOptions,
    implementation_decomposes,
)
from xla_strategies.distribute.strategy import Strategy
from xla_strategies.hardware.topology import Topology
from xla_strategies.passes import CombineAllReduces, DecomposeAllReduces
from xla_strategies.runtime import cluster_health, cluster_rendezvous
from xla_strategies.step.step_strategy import PipelineChanges, Setting
from xla_strategies.strategies.gpu_nodes import compile_only_nodes


class MultiWorkerMirroredStrategy(Strategy):
    """One replica per device of every worker; gradients reduced across all of them."""

    pipeline_label = "multi_worker"
    # A dead peer is an UnavailableError naming it (`cluster_health`) from the step that
    # met it. The cost is the host's dispatch of the next step, no longer overlapped with
    # this one: well under 1% of a multi-host step.
    completes_steps = True

    def __init__(
        self,
        cluster_resolver: SimpleClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        topology: Topology | str | None = None,
        compile_only: bool = False,
        logical_devices_per_replica: int = 1,
        layout_map: Any = None,
        pipeline_stages: int = 1,
    ) -> None:
        """`topology="2xdgx-h100", compile_only=True`: compile for those GPU nodes on a
        machine without them, one process (`pip install 'xla-strategies[gpu]'`); the mesh
        is laid out as on the real cluster, one row per node. `xla-strategies aot
        --topology 2xdgx-h100` makes every MultiWorkerMirroredStrategy of a script so.
        `logical_devices_per_replica=k`: each replica spans k devices of one worker (a
        trailing "model" axis inside each node, over NVLink on GPUs), and `layout_map`
        lays a Keras model's variables out over it, as on `MirroredStrategy`.
        `pipeline_stages=S`: each replica's layers split over S groups of workers (a
        "stage" axis cut from the workers), as on `MirroredStrategy`."""
        self.communication_options = communication_options or CommunicationOptions()
        nodes, gpus = compile_only_nodes(
            "MultiWorkerMirroredStrategy", topology, compile_only, several=True
        )
        if gpus is not None:
            self.cluster_resolver = cluster_resolver
            devices, hosts = gpus, nodes.mesh_axes["host"]
        else:
            self.cluster_resolver = cluster_resolver or TFConfigClusterResolver()
            _start_distributed(self.cluster_resolver, self.communication_options)
            devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
            try:
                _check_same_device_counts(devices)
            except ValueError:
                _shutdown(meet=False)  # every worker fails the same check: leave in order
                raise
            hosts = jax.process_count()
        grid = np.asarray(devices, dtype=object).reshape(hosts, -1)
        super().__init__(
            grid,
            ("host", "local"),
            gpus is not None,
            logical_devices_per_replica,
            layout_map,
            pipeline_stages,
        )
        self._decomposes = implementation_decomposes(
            self.communication_options.implementation, devices[0].platform
        )

    def pipeline_changes(self) -> PipelineChanges:
        """Reductions are decomposed over the host and local axes, unless
        `CommunicationOptions(implementation=RING or NCCL)` asks for one flat collective."""
        return PipelineChanges(add=(DecomposeAllReduces(),) if self._decomposes else ())

    def pipeline_settings(self) -> tuple[Setting, ...]:
        pack = self.communication_options.bytes_per_pack
        if not pack:
            return ()
        source = f"CommunicationOptions(bytes_per_pack={pack})"
        return (Setting(CombineAllReduces, source, {"threshold_bytes": pack}),)

    @property
    def topology(self) -> Topology | None:
        """On GPUs, the nodes' (from the devices' kind); on CPU hosts, the gloo profile
        fitted by benchmarks/multi_worker.py, when the hosts have as many devices as it was
        fitted for; None elsewhere (no estimates)."""
        if self.devices[0].platform == "gpu":
            return super().topology
        if self.devices[0].platform != "cpu" or jax.process_count() == 1:
            return None  # one worker: no network level to model
        topology = Topology.from_name(f"{jax.process_count()}xcpu-gloo")
        if topology.mesh_axes.get("local") != jax.local_device_count():
            return None
        split = topology.split_model_axis(self.logical_devices_per_replica)
        return split.split_stage_axis(self.pipeline_stages)

    def __repr__(self) -> str:
        if self.compile_only:
            return super().__repr__()
        return (
            f"MultiWorkerMirroredStrategy(workers={jax.process_count()}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync}{self._logical_devices_shown()})"
        )


def _check_same_device_counts(devices: list) -> None:
    """Every worker must bring as many devices: the mesh is one row per worker."""
    counts = Counter(d.process_index for d in devices)
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"worker {w} has {n} local devices" for w, n in sorted(counts.items()))
        raise ValueError(
            f"MultiWorkerMirroredStrategy needs the same number of devices on every worker: "
            f"{shown}. Give every worker the same devices (CUDA_VISIBLE_DEVICES, "
            "jax_num_cpu_devices)"
        )


def _start_distributed(resolver: SimpleClusterResolver, options: CommunicationOptions) -> None:
    """Start `jax.distributed` once per process, with gloo collectives on CPU hosts.

    Raises:
        UnavailableError: a worker did not start, or the coordinator's port is taken,
            within `options.timeout_seconds` (300 s by default), in every process.
    """
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # a dead peer must not abort the survivors (`cluster_health`)
    jax.config.update("jax_enable_recoverability", True)
    timeout = max(1, math.ceil(options.timeout_seconds)) if options.timeout_seconds else 300
    # JAX ends the process from C++ on these start-up faults: meet every worker first
    cluster_rendezvous.check_in(
        resolver.coordinator_address, resolver.process_id, resolver.num_processes, timeout
    )
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
        raise UnavailableError(
            f"worker {resolver.process_id} of {resolver.num_processes} could not join the cluster "
            f"at {resolver.coordinator_address} (timeout {timeout} s): {str(exc).splitlines()[0]}"
        ) from exc
    cluster_health.start_watching()
    atexit.register(_shutdown)


def _shutdown(meet: bool = True) -> None:
    """Leave the cluster at exit. A barrier first (`meet`), so a worker that finishes
    early waits for the others here. Then the workers leave before the coordinator
    (worker 0), whose process runs the coordination service: a worker still leaving when
    the service is gone would be ended by JAX. Once a peer has died there is no one to
    meet: leave at once, keeping the process's exit status."""
    from jax._src import distributed

    cluster_health.stop_watching()
    cluster_health.exit_if_peer_lost()  # a peer died: the runtime's teardown would abort
    if distributed.global_state.client is None:
        return
    try:
        if meet:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("xla_strategies shutdown")
    finally:
        if distributed.global_state.process_id == 0:
            cluster_health.wait_until_others_left(_LEAVE_SECONDS)
        jax.distributed.shutdown()


# How long the coordinator waits at exit for the other workers to leave the cluster.
_LEAVE_SECONDS = 60.0
