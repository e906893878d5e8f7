"""Gradient-sync microbenchmark: reduce a real model's gradient set across 8 replicas.

Gradient sets with the tensor shapes of ResNet-50 (161 tensors), BERT-base (199) and GPT-2
small (148), every dimension above 16 divided by `--scale` so they fit a 2-core machine.
Three ways, side by side in one run:

- per tensor: one all-reduce per tensor, with XLA's CPU all-reduce combiner switched off
  for this program (`xla_disable_hlo_passes=cpu-all-reduce-combiner`);
- XLA tuple: one `psum` per tensor in one program; XLA's all-reduce combiner merges them
  into tuple-shaped all-reduces;
- buckets: this library's combine-all-reduces (flat buffers).

`--sweep` also times the buckets at several `threshold-bytes` (the default's source).
Run: `python -m benchmarks.gradient_sync` (or `make bench`). Writes results/gradient_sync.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from benchmarks.gradient_shapes import bert, gpt2, resnet50

RESULTS = Path(__file__).parent / "results"
_NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


MODELS = {"ResNet-50": resnet50, "BERT-base": bert, "GPT-2 small": gpt2}


def scaled(shapes: list[tuple[int, ...]], scale: int) -> list[tuple[int, ...]]:
    return [tuple(d // scale if d > 16 else d for d in shape) for shape in shapes]


def variants(strategy: Any, grads: Any, thresholds: list[int]) -> dict[str, tuple[Any, str]]:
    """Each variant compiled for `grads`: (callable taking grads, compiled HLO text)."""
    import xla_strategies as xs

    def tuple_psum(grads: list[Any]) -> list[Any]:
        return [lax.psum(g[0], "replica") for g in grads]

    def ours(grads: list[Any]) -> list[Any]:
        return xs.get_replica_context().all_reduce(xs.ReduceOp.SUM, [g[0] for g in grads])

    mapped = jax.shard_map(
        tuple_psum, mesh=strategy.mesh, in_specs=P("replica"), out_specs=P(), check_vma=False
    )
    lowered = jax.jit(mapped).lower(grads)
    found = {}
    for name, options in (("per tensor", _NO_COMBINER), ("XLA tuple", None)):
        compiled = lowered.compile(compiler_options=options)
        found[name] = (compiled, compiled.as_text())
    for threshold in thresholds:
        spec = f"insert-reductions,combine-all-reduces{{threshold-bytes={threshold}}}"
        step = strategy.compile(ours, pipeline=spec)
        found[f"buckets {threshold >> 10} KiB"] = (step, step.lower(grads).compile().as_text())
    return found


def measure(scale: int, thresholds: list[int], rounds: int, repeats: int) -> dict[str, Any]:
    import xla_strategies as xs
    from xla_strategies.hardware.hlo import count_hlo_collectives

    strategy = xs.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    results: dict[str, Any] = {}
    for model, make in MODELS.items():
        shapes = scaled(make(), scale)
        rng = np.random.default_rng(0)
        grads = [rng.normal(size=(n, *s)).astype(np.float32) for s in shapes]
        grads = next(iter(strategy.experimental_distribute_dataset([grads])))
        compiled = variants(strategy, grads, thresholds)
        fns = {k: fn for k, (fn, _) in compiled.items()}
        counts = {k: count_hlo_collectives(text)["all-reduce"] for k, (_, text) in compiled.items()}
        for fn in fns.values():
            jax.block_until_ready(fn(grads))
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for key, fn in fns.items():
                start = time.perf_counter()
                for _ in range(repeats):
                    out = fn(grads)
                jax.block_until_ready(out)
                samples[key].append((time.perf_counter() - start) / repeats)
        results[model] = {
            "tensors": len(shapes),
            "bytes": int(sum(np.prod(s) for s in shapes) * 4),
            "ms": {k: 1e3 * statistics.median(v) for k, v in samples.items()},
            "hlo_all_reduces": counts,
        }
    return {"scale": scale, "replicas": n, "models": results}


def print_table(result: dict[str, Any]) -> None:
    print(
        f"gradient sync over {result['replicas']} replicas, "
        f"dimensions above 16 divided by {result['scale']}"
    )
    for model, r in result["models"].items():
        base = r["ms"]["XLA tuple"]
        print(f"\n{model}: {r['tensors']} tensors, {r['bytes'] / 1e6:.2f} MB per replica")
        print(f"  {'variant':<20}{'ms':>9}{'vs XLA tuple':>14}{'HLO all-reduces':>17}")
        for key, ms in r["ms"].items():
            print(f"  {key:<20}{ms:>9.2f}{ms / base:>14.2f}{r['hlo_all_reduces'][key]:>17}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--sweep", action="store_true", help="time several bucket thresholds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    from xla_strategies.passes.transforms.combine_all_reduces import DEFAULT_THRESHOLD_BYTES

    thresholds = [DEFAULT_THRESHOLD_BYTES]
    if args.sweep:
        thresholds = sorted(
            {16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 32 << 20, DEFAULT_THRESHOLD_BYTES}
        )
    result = measure(args.scale, thresholds, args.rounds, args.repeats)
    RESULTS.mkdir(exist_ok=True)
    name = "gradient_sync_sweep.json" if args.sweep else "gradient_sync.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


if __name__ == "__main__":
    main()
