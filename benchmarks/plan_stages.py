"""The planner on pipeline stages across slices: `strategy.plan` on one of the benchmarks'
models (`benchmarks.tpu_models`, flax linen, layers under `nn.scan` with `nn.remat`) for a
multislice topology, with stages only, its batch as given: the state's sharding within
each stage, then every schedule beside 1F1B on the best of those (the interleaved ones at
each count of virtual stages the planner takes from the layers).

    JAX_PLATFORMS=cpu python -m benchmarks.plan_stages --model llama2-70b --topology 2xv5p-512

The table and the recommendation go to stdout, the rows to
`benchmarks/results/plan_stages.json` (one entry per model and topology).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import optax

import xla_strategies as xs
from benchmarks.tpu_aot import _batch, abstract_state
from benchmarks.tpu_models import WORKLOADS

RESULTS = Path(__file__).parent / "results" / "plan_stages.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-70b", choices=sorted(WORKLOADS))
    parser.add_argument("--topology", default="2xv5p-512")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="configurations compiled at once")
    args = parser.parse_args()
    workload = WORKLOADS[args.model]()
    strategy = xs.TPUStrategy(args.topology, compile_only=True)
    tx = optax.adamw(1e-4)
    variables, opt_state = abstract_state(workload, tx)
    state = strategy.replicate(variables), strategy.replicate(opt_state)
    step = strategy.compile(workload.step(tx, None), donate_argnums=(0, 1))
    started = time.perf_counter()
    found = strategy.plan(
        step, *state, _batch(strategy, workload), model_axes=(1,), batch_doublings=0,
        stages=(args.stages,), remat_policies=(), workers=args.workers,
    )  # fmt: skip
    minutes = (time.perf_counter() - started) / 60
    print(found.table(), found.memory(), found.recommendation("train_step"), sep="\n")
    print(f"plan: {minutes:.1f} min")
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    recorded[f"{workload.name} {args.topology} S={args.stages}"] = {
        "batch_per_chip": workload.batch_per_chip,
        "estimate": found.calibration,
        "plan_minutes": round(minutes, 1),
        "best": dataclasses.asdict(found.best()) if found.best() else None,
        "rows": [dataclasses.asdict(row) for row in found.rows],
    }
    RESULTS.write_text(json.dumps(recorded, indent=1) + "\n")


if __name__ == "__main__":
    main()
