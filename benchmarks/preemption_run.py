"""One worker of benchmarks/preemption.py: times the same train step called directly and
through PreemptionCheckpointHandler.run, in alternating blocks. The chief prints one JSON
line `RESULT {...}`."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import xla_strategies as xs  # noqa: E402
from xla_strategies.demo import models  # noqa: E402


def main() -> None:
    blocks, steps = int(sys.argv[1]), int(sys.argv[2])
    strategy = xs.MultiWorkerMirroredStrategy(
        communication_options=xs.CommunicationOptions(timeout_seconds=120)
    )
    graphdef, params = nnx.split(models.MLP((64, 256, 256, 10), rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-3)
    compiled = strategy.compile(models.mlp_train_step(graphdef, tx), donate_argnums=(0, 1))
    rng = np.random.default_rng(jax.process_index())
    per_host = 8 * jax.local_device_count()
    data = strategy.distribute_datasets_from_function(
        lambda ctx: [
            {
                "x": rng.normal(size=(per_host, 64)).astype(np.float32),
                "y": rng.integers(0, 10, per_host).astype(np.int32),
            }
        ]
    )
    batch = next(iter(data))

    def step(state, batch):
        *new, loss = compiled(*state, batch)
        jax.block_until_ready(loss)
        return tuple(new), loss

    state = (strategy.replicate(params), strategy.replicate(tx.init(params)))
    times: dict[str, list[float]] = {"direct": [], "handler": []}
    with tempfile.TemporaryDirectory() as tmp:
        manager = xs.CheckpointManager(tmp, strategy)
        with xs.PreemptionCheckpointHandler(strategy, manager) as handler:
            for _ in range(3):
                state, _ = handler.run(step, state, batch)  # compile both paths
            for _ in range(blocks):
                for name in times:
                    start = time.perf_counter()
                    for _ in range(steps):
                        if name == "direct":
                            state, _ = step(state, batch)
                        else:
                            state, _ = handler.run(step, state, batch)
                    times[name].append((time.perf_counter() - start) / steps)
        manager.close()
    if strategy.cluster_resolver.is_chief:
        result = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
