"""A worker that finds its cluster in the Slurm environment (as `srun` sets it), starts
MultiWorkerMirroredStrategy from it, and prints its task and a cross-worker sum."""

from __future__ import annotations

import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402

import xla_strategies as xs  # noqa: E402

resolver = xs.cluster_resolver.SlurmClusterResolver(port_base=int(sys.argv[1]))
strategy = xs.MultiWorkerMirroredStrategy(
    resolver, xs.experimental.CommunicationOptions(timeout_seconds=60)
)
ids = strategy.experimental_distribute_values_from_function(
    lambda context: np.float32(context.replica_id_in_sync_group)
)
total = float(strategy.reduce("sum", ids))
print(f"TASK {resolver.task_type} {resolver.task_id} REPLICAS {strategy.num_replicas_in_sync} "
      f"SUM {total}", flush=True)  # fmt: skip
