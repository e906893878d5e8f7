"""`strategy.plan(step, *abstract_args)`: which configuration fits, and which is fastest,
answered before launch by XLA's compiler for the strategy's topology.

The candidates, each compiled deviceless (`compile_only`) for the same topology:

- the sharding of the state: replicated on every chip (data parallelism), the optimizer
  state split (weight-update sharding), the parameters split too (parameter sharding);
- a model axis of 1, 2, 4 or 8 devices per replica, where the strategy can build one
  (`Strategy.with_logical_devices_per_replica`) and it divides the topology's fastest axis;
- pipeline stages across 2 or 4 slices, where the strategy can cut its slices so
  (`Strategy.with_pipeline_stages`): the state replicated within each stage or its
  parameters sharded over the stage's replicas, paired 1F1B (the default schedule) over
  as many microbatches as divide a replica's rows, at most 4 per stage;
- the per-chip batch: the one given, then doubled while it fits (every batch argument,
  the ones split over the replicas, grows together);
- on the best configuration found without stages, where the step has remat blocks
  (`jax.checkpoint`, `nn.remat`) without a policy of their own: the policies of
  `REMAT_POLICIES`, which keep more for the backward pass and compute less again
  (`compile(remat_policy=...)`; a pipelined step takes none yet);
- on the best configuration found with stages (the one of least memory where none fits),
  at its batch: the other schedules, 1F1B in ticks of one action, zero-bubble H1, and
  interleaved 1F1B (in ticks of one action and paired) and looped BFS with the virtual
  stages that divide a stage's layers (`virtual_stage_counts`).

Each row gives memory per chip (XLA's memory analysis), whether it fits, the estimated step
(labelled with what the estimate was fitted to) and items per second per chip (the batch
arguments' rows over the step, per chip). A `budget` in seconds stops the search with the
best found so far. A configuration whose state alone (the arguments that are not
batches) is more than a chip holds, at its best split, is not compiled: its row says so.
Configurations compile `WORKERS` at a time, each in a thread of its own
(a configuration's batch doublings one after another). Progress goes to stderr: what
compiles, how many are left, the best.
Every row is cached by the program's fingerprint (`step.verdict_cache`): planning the same
step again compiles nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xla_strategies.distribute.plan_compile import (
    Job,
    batch_per_chip,
    compiled_row,
    configured,
    laid_out,
    options_of,
    pruned,
    row_of,
)
from xla_strategies.distribute.plan_rows import NOT_COMPILED, SHARDINGS, Plan, Row, best_so_far
from xla_strategies.hardware.compiled_report import calibration_label
from xla_strategies.hardware.hlo_timeline import hlo_timeline, save_timeline
from xla_strategies.passes.bridge.remat_policy import given_remat_policy
from xla_strategies.passes.stages.schedules import INTERLEAVED_SCHEDULES

if TYPE_CHECKING:
    from xla_strategies.step.step_strategy import StepStrategy as Strategy

MODEL_AXES = (1, 2, 4, 8)
#: what a step's remat blocks without a policy are tried with, beside as written (keeping
#: only their inputs), on the best configuration found: more kept, less computed again
REMAT_POLICIES = ("dots_with_no_batch_dims_saveable", "dots_saveable", "everything_saveable")
#: what the best configuration with stages is tried with beside the default, paired 1F1B
SCHEDULES_TRIED = (
    "1f1b",
    "zero-bubble-h1",
    "interleaved-1f1b",
    "interleaved-1f1b-paired",
    "looped-bfs",
)
#: how many counts of virtual stages an interleaved schedule is tried with at most
VIRTUAL_STAGES_TRIED = 4
STAGES = (1, 2, 4)
#: how many times the per-chip batch is doubled at most
BATCH_DOUBLINGS = 3
#: configurations compiled at once: one per core, at most 4 (a 7B model's compile holds
#: 2.5 GB of host memory)
WORKERS = min(os.cpu_count() or 1, 4)


def plan(
    strategy: Strategy,
    step: Callable[..., Any],
    args: tuple[Any, ...],
    budget: float | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    model_axes: tuple[int, ...] = MODEL_AXES,
    batch_doublings: int = BATCH_DOUBLINGS,
    stages: tuple[int, ...] = STAGES,
    remat_policies: tuple[str, ...] = REMAT_POLICIES,
    timeline_to: Path | None = None,
    workers: int = WORKERS,
    schedules: tuple[str, ...] = SCHEDULES_TRIED,
) -> Plan:
    """Compile `step` (a function, or a compiled step whose own options are kept) on `args`
    (abstract `jax.ShapeDtypeStruct`s: state mirrored, batches with
    `strategy.split_sharding()`) in every candidate configuration; see the module.
    `timeline_to`: where the recommended configuration's timeline goes (`write_timeline`);
    `workers`: how many configurations compile at once; `schedules`: the ones tried beside
    the default on the best configuration with stages."""
    found = _search(strategy, step, args, budget, log, model_axes, batch_doublings, stages,
                    remat_policies, workers, schedules)  # fmt: skip
    if timeline_to is not None and write_timeline(strategy, step, args, found, timeline_to):
        log(f"plan: the recommended step as XLA schedules it: {timeline_to} and its .png")
    return found


def _search(
    strategy: Strategy,
    step: Callable[..., Any],
    args: tuple[Any, ...],
    budget: float | None,
    log: Callable[[str], None],
    model_axes: tuple[int, ...],
    batch_doublings: int,
    stages: tuple[int, ...],
    remat_policies: tuple[str, ...],
    workers: int,
    schedules: tuple[str, ...],
) -> Plan:
    started = time.monotonic()
    compiled: list[Row] = []  # every row so far, in the order compiled: the best so far
    lock = threading.Lock()
    candidates = list(_candidates(strategy, model_axes, stages))
    calibration = calibration_label(strategy.topology)

    def search(job: Job) -> tuple[list[Row], bool]:
        """Rows of one configuration, the batch doubled while it fits; False: out of time."""
        refused = pruned(job.variant, job.sharding, args, strategy)
        if refused is not None:  # its state alone outgrows the chip: nothing to compile
            with lock:
                log(f"plan: not compiling {job.what}: {refused.describe()}: {refused.note}")
                compiled.append(refused)
            return [refused], True
        rows: list[Row] = []
        factors = [job.factor] if job.factor else [2**d for d in range(batch_doublings + 1)]
        for factor in factors:
            if budget is not None and time.monotonic() - started > budget:
                return rows, False
            scaled = laid_out(job.variant, args, factor, strategy)
            row = row_of(job, batch_per_chip(job.variant, scaled))
            with lock:
                log(f"plan: compiling {job.what}: {row.describe()}{best_so_far(compiled)}")
            row = compiled_row(job, step, scaled)
            rows.append(row)
            with lock:
                compiled.append(row)
            if not row.fits or not row.batch_per_chip:
                break  # a larger batch fits no better
        return rows, True

    def searched(jobs: list[Job]) -> tuple[list[Row], bool]:
        """The jobs' rows in the jobs' order, `workers` configurations compiling at once
        (XLA's compiler releases the GIL)."""
        with ThreadPoolExecutor(max(1, workers)) as pool:
            done = list(pool.map(search, jobs))
        return [row for rows, _ in done for row in rows], all(ok for _, ok in done)

    count = len(candidates)
    jobs = [Job(v, s, m, f"{i}/{count}") for i, (v, s, m) in enumerate(candidates, 1)]
    rows, finished = searched(jobs)
    variants = {(s, m, v.pipeline_stages): v for v, s, m in candidates}
    if finished:
        more = _remat_jobs(strategy, step, args, rows, variants, remat_policies)
        more += _schedule_jobs(strategy, step, args, rows, variants, schedules)
        if more:
            tried, finished = searched(more)
            rows += tried
    return Plan(tuple(rows), calibration, repr(strategy), finished=finished)


def _remat_jobs(
    strategy: Strategy,
    step: Callable[..., Any],
    args: tuple[Any, ...],
    rows: list[Row],
    variants: dict[tuple[str, int, int], Strategy],
    remat_policies: tuple[str, ...],
) -> list[Job]:
    """The remat policies, each on the best configuration without stages, where the step
    has remat blocks that take one (a pipelined step takes none yet: `step.stage_plan`)."""
    best = Plan(tuple(r for r in rows if r.stages == 1), "", "", True).best()
    if best is None or not remat_policies or not _has_unpoliced_remat(strategy, step, args):
        return []
    variant = variants[(best.sharding, best.devices_per_replica, best.stages)]
    count = len(remat_policies)
    return [
        Job(variant, best.sharding, best.devices_per_replica, f"remat {i}/{count}", policy)
        for i, policy in enumerate(remat_policies, 1)
    ]


def _schedule_jobs(
    strategy: Strategy,
    step: Callable[..., Any],
    args: tuple[Any, ...],
    rows: list[Row],
    variants: dict[tuple[str, int, int], Strategy],
    schedules: tuple[str, ...],
) -> list[Job]:
    """`schedules`, on the best configuration with stages (the one of least memory where
    none fits), at its batch; the interleaved ones at each count of virtual stages
    `virtual_stage_counts` takes from its layers."""
    staged = [
        r for r in rows if r.stages > 1 and r.memory_bytes and not r.note.startswith(NOT_COMPILED)
    ]
    if not staged or not schedules:
        return []
    fitting = [r for r in staged if r.fits]
    if fitting:
        base = max(fitting, key=lambda r: r.items_per_s_per_chip or 0)
    else:
        base = min(staged, key=lambda r: r.memory_bytes or 0)
    variant = variants[(base.sharding, base.devices_per_replica, base.stages)]
    given = batch_per_chip(variant, laid_out(variant, args, 1, strategy))
    factor = base.batch_per_chip // given if given else 1
    counts = []
    if any(schedule in INTERLEAVED_SCHEDULES for schedule in schedules):
        layers = _stacked_layers(variant, step, laid_out(variant, args, factor, strategy), base)
        counts = virtual_stage_counts(layers // base.stages)
    tried = [
        (schedule, v)
        for schedule in schedules
        for v in (counts if schedule in INTERLEAVED_SCHEDULES else [0])
    ]
    model = base.devices_per_replica
    return [
        Job(variant, base.sharding, model, f"schedule {i}/{len(tried)}", "", name, v, factor)
        for i, (name, v) in enumerate(tried, 1)
    ]


def virtual_stage_counts(layers_per_stage: int, most: int = VIRTUAL_STAGES_TRIED) -> list[int]:
    """The virtual stages tried for `layers_per_stage`: those that divide it (at least 2),
    at most `most` of them spread from the fewest chunks to one layer a chunk.

    >>> virtual_stage_counts(63)
    [3, 7, 21, 63]
    >>> virtual_stage_counts(8), virtual_stage_counts(1)
    ([2, 4, 8], [])
    """
    counts = [v for v in range(2, layers_per_stage + 1) if layers_per_stage % v == 0]
    if len(counts) <= most:
        return counts
    picks = {round(i * (len(counts) - 1) / (most - 1)) for i in range(most)}
    return [counts[i] for i in sorted(picks)]


def _stacked_layers(
    variant: Strategy, step: Callable[..., Any], args: tuple[Any, ...], row: Row
) -> int:
    """How many layers the stack `row`'s configuration splits over its stages holds (the
    leading dimension of the weights held split over the stage axis); 0 where the step
    marks its stages' boundaries instead."""
    graph = configured(variant, step, row.options()).graph(*args)
    inputs = zip(graph.inputs, graph.io.inputs, strict=True)
    stacked = [value.shape[0] for value, attrs in inputs if attrs.stage_split]
    return max(stacked, default=0)


def _has_unpoliced_remat(strategy: Strategy, step: Callable[..., Any], args: tuple) -> bool:
    """Whether the step has a remat block without a policy of its own (the policies are
    tried only where one would take them): its capture, counted."""
    options = dataclasses.replace(options_of(step), remat_policy=None)
    with given_remat_policy("nothing_saveable") as blocks:
        strategy.compile(getattr(step, "fn", step), options=options).graph(*args)
    return blocks()[0] > 0


def _candidates(
    strategy: Strategy, model_axes: tuple[int, ...], stages: tuple[int, ...]
) -> Iterator[tuple[Strategy, str, int]]:
    for count in stages:
        staged = strategy.with_pipeline_stages(count)
        for model in model_axes if staged is not None else ():
            variant = staged.with_logical_devices_per_replica(model)
            if variant is None:
                continue
            # with stages, the state is replicated within each, or its parameters are held
            # in blocks over the stage's replicas (FSDP inside each stage, on top of a
            # model axis's split); weight-update sharding alone is refused
            within = ("replicated", "parameter sharding")
            for sharding in SHARDINGS if count == 1 else within:
                yield variant, sharding, model


def write_timeline(
    strategy: Strategy, step: Callable[..., Any], args: tuple[Any, ...], found: Plan, out: Path
) -> Path | None:
    """The recommended row's step as XLA schedules it (`hlo_timeline`), compiled once more
    for its HLO: a trace at `out` and its picture beside it (`.png`); None when nothing
    fits."""
    best = found.best()
    if best is None:
        return None
    variant = strategy.with_pipeline_stages(best.stages)
    variant = variant.with_logical_devices_per_replica(best.devices_per_replica)
    base = batch_per_chip(variant, laid_out(variant, args, 1, strategy))
    scaled = laid_out(variant, args, best.batch_per_chip // base if base else 1, strategy)
    text = configured(variant, step, best.options()).lower(*scaled).compile().as_text()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_timeline(hlo_timeline(text, variant.topology, best.devices_per_replica), out)
    return out
