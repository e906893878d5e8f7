"""The planner against a published MaxText recipe: `strategy.plan` on the benchmarks'
Llama-2-7B (a model the planner's tests never saw), for the topology and sequence length
of MaxText's own tuned recipe, starting from one sequence per chip and no remat policy.

    JAX_PLATFORMS=cpu python -m benchmarks.plan_against_recipe            # v5p-128, 4096
    JAX_PLATFORMS=cpu .venv-maxtext/bin/python benchmarks/maxtext_aot.py recipe.hlo.txt \\
        --topology v5p-128 per_device_batch_size=4 remat_policy=minimal max_target_length=4096
    xla-strategies report recipe.hlo.txt --topology v5p-128

MaxText's recipe (`benchmarks/maxtext_v5p_model_configs.py`, `llama2_7b_v5p_128`): FSDP
over all chips, 4 sequences of 4096 per chip, `remat_policy=minimal`. The plan's table, its
recommendation and its best row's tokens per second per chip go to stdout and to
`benchmarks/results/plan_against_recipe.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import optax

import xla_strategies as xs
from benchmarks.tpu_aot import abstract_state
from benchmarks.tpu_models import TransformerConfig, language_model

RESULTS = Path(__file__).parent / "results" / "plan_against_recipe.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topology", default="v5p-128")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--model-axes", default="1,2", help="devices per replica to try")
    args = parser.parse_args()
    cfg = TransformerConfig(32000, 4096, 32, 32, 11008, args.seq_len, swiglu=True)
    workload = language_model("Llama-2-7B", cfg)
    strategy = xs.TPUStrategy(args.topology, compile_only=True)
    tx = optax.adamw(1e-4)
    variables, opt_state = abstract_state(workload, tx)
    state = strategy.replicate(variables), strategy.replicate(opt_state)
    batch = {
        key: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=strategy.split_sharding())
        for key, spec in workload.batch(strategy.num_replicas_in_sync).items()
    }
    started = time.perf_counter()
    found = strategy.plan(
        workload.step(tx, None),
        *state,
        batch,
        model_axes=tuple(int(a) for a in args.model_axes.split(",")),
    )
    seconds = time.perf_counter() - started
    print(found.table(), found.memory(), found.recommendation("train_step"), sep="\n")
    best = found.best()
    tokens = (
        best.items_per_s_per_chip * args.seq_len if best and best.items_per_s_per_chip else None
    )
    print(f"plan: {seconds / 60:.1f} min; best: {tokens and round(tokens):,} tokens/s/chip")
    RESULTS.write_text(
        json.dumps(
            {
                "topology": args.topology,
                "seq_len": args.seq_len,
                "estimate": found.calibration,
                "plan_minutes": round(seconds / 60, 1),
                "best": dataclasses.asdict(best) if best else None,
                "best_tokens_per_s_per_chip": tokens,
                "rows": [dataclasses.asdict(r) for r in found.rows],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
