"""Train-step benchmark: the same per-replica transformer step seven ways, side by side.

(a) xla_strategies, default pipeline        (d) xla_strategies, every optimisation disabled
(b) jax.shard_map(check_vma=True), psums    (e) compute only: no cross-replica reductions
(c) jax.jit, batch sharded by NamedSharding (automatic SPMD)
(f) CentralStorageStrategy: gradients reduced to one device, update there, broadcast back
(g) xla_strategies, shard_weight_updates=True: reduce-scatter, 1/N of the update, all-gather
(h) xla_strategies, shard_parameters=True: parameters and optimizer state held split, each
    scanned layer gathered inside the loop

Run: `python -m benchmarks.train_step` (or `make bench`). Writes results/train_step.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

RESULTS = Path(__file__).parent / "results"
VARIANTS = {
    "a": "xla_strategies, default pipeline",
    "b": "jax.shard_map, check_vma psums",
    "c": "jax.jit, sharded batch (SPMD)",
    "d": "xla_strategies, passes disabled",
    "e": "compute only (no reductions)",
    "f": "CentralStorageStrategy",
    "g": "xla_strategies, sharded weight update",
    "h": "xla_strategies, sharded parameters",
}


def build(
    layers: int, width: int, per_replica_batch: int, seq_len: int, thresholds: list[int]
) -> dict[str, Any]:
    """Each variant as (step function, its arguments), plus the model's description."""
    import optax
    from flax import nnx

    import xla_strategies as xs
    from xla_strategies.demo import models
    from xla_strategies.demo.data import synthetic_tokens
    from xla_strategies.passes import DEFAULT_PIPELINE

    strategy = xs.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    cfg = models.TransformerConfig(vocab=512, width=width, heads=4, layers=layers, seq_len=seq_len)
    graphdef, params = nnx.split(models.TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    step = models.lm_train_step(graphdef, tx)
    tokens = next(synthetic_tokens(1, per_replica_batch * n, seq_len, cfg.vocab))
    mesh = strategy.mesh
    batch = next(iter(strategy.experimental_distribute_dataset([tokens])))

    def state() -> tuple[Any, Any]:
        return strategy.replicate(params), strategy.replicate(tx.init(params))

    def manual(check_vma: bool) -> Callable[..., Any]:
        """(b) with check_vma: JAX inserts the psums; (e) without: nothing is reduced."""

        def step_sum_to_mean(p: Any, o: Any, t: Any) -> Any:
            # what a JAX user writes: autodiff sums over replicas, divide for the mean
            def loss_fn(q: Any) -> Any:
                logits = nnx.merge(graphdef, q)(t[:, :-1])
                per_token = optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:])
                return per_token.mean(), per_token.mean(axis=-1)

            (_, per_example), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
            grads = jax.tree.map(lambda g: g / n, grads)
            updates, o = tx.update(grads, o, p)
            return optax.apply_updates(p, updates), o, per_example

        specs = (P(), P(), P("replica"))
        per_replica = step_sum_to_mean if check_vma else step
        mapped = jax.shard_map(
            per_replica, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=check_vma
        )
        return jax.jit(mapped, donate_argnums=(0, 1))

    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    spmd = jax.jit(
        step,
        in_shardings=(replicated, replicated, split),
        out_shardings=(replicated, replicated, split),
        donate_argnums=(0, 1),
    )
    variants = {
        "a": strategy.compile(step, donate_argnums=(0, 1)),
        "b": manual(check_vma=True),
        "c": spmd,
        "d": strategy.compile(step, pipeline="insert-reductions", donate_argnums=(0, 1)),
        "e": manual(check_vma=False),
        "f": xs.CentralStorageStrategy().compile(step, donate_argnums=(0, 1)),
        "g": strategy.compile(step, shard_weight_updates=True, donate_argnums=(0, 1)),
        "h": strategy.compile(step, shard_parameters=True, donate_argnums=(0, 1)),
    }
    for threshold in thresholds:  # (a) with another bucket threshold, for the sweep
        spec = DEFAULT_PIPELINE.replace(
            "combine-all-reduces", f"combine-all-reduces{{threshold-bytes={threshold}}}"
        )
        variants[f"a@{threshold >> 10}K"] = strategy.compile(
            step, pipeline=spec, donate_argnums=(0, 1)
        )
    per_layer = len(jax.tree.leaves(params["blocks"]))
    tensors = len(jax.tree.leaves(params)) - per_layer + layers * per_layer
    return {
        "variants": variants,
        "state": state,
        "batch": batch,
        "model": (
            f"transformer LM, {layers} scanned layers, width {width}, vocab 512, seq {seq_len}, "
            f"{tensors} parameter tensors (layers unstacked), "
            f"{sum(x.size for x in jax.tree.leaves(params)):,} parameters, "
            f"per-replica batch {per_replica_batch}, {n} replicas"
        ),
    }


def hlo_report(fn: Any, args: tuple) -> dict[str, Any]:
    from xla_strategies.hardware.hlo_collectives import executed_collectives

    compiled = fn.lower(*args).compile()
    executed = executed_collectives(compiled.as_text())
    reduce = executed["all-reduce"]
    moved = {kind: executed.get(kind, {}).get("bytes", 0) for kind in _MOVING}
    memory = compiled.memory_analysis()
    peak = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    return {
        "all_reduce_per_step": reduce["count"],
        "all_reduce_bytes_per_step": reduce["bytes"],
        "collective_permute_per_step": executed.get("collective-permute", {}).get("count", 0),
        "collectives_per_step": sum(executed.get(k, {}).get("count", 0) for k in _MOVING),
        "collective_bytes_per_step": sum(moved.values()),
        "peak_bytes": peak - memory.alias_size_in_bytes,
    }


