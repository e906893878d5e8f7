"""One worker of benchmarks/multi_worker.py: times a flat all-reduce, its hierarchical
decomposition, and what the default pipeline chooses, for several sizes. The chief prints
one JSON line `RESULT {...}`."""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402

import xla_strategies as xs  # noqa: E402
from xla_strategies.passes import DEFAULT_PIPELINE  # noqa: E402

PIPELINES = {
    "flat": "insert-reductions",
    "hierarchical": "insert-reductions,decompose-all-reduces{force=ordered}",
    "chosen": DEFAULT_PIPELINE + ",decompose-all-reduces",
}


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    repeats = int(sys.argv[2])
    strategy = xs.MultiWorkerMirroredStrategy(
        communication_options=xs.CommunicationOptions(timeout_seconds=120)
    )
    local = jax.local_device_count()

    def reduce(g):
        return xs.get_replica_context().all_reduce(xs.ReduceOp.SUM, g[0])

    results = {}
    for nbytes in sizes:
        n = nbytes // 4
        data = strategy.distribute_datasets_from_function(
            lambda ctx, n=n: [np.ones((local, n), np.float32)]
        )
        grads = next(iter(data))
        steps = {
            name: strategy.compile(reduce, pipeline=spec, name=name)
            for name, spec in PIPELINES.items()
        }
        for step in steps.values():
            jax.block_until_ready(step(grads))
        times = {name: [] for name in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                start = time.perf_counter()
                jax.block_until_ready(step(grads))
                times[name].append(time.perf_counter() - start)
        chosen = steps["chosen"].executable(grads).graph.count_ops("reduce_scatter") > 0
        results[nbytes] = {k: statistics.median(v) for k, v in times.items()}
        results[nbytes]["chosen_algorithm"] = "hierarchical" if chosen else "flat"
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
