"""Train the flax MLP with MultiWorkerMirroredStrategy: run this once per machine (or per
process), each with its own TF_CONFIG. See the README's "Several machines" section.

    TF_CONFIG='{"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
                "task": {"type": "worker", "index": 0}}' python examples/multi_worker.py
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax
from flax import nnx

import xla_strategies as xs
from xla_strategies.demo import models


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--cpu-devices", type=int, default=4, help="emulated devices per CPU host")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for peers")
    args = parser.parse_args()
    xs.emulate_cpu_devices(args.cpu_devices)
    strategy = xs.MultiWorkerMirroredStrategy(
        communication_options=xs.CommunicationOptions(timeout_seconds=args.timeout)
    )
    graphdef, params = nnx.split(models.MLP((12, 64, 64, 5), rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-2)
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    train_step = strategy.compile(
        models.mlp_train_step(graphdef, tx), name="train_step", donate_argnums=(0, 1)
    )

    def dataset_fn(ctx: xs.InputContext):
        """Each host makes its own part of every global batch, from its own seed."""
        rng = np.random.default_rng(ctx.input_pipeline_id)
        centres = np.random.default_rng(0).normal(size=(5, 12)) * 2
        size = ctx.get_per_host_batch_size(args.global_batch)
        for _ in range(args.steps):
            x = rng.normal(size=(size, 12)).astype(np.float32) * 2
            y = np.argmin(((x[:, None] - centres[None]) ** 2).sum(-1), axis=1).astype(np.int32)
            yield {"x": x, "y": y}

    for step, batch in enumerate(strategy.distribute_datasets_from_function(dataset_fn)):
        *state, per_example = train_step(*state, batch)
        if step % 20 == 0:
            # strategy.reduce is a collective: every worker calls it, the chief prints
            loss = float(strategy.reduce("mean", per_example, axis=0))
            if jax.process_index() == 0:
                print(f"step {step}: loss {loss:.3f}", flush=True)


if __name__ == "__main__":
    main()
