"""Pipeline stages across TPU slices, judged by XLA's TPU compiler beside data parallelism.

One model of `benchmarks.tpu_models` (flax linen, layers under `nn.scan` with `nn.remat`),
one train step as its users write it (the loss closes over the batch), compiled for a
multislice topology at one global batch:

- `jit DP`: plain `jax.jit`, parameters replicated (the peer);
- `ours DP`: `TPUStrategy(topology).compile(step)`, the library's default;
- `ours S stages, <schedule>`: `TPUStrategy(topology, pipeline_stages=S)` with
  `compile(microbatches=M, schedule=...)`: the layers split over the slices.

With `--shard-parameters` every program holds its parameters split: `jax.jit` FSDP over
every chip, ours `shard_parameters=True` (within each slice, replicated across them), and
each stage in blocks over its replicas.

Each row: memory per chip (arguments + outputs - aliased + temporaries), the estimated step
with its calibration (`hardware.calibration`), and the bytes a step moves across slices.
Each program's HLO text is kept as `tpu_aot`'s are, so `--reread` reads every recorded row
again with the reader as it is, without compiling.

    JAX_PLATFORMS=cpu python -m benchmarks.tpu_pipeline --model gpt2-medium --topology 2xv5e-256
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import gzip
import json
import re
import time
from pathlib import Path
from typing import Any

import optax

import xla_strategies as xs
from benchmarks.tpu_aot import HLO_DIR, TENSOR_PARALLEL_MODELS, _batch, abstract_state, peer
from benchmarks.tpu_models import WORKLOADS
from xla_strategies.hardware.compiled_report import compiled_report, hlo_report
from xla_strategies.passes.stages.executor import KEEPS

RESULTS = Path(__file__).parent / "results" / "tpu_pipeline.json"


def _ours(strategy: Any, workload: Any, **options: Any) -> Any:
    tx = optax.adamw(1e-4)
    variables, opt_state = abstract_state(workload, tx)
    state = strategy.replicate(variables), strategy.replicate(opt_state)
    step = strategy.compile(workload.step(tx, None), donate_argnums=(0, 1), **options)
    return step.lower(*state, _batch(strategy, workload)).compile()


def _row(label: str, strategy: Any, compile_one: Any, cell: str) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        compiled = compile_one()
    except xs.errors.OutOfMemoryError as exc:
        return {"program": label, "fits": False, "error": str(exc)[:300]}
    report = compiled_report(compiled, strategy)
    row = {
        "program": label,
        "fits": report.fits,
        "memory_gib": report.memory.total_bytes / 2**30,
        "stages": strategy.pipeline_stages,
        "devices_per_replica": strategy.logical_devices_per_replica,
        **_read(report),
        "compile_s": time.perf_counter() - start,
        "hlo": re.sub(r"[^\w.-]+", "-", f"pipeline {cell} {label}") + ".hlo.txt.gz",
    }
    HLO_DIR.mkdir(parents=True, exist_ok=True)
    (HLO_DIR / row["hlo"]).write_bytes(gzip.compress(compiled.as_text().encode()))
    return row


def _read(report: Any) -> dict[str, Any]:
    """What a row reads from a compiled program's report."""
    across = sum(c.nbytes * c.times for c in report.collectives if c.across_slices)
    return {
        "step_ms": 1e3 * report.estimate["step_s"],
        "across_slices_mb": across / 1e6,
        "calibration": report.calibration,
    }


