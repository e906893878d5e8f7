"""Cluster configuration: `TF_CONFIG` parsing and cluster resolvers, as in tf.distribute.

    TF_CONFIG='{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"]},
                "task": {"type": "worker", "index": 0}}'

The JAX coordinator is the chief, or worker 0 when there is no chief. Process ids number
the chief first, then the workers in order; "ps" and "evaluator" tasks run no replicas.

Exposed as `xs.cluster_resolver.TFConfigClusterResolver` and `SimpleClusterResolver`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
SINGLETON_TASKS = ("chief", "evaluator")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


def validate_cluster(cluster: Any, task_type: Any, task_id: Any, source: str = "cluster") -> None:
    """Raise ValueError naming the problem, as tf.distribute's resolvers do."""
    if not isinstance(cluster, Mapping) or not cluster:
        raise ValueError(
            f"{source}: 'cluster' must be a non-empty object of task type -> addresses"
        )
    for job, addresses in cluster.items():
        if job not in TASK_TYPES:
            raise ValueError(
                f"{source}: unknown task type {job!r} in 'cluster'; known: {', '.join(TASK_TYPES)}"
            )
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(
                f"{source}: cluster[{job!r}] must be a non-empty list of 'host:port' addresses"
            )
        if job in SINGLETON_TASKS and len(addresses) > 1:
            raise ValueError(f"{source}: at most one {job} is allowed, got {len(addresses)}")
        for address in addresses:
            found = _ADDRESS.match(address) if isinstance(address, str) else None
            if not found or not 0 < int(found.group(2)) < 65536:
                raise ValueError(
                    f"{source}: malformed address {address!r} in cluster[{job!r}]; "
                    "expected 'host:port'"
                )
    if task_type not in TASK_TYPES:
        raise ValueError(
            f"{source}: unknown task type {task_type!r}; known: {', '.join(TASK_TYPES)}"
        )
    if task_type not in cluster:
        raise ValueError(
            f"{source}: task type {task_type!r} is not in the cluster ({', '.join(cluster)})"
        )
    if not isinstance(task_id, int) or isinstance(task_id, bool):
        raise ValueError(f"{source}: task index must be an integer, got {task_id!r}")
    if not 0 <= task_id < len(cluster[task_type]):
        raise ValueError(
            f"{source}: task index {task_id} is out of range for {len(cluster[task_type])} "
            f"{task_type} task(s)"
        )


@dataclass(frozen=True)
class SimpleClusterResolver:
    """A cluster given directly: `cluster_spec` maps task type -> list of 'host:port'."""

    cluster: Mapping[str, list[str]]
    task_type: str
    task_id: int
    rpc_layer: str = "grpc"
    environment: str = ""
    _source: str = field(default="SimpleClusterResolver", repr=False)

    def __post_init__(self) -> None:
        validate_cluster(self.cluster, self.task_type, self.task_id, self._source)

    def cluster_spec(self) -> dict[str, list[str]]:
        return {job: list(addresses) for job, addresses in self.cluster.items()}

    @property
    def replica_tasks(self) -> list[tuple[str, int]]:
        """The tasks that run replicas, in process-id order: the chief, then the workers."""
        return [
            (job, i) for job in ("chief", "worker") for i in range(len(self.cluster.get(job, [])))
        ]

    @property
    def num_processes(self) -> int:
        return len(self.replica_tasks)

    @property
    def process_id(self) -> int:
        task = (self.task_type, self.task_id)
        if task not in self.replica_tasks:
            raise ValueError(
                f"a {self.task_type} task runs no replicas; only chief and worker tasks do"
            )
        return self.replica_tasks.index(task)

    @property
    def coordinator_address(self) -> str:
        job = "chief" if "chief" in self.cluster else "worker"
        return self.cluster[job][0]

    @property
    def is_chief(self) -> bool:
        return self.process_id == 0


def TFConfigClusterResolver(environ: Mapping[str, str] | None = None) -> SimpleClusterResolver:  # noqa: N802
    """The cluster described by the `TF_CONFIG` environment variable."""
    text = (os.environ if environ is None else environ).get("TF_CONFIG")
    if not text:
        raise ValueError("TF_CONFIG is not set; set it to the cluster's JSON description")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
    for key in ("cluster", "task"):
        if key not in config:
            raise ValueError(f"TF_CONFIG has no {key!r} field")
    task = config["task"]
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise ValueError("TF_CONFIG 'task' must have 'type' and 'index'")
    return SimpleClusterResolver(
        config["cluster"],
        task["type"],
        task["index"],
        rpc_layer=config.get("rpc_layer", "grpc"),
        environment=config.get("environment", ""),
        _source="TF_CONFIG",
    )
