"""`TPUClusterResolver`: the hosts of the Cloud TPU VM slice this process runs on.

A TPU VM slice tells each host who it is through its environment (what JAX's own TPU
cluster detection reads): `TPU_WORKER_HOSTNAMES` (or `TPU_PROCESS_ADDRESSES`) lists the
slice's hosts, `TPU_WORKER_ID` is this host's index, `TPU_ACCELERATOR_TYPE` the slice
(e.g. "v5litepod-16"). A single-host TPU VM without them is one worker, itself. The
metadata server and the Cloud TPU API (tf.distribute's way to look a TPU up by name) are
not queried.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from typing import Any

from xla_strategies.cluster_resolver.tf_config import SimpleClusterResolver

#: The port a TPU VM worker serves on, as in tf.distribute.
TPU_WORKER_PORT = 8470


class TPUClusterResolver(SimpleClusterResolver):
    """As `tf.distribute.cluster_resolver.TPUClusterResolver`, for the TPU VM it runs on.

    Args:
        tpu: None or "local" (this slice). A TPU's name or gRPC address would need the
            Cloud TPU API, which is not provided.
        job_name: the job the hosts form ("worker").
        environ: the environment to read (default `os.environ`).
    Other tf.distribute arguments (zone, project, credentials, ...) only serve the Cloud
    TPU API and must be left unset.
    """

    def __init__(
        self,
        tpu: str | None = None,
        zone: str | None = None,
        project: str | None = None,
        job_name: str = "worker",
        coordinator_name: str | None = None,
        coordinator_address: str | None = None,
        credentials: str = "default",
        service: Any = None,
        discovery_url: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        if tpu not in (None, "", "local"):
            raise ValueError(
                f"TPUClusterResolver(tpu={tpu!r}): looking a TPU up by name or address needs "
                "the Cloud TPU API, which is not provided; run on the TPU VM with tpu=None"
            )
        api = {"zone": zone, "project": project, "coordinator_name": coordinator_name,
               "coordinator_address": coordinator_address, "service": service,
               "discovery_url": discovery_url}  # fmt: skip
        given = sorted(k for k, v in api.items() if v is not None)
        if given or credentials != "default":
            raise ValueError(
                f"TPUClusterResolver: {', '.join(given) or 'credentials'} only serve the "
                "Cloud TPU API, which is not provided; leave them unset on the TPU VM"
            )
        env = os.environ if environ is None else environ
        hosts, worker = _slice_hosts(env)
        cluster = {job_name: [h if ":" in h else f"{h}:{TPU_WORKER_PORT}" for h in hosts]}
        super().__init__(cluster, job_name, worker, _source="TPU VM environment")
        self.accelerator_type = env.get("TPU_ACCELERATOR_TYPE", "")

    def num_accelerators(
        self, task_type: Any = None, task_id: Any = None, config_proto: Any = None
    ) -> dict[str, int]:
        """The TPU chips JAX sees on this host."""
        import jax

        return {"TPU": sum(1 for d in jax.local_devices() if d.platform == "tpu")}


def _slice_hosts(env: Mapping[str, str]) -> tuple[list[str], int]:
    """The slice's hosts (with a port where the environment gives one), in worker order,
    and this host's index."""
    listed = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if listed:
        hosts = [h.strip() for h in listed.split(",") if h.strip()]
        worker = env.get("TPU_WORKER_ID", "")
        if not worker.isdigit() or int(worker) >= len(hosts):
            raise ValueError(
                f"TPUClusterResolver: TPU_WORKER_ID={worker!r} is not an index into the "
                f"{len(hosts)} hosts of TPU_WORKER_HOSTNAMES"
            )
        return hosts, int(worker)
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return ["localhost"], 0  # a single-host TPU VM
    raise RuntimeError(
        "TPUClusterResolver: not on a Cloud TPU VM: TPU_WORKER_HOSTNAMES and "
        "TPU_WORKER_ID are not set and this machine has no TPU chips (/dev/accel*, "
        "/dev/vfio/*). Elsewhere describe the cluster with TF_CONFIG "
        "(TFConfigClusterResolver) or SimpleClusterResolver"
    )
