"""`strategy.plan(step, *abstract_args)`: which configuration fits, and which is fastest,
answered before launch by XLA's compiler for the strategy's topology.

The candidates, each compiled deviceless (`compile_only`) for the same topology:

- the sharding of the state: replicated on every chip (data parallelism), the optimizer
  state split (weight-update sharding), the parameters split too (parameter sharding);
- a model axis of 1, 2, 4 or 8 devices per replica, where the strategy can build one
  (`Strategy.with_logical_devices_per_replica`) and it divides the topology's fastest axis;
- pipeline stages across 2 or 4 slices, where the strategy can cut its slices so
  (`Strategy.with_pipeline_stages`): the state replicated within each stage, 1F1B over as
  many microbatches as divide a replica's rows, at most 4 per stage;
- the per-chip batch: the one given, then doubled while it fits (every batch argument,
  the ones split over the replicas, grows together).

Each row gives memory per chip (XLA's memory analysis), whether it fits, the estimated step
(labelled with what the estimate was fitted to) and items per second per chip (the batch
arguments' rows over the step, per chip). A `budget` in seconds stops the search with the
best found so far. Progress goes to stderr: what compiles, how many are left, the best.
Every row is cached by the program's fingerprint (`step.verdict_cache`): planning the same
step again compiles nothing.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from xla_strategies.core.errors import OutOfMemoryError
from xla_strategies.core.layout import Layout
from xla_strategies.hardware.compiled_report import calibration_label, compiled_report
from xla_strategies.hardware.memory_at_peak import (
    dump_options,
    library_directories,
    memory_at_peak,
)
from xla_strategies.passes.ir.text import print_graph
from xla_strategies.step import verdict_cache
from xla_strategies.step.compile_options import CompileOptions
from xla_strategies.step.verdict_cache import fingerprint

if TYPE_CHECKING:
    from xla_strategies.step.step_strategy import StepStrategy as Strategy

#: the state's sharding, as compile options (each forced: the default pipeline's own
#: choice between them is what the plan checks)
SHARDINGS = {
    "replicated": {"shard_parameters": False, "shard_weight_updates": False},
    "weight-update sharding": {"shard_parameters": False, "shard_weight_updates": True},
    "parameter sharding": {"shard_parameters": True},
}
MODEL_AXES = (1, 2, 4, 8)
#: how many of the largest buffers at the peak a row keeps
HELD_SHOWN = 8
STAGES = (1, 2, 4)
#: how many times the per-chip batch is doubled at most
BATCH_DOUBLINGS = 3


@dataclass(frozen=True)
class Row:
    """One compiled configuration."""

    sharding: str
    devices_per_replica: int
    batch_per_chip: int
    fits: bool
    memory_bytes: int | None
    step_s: float | None
    items_per_s_per_chip: float | None
    note: str = ""
    stages: int = 1
    microbatches: int = 0  # with stages: the pipeline's microbatches
    #: what holds the memory at XLA's peak (`hardware.memory_at_peak`), fitting or not:
    #: bytes per group, and the largest buffers as (bytes, shape, what made it)
    held_by_group: dict[str, int] = dataclasses.field(default_factory=dict)
    largest_held: tuple[tuple[int, str, str], ...] = ()

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Row:
        """A row read back from the cache (JSON keeps tuples as lists)."""
        largest = tuple(tuple(entry) for entry in row.get("largest_held", ()))
        return cls(**{**row, "largest_held": largest})

    def held(self) -> str:
        """What holds this configuration's memory, a line per group and largest buffer."""
        if not self.held_by_group:
            return "  (XLA wrote no buffer assignment for this configuration)"
        lines = [f"  {n / 2**30:8.2f} GiB  {group}" for group, n in self.held_by_group.items()]
        unlisted = (self.memory_bytes or 0) - sum(self.held_by_group.values())
        if unlisted > 0:  # the heap beyond what is live at its peak, XLA's own scratch
            lines.append(
                f"  {unlisted / 2**30:8.2f} GiB  counted by XLA, live in no buffer it lists"
            )
        lines += [
            f"  {n / 2**20:10.1f} MiB  {shape:<24} {what}" for n, shape, what in self.largest_held
        ]
        return "\n".join(lines)

    def line(self) -> str:
        gib = "   -   " if self.memory_bytes is None else f"{self.memory_bytes / 2**30:7.2f}"
        step = "    -    " if self.step_s is None else f"{self.step_s * 1e3:9.2f}"
        rate = "-" if self.items_per_s_per_chip is None else f"{self.items_per_s_per_chip:,.1f}"
        fits = "yes" if self.fits else "NO"
        return (
            f"{self.sharding:<24} {self.stages:>6} {self.devices_per_replica:>5} "
            f"{self.batch_per_chip:>7} {gib} {fits:>4} {step} {rate:>14}  {self.note}"
        )


