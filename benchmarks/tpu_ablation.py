"""Does each pass of the TPU default pipeline earn its place on XLA's TPU compiler?

For one model and topology, our step is compiled with the strategy's default pipeline and
then with each of its passes disabled in turn, and every program is read by the one HLO
reader (`compiled_report`). A pass earns its place when the pipeline without it moves no
fewer collective bytes, leaves no fewer bytes synchronous and estimates no faster a step.
Passes that cannot be disabled alone (insert-reductions: the gradients' reductions
themselves) are not ablated. A pipeline whose optimised graph is the default's, IR text for
IR text, lowers to the same XLA program: it is not compiled again, and its row says so.

    JAX_PLATFORMS=cpu python -m benchmarks.tpu_ablation --model gpt2-medium --topology v5e-256
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import optax
from tqdm import tqdm

import xla_strategies as xs
from benchmarks.tpu_aot import _batch, abstract_state
from benchmarks.tpu_models import WORKLOADS
from xla_strategies.hardware.compiled_report import compiled_report
from xla_strategies.passes.ir.text import print_graph
from xla_strategies.passes.pipeline import without_pass

RESULTS = Path(__file__).parent / "results" / "tpu_ablation.json"
NOT_ABLATED = {"insert-reductions"}


def ablation_inputs(strategy: Any, workload: Any) -> tuple[Any, tuple]:
    """The optimizer and the abstract arguments every ablation of a cell compiles with."""
    tx = optax.adamw(1e-4)
    variables, opt_state = abstract_state(workload, tx)
    args = (
        strategy.replicate(variables),
        strategy.replicate(opt_state),
        _batch(strategy, workload),
    )
    return tx, args


def step_without(strategy: Any, workload: Any, tx: Any, disabled: str | None) -> Any:
    """Our default step with pass `disabled` off (None: the whole default pipeline)."""
    pipeline = strategy.pipeline(None)
    if disabled is not None:
        pipeline = without_pass(pipeline, disabled)
    return strategy.compile(
        workload.step(tx, "batch"),
        axis_name="batch",
        donate_argnums=(0, 1),
        pipeline=pipeline,
        name=f"{workload.name} ablation",  # one name: the IR text of equal programs equal
    )


def optimised_graph(step: Any, args: tuple) -> str:
    """The IR text of the graph the passes leave, which alone decides the XLA program."""
    return print_graph(step.executable(*args).graph)


def compile_without(strategy: Any, step: Any, args: tuple, disabled: str | None) -> dict:
    """One ablation's program compiled and read, or that it does not fit."""
    try:
        report = compiled_report(step.lower(*args).compile(), strategy)
    except xs.errors.OutOfMemoryError as exc:  # without a pass that makes it fit
        return {"without": disabled or "-", "does_not_fit": str(exc).split(". ")[0]}
    return {
        "without": disabled or "-",
        "memory_gib": report.memory.total_bytes / 2**30,
        "collectives": sum(c.times for c in report.collectives),
        "collective_bytes": report.bytes_per_step(),
        "synchronous_bytes": report.bytes_per_step(synchronous_only=True),
        "step_ms": 1e3 * (report.estimate["step_s"] or math.nan),
    }


_JUDGED = {
    "memory_gib": "memory",
    "collective_bytes": "bytes",
    "synchronous_bytes": "synchronous bytes",
    "step_ms": "step",
}


