"""Train a flax MLP classifier with MirroredStrategy on synthetic data.

python examples/train_mlp.py --steps 200
python examples/train_mlp.py --steps 200 --checkpoint-dir ckpt/   # preemptible, resumable
xla-strategies dump --stop-after-compile -- python examples/train_mlp.py

With `--checkpoint-dir`, a checkpoint is saved every `--save-every` steps, a SIGTERM saves
the step in flight and exits with code 42, and running the command again resumes where the
last checkpoint left off.
"""

from __future__ import annotations

import argparse

import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import xla_strategies as xs
from xla_strategies.demo import models


def batches(steps: int, batch: int, seed: int = 0):
    """Points in 12 dimensions labelled by which of 5 fixed centres is nearest."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(5, 12)) * 2
    for _ in range(steps):
        x = rng.normal(size=(batch, 12)).astype(np.float32) * 2
        y = np.argmin(((x[:, None] - centres[None]) ** 2).sum(-1), axis=1).astype(np.int32)
        yield {"x": x, "y": y}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--save-every", type=int, default=50)
    args = parser.parse_args()
    xs.emulate_cpu_devices(8)  # only the CPU backend; GPUs and TPUs are used as they are

    strategy = xs.MirroredStrategy()
    graphdef, params = nnx.split(models.MLP((12, 64, 64, 5), rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-2)
    with strategy.scope():
        state = strategy.replicate(params), strategy.replicate(tx.init(params))
    train_step = strategy.compile(
        models.mlp_train_step(graphdef, tx), name="train_step", donate_argnums=(0, 1)
    )
    dataset = strategy.experimental_distribute_dataset(batches(args.steps, args.batch))
    if args.checkpoint_dir is None:
        with tqdm(dataset, total=args.steps, desc="train") as bar:
            for batch in bar:
                *state, per_example = train_step(*state, batch)
                bar.set_postfix(loss=f"{float(strategy.reduce('mean', per_example, axis=0)):.3f}")
        return

    def step(state, batch):
        *new_state, per_example = train_step(*state, batch)
        return tuple(new_state), per_example

    iterator = iter(dataset)
    manager = xs.CheckpointManager(
        args.checkpoint_dir, strategy, save_interval_steps=args.save_every
    )
    with manager, xs.PreemptionCheckpointHandler(strategy, manager, iterator) as handler:
        state = handler.restore(tuple(state))
        print(f"starting at step {handler.total_run_calls}", flush=True)
        with tqdm(total=args.steps, initial=handler.total_run_calls, desc="train") as bar:
            while handler.total_run_calls < args.steps:
                state, per_example = handler.run(step, state, next(iterator))
                manager.save(handler.total_run_calls, state, iterator)  # every save_every
                bar.set_postfix(loss=f"{float(strategy.reduce('mean', per_example, axis=0)):.3f}")
                bar.update()
        manager.wait_until_finished()


if __name__ == "__main__":
    main()