@dataclass(frozen=True)
class Plan:
    rows: tuple[Row, ...]
    calibration: str
    strategy: str
    finished: bool  # False: the budget ran out first

    def best(self) -> Row | None:
        """The fitting row with the most items per second per chip."""
        fitting = [r for r in self.rows if r.fits and r.items_per_s_per_chip]
        return max(fitting, key=lambda r: r.items_per_s_per_chip, default=None)

    def table(self) -> str:
        header = (
            f"{'configuration':<24} {'stages':>6} {'model':>5} {'batch':>7} {'GiB':>7} {'fits':>4} "
            f"{'step ms':>9} {'items/s/chip':>14}"
        )
        lines = [f"plan for {self.strategy} (estimate: {self.calibration})", header]
        lines += [row.line() for row in self.rows]
        if not self.finished:
            lines.append("(the budget ran out: the rows above are what was compiled)")
        return "\n".join(lines)

    def memory(self) -> str:
        """What holds the memory of the recommended row and of the largest that does not
        fit (the configuration one step too big), at XLA's peak."""
        best = self.best()
        missed = [r for r in self.rows if not r.fits and r.held_by_group]
        shown = [("recommended", best)] if best else []
        if missed:
            shown.append(("does not fit", min(missed, key=lambda r: r.memory_bytes or 0)))
        return "\n".join(
            f"what holds the memory, {label}: {row.sharding}, {row.devices_per_replica} per "
            f"replica, {row.batch_per_chip} per chip\n{row.held()}"
            for label, row in shown
        )

    def recommendation(self, step_name: str = "step") -> str:
        """The lines to paste, and the reason in one line."""
        best = self.best()
        if best is None:
            return "# no configuration fits: a larger topology, or a smaller batch per chip"
        chosen = _options(best.sharding, best.stages, best.microbatches)
        options = ", ".join(f"{k}={v!r}" for k, v in chosen.items())
        staged = f", {best.stages} pipeline stages" if best.stages > 1 else ""
        return (
            f"# {best.sharding}{staged}, {best.devices_per_replica} device(s) per replica, "
            f"{best.batch_per_chip} per chip: the most items/s per chip that fits\n"
            f"strategy = strategy.with_logical_devices_per_replica({best.devices_per_replica})"
            + (f".with_pipeline_stages({best.stages})" if best.stages > 1 else "")
            + f"\n{step_name} = strategy.compile({step_name}{', ' if options else ''}{options})"
        )


def plan(
    strategy: Strategy,
    step: Callable[..., Any],
    args: tuple[Any, ...],
    budget: float | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    model_axes: tuple[int, ...] = MODEL_AXES,
    batch_doublings: int = BATCH_DOUBLINGS,
    stages: tuple[int, ...] = STAGES,
) -> Plan:
    """Compile `step` (a function, or a compiled step whose own options are kept) on `args`
    (abstract `jax.ShapeDtypeStruct`s: state mirrored, batches with
    `strategy.split_sharding()`) in every candidate configuration; see the module."""
    started = time.monotonic()
    rows: list[Row] = []
    candidates = list(_candidates(strategy, model_axes, stages))
    calibration = calibration_label(strategy.topology)
    for index, (variant, sharding, model) in enumerate(candidates, 1):
        for doubling in range(batch_doublings + 1):
            if budget is not None and time.monotonic() - started > budget:
                return Plan(tuple(rows), calibration, repr(strategy), finished=False)
            scaled = _on(variant, args, 2**doubling, strategy)
            per_chip = _batch_per_chip(variant, scaled)
            staged = f", {variant.pipeline_stages} stages" if variant.pipeline_stages > 1 else ""
            log(f"plan: compiling {index}/{len(candidates)}: {sharding}{staged}, {model} per "
                f"replica, {per_chip} per chip{_best_so_far(rows)}")  # fmt: skip
            row = _compiled_row(variant, step, scaled, sharding, model, per_chip)
            rows.append(row)
            if not row.fits or not per_chip:
                break  # a larger batch fits no better
    return Plan(tuple(rows), calibration, repr(strategy), finished=True)


def _candidates(
    strategy: Strategy, model_axes: tuple[int, ...], stages: tuple[int, ...]
) -> Iterator[tuple[Strategy, str, int]]:
    for count in stages:
        staged = strategy.with_pipeline_stages(count)
        for model in model_axes if staged is not None else ():
            variant = staged.with_logical_devices_per_replica(model)
            if variant is None:
                continue
            # with stages, the state is replicated within each: the passes that shard it
            # do not know the stages yet (`step.stage_plan.staged_pipeline`)
            for sharding in SHARDINGS if count == 1 else ("replicated",):
                yield variant, sharding, model


def _on(strategy: Strategy, args: tuple[Any, ...], factor: int, given: Strategy) -> tuple[Any, ...]:
    """`args`, laid out for `given`, laid out for `strategy`: batches (leaves `given` splits
    over its replicas) with `factor` times the rows, the rest replicated."""

    def leaf(a: Any) -> Any:
        if given.layout(a) is Layout.SPLIT:
            shape = (a.shape[0] * factor, *a.shape[1:])
            return jax.ShapeDtypeStruct(shape, a.dtype, sharding=strategy.split_sharding())
        return strategy.replicate(jax.ShapeDtypeStruct(a.shape, a.dtype))

    return jax.tree.map(leaf, args)


