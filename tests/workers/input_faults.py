"""A worker whose input differs from its peer's: `--batches` global batches of its own
length, `--rows` rows per batch on this host, `--devices` local devices. Prints
`BATCHES n` when its epoch ends, or `ERROR <type>: <message>`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs=2, default=(4, 4))
    parser.add_argument("--rows", type=int, nargs=2, default=(8, 8))
    parser.add_argument("--devices", type=int, nargs=2, default=(2, 2))
    args = parser.parse_args()
    import json
    import os

    me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    jax.config.update("jax_num_cpu_devices", args.devices[me])
    import jax.numpy as jnp
    import numpy as np

    import xla_strategies as xs

    try:
        options = xs.CommunicationOptions(timeout_seconds=30)
        strategy = xs.MultiWorkerMirroredStrategy(communication_options=options)
        step = strategy.compile(lambda w, x: w + jnp.mean(x))
        w = strategy.replicate(np.zeros((), np.float32))

        def dataset_fn(ctx):
            rows = args.rows[ctx.input_pipeline_id]
            return [np.ones((rows, 4), np.float32) for _ in range(args.batches[me])]

        iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
        count = 0
        while True:
            try:
                batch = iterator.get_next()
            except xs.errors.OutOfRangeError:
                break
            w = step(w, batch)
            count += 1
        print(f"BATCHES {count}", flush=True)
    except Exception as exc:  # noqa: BLE001 - what the test reads
        print(f"ERROR {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
