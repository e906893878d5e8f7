"""Resolvers that ask a cloud's API for the cluster: Kubernetes pods, GCE instance groups.

Each talks to its service through the service's own client library, imported when the
resolver is made (`pip install kubernetes`, `pip install google-api-python-client`), or
through a client object given to it (`override_client`, `service`), as tf.distribute's
resolvers take one. The cluster is read once, when the resolver is made.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from xla_strategies.cluster_resolver.tf_config import SimpleClusterResolver


class KubernetesClusterResolver(SimpleClusterResolver):
    """As `tf.distribute.cluster_resolver.KubernetesClusterResolver`: each job's running
    pods (found by label selector), ordered by pod name, at `tf_server_port`.

    This task is `task_type`/`task_id` when given; otherwise the pod named as this host
    (`HOSTNAME`, which Kubernetes sets to the pod's name). tf.distribute leaves the task
    for the user to set.
    """

    def __init__(
        self,
        job_to_label_mapping: Mapping[str, list[str]] | None = None,
        tf_server_port: int = 8470,
        rpc_layer: str = "grpc",
        override_client: Any = None,
        *,
        task_type: str | None = None,
        task_id: int | None = None,
    ) -> None:
        mapping = job_to_label_mapping or {"worker": ["job-name=tensorflow"]}
        client = override_client if override_client is not None else _kubernetes_client()
        cluster: dict[str, list[str]] = {}
        names: dict[str, list[str]] = {}
        for job, selectors in mapping.items():
            pods = [
                pod
                for selector in selectors
                for pod in client.list_pod_for_all_namespaces(label_selector=selector).items
            ]
            pods.sort(key=lambda pod: pod.metadata.name)
            for pod in pods:
                if pod.status.phase != "Running":
                    raise RuntimeError(
                        f"pod {pod.metadata.name!r} of job {job!r} is not running "
                        f"(phase {pod.status.phase!r})"
                    )
            cluster[job] = [f"{pod.status.pod_ip}:{tf_server_port}" for pod in pods]
            names[job] = [pod.metadata.name for pod in pods]
        if task_type is None:
            task_type, task_id = _own_pod(names, os.environ.get("HOSTNAME", ""))
        super().__init__(cluster, task_type, task_id, rpc_layer=rpc_layer, _source="Kubernetes")


class GCEClusterResolver(SimpleClusterResolver):
    """As `tf.distribute.cluster_resolver.GCEClusterResolver`: the running instances of a
    Compute Engine instance group, by internal IP (sorted), at `port`, as one job."""

    def __init__(
        self,
        project: str,
        zone: str,
        instance_group: str,
        port: int,
        task_type: str = "worker",
        task_id: int = 0,
        rpc_layer: str = "grpc",
        credentials: Any = "default",
        service: Any = None,
    ) -> None:
        if service is None:
            service = _compute_service(None if credentials == "default" else credentials)
        where = {"project": project, "zone": zone}
        addresses, request = (
            [],
            service.instanceGroups().listInstances(
                instanceGroup=instance_group, body={"instanceState": "RUNNING"}, **where
            ),
        )
        while request is not None:
            response = request.execute()
            for item in response.get("items", []):
                name = item["instance"].split("/")[-1]
                instance = service.instances().get(instance=name, **where).execute()
                addresses.append(f"{instance['networkInterfaces'][0]['networkIP']}:{port}")
            request = service.instanceGroups().listInstances_next(request, response)
        if not addresses:
            raise RuntimeError(
                f"GCEClusterResolver: instance group {instance_group!r} in {project}/{zone} "
                "has no running instance"
            )
        cluster = {task_type: sorted(addresses)}
        super().__init__(cluster, task_type, task_id, rpc_layer=rpc_layer, _source="GCE")


def _own_pod(names: dict[str, list[str]], hostname: str) -> tuple[str, int]:
    for job, pods in names.items():
        if hostname in pods:
            return job, pods.index(hostname)
    raise ValueError(
        f"KubernetesClusterResolver: this host ({hostname or 'HOSTNAME unset'}) is none of "
        "the cluster's pods; pass task_type= and task_id="
    )


def _kubernetes_client() -> Any:
    try:
        from kubernetes import client, config
    except ImportError:
        raise ImportError(
            "KubernetesClusterResolver needs the kubernetes package (pip install "
            "kubernetes), or a client passed as override_client"
        ) from None
    try:
        config.load_incluster_config()  # inside a pod
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


def _compute_service(credentials: Any) -> Any:
    try:
        from googleapiclient import discovery
    except ImportError:
        raise ImportError(
            "GCEClusterResolver needs the google-api-python-client package (pip install "
            "google-api-python-client), or a Compute Engine service passed as service"
        ) from None
    return discovery.build("compute", "v1", credentials=credentials)
