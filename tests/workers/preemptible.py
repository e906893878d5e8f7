"""A preemptible worker: trains the MLP with Adam under MultiWorkerMirroredStrategy inside
a PreemptionCheckpointHandler, printing `STEP n` after each completed step (n counts from
1). With `--sigterm-self-at K` the chief signals itself during step K. The chief writes the final
parameters and optimizer state when the run reaches `--steps`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402
import optax  # noqa: E402

import xla_strategies as xs  # noqa: E402
from tests import helpers  # noqa: E402
from tests.workers.train import per_host  # noqa: E402
from xla_strategies.demo import models  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--sigterm-self-at", type=int, default=None)
    args = parser.parse_args()
    strategy = xs.MultiWorkerMirroredStrategy(
        communication_options=xs.CommunicationOptions(timeout_seconds=60)
    )
    graphdef, params = helpers.mlp()
    tx = optax.adam(1e-2)
    compiled = strategy.compile(models.mlp_train_step(graphdef, tx))

    def train_step(state, batch):
        new_params, new_opt, loss = compiled(state["params"], state["opt"], batch)
        jax.block_until_ready(new_params)
        print(f"STEP {handler.total_run_calls + 1}", flush=True)  # this step is done
        return {"params": new_params, "opt": new_opt}, loss

    batches = helpers.mlp_batches(args.steps)
    iterator = iter(strategy.distribute_datasets_from_function(per_host(batches)))
    manager = xs.CheckpointManager(args.dir, strategy, save_interval_steps=1000)
    with xs.PreemptionCheckpointHandler(strategy, manager, iterator) as handler:
        fresh = {"params": params, "opt": tx.init(params)}
        state = handler.restore(jax.tree.map(strategy.replicate, fresh))
        print(f"RESUMED {handler.total_run_calls}", flush=True)
        while handler.total_run_calls < args.steps:
            batch = next(iterator)
            chief = strategy.cluster_resolver.is_chief
            if chief and handler.total_run_calls + 1 == args.sigterm_self_at:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while the step runs
            state, _ = handler.run(train_step, state, batch)
            time.sleep(args.step_sleep)
    manager.close()
    gathered = {
        jax.tree_util.keystr(path): np.asarray(
            jax.experimental.multihost_utils.process_allgather(leaf, tiled=True)
        )
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    if strategy.cluster_resolver.is_chief:
        partial = Path(args.out).with_suffix(".partial.npz")
        np.savez(partial, **gathered)
        os.replace(partial, args.out)


if __name__ == "__main__":
    main()