_MOVING = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute")


def optimizer_state_bytes(opt_state: Any, device: Any) -> tuple[int, int]:
    """(bytes `device` holds, bytes of the whole state): read from the arrays' shards."""
    leaves = jax.tree.leaves(opt_state)
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
    return held, sum(x.nbytes for x in leaves)


def measure(
    layers: int,
    width: int,
    per_replica_batch: int,
    seq_len: int,
    rounds: int,
    steps: int,
    thresholds: tuple[int, ...] = (),
) -> dict:
    setup = build(layers, width, per_replica_batch, seq_len, list(thresholds))
    variants, batch = setup["variants"], setup["batch"]
    states = {k: setup["state"]() for k in variants}
    report = {k: hlo_report(fn, (*states[k], batch)) for k, fn in variants.items()}
    for key, fn in variants.items():  # compile and warm up
        for _ in range(3):
            *states[key], loss = fn(*states[key], batch)
        jax.block_until_ready(loss)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):  # interleave variants so drift hits all alike
        for key, fn in variants.items():
            start = time.perf_counter()
            for _ in range(steps):
                *states[key], loss = fn(*states[key], batch)
            jax.block_until_ready(loss)
            samples[key].append((time.perf_counter() - start) / steps)
    for key in variants:
        report[key]["step_ms"] = 1e3 * statistics.median(samples[key])
        device = next(iter(batch.sharding.device_set))
        held, whole = optimizer_state_bytes(states[key][1], device)
        report[key]["opt_state_bytes_per_device"] = held
        report[key]["opt_state_bytes"] = whole
        held, whole = optimizer_state_bytes(states[key][:2], device)
        report[key]["state_bytes_per_device"] = held  # parameters and optimizer state
        report[key]["state_bytes"] = whole
    a = report["a"]["step_ms"]
    return {
        "model": setup["model"],
        "variants": {
            k: {"name": VARIANTS.get(k, f"(a), threshold-bytes={k[2:]}iB"), **v}
            for k, v in report.items()
        },
        "speedup_a_vs_b": report["b"]["step_ms"] / a,
        "speedup_a_vs_c": report["c"]["step_ms"] / a,
        "a_over_e": a / report["e"]["step_ms"],
        "central_storage_over_a": report["f"]["step_ms"] / a,
        "g_over_e": report["g"]["step_ms"] / report["e"]["step_ms"],
        "g_over_a": report["g"]["step_ms"] / a,
        "g_opt_state_fraction": report["g"]["opt_state_bytes_per_device"]
        / report["a"]["opt_state_bytes_per_device"],
        "h_over_a": report["h"]["step_ms"] / a,
        "h_over_g": report["h"]["step_ms"] / report["g"]["step_ms"],
        "h_state_fraction": report["h"]["state_bytes_per_device"]
        / report["a"]["state_bytes_per_device"],
        "targets": {
            "speedup_vs_b_and_c": 2.0,
            "a_over_e": 1.3,
            "g_over_e": 1.0,
            "g_opt_state_fraction": 1 / 8 + 0.05,
            "h_state_fraction": 1 / 8 + 0.05,
        },
    }


def print_table(result: dict) -> None:
    print(result["model"])
    print(
        f"{'':8}{'variant':<36}{'step ms':>9}{'vs (a)':>8}{'all-reduce/step':>17}"
        f"{'collectives':>12}{'MB/step':>9}{'peak MB':>9}{'opt MB/dev':>11}"
    )
    a = result["variants"]["a"]["step_ms"]
    for key, v in result["variants"].items():
        print(
            f"{key:<8}{v['name'][:36]:<36}{v['step_ms']:>9.2f}{v['step_ms'] / a:>8.2f}"
            f"{v['all_reduce_per_step']:>17}{v['collectives_per_step']:>12}"
            f"{v['collective_bytes_per_step'] / 1e6:>9.2f}{v['peak_bytes'] / 1e6:>9.1f}"
            f"{v['opt_state_bytes_per_device'] / 1e6:>11.3f}"
        )
    print(
        f"(a) vs (b): {result['speedup_a_vs_b']:.2f}x faster, "
        f"vs (c): {result['speedup_a_vs_c']:.2f}x; "
        f"(a)/(e) = {result['a_over_e']:.2f}"
    )
    f = result["variants"]["f"]
    print(
        f"(f) CentralStorage: {result['central_storage_over_a']:.2f}x the step time of (a), "
        f"{f['collective_permute_per_step']} collective-permutes and "
        f"{f['all_reduce_per_step']} all-reduces per step"
    )
    print(
        f"(g) sharded update: (g)/(e) = {result['g_over_e']:.2f}, (g)/(a) = "
        f"{result['g_over_a']:.2f}; optimizer state per device "
        f"{result['g_opt_state_fraction']:.3f} of (a)'s"
    )
    print(
        f"(h) sharded parameters: (h)/(a) = {result['h_over_a']:.2f}, (h)/(g) = "
        f"{result['h_over_g']:.2f}; parameters and optimizer state per device "
        f"{result['h_state_fraction']:.3f} of (a)'s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--per-replica-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--thresholds",
        type=int,
        nargs="*",
        default=[],
        help="extra bucket thresholds (bytes) to time",
    )
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    result = measure(
        args.layers,
        args.width,
        args.per_replica_batch,
        args.seq_len,
        args.rounds,
        args.steps,
        tuple(args.thresholds),
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_step.json").write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


if __name__ == "__main__":
    main()
