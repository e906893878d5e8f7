"""Cluster resolvers read their real sources; each gives MultiWorkerMirroredStrategy what
TF_CONFIG gives it: the cluster, this task, the coordinator and the process ids."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import xla_strategies as xs
from tests.multiprocess import PORT_ATTEMPTS, PORT_TAKEN, ROOT, free_ports
from xla_strategies.cluster_resolver import slurm

SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "5",
    "SLURM_STEP_NODELIST": "node[1-2],gpu07",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_GPUS_ON_NODE": "4",
}


@pytest.fixture
def slurm_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TPU_", "CUDA_VISIBLE")):
            monkeypatch.delenv(name)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
        ("a[08-10],b", ["a08", "a09", "a10", "b"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("single", ["single"]),
    ],
)
def test_hostlist_expansion(hostlist, hosts):
    assert slurm.expand_hostlist(hostlist) == hosts


def test_tasks_per_node_expansion():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="malformed Slurm tasks-per-node entry 'x2'"):
        slurm.expand_tasks_per_node("x2")
    with pytest.raises(ValueError, match="malformed range 'a-b'"):
        slurm.expand_hostlist("node[a-b]")


def test_slurm_resolver_reads_the_environment(slurm_env):
    resolver = xs.cluster_resolver.SlurmClusterResolver(port_base=9000)
    assert resolver.cluster_spec() == {
        "worker": ["node1:9000", "node1:9001", "node2:9000", "node2:9001", "gpu07:9000"]
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    # what MultiWorkerMirroredStrategy reads, as from TF_CONFIG
    assert (resolver.num_processes, resolver.process_id) == (5, 3)
    assert resolver.coordinator_address == "node1:9000"
    # 4 GPUs, 2 tasks on the fullest node: 2 each; task 3 is node2's second
    assert resolver.task_gpus == [2, 3] and resolver.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_slurm_jobs_take_the_tasks_in_name_order(slurm_env):
    resolver = xs.cluster_resolver.SlurmClusterResolver(
        jobs={"worker": 4, "chief": 1}, port_base=9000, auto_set_gpu=False
    )
    assert resolver.cluster_spec() == {
        "chief": ["node1:9000"],
        "worker": ["node1:9001", "node2:9000", "node2:9001", "gpu07:9000"],
    }
    assert (resolver.task_type, resolver.task_id, resolver.process_id) == ("worker", 2, 3)
    slurm_env.setenv("SLURM_JOB_NODELIST", "other[1-5]")  # the step's list wins
    slurm_env.setenv("SLURM_PROCID", "0")
    assert xs.cluster_resolver.SlurmClusterResolver(auto_set_gpu=False).is_chief


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"SLURM_PROCID": None}, RuntimeError, "SLURM_PROCID is not set; run under Slurm"),
        ({"SLURM_NTASKS": "4"}, RuntimeError, "the nodes hold 5 tasks .* SLURM_NTASKS is 4"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2"}, ValueError, "3 nodes but task counts for 1"),
        ({"SLURM_PROCID": "x"}, ValueError, "SLURM_PROCID='x' is not a non-negative integer"),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "2"}, ValueError, "SLURM_PROCID=5 is not below"),
    ],
)
def test_slurm_errors_name_the_variable(slurm_env, change, error, message):
    for name, value in change.items():
        if value is None:
            slurm_env.delenv(name)
        else:
            slurm_env.setenv(name, value)
    with pytest.raises(error, match=message):
        xs.cluster_resolver.SlurmClusterResolver()


def test_slurm_checks_jobs_and_gpus(slurm_env):
    with pytest.raises(RuntimeError, match=r"jobs=\{'worker': 2\} ask for 2 tasks but .* 5"):
        xs.cluster_resolver.SlurmClusterResolver(jobs={"worker": 2})
    with pytest.raises(TypeError, match=r"jobs\['ps'\] must be a task count .* got 'x'"):
        xs.cluster_resolver.SlurmClusterResolver(jobs={"worker": 1, "ps": "x"})
    slurm_env.setenv("SLURM_GPUS_ON_NODE", "1")  # 2 tasks per node: no GPU each
    resolver = xs.cluster_resolver.SlurmClusterResolver()
    assert resolver.gpus_per_task == 0 and "CUDA_VISIBLE_DEVICES" not in os.environ
    with pytest.raises(RuntimeError, match="need more than the node's 1 GPUs"):
        xs.cluster_resolver.SlurmClusterResolver(gpus_per_task=1)


def test_slurm_feeds_multi_worker_mirrored_strategy():
    """Two `srun` tasks on one node: each finds its place in the Slurm environment and
    MultiWorkerMirroredStrategy joins them (2 processes x 2 CPU devices)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TF_CONFIG"))}
    slurm_vars = {"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost",
                  "SLURM_TASKS_PER_NODE": "2", "JAX_PLATFORMS": "cpu"}  # fmt: skip
    for _ in range(PORT_ATTEMPTS):  # a busy run may take the free port before the chief
        (port,) = free_ports(1)
        processes = [
            subprocess.Popen(
                [sys.executable, "tests/workers/slurm_worker.py", str(port)],
                cwd=ROOT,
                env={**base, **slurm_vars, "SLURM_PROCID": str(rank)},
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for rank in range(2)
        ]
        outputs = [p.communicate(timeout=240)[0] for p in processes]
        if not any(PORT_TAKEN in output for output in outputs):
            break
    for rank, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, output[-3000:]
        assert f"TASK worker {rank} REPLICAS 4 SUM 6.0" in output  # 0 + 1 + 2 + 3


# TPU VM


def test_tpu_resolver_reads_the_tpu_vm_environment(slurm_env):
    slurm_env.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4")
    slurm_env.setenv("TPU_WORKER_ID", "2")
    slurm_env.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    resolver = xs.cluster_resolver.TPUClusterResolver()
    assert resolver.cluster_spec() == {"worker": [f"10.0.0.{i}:8470" for i in range(1, 5)]}
    assert (resolver.task_type, resolver.task_id, resolver.process_id) == ("worker", 2, 2)
    assert resolver.accelerator_type == "v5litepod-16"
    assert resolver.coordinator_address == "10.0.0.1:8470"
    slurm_env.setenv("TPU_WORKER_ID", "4")
    with pytest.raises(ValueError, match="TPU_WORKER_ID='4' is not an index into the 4 hosts"):
        xs.cluster_resolver.TPUClusterResolver()


def test_tpu_resolver_elsewhere_says_why(slurm_env):
    with pytest.raises(RuntimeError, match="not on a Cloud TPU VM: TPU_WORKER_HOSTNAMES"):
        xs.cluster_resolver.TPUClusterResolver()
    with pytest.raises(ValueError, match="tpu='my-tpu'.*Cloud TPU API"):
        xs.cluster_resolver.TPUClusterResolver("my-tpu")
    with pytest.raises(ValueError, match="project, zone only serve the Cloud TPU API"):
        xs.cluster_resolver.TPUClusterResolver(zone="us-central2-b", project="p")


# Kubernetes and GCE, through a client given to them


def _pod(name, ip, phase="Running"):
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name), status=SimpleNamespace(phase=phase, pod_ip=ip)
    )


