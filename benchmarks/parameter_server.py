"""Parameter-server benchmark: steps per second with 1, 2 and 4 workers (2 PS tasks), and
how stale the applied gradients were.

A flax MLP (64-256-256-10) classifies a synthetic 10-class problem with Adam on the PS
tasks; each worker has 2 emulated CPU devices and runs the compiled gradient step
synchronously across them. Every configuration runs `--steps` scheduled steps after a
warm-up that compiles on every worker.

What this machine can show: the coordinator, Ray's actor calls and the pull/push traffic,
and how staleness grows with the number of workers. What it cannot show: scaling. All
workers and PS tasks share 2 cores, so more workers mostly add contention.

Run: `python -m benchmarks.parameter_server` (or `make bench`). Writes
results/parameter_server.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"


def _dataset_fn():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(10, 64)).astype(np.float32)

    def dataset_fn():
        local = np.random.default_rng()
        while True:
            y = local.integers(0, 10, size=64).astype(np.int32)
            x = centers[y] + local.normal(scale=0.5, size=(64, 64)).astype(np.float32)
            yield {"x": x, "y": y}

    return dataset_fn


def run(workers: int, steps: int) -> dict[str, Any]:
    import optax
    from flax import nnx

    import xla_strategies as xs
    from xla_strategies.demo import models

    cluster = {"chief": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{10 + i}" for i in range(workers)]}
    cluster["ps"] = ["127.0.0.1:20", "127.0.0.1:21"]
    resolver = xs.cluster_resolver.SimpleClusterResolver(cluster, "chief", 0)
    strategy = xs.ParameterServerStrategy(resolver, devices_per_worker=2)
    graphdef, params = nnx.split(models.MLP((64, 256, 256, 10), rngs=nnx.Rngs(0)), nnx.Param)
    strategy.create_variables(params, optax.adam(1e-3))

    grad_step = strategy.compile(models.mlp_grad_step(graphdef))  # (grads, loss) per replica

    coordinator = xs.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(_dataset_fn()))

    def worker_fn(it):
        return float(np.mean(grad_step(next(it))))

    warm = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(4 * workers)]
    coordinator.join()
    before = sum(strategy.staleness().values())
    start = time.perf_counter()
    losses = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    seconds = time.perf_counter() - start
    staleness = strategy.staleness()
    coordinator.shutdown()
    strategy.shutdown()
    total = sum(staleness.values())
    return {
        "workers": workers,
        "steps_per_second": steps / seconds,
        "first_loss": warm[0].fetch(),
        "last_loss": losses[-1].fetch(),
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "mean_staleness": sum(k * v for k, v in staleness.items()) / total,
        "pushes": total - before,
    }


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results = [run(n, args.steps) for n in args.workers]
    ray.shutdown()
    print(f"\n{'workers':>8} {'steps/s':>8} {'mean staleness':>15}  staleness histogram")
    for r in results:
        hist = ", ".join(f"{k}: {v}" for k, v in r["staleness"].items())
        print(
            f"{r['workers']:>8} {r['steps_per_second']:>8.1f} {r['mean_staleness']:>15.2f}  {hist}"
        )
    print(f"loss: {results[0]['first_loss']:.3f} -> {results[0]['last_loss']:.3f} (1 worker)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parameter_server.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
