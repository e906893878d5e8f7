"""`xla-strategies demo`: train the transformer LM with `MirroredStrategy` and report what
the compiler did to its cross-replica reductions."""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size (default 32)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--width", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per example (default 32)")
    parser.add_argument("--learning-rate", type=float, default=3e-3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import optax
    from flax import nnx
    from tqdm import tqdm

    import xla_strategies as xs
    from xla_strategies.demo import models
    from xla_strategies.demo.data import synthetic_tokens
    from xla_strategies.hardware.hlo import count_hlo_collectives
    from xla_strategies.passes.cost.collective_stats import collective_summary

    strategy = xs.MirroredStrategy()
    if args.batch_size % strategy.num_replicas_in_sync:
        raise SystemExit(
            f"--batch-size {args.batch_size} does not divide across "
            f"{strategy.num_replicas_in_sync} replicas"
        )
    cfg = models.TransformerConfig(
        vocab=64, width=args.width, heads=4, layers=args.layers, seq_len=args.seq_len
    )
    graphdef, params = nnx.split(models.TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.learning_rate))
    with strategy.scope():
        state = strategy.replicate(params), strategy.replicate(tx.init(params))
    train_step = strategy.compile(
        models.lm_train_step(graphdef, tx), name="train_step", donate_argnums=(0, 1)
    )
    dataset = strategy.experimental_distribute_dataset(
        synthetic_tokens(args.steps, args.batch_size, args.seq_len, cfg.vocab)
    )
    print(
        f"{strategy}: {cfg.layers}-layer transformer LM, {_count(params):,} parameters, "
        f"global batch {args.batch_size}, "
        f"devices: {jax.devices()[0].platform} x {jax.device_count()}"
    )
    losses, step_times = [], []
    with tqdm(dataset, total=args.steps, desc="train", unit="step") as bar:
        for batch in bar:
            start = time.perf_counter()
            *state, per_example = train_step(*state, batch)
            loss = float(strategy.reduce(xs.ReduceOp.MEAN, per_example, axis=0))
            step_times.append(time.perf_counter() - start)
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}")

    executable = train_step.executable(*state, batch)
    hlo = train_step.lower(*state, batch).compile().as_text()
    report = {
        "first_loss": losses[0],
        "last_loss": float(np.mean(losses[-5:])),
        "captured": executable.captured_text_stats,
        "optimised": collective_summary(executable.graph),
        "hlo_all_reduce": count_hlo_collectives(hlo)["all-reduce"],
        "step_ms": 1e3 * float(np.median(step_times[len(step_times) // 2 :])),
        "compile_s": executable.seconds,
    }
    _print_report(report)
    return report


def _count(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _print_report(r: dict[str, Any]) -> None:
    print(f"\nloss: {r['first_loss']:.3f} -> {r['last_loss']:.3f} (mean of the last 5 steps)")
    rows = [
        ("all-reduces per step, as captured", r["captured"]["all_reduce_count"]),
        ("all-reduce bytes per step, as captured", f"{r['captured']['all_reduce_bytes']:,}"),
        ("all-reduces per step, after the pipeline", r["optimised"]["all_reduce_count"]),
        (
            "all-reduce bytes per step, after the pipeline",
            f"{r['optimised']['all_reduce_bytes']:,}",
        ),
        ("all-reduce instructions in XLA's compiled HLO", r["hlo_all_reduce"]),
        ("step time (median, ms)", f"{r['step_ms']:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"  {name:<{width}}  {value}" for name, value in rows))