def reread() -> None:
    """Read every recorded row's saved HLO text again with the reader as it is now (memory
    and compile time are the executable's, kept); rows without a saved text are named."""
    found = json.loads(RESULTS.read_text())
    missing = []
    for cell, rows in found.items():
        topology = cell.split()[1]
        for row in rows:
            path = HLO_DIR / row.get("hlo", "-")
            if "error" in row:
                continue
            if not path.exists():
                missing.append(f"{cell}: {row['program']}")
                continue
            text = gzip.decompress(path.read_bytes()).decode()
            per_replica = row.get("devices_per_replica", 1)
            split = xs.Topology.from_name(topology).split_model_axis(per_replica)
            split = split.split_stage_axis(row["stages"])
            row.update(_read(hlo_report(text, split, per_replica)))
            print(f"{cell}: {row['program']}: {row['step_ms']:.1f} ms")
    RESULTS.write_text(json.dumps(found, indent=1) + "\n")
    if missing:
        print(f"not re-read, no saved HLO text (compile them again): {', '.join(missing)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-medium", choices=sorted(WORKLOADS))
    parser.add_argument("--topology", default="2xv5e-256")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--shard-parameters", action="store_true")
    parser.add_argument(
        "--model-axis",
        type=int,
        default=1,
        help="chips per replica: a model axis inside each stage, the model annotated for "
        "tensor parallelism (the global batch is the same)",
    )
    parser.add_argument("--stage-keeps", choices=KEEPS)
    parser.add_argument(
        "--virtual-stages", type=int, help="chunks per stage (interleaved-1f1b, looped-bfs)"
    )
    parser.add_argument(
        "--batch-per-chip", type=int, help="sequences per chip (default: the model's)"
    )
    parser.add_argument(
        "--stages-only", action="store_true", help="only the staged rows (the cell's others kept)"
    )
    parser.add_argument(
        "--reread",
        action="store_true",
        help="only read every recorded row's saved HLO text again, with the reader as it is",
    )
    args = parser.parse_args()
    if args.reread:
        reread()
        return
    workload = _workload(args.model, args.model_axis)
    cell = f"{args.model} {args.topology} S={args.stages}{' FSDP' if args.shard_parameters else ''}"
    cell += f" TP={args.model_axis}" if args.model_axis > 1 else ""
    if args.batch_per_chip:
        workload = dataclasses.replace(workload, batch_per_chip=args.batch_per_chip)
        cell += f" {args.batch_per_chip}/chip"
    per_replica = {"logical_devices_per_replica": args.model_axis}
    flat = xs.TPUStrategy(args.topology, compile_only=True, **per_replica)
    split = {"shard_parameters": True} if args.shard_parameters else {}
    kind = "FSDP" if split else "DP"
    rows = [] if args.stages_only else [
        _row(f"jit {kind}", flat, lambda: peer(flat, workload, fsdp=bool(split)), cell),
        _row(f"ours {kind}", flat, lambda: _ours(flat, workload, **split), cell),
    ]  # fmt: skip
    staged = xs.TPUStrategy(
        args.topology, compile_only=True, pipeline_stages=args.stages, **per_replica
    )
    keeps = {"stage_keeps": args.stage_keeps} if args.stage_keeps else {}
    chunks = {"virtual_stages": args.virtual_stages} if args.virtual_stages else {}
    for schedule in args.schedules:
        label = f"ours {args.stages} stages{' FSDP' if split else ''}, {schedule}, "
        label += f"M={args.microbatches}" + (f", V={args.virtual_stages}" if chunks else "")
        label += f", {args.stage_keeps}" if keeps else ""
        options = {"schedule": schedule, "microbatches": args.microbatches, **split, **keeps}
        options |= chunks
        rows.append(_row(label, staged, lambda o=options: _ours(staged, workload, **o), cell))
    print(f"{workload.name} on {args.topology}, {workload.batch_per_chip} per chip")
    print(f"{'program':36s} {'GiB/chip':>9s} {'step ms':>9s} {'DCN MB':>8s}")
    for row in rows:
        if not row.get("fits", False) and "error" in row:
            print(f"{row['program']:36s} does not fit: {row['error'][:60]}")
            continue
        print(
            f"{row['program']:36s} {row['memory_gib']:9.2f} {row['step_ms']:9.1f} "
            f"{row['across_slices_mb']:8.1f}"
        )
    print(rows[-1].get("calibration", ""))
    _record(cell, rows, keep_others=args.stages_only)


def _workload(model: str, model_axis: int) -> Any:
    """The model's workload; with a model axis, the one annotated for tensor parallelism."""
    if model_axis == 1:
        return WORKLOADS[model]()
    if model not in TENSOR_PARALLEL_MODELS:
        raise SystemExit(
            f"--model-axis {model_axis} needs a model annotated for tensor parallelism: "
            f"one of {sorted(TENSOR_PARALLEL_MODELS)}, not {model!r}"
        )
    return WORKLOADS[model](tp=True)


def _record(cell: str, rows: list[dict[str, Any]], keep_others: bool) -> None:
    """`rows` into the results file's `cell` (with `keep_others`, beside the cell's rows
    of other programs), read and written under a lock: runs side by side each keep the
    rows the others wrote while they compiled."""
    with open(RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        labels = {row["program"] for row in rows}
        kept = [row for row in found.get(cell, []) if row["program"] not in labels]
        found[cell] = (kept if keep_others else []) + rows
        RESULTS.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