def _batch_per_chip(strategy: Strategy, args: tuple[Any, ...]) -> int:
    rows = [a.shape[0] for a in jax.tree.leaves(args) if strategy.layout(a) is Layout.SPLIT]
    return max(rows, default=0) // len(strategy.devices)


def _compiled_row(
    strategy: Strategy,
    step: Callable[..., Any],
    args: tuple[Any, ...],
    sharding: str,
    model: int,
    per_chip: int,
) -> Row:
    stages = strategy.pipeline_stages
    microbatches = _microbatches(strategy, args) if stages > 1 else 0
    chosen = _options(sharding, stages, microbatches)
    options = dataclasses.replace(_options_of(step), **chosen)
    compiled_step = strategy.compile(getattr(step, "fn", step), options=options)
    where = (sharding, model, str(strategy.topology), stages, microbatches)
    key = fingerprint(print_graph(compiled_step.graph(*args)), strategy.topology, where)
    cached = verdict_cache.read("plan_rows", key)
    if cached is not None:
        return Row.from_json(cached)
    row = _compile(compiled_step, strategy, args, sharding, model, per_chip)
    row = dataclasses.replace(row, stages=stages, microbatches=microbatches)
    verdict_cache.write("plan_rows", key, dataclasses.asdict(row))
    return row


def _options(sharding: str, stages: int, microbatches: int) -> dict[str, Any]:
    """The compile options of a row: its sharding's, and with stages its microbatches."""
    return {**SHARDINGS[sharding], **({"microbatches": microbatches} if stages > 1 else {})}


def _microbatches(strategy: Strategy, args: tuple[Any, ...]) -> int:
    """The most microbatches, at most 4 per stage, that divide a replica's rows."""
    rows = [a.shape[0] for a in jax.tree.leaves(args) if strategy.layout(a) is Layout.SPLIT]
    per_replica = max(rows, default=0) // strategy.num_replicas_in_sync
    most = min(per_replica, 4 * strategy.pipeline_stages)
    return next((m for m in range(most, 0, -1) if per_replica % m == 0), 1)


def _compile(
    compiled_step: Any,
    strategy: Strategy,
    args: tuple[Any, ...],
    sharding: str,
    model: int,
    per_chip: int,
) -> Row:
    with tempfile.TemporaryDirectory() as dump:
        try:
            with warnings.catch_warnings(record=True) as caught:  # an option that did nothing
                warnings.simplefilter("always")
                lowered = compiled_step.lower(*args)
                compiled = lowered.compile(compiler_options=dump_options(dump))
                report = compiled_report(compiled, strategy)
        except OutOfMemoryError as exc:
            memory = _needed_bytes(str(exc))
            row = Row(sharding, model, per_chip, False, memory, None, None, str(exc).split(":")[0])
            return _with_held(row, dump, args)
        except (ValueError, TypeError) as exc:  # a configuration this step cannot take
            note = f"not compiled: {str(exc).splitlines()[0][:120]}"
            return Row(sharding, model, per_chip, False, None, None, None, note)
        step_s = report.estimate.get("step_s")
        rate = per_chip / step_s if step_s and per_chip else None
        memory = report.memory.total_bytes if report.memory else None
        note = str(caught[0].message).splitlines()[0][:160] if caught else ""
        fits = report.fits is not False
        row = Row(sharding, model, per_chip, fits, memory, step_s, rate, note)
        return _with_held(row, dump, args)


def _with_held(row: Row, dump: str, args: tuple[Any, ...]) -> Row:
    """`row` with what holds its memory, read from XLA's dump; as it was where XLA wrote
    none (a compile refused before its buffer assignment)."""
    try:
        held = memory_at_peak(dump, library_directories())
    except FileNotFoundError:
        return row
    names = [f"args{jax.tree_util.keystr(path)}" for path, _ in jax.tree.leaves_with_path(args)]
    largest = tuple((b.nbytes, b.shape, held.describe(b, names)) for b in held.buffers[:HELD_SHOWN])
    return dataclasses.replace(row, held_by_group=held.by_group(), largest_held=largest)


def _needed_bytes(message: str) -> int | None:
    """The bytes per chip an out-of-memory refusal says the step needs."""
    found = re.search(r"needs ([\d.]+)([KMGT]?)i?B per", message)
    if found is None:
        return None
    return int(float(found[1]) * 1024 ** "_KMGT".index(found[2] or "_"))


def _options_of(step: Any) -> CompileOptions:
    """A compiled step's own options (donation, static arguments...), the sharding ones
    reset for the planner to set; none for a plain function. Each row compiles its own
    configuration: never swapped for another by `select_by_compiling`."""
    given = getattr(step, "options", None) or CompileOptions()
    return dataclasses.replace(
        given, shard_weight_updates=None, shard_parameters=None, select_by_compiling=False
    )


def _best_so_far(rows: list[Row]) -> str:
    best = Plan(tuple(rows), "", "", True).best()
    if best is None:
        return ""
    return (
        f"; best so far: {best.sharding}, {best.devices_per_replica} per replica, "
        f"{best.batch_per_chip} per chip, {best.items_per_s_per_chip:,.1f} items/s/chip"
    )
