"""A worker: trains the MLP and the transformer with MultiWorkerMirroredStrategy on
per-host input, printing `STEP n`; the chief saves the final parameters atomically.
`--models sharded` trains a float64 MLP with clipped AdamW three times: with weight-update
sharding, with parameter sharding and with neither, and saves the optimizer state too."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402
import optax  # noqa: E402

import xla_strategies as xs  # noqa: E402
from tests import helpers  # noqa: E402
from xla_strategies.demo import models  # noqa: E402


def per_host(batches):
    """dataset_fn: this host's contiguous slice of every global batch."""

    def dataset_fn(ctx: xs.InputContext):
        size = ctx.get_per_host_batch_size(len(jax.tree.leaves(batches[0])[0]))
        start = ctx.input_pipeline_id * size
        return [jax.tree.map(lambda a: a[start : start + size], b) for b in batches]

    return dataset_fn


def train(strategy, step_fn, params, tx, batches, tag, keep=1, **options):
    """The params (and with keep=2 the optimizer state) after training, gathered."""
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    step = strategy.compile(step_fn, donate_argnums=(0, 1), **options)
    for n, batch in enumerate(strategy.distribute_datasets_from_function(per_host(batches))):
        *state, _ = step(*state, batch)
        jax.block_until_ready(state[0])
        print(f"STEP {n}", flush=True)
    pieces = {"": state[0], "opt_state": state[1]} if keep > 1 else {"": state[0]}
    return {
        f"{tag}/{name}{jax.tree_util.keystr(p)}": np.asarray(
            jax.experimental.multihost_utils.process_allgather(x, tiled=True)
        )
        for name, piece in pieces.items()
        for p, x in jax.tree_util.tree_flatten_with_path(piece)[0]
    } | {
        f"{tag}/{name}": np.asarray(
            [strategy.is_held_sharded(x) for x in jax.tree.leaves(piece) if x.ndim]
        )
        for name, piece in (("held_sharded", state[1]), ("params_held_sharded", state[0]))
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--models", default="mlp,transformer,stats")
    args = parser.parse_args()
    options = xs.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = xs.MultiWorkerMirroredStrategy(communication_options=options)
    print(f"READY {strategy}", flush=True)
    results = {}
    tx = optax.sgd(0.1)
    if "mlp" in args.models:
        graphdef, params = helpers.mlp()
        results |= train(
            strategy,
            models.mlp_train_step(graphdef, tx),
            params,
            tx,
            helpers.mlp_batches(args.steps),
            "mlp",
        )
    if "transformer" in args.models:
        graphdef, params, cfg = helpers.transformer()
        results |= train(
            strategy,
            models.lm_train_step(graphdef, tx),
            params,
            tx,
            helpers.lm_batches(args.steps, cfg),
            "transformer",
        )
    if "stats" in args.models:  # per-replica state across hosts: stacked, fed back
        step = strategy.compile(lambda stats, batch: 0.9 * stats + 0.1 * batch["x"].mean(0))
        stats = np.zeros(12, np.float32)
        dataset = strategy.distribute_datasets_from_function(
            per_host(helpers.mlp_batches(args.steps))
        )
        for batch in dataset:
            stats = step(stats, batch)
        gathered = jax.experimental.multihost_utils.process_allgather(stats, tiled=True)
        results["stats"] = np.asarray(gathered)
    if "sharded" in args.models:  # weight-update sharding across hosts against replicated
        jax.config.update("jax_enable_x64", True)
        graphdef, params = helpers.mlp(np.float64)
        tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))
        batches = helpers.mlp_batches(args.steps, dtype=np.float64)
        for tag, options in (
            ("sharded=True", {"shard_weight_updates": True}),
            ("sharded=params", {"shard_parameters": True}),
            ("sharded=False", {"shard_weight_updates": False}),
        ):
            results |= train(
                strategy,
                models.mlp_train_step(graphdef, tx),
                params,
                tx,
                batches,
                tag,
                keep=2,
                **options,
            )
    if strategy.cluster_resolver.is_chief:
        out = Path(args.out)
        partial = out.with_suffix(".partial.npz")
        np.savez(partial, **results)
        os.replace(partial, out)  # never a half-written result


if __name__ == "__main__":
    main()