class _Kubernetes:
    def __init__(self, pods):
        self.pods, self.selectors = pods, []

    def list_pod_for_all_namespaces(self, label_selector):
        self.selectors.append(label_selector)
        return SimpleNamespace(items=self.pods.get(label_selector, []))


def test_kubernetes_resolver_lists_running_pods(monkeypatch):
    client = _Kubernetes(
        {
            "job-name=workers": [_pod("w-1", "10.1.0.2"), _pod("w-0", "10.1.0.1")],
            "job-name=chief": [_pod("c-0", "10.1.0.9")],
        }  # fmt: skip
    )
    mapping = {"chief": ["job-name=chief"], "worker": ["job-name=workers"]}
    monkeypatch.setenv("HOSTNAME", "w-1")
    resolver = xs.cluster_resolver.KubernetesClusterResolver(mapping, override_client=client)
    assert resolver.cluster_spec() == {
        "chief": ["10.1.0.9:8470"],
        "worker": ["10.1.0.1:8470", "10.1.0.2:8470"],  # by pod name
    }
    assert (resolver.task_type, resolver.task_id, resolver.process_id) == ("worker", 1, 2)
    client.pods["job-name=workers"].append(_pod("w-2", None, "Pending"))
    with pytest.raises(RuntimeError, match="pod 'w-2' of job 'worker' is not running"):
        xs.cluster_resolver.KubernetesClusterResolver(mapping, override_client=client)


