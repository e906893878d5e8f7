"""What a compiled step writes when dumping is on, and the environment that switches it on.

`xla-strategies dump` sets these for the user's script; they also work by hand:

    XLA_STRATEGIES_DUMP_TO=DIR            write DIR/<step>/ (IR after every pass, ledger,
                                          timeline, StableHLO, compiled HLO, XLA's memory,
                                          collectives and step estimate)
    XLA_STRATEGIES_PRINT_IR=all|change    print the IR after every pass (or after changes)
    XLA_STRATEGIES_PIPELINE=SPEC          run SPEC instead of the strategy's pipeline
    XLA_STRATEGIES_STOP_AFTER_COMPILE=1   raise xs.errors.StoppedAfterCompile once the first
                                          step has compiled (`dump` turns it into exit 0)
    XLA_STRATEGIES_SELECT_BY_COMPILING=1  compile-only steps compile their pipeline's
                                          alternatives and keep the best (`aot` sets it)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from xla_strategies.hardware.compiled_report import compiled_report
from xla_strategies.hardware.hlo_timeline import hlo_timeline, save_timeline
from xla_strategies.hardware.report_text import summary_text
from xla_strategies.passes.bridge.layouts import input_shardings
from xla_strategies.passes.cost.ledger import LedgerRecorder
from xla_strategies.passes.cost.timeline import chrome_trace
from xla_strategies.passes.dump import IRDumper, IRPrinter
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.passes.pipeline import PassPipeline, PassTimer
from xla_strategies.passes.stages.picture import picture, trace
from xla_strategies.step.compile_program import compile_lowered

DUMP_TO, PRINT_IR = "XLA_STRATEGIES_DUMP_TO", "XLA_STRATEGIES_PRINT_IR"
#: The last progress line of the steps dumped to a directory, in that directory: what the
#: command line that runs the script shows while it waits.
PROGRESS_FILE = ".progress"
PIPELINE, STOP_AFTER_COMPILE = "XLA_STRATEGIES_PIPELINE", "XLA_STRATEGIES_STOP_AFTER_COMPILE"
SELECT_BY_COMPILING = "XLA_STRATEGIES_SELECT_BY_COMPILING"
#: set by `xla-strategies plan`: the first step plans (its value: the budget in seconds, or
#: "none"), prints the plan and stops
PLAN = "XLA_STRATEGIES_PLAN"
#: the recommended configuration's step as XLA schedules it, in the step's dump folder
PLAN_TIMELINE = "plan_timeline.json"


def note_progress(directory: Path | None, message: str) -> None:
    """The last thing a step said, for the command line's heartbeat (`PROGRESS_FILE`)."""
    if directory is not None:
        with contextlib.suppress(OSError):  # a heartbeat's detail, never a failure
            directory.mkdir(parents=True, exist_ok=True)
            (directory / PROGRESS_FILE).write_text(message)


@dataclass(frozen=True)
class DumpOptions:
    directory: Path | None = None
    print_ir: str | None = None
    pipeline: str | None = None
    stop_after_compile: bool = False
    #: XLA_STRATEGIES_SELECT_BY_COMPILING: "1" on, "0" off, unset: the step's own rule
    select_by_compiling: bool | None = None
    plan: str | None = None

    @classmethod
    def from_env(cls) -> DumpOptions:
        print_ir = os.environ.get(PRINT_IR) or None
        if print_ir not in (None, "all", "change"):
            raise ValueError(f"{PRINT_IR} must be 'all' or 'change', got {print_ir!r}")
        return cls(
            directory=Path(os.environ[DUMP_TO]) if os.environ.get(DUMP_TO) else None,
            print_ir=print_ir,
            pipeline=os.environ.get(PIPELINE) or None,
            stop_after_compile=os.environ.get(STOP_AFTER_COMPILE, "") not in ("", "0"),
            select_by_compiling=_switch(os.environ.get(SELECT_BY_COMPILING, "")),
            plan=os.environ.get(PLAN) or None,
        )


def _switch(value: str) -> bool | None:
    """An environment switch: "" unset (None), "0" off, anything else on."""
    return None if value == "" else value != "0"


