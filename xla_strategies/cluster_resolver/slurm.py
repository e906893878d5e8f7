"""`SlurmClusterResolver`: the cluster of a Slurm job step, read from its environment.

Slurm starts one task per process (`srun`) and tells each its rank and the allocation:

    SLURM_PROCID=3  SLURM_NTASKS=4  SLURM_STEP_NODELIST=node[1-2]  SLURM_STEP_TASKS_PER_NODE=2(x2)

Tasks fill the nodes in node-list order, `tasks_per_node[host]` each, on ports `port_base`,
`port_base + 1`, ...; the jobs (default: every task a worker) take the tasks in order of
their names, as tf.distribute's resolver does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from xla_strategies.cluster_resolver.tf_config import SimpleClusterResolver


class SlurmClusterResolver(SimpleClusterResolver):
    """As `tf.distribute.cluster_resolver.SlurmClusterResolver`.

    Args:
        jobs: job name -> number of tasks; default `{"worker": SLURM_NTASKS}`.
        port_base: the first port on each node.
        gpus_per_node: GPUs on a node; default `SLURM_GPUS_ON_NODE`, else the entries of
            `CUDA_VISIBLE_DEVICES`, else 0 (tf.distribute asks `nvidia-smi`).
        gpus_per_task: GPUs each task gets; default gpus_per_node split evenly over the
            tasks of the fullest node.
        tasks_per_node: an int, or host -> count; default `SLURM_STEP_TASKS_PER_NODE` or
            `SLURM_TASKS_PER_NODE` (`"2(x3),1"`: 2 on each of three nodes, then 1).
        auto_set_gpu: set `CUDA_VISIBLE_DEVICES` to this task's GPUs (when it has any and
            the resolver reads `os.environ`).
        rpc_layer: kept for tf.distribute's signature.
        environ: the environment to read (default `os.environ`).
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str = "grpc",
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        rank, num_tasks = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS")
        if rank >= num_tasks:
            raise ValueError(
                f"SlurmClusterResolver: SLURM_PROCID={rank} is not below "
                f"SLURM_NTASKS={num_tasks}: the ranks of a step are 0 to {num_tasks - 1}"
            )
        hosts = expand_hostlist(_var(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
        per_node = _tasks_per_node(tasks_per_node, hosts, env)
        gpus = _gpus_on_node(env) if gpus_per_node is None else gpus_per_node
        per_task = gpus // max(per_node.values()) if gpus_per_task is None else gpus_per_task
        if max(per_node.values()) * per_task > gpus:
            raise RuntimeError(
                f"SlurmClusterResolver: {max(per_node.values())} tasks per node with "
                f"{per_task} GPUs each need more than the node's {gpus} GPUs"
            )
        jobs = dict(sorted((jobs or {"worker": num_tasks}).items()))
        for job, count in jobs.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise TypeError(
                    f"SlurmClusterResolver: jobs[{job!r}] must be a task count (an int of "
                    f"at least 0), got {count!r}"
                )
        if sum(jobs.values()) != num_tasks:
            raise RuntimeError(
                f"SlurmClusterResolver: jobs={jobs} ask for {sum(jobs.values())} tasks but "
                f"Slurm started {num_tasks} (SLURM_NTASKS)"
            )
        addresses, task_gpus = [], []
        for host in hosts:
            for slot in range(per_node[host]):
                addresses.append(f"{host}:{port_base + slot}")
                task_gpus.append([slot * per_task + g for g in range(per_task)])
        if len(addresses) != num_tasks:
            raise RuntimeError(
                f"SlurmClusterResolver: the nodes hold {len(addresses)} tasks "
                f"({per_node}) but SLURM_NTASKS is {num_tasks}"
            )
        cluster, start = {}, 0
        for job, count in jobs.items():
            cluster[job] = addresses[start : start + count]
            if start <= rank < start + count:
                task_type, task_id = job, rank - start
            start += count
        super().__init__(cluster, task_type, task_id, rpc_layer=rpc_layer, _source="Slurm")
        self.gpus_per_node, self.gpus_per_task = gpus, per_task
        self.task_gpus = task_gpus[rank]
        if auto_set_gpu and self.task_gpus and environ is None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.task_gpus))

    def num_accelerators(
        self, task_type: Any = None, task_id: Any = None, config_proto: Any = None
    ) -> dict[str, int]:
        """This task's GPUs, as tf.distribute counts them."""
        return {"GPU": self.gpus_per_task}


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, in order: `"node[1-3,05],gpu7"` -> node1, node2,
    node3, node05, gpu7. Ranges keep the width of their start (`[01-10]`); several bracket
    groups in one name multiply (`"r[1-2]n[1-2]"` -> r1n1, r1n2, r2n1, r2n2)."""
    hosts: list[str] = []
    for name in _split_outside_brackets(hostlist.strip()):
        hosts.extend(_expand_name(name))
    if not hosts:
        raise ValueError(f"the Slurm node list {hostlist!r} names no host")
    return hosts


def expand_tasks_per_node(tasks: str) -> list[int]:
    """Slurm's task counts per node: `"2(x3),1"` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in tasks.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not found:
            raise ValueError(f"malformed Slurm tasks-per-node entry {item!r} in {tasks!r}")
        counts.extend([int(found.group(1))] * int(found.group(2) or 1))
    return counts


def _expand_name(name: str) -> list[str]:
    found = re.search(r"\[([^\]]*)\]", name)
    if not found:
        return [name]
    head, tail = name[: found.start()], name[found.end() :]
    middles = []
    for part in found.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"malformed range {part!r} in the Slurm host name {name!r}")
        for number in range(int(low), int(high or low) + 1):
            middles.append(str(number).zfill(len(low)))
    return [head + middle + rest for middle in middles for rest in _expand_name(tail)]


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p for p in [*parts, current] if p]


def _tasks_per_node(given: Any, hosts: list[str], env: Mapping[str, str]) -> dict[str, int]:
    if isinstance(given, int):
        return {host: given for host in hosts}
    if given is not None:
        missing = [h for h in hosts if h not in given]
        if missing:
            raise ValueError(f"tasks_per_node names no count for the nodes {missing}")
        return {host: given[host] for host in hosts}
    counts = expand_tasks_per_node(_var(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if len(counts) != len(hosts):
        raise ValueError(
            f"Slurm lists {len(hosts)} nodes but task counts for {len(counts)} ({counts})"
        )
    return dict(zip(hosts, counts, strict=True))


def _gpus_on_node(env: Mapping[str, str]) -> int:
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"])
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()])


def _var(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    raise RuntimeError(
        f"SlurmClusterResolver: {' or '.join(names)} is not set; run under Slurm (srun)"
    )


def _int_var(env: Mapping[str, str], name: str) -> int:
    text = _var(env, name)
    if not text.strip().isdigit():
        raise ValueError(f"{name}={text!r} is not a non-negative integer")
    return int(text)
