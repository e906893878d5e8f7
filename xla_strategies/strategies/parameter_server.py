"""`ParameterServerStrategy`: asynchronous training with parameter servers, on Ray.

The cluster (how many `worker` and `ps` tasks) comes from the cluster resolver, as in
tf.distribute; the tasks are Ray actors. The process that builds the strategy is the chief:
it holds the `ClusterCoordinator` that schedules work.

    strategy = xs.ParameterServerStrategy(resolver, variable_partitioner=...)
    strategy.create_variables(params, optax.adam(1e-3))   # placed on the PS tasks

    @strategy.compile
    def grad_step(params, batch):                          # per replica, on a worker
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return grads, loss

    coordinator = xs.ClusterCoordinator(strategy)
    dataset = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(dataset)
    losses = [coordinator.schedule(lambda it: grad_step(next(it)), args=(iterator,))
              for _ in range(steps)]
    coordinator.join()
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from xla_strategies.cluster_resolver.tf_config import TFConfigClusterResolver
from xla_strategies.core.errors import UnavailableError
from xla_strategies.runtime.parameter_server.placement import Placement
from xla_strategies.runtime.parameter_server.shard import ParameterShard, call_shards
from xla_strategies.runtime.parameter_server.worker import PSStep, Worker
from xla_strategies.strategies.mirrored import MirroredStrategy


def _reachable(address: str, timeout: float) -> None:
    """Raise `UnavailableError` naming `address` when nothing accepts a connection there
    within `timeout` seconds ("auto" and "local" name no host to try)."""
    found = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)", address)
    if found is None:
        return
    host, port = found.group(1), int(found.group(2))
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise UnavailableError(
            f"ParameterServerStrategy: nothing accepts connections at {address} "
            f"({exc.strerror or exc} within {timeout:g} s); start the Ray cluster there "
            "or pass its address (ray start --head prints it)"
        ) from None


class ParameterServerStrategy:
    """Workers compute gradients on their own devices; PS tasks apply them as they arrive.

    Args:
        cluster_resolver: gives the `worker` and `ps` tasks (default: `TF_CONFIG`).
        variable_partitioner: splits variables along axis 0, e.g.
            `xs.partitioners.MinSizePartitioner(min_shard_bytes, max_shards)`; by default
            every variable is whole, and variables are dealt to the PS tasks by size.
        address: a Ray cluster to join (`"auto"`, `"ray://host:10001"`); by default a local
            Ray instance is started on this machine.
        devices_per_worker: emulated CPU devices per worker process (CPU-only hosts).
        runtime_env: Ray's runtime environment for the tasks (the import path is added).
        connect_timeout: seconds to reach `address` before an `UnavailableError` names it
            (Ray itself would retry for minutes without a word).
    """

    def __init__(
        self,
        cluster_resolver: Any = None,
        variable_partitioner: Callable[..., list[int]] | None = None,
        *,
        address: str | None = None,
        devices_per_worker: int | None = None,
        runtime_env: dict[str, Any] | None = None,
        connect_timeout: float = 30.0,
    ) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        cluster = resolver.cluster_spec()
        self.num_workers, self.num_ps = len(cluster.get("worker", [])), len(cluster.get("ps", []))
        if self.num_workers < 1 or self.num_ps < 1:
            raise ValueError(
                "ParameterServerStrategy needs at least one 'worker' and one 'ps' task in the "
                f"cluster, got {self.num_workers} and {self.num_ps}"
            )
        if devices_per_worker is not None and devices_per_worker < 1:
            raise ValueError(f"devices_per_worker must be at least 1, got {devices_per_worker}")
        self.cluster_resolver = resolver
        self.variable_partitioner = variable_partitioner
        self.devices_per_worker = devices_per_worker
        if address is not None:
            _reachable(address, connect_timeout)
        self._start_ray(address, runtime_env)
        self.placement: Placement | None = None
        self.shards: list[Any] = []

    def _start_ray(self, address: str | None, runtime_env: dict[str, Any] | None) -> None:
        import ray

        if ray.is_initialized():
            return
        env = dict(runtime_env or {})
        # Tasks import what this process imports (the user's modules, by path).
        paths = os.pathsep.join(p for p in sys.path if p)
        env["env_vars"] = {"PYTHONPATH": paths, **env.get("env_vars", {})}
        options = {"include_dashboard": False, "log_to_driver": True, "runtime_env": env}
        if address is None:
            options |= {"address": "local", "_node_ip_address": "127.0.0.1"}
        else:
            options["address"] = address
        ray.init(**options)

    # variables

    def create_variables(self, params: Any, optimizer: Any) -> None:
        """Place `params` on the PS tasks, each of which runs `optimizer` (an optax
        transformation) on its own pieces. Element-wise optimizers (SGD, Adam, ...) give
        the same update as on the whole tree; global ones (norm clipping) see one piece."""
        import ray

        host = jax.tree.map(np.asarray, params)
        self.placement = Placement.build(host, self.num_ps, self.variable_partitioner)
        actor = ray.remote(ParameterShard).options(num_cpus=0, max_restarts=0)
        self.shards = [
            actor.remote(i, pieces, optimizer)
            for i, pieces in enumerate(self.placement.split(host))
        ]

    def variables(self, timeout: float = 60) -> Any:
        """The current variables, assembled from the PS tasks, as numpy arrays."""
        parts = self._from_shards("pull", timeout)
        return self._placement().join([p for _, p in parts])

    def staleness(self, timeout: float = 60) -> Counter[int]:
        """How many updates behind each applied gradient was, counted over all PS tasks."""
        total: Counter[int] = Counter()
        for stats in self._from_shards("stats", timeout):
            total.update({int(k): v for k, v in stats["staleness"].items()})
        return total

    def versions(self, timeout: float = 60) -> list[int]:
        """Updates applied so far by each PS task."""
        return [s["version"] for s in self._from_shards("stats", timeout)]

    def _from_shards(self, method: str, timeout: float) -> list[Any]:
        self._placement()
        return call_shards(self.shards, method, timeout=timeout)

    def _placement(self) -> Placement:
        if self.placement is None:
            raise RuntimeError("call strategy.create_variables(params, optimizer) first")
        return self.placement

    # steps and workers

    def compile(self, grad_fn: Callable[..., Any]) -> PSStep:
        """A per-replica gradient step `grad_fn(params, batch) -> (grads, aux)`, run on a
        worker's local devices with the synchronous pass pipeline."""
        if not callable(grad_fn):
            raise TypeError(f"grad_fn must be callable, got {type(grad_fn).__name__}")
        return PSStep(grad_fn)

    def start_workers(self) -> list[Any]:
        """Start the worker tasks on Ray (the coordinator calls it once)."""
        import ray

        placement = self._placement()
        env: dict[str, Any] = {}
        if self.devices_per_worker is not None:
            flag = f"--xla_force_host_platform_device_count={self.devices_per_worker}"
            env = {"env_vars": {"XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}}
        # A killed worker is restarted by Ray and used again; its closures run elsewhere.
        actor = ray.remote(Worker).options(num_cpus=0, max_restarts=-1, runtime_env=env)
        return [
            actor.remote(i, self.shards, placement, MirroredStrategy)
            for i in range(self.num_workers)
        ]

    def shutdown(self) -> None:
        import ray

        for shard in self.shards:
            ray.kill(shard)
        self.shards = []

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(workers={self.num_workers}, ps={self.num_ps})"
