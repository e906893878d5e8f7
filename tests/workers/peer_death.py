"""A worker whose peer dies mid-training: it trains until a step (or the wait for the
next batch) fails, then runs an emergency handler (a save that takes `--handler-seconds`)
and exits with status 7. Prints `STEP n` after each step, `CAUGHT <error>` and `SAVED` as
it goes. `--stall-at N`: worker 1's data never yields batch N (it prints `STALLED` once
every earlier step has finished), so its peer waits for that batch, not in a step."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402
import optax  # noqa: E402

import xla_strategies as xs  # noqa: E402
from tests import helpers  # noqa: E402
from xla_strategies.demo import models  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--handler-seconds", type=float, default=20)
    parser.add_argument("--timeout", type=float, default=10)
    parser.add_argument("--stall-at", type=int, default=None)
    args = parser.parse_args()
    options = xs.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = xs.MultiWorkerMirroredStrategy(communication_options=options)
    tx = optax.sgd(0.1)
    graphdef, params = helpers.mlp()
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    step = strategy.compile(models.mlp_train_step(graphdef, tx), donate_argnums=(0, 1))
    batches = helpers.mlp_batches(1000)
    stepped = threading.Event()
    if args.stall_at is not None and jax.process_index() == 1:
        batches = _stalling(batches, args.stall_at, stepped)
    try:
        for n, batch in enumerate(strategy.experimental_distribute_dataset(batches)):
            *state, _ = step(*state, batch)
            jax.block_until_ready(state[0])
            print(f"STEP {n}", flush=True)
            if n + 1 == args.stall_at:
                stepped.set()
    except Exception as exc:  # noqa: BLE001 - what a user's emergency handler catches
        started = time.monotonic()
        print(
            f"CAUGHT at {time.time():.3f} {type(exc).__name__}: {exc}".splitlines()[0], flush=True
        )
        try:
            step(*state, batch)  # a loop that carries on
        except xs.errors.UnavailableError as again:
            print(f"NEXT STEP {type(again).__name__}: {again}", flush=True)
        time.sleep(args.handler_seconds)  # an emergency checkpoint of a large model
        np.save(args.out, np.zeros(4))
        print(f"SAVED after {time.monotonic() - started:.1f} s", flush=True)
        sys.exit(7)


def _stalling(batches: list, stall_at: int, stepped: threading.Event):
    """`batches` up to `stall_at`, then a read that never returns (a stuck file system)."""
    yield from batches[:stall_at]
    stepped.wait()
    print("STALLED", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
