"""A worker that only joins the cluster: it builds MultiWorkerMirroredStrategy with
`--timeout` seconds, runs one all-reduce across the workers and prints `JOINED <sum>`.
A start-up fault prints `CAUGHT at <time> <error>` and exits with status 5. With
`--late-worker i --delay s`, worker i waits s seconds before joining: it starts late."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402

import xla_strategies as xs  # noqa: E402
from tests.workers.statuses import CAUGHT_STATUS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=10)
    parser.add_argument("--late-worker", type=int, default=None)
    parser.add_argument("--delay", type=float, default=0)
    args = parser.parse_args()
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == args.late_worker:
        time.sleep(args.delay)
    options = xs.CommunicationOptions(timeout_seconds=args.timeout)
    try:
        strategy = xs.MultiWorkerMirroredStrategy(communication_options=options)
    except xs.errors.UnavailableError as exc:
        print(f"CAUGHT at {time.time():.3f} {type(exc).__name__}: {exc}", flush=True)
        sys.exit(CAUGHT_STATUS)
    from jax.experimental import multihost_utils

    ones = np.ones(1, np.float32) * (jax.process_index() + 1)
    total = multihost_utils.process_allgather(ones).sum()
    print(f"JOINED {total:g} on {strategy.num_replicas_in_sync} replicas", flush=True)


if __name__ == "__main__":
    main()
