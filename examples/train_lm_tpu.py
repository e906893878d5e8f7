"""Train the demo's transformer LM on a TPU slice with TPUStrategy.

python examples/train_lm_tpu.py                        # on the TPU VM's own slice
python examples/train_lm_tpu.py --emulate v5e-8        # the same mesh on 8 CPU devices
xla-strategies aot --topology v5e-256 -- python examples/train_lm_tpu.py --layers 24

The last line needs no TPU: it compiles the first step with XLA's TPU compiler for a
v5e-256 and prints the memory per chip, the collectives XLA kept and the step estimate.
"""

from __future__ import annotations

import argparse

import jax
import optax
from flax import nnx
from tqdm import tqdm

import xla_strategies as xs
from xla_strategies.demo import models
from xla_strategies.demo.data import synthetic_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--emulate", help="a TPU topology to lay out on CPU devices")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-per-chip", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--shard-weight-updates", action="store_true")
    args = parser.parse_args()
    if args.emulate:
        xs.emulate_cpu_devices(xs.Topology.from_name(args.emulate).num_devices)
        strategy = xs.TPUStrategy(args.emulate, emulate=True)
    else:
        strategy = xs.TPUStrategy()

    cfg = models.TransformerConfig(
        vocab=256, width=args.width, heads=4, layers=args.layers, seq_len=args.seq_len
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
    if strategy.compile_only:  # shapes only: a model bigger than this host still compiles
        model = nnx.eval_shape(lambda: models.TransformerLM(cfg, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(model, nnx.Param)
        opt_state = jax.eval_shape(tx.init, params)
    else:
        graphdef, params = nnx.split(models.TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        opt_state = tx.init(params)
    state = strategy.replicate(params), strategy.replicate(opt_state)
    train_step = strategy.compile(
        models.lm_train_step(graphdef, tx),
        name="train_step",
        donate_argnums=(0, 1),
        shard_weight_updates=args.shard_weight_updates or None,
    )
    batch = args.batch_per_chip * strategy.num_replicas_in_sync
    dataset = strategy.experimental_distribute_dataset(
        synthetic_tokens(args.steps, batch, args.seq_len, cfg.vocab)
    )
    with tqdm(dataset, total=args.steps, desc="train", unit="step") as bar:
        for tokens in bar:
            *state, per_example = train_step(*state, tokens)
            bar.set_postfix(loss=f"{float(strategy.reduce('mean', per_example, axis=0)):.3f}")


if __name__ == "__main__":
    main()