class StepDumper:
    """What one step's build prints and writes, as `DumpOptions` ask: the pipeline's
    instruments (timer, IR printer, IR dumper, ledger), then the artifacts."""

    def __init__(self, options: DumpOptions, name: str, strategy: Any) -> None:
        self.options, self.strategy, self.name = options, strategy, name
        self.directory = step_directory(options.directory, name) if options.directory else None
        self.ledger = LedgerRecorder(strategy.topology)

    def instrument(self, pipeline: PassPipeline) -> PassPipeline:
        pipeline = pipeline.with_instruments(PassTimer())
        if self.options.print_ir:
            pipeline = pipeline.with_instruments(
                IRPrinter(only_changed=self.options.print_ir == "change")
            )
        if self.directory is not None:
            dumper = IRDumper(self.directory, self.strategy.pipeline_label)
            pipeline = pipeline.with_instruments(dumper, self.ledger)
        return pipeline

    def progress(self, message: str) -> None:
        """One line on stderr while a long dump or `aot` compile runs (silent otherwise)."""
        if self.directory is not None or self.options.stop_after_compile:
            print(f"xla-strategies: {self.name}: {message}", file=sys.stderr, flush=True)
        note_progress(self.options.directory, f"{self.name}: {message}")

    def write(
        self,
        graph: Graph,
        run: Any,
        arrays: Sequence[Any],
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        """The ledger, timeline, StableHLO and compiled HLO, when dumping to a directory."""
        if self.directory is None:
            return
        strategy = self.strategy
        shardings = input_shardings(
            graph, strategy.mesh, strategy.stacked_mesh, strategy.sharded_mesh
        )
        args = abstract([(a.shape, a.dtype) for a in arrays], shardings)
        write_artifacts(
            self.directory,
            graph,
            run,
            args,
            self.ledger,
            strategy,
            self.name,
            self.progress,
            compiler_options,
        )

    def write_schedule(self, plan: Any) -> None:
        """A pipelined step's schedule (`plan`: a `StagePlan`, or None), drawn as stages by
        ticks (`schedule.txt`) and as a trace a profiler opens (`schedule.trace.json`)."""
        if self.directory is None or plan is None:
            return
        table = plan.table()
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "schedule.txt").write_text(picture(table) + "\n")
        (self.directory / "schedule.trace.json").write_text(trace(table) + "\n")


def step_directory(root: Path, name: str) -> Path:
    """`root/name`, or `root/name.2`, ... when that step was already dumped in this run."""
    path, n = root / name, 1
    while (path / "ledger.json").exists() and _dumped_this_process(path):
        n += 1
        path = root / f"{name}.{n}"
    return path


_WRITTEN: set[Path] = set()


def _dumped_this_process(path: Path) -> bool:
    return path in _WRITTEN


def write_artifacts(
    directory: Path,
    graph: Graph,
    run: Any,
    abstract_args: list[Any],
    ledger: LedgerRecorder,
    strategy: Any,
    name: str,
    progress: Callable[[str], None] = lambda message: None,
    compiler_options: Mapping[str, Any] | None = None,
) -> None:
    """Write the ledger, the timeline, the StableHLO, XLA's compiled HLO of one step and
    what XLA says of it (`compiled_report.json`, `summary.txt`: memory per chip, the
    collectives kept, the step estimate; `compiled_timeline.json` and `.png`: the step as
    XLA scheduled it, where the topology knows its chip's rates)."""
    directory.mkdir(parents=True, exist_ok=True)
    topology = strategy.topology
    (directory / "ledger.json").write_text(json.dumps(ledger.to_json(), indent=1) + "\n")
    (directory / "timeline.json").write_text(json.dumps(chrome_trace(graph, topology)) + "\n")
    _WRITTEN.add(directory)
    lowered = run.lower(*abstract_args)
    (directory / "stablehlo.mlir").write_text(lowered.as_text(debug_info=True))
    target = getattr(strategy.topology, "name", None) or strategy.devices[0].platform
    progress(f"XLA compiling for {target} (a large model takes minutes)")
    start = time.perf_counter()
    compiled = compile_lowered(lowered.compile, strategy, name)
    progress(f"XLA compiled in {time.perf_counter() - start:.1f} s")
    (directory / "compiled.hlo.txt").write_text(compiled.as_text())
    report = compiled_report(compiled, strategy, compiler_options)
    (directory / "compiled_report.json").write_text(json.dumps(report.to_json(), indent=1))
    (directory / "summary.txt").write_text(summary_text(report, name) + "\n")
    if topology is not None and topology.memory_bandwidth and topology.peak_flops:
        per_replica = getattr(strategy, "logical_devices_per_replica", 1)
        scheduled = hlo_timeline(compiled.as_text(), topology, per_replica)
        save_timeline(scheduled, directory / "compiled_timeline.json")


def abstract(shapes: list[tuple[tuple[int, ...], str]], shardings: list[Any]) -> list[Any]:
    return [
        jax.ShapeDtypeStruct(s, d, sharding=sh)
        for (s, d), sh in zip(shapes, shardings, strict=True)
    ]