def test_cloud_resolvers_without_their_client_name_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # not installed
    monkeypatch.setitem(sys.modules, "googleapiclient", None)
    with pytest.raises(ImportError, match="pip install kubernetes"):
        xs.cluster_resolver.KubernetesClusterResolver()
    with pytest.raises(ImportError, match="pip install google-api-python-client"):
        xs.cluster_resolver.GCEClusterResolver("p", "z", "group", 2222)


class _Request:
    def __init__(self, response):
        self.response = response

    def execute(self):
        return self.response


class _Compute:
    """The two Compute Engine calls the resolver makes, with two pages of instances."""

    def __init__(self):
        self.pages = [["zz-1", "aa-0"], ["mm-2"]]
        self.ips = {"zz-1": "10.2.0.3", "aa-0": "10.2.0.1", "mm-2": "10.2.0.2"}

    def instanceGroups(self):  # noqa: N802 - the client's name
        return self

    def instances(self):
        return self

    def listInstances(self, project, zone, instanceGroup, body):  # noqa: N802, N803
        assert (project, zone, instanceGroup, body) == ("p", "z", "g", {"instanceState": "RUNNING"})
        return _Request({"items": [{"instance": f"zones/z/instances/{n}"} for n in self.pages[0]]})

    def listInstances_next(self, request, response):  # noqa: N802
        return (
            _Request({"items": [{"instance": f"x/{n}"} for n in self.pages[1]]})
            if (request.response["items"][0]["instance"].startswith("zones"))
            else None
        )

    def get(self, project, zone, instance):
        return _Request({"networkInterfaces": [{"networkIP": self.ips[instance]}]})


def test_gce_resolver_lists_the_instance_group():
    resolver = xs.cluster_resolver.GCEClusterResolver("p", "z", "g", 2222, service=_Compute())
    assert resolver.cluster_spec() == {"worker": [f"10.2.0.{i}:2222" for i in (1, 2, 3)]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)


def test_union_resolver_joins_the_clusters():
    first = xs.cluster_resolver.SimpleClusterResolver({"chief": ["a:1"]}, "chief", 0)
    second = xs.cluster_resolver.SimpleClusterResolver({"worker": ["b:1", "c:1"]}, "worker", 1)
    union = xs.cluster_resolver.UnionResolver(first, second, task_type="worker", task_id=1)
    assert union.cluster_spec() == {"chief": ["a:1"], "worker": ["b:1", "c:1"]}
    assert (union.process_id, union.coordinator_address) == (2, "a:1")
    assert xs.cluster_resolver.UnionResolver(first, second).is_chief
    with pytest.raises(ValueError, match="resolver 1 lists \\['b:1', 'c:1'\\] in job 'worker'"):
        xs.cluster_resolver.UnionResolver(second, second)
    with pytest.raises(TypeError, match="argument 1 is a str, not a cluster resolver"):
        xs.cluster_resolver.UnionResolver(first, "b:1")
