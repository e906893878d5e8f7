"""Train a flax MLP classifier with ParameterServerStrategy: asynchronous workers and
parameter-server tasks, all Ray actors.

python examples/parameter_server.py --workers 2 --ps 2 --steps 300
TF_CONFIG='{"cluster": {...}}' python examples/parameter_server.py --address auto

Without TF_CONFIG the cluster is `--workers` workers and `--ps` PS tasks on a local Ray
instance. With `--address`, the tasks run on that Ray cluster (see the README).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import xla_strategies as xs
from xla_strategies.demo import models


def dataset_fn():
    """Each worker's own stream: points in 12 dimensions labelled by the nearest of 5
    fixed centres (the centres are the same everywhere, the points are not)."""
    centres = np.random.default_rng(0).normal(size=(5, 12)) * 2
    rng = np.random.default_rng()
    while True:
        x = rng.normal(size=(64, 12)).astype(np.float32) * 2
        y = np.argmin(((x[:, None] - centres[None]) ** 2).sum(-1), axis=1).astype(np.int32)
        yield {"x": x, "y": y}


def resolver(workers: int, ps: int) -> xs.cluster_resolver.SimpleClusterResolver:
    if "TF_CONFIG" in os.environ:
        return xs.cluster_resolver.TFConfigClusterResolver()
    cluster = {
        "chief": ["127.0.0.1:2222"],
        "worker": [f"127.0.0.1:{2300 + i}" for i in range(workers)],
        "ps": [f"127.0.0.1:{2400 + i}" for i in range(ps)],
    }
    return xs.cluster_resolver.SimpleClusterResolver(cluster, "chief", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices-per-worker", type=int, default=2)
    parser.add_argument("--address", default=None, help="a Ray cluster to join, e.g. auto")
    args = parser.parse_args()

    strategy = xs.ParameterServerStrategy(
        resolver(args.workers, args.ps),
        variable_partitioner=xs.partitioners.MinSizePartitioner(4096, max_shards=args.ps),
        address=args.address,
        devices_per_worker=args.devices_per_worker,
    )
    graphdef, params = nnx.split(models.MLP((12, 64, 64, 5), rngs=nnx.Rngs(0)), nnx.Param)
    strategy.create_variables(params, optax.adam(1e-2))

    grad_step = strategy.compile(models.mlp_grad_step(graphdef))  # (grads, loss) per replica

    coordinator = xs.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def worker_fn(it):
        return float(np.mean(grad_step(next(it))))

    losses = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(args.steps)]
    with tqdm(total=args.steps, desc="train") as bar:
        for loss in losses:
            bar.set_postfix(loss=f"{loss.fetch():.3f}")
            bar.update()
    coordinator.join()
    staleness = strategy.staleness()
    summary = {
        "first_loss": losses[0].fetch(),
        "last_loss": float(np.mean([v.fetch() for v in losses[-10:]])),
        "completed": coordinator.completed,
        "updates_per_ps": strategy.versions(),
        "staleness": {str(k): staleness[k] for k in sorted(staleness)},
    }
    print(json.dumps(summary))
    coordinator.shutdown()
    strategy.shutdown()


if __name__ == "__main__":
    main()