def _judged(base: dict[str, Any], row: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Where the default (with the pass) is better than `row` (without it), and where
    worse, beyond 0.1 %."""
    better = [name for key, name in _JUDGED.items() if base[key] < row[key] * 0.999]
    worse = [name for key, name in _JUDGED.items() if base[key] > row[key] * 1.001]
    return better, worse


def verdict(base: dict[str, Any], row: dict[str, Any]) -> str:
    """What the pass this row leaves out does on the cell: where the default (with it) is
    better and where worse. It earns its place when the default is worse nowhere."""
    if "does_not_fit" in row:
        return "earns its place: without it the step does not fit"
    if row.get("same_program"):
        return "no effect on this cell (the same program)"
    better, worse = _judged(base, row)
    if not better and not worse:
        return "no effect on this cell"
    said = (f"better in {', '.join(better)}" if better else "") + (
        f"{'; ' if better else ''}worse in {', '.join(worse)}" if worse else ""
    )
    return ("earns its place: " if not worse else "trade-off: ") + said


_SHORT = {"memory": "mem", "bytes": "bytes", "synchronous bytes": "sync", "step": "step"}
LEGEND = (
    "`=` the same program as the default (its optimised graph is the default's: not "
    "compiled); `0` compiled, no change beyond 0.1 %; `+X` the default is better in X "
    "than the pipeline without the pass, `-X` worse (mem: memory per chip, bytes: "
    "collective bytes, sync: synchronous bytes, step: estimated step); `fits` without "
    "the pass the step does not fit the chip"
)


def short_verdict(base: dict[str, Any], row: dict[str, Any]) -> str:
    """`verdict` in a word or two, for the summary's cells (`LEGEND`)."""
    if "does_not_fit" in row:
        return "fits"
    if row.get("same_program"):
        return "="
    better, worse = _judged(base, row)
    said = [f"+{_SHORT[b]}" for b in better] + [f"-{_SHORT[w]}" for w in worse]
    return " ".join(said) or "0"


def summary(cells: dict[str, list[dict[str, Any]]]) -> str:
    """One line per ablated cell, one column per pass: what leaving it out does."""
    passes = list(dict.fromkeys(r["without"] for rows in cells.values() for r in rows[1:]))
    lines = [
        f"| cell | {' | '.join(passes)} |",
        "|---" * (len(passes) + 1) + "|",
    ]
    for name, rows in cells.items():
        said = {r["without"]: short_verdict(rows[0], r) for r in rows[1:]}
        lines.append(f"| {name} | {' | '.join(said.get(p, '') for p in passes)} |")
    return "\n".join(lines) + "\n\n" + LEGEND


def table(name: str, rows: list[dict[str, Any]]) -> str:
    """The markdown table of one cell's ablation, the default first."""
    base = rows[0]
    lines = [
        f"| {name}: without | GiB/chip | collectives/step | MiB/step | "
        "synchronous MiB/step | step ms | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "does_not_fit" in row:
            lines.append(f"| {row['without']} | - | - | - | - | - | {verdict(base, row)} |")
            continue
        lines.append(
            f"| {row['without']} | {row['memory_gib']:.2f} | {row['collectives']} "
            f"| {row['collective_bytes'] / 2**20:,.0f} | {row['synchronous_bytes'] / 2**20:,.0f} "
            f"| {row['step_ms']:.2f} | {'' if row is base else verdict(base, row)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt2-medium", choices=list(WORKLOADS))
    parser.add_argument("--topology", default="v5e-256")
    parser.add_argument("--table", action="store_true", help="print the recorded tables only")
    args = parser.parse_args()
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.table:
        strategy = xs.TPUStrategy(args.topology, compile_only=True)
        workload = WORKLOADS[args.model]()
        passes = [n for n in strategy.pipeline(None).enabled_names() if n not in NOT_ABLATED]
        rows = old[f"{workload.name} on {args.topology}"] = []
        tx, step_args = ablation_inputs(strategy, workload)
        default_graph = None
        for disabled in tqdm([None, *passes], desc="ablate", unit="pipeline"):
            step = step_without(strategy, workload, tx, disabled)
            graph = optimised_graph(step, step_args)
            if disabled is None:
                default_graph = graph
            if disabled is not None and graph == default_graph:
                rows.append({**rows[0], "without": disabled, "same_program": True})
            else:
                rows.append(compile_without(strategy, step, step_args, disabled))
            tqdm.write(json.dumps(rows[-1]))
            # after every program: a run cut short keeps what it compiled
            RESULTS.write_text(json.dumps(old, indent=1) + "\n")
    print(summary(old))
    print("\n\n".join(table(name, rows) for name, rows in old.items()))


if __name__ == "__main__":
    main()
