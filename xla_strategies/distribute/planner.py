"""`strategy.plan(step, *abstract_args)`: which configuration fits, and which is fastest,
answered before launch by XLA's compiler for the strategy's topology.

The candidates, each compiled deviceless (`compile_only`) for the same topology:

- the sharding of the state: replicated on every chip (data parallelism), the optimizer
  state split (weight-update sharding), the parameters split too (parameter sharding);
- a model axis of 1, 2, 4 or 8 devices per replica, where the strategy can build one
  (`Strategy.with_logical_devices_per_replica`) and it divides the topology's fastest axis;
- pipeline stages across 2 or 4 slices, where the strategy can cut its slices so
  (`Strategy.with_pipeline_stages`): the state replicated within each stage or its
  parameters sharded over the stage's replicas, 1F1B over as many microbatches as divide
  a replica's rows, at most 4 per stage;
- the per-chip batch: the one given, then doubled while it fits (every batch argument,
  the ones split over the replicas, grows together);
- on the best configuration found, where the step has remat blocks (`jax.checkpoint`,
  `nn.remat`) without a policy of their own: the policies of `REMAT_POLICIES`, which keep
  more for the backward pass and compute less again (`compile(remat_policy=...)`).

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
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from xla_strategies.core.errors import OutOfMemoryError
from xla_strategies.core.layout import Layout
from xla_strategies.distribute.plan_rows import (
    ROW_VERSION,
    SHARDINGS,
    Plan,
    Row,
    best_so_far,
    configuration,
    row_options,
)
from xla_strategies.hardware.compiled_report import calibration_label, compiled_report
from xla_strategies.hardware.hlo_timeline import hlo_timeline, save_timeline
from xla_strategies.hardware.memory_at_peak import (
    dump_options,
    library_directories,
    memory_at_peak,
)
from xla_strategies.passes.bridge.remat_policy import given_remat_policy
from xla_strategies.passes.ir.text import print_graph
from xla_strategies.step import verdict_cache
from xla_strategies.step.compile_options import CompileOptions
from xla_strategies.step.verdict_cache import fingerprint

if TYPE_CHECKING:
    from xla_strategies.step.step_strategy import StepStrategy as Strategy

MODEL_AXES = (1, 2, 4, 8)
#: how many of the largest buffers at the peak a row keeps
HELD_SHOWN = 8
#: what a step's remat blocks without a policy are tried with, beside as written (keeping
#: only their inputs), on the best configuration found: more kept, less computed again
REMAT_POLICIES = ("dots_with_no_batch_dims_saveable", "dots_saveable", "everything_saveable")
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
) -> Plan:
    """Compile `step` (a function, or a compiled step whose own options are kept) on `args`
    (abstract `jax.ShapeDtypeStruct`s: state mirrored, batches with
    `strategy.split_sharding()`) in every candidate configuration; see the module.
    `timeline_to`: where the recommended configuration's timeline goes (`write_timeline`);
    `workers`: how many configurations compile at once."""
    found = _search(strategy, step, args, budget, log, model_axes, batch_doublings, stages,
                    remat_policies, workers)  # fmt: skip
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
) -> Plan:
    started = time.monotonic()
    compiled: list[Row] = []  # every row so far, in the order compiled: the best so far
    lock = threading.Lock()
    candidates = list(_candidates(strategy, model_axes, stages))
    calibration = calibration_label(strategy.topology)

    def search(job: tuple[Strategy, str, int, str, str]) -> tuple[list[Row], bool]:
        """Rows of one configuration, the batch doubled while it fits; False: out of time."""
        variant, sharding, model, what, policy = job
        pruned = _pruned(variant, sharding, args, strategy)
        if pruned is not None:  # its state alone outgrows the chip: nothing to compile
            with lock:
                log(f"plan: not compiling {what}: {pruned.describe()}: {pruned.note}")
                compiled.append(pruned)
            return [pruned], True
        rows: list[Row] = []
        for doubling in range(batch_doublings + 1):
            if budget is not None and time.monotonic() - started > budget:
                return rows, False
            scaled = _on(variant, args, 2**doubling, strategy)
            per_chip = _batch_per_chip(variant, scaled)
            words = configuration(sharding, variant.pipeline_stages, policy, model, per_chip)
            with lock:
                log(f"plan: compiling {what}: {words}{best_so_far(compiled)}")
            row = _compiled_row(variant, step, scaled, sharding, model, per_chip, policy)
            rows.append(row)
            with lock:
                compiled.append(row)
            if not row.fits or not per_chip:
                break  # a larger batch fits no better
        return rows, True

    def searched(jobs: list[tuple[Strategy, str, int, str, str]]) -> tuple[list[Row], bool]:
        """The jobs' rows in the jobs' order, `workers` configurations compiling at once
        (XLA's compiler releases the GIL)."""
        with ThreadPoolExecutor(max(1, workers)) as pool:
            done = list(pool.map(search, jobs))
        return [row for rows, _ in done for row in rows], all(ok for _, ok in done)

    count = len(candidates)
    jobs = [(v, s, m, f"{i}/{count}", "") for i, (v, s, m) in enumerate(candidates, 1)]
    rows, finished = searched(jobs)
    best = Plan(tuple(rows), calibration, repr(strategy), True).best()
    variants = {(s, m, v.pipeline_stages): v for v, s, m in candidates}
    if (
        finished
        and best is not None
        and remat_policies
        and _has_unpoliced_remat(strategy, step, args)
    ):
        variant = variants[(best.sharding, best.devices_per_replica, best.stages)]
        count = len(remat_policies)
        jobs = [
            (variant, best.sharding, best.devices_per_replica, f"remat {i}/{count}", policy)
            for i, policy in enumerate(remat_policies, 1)
        ]
        more, finished = searched(jobs)
        rows += more
    return Plan(tuple(rows), calibration, repr(strategy), finished=finished)


def _has_unpoliced_remat(strategy: Strategy, step: Callable[..., Any], args: tuple) -> bool:
    """Whether the step has a remat block without a policy of its own (the policies are
    tried only where one would take them): its capture, counted."""
    options = dataclasses.replace(_options_of(step), remat_policy=None)
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
            # in blocks over the stage's replicas (FSDP inside each stage; not with a
            # model axis yet, `step.stage_plan`); weight-update sharding alone is refused
            within = ("replicated",) + (("parameter sharding",) if model == 1 else ())
            for sharding in SHARDINGS if count == 1 else within:
                yield variant, sharding, model


def _pruned(variant: Strategy, sharding: str, args: tuple[Any, ...], given: Strategy) -> Row | None:
    """A row that says `variant` cannot fit, where the state alone (the arguments `given`
    does not split over its replicas) is more than a chip's memory at its best: split over
    the model axis and stages when replicated, over every device when sharded. None where
    it may fit, or the chip's memory is unknown."""
    hbm = variant.topology.hbm_bytes if variant.topology is not None else None
    state = sum(
        a.size * a.dtype.itemsize
        for a in jax.tree.leaves(args)
        if given.layout(a) is not Layout.SPLIT
    )
    split = variant.logical_devices_per_replica * variant.pipeline_stages
    floor = state // (split if sharding == "replicated" else len(variant.devices))
    if hbm is None or floor <= hbm:
        return None
    per_chip = _batch_per_chip(variant, _on(variant, args, 1, given))
    note = (
        f"not compiled: the state alone needs {floor / 2**30:.2f} GiB per chip at best, "
        f"more than its {hbm / 2**30:.2f} GiB"
    )
    devices = variant.logical_devices_per_replica
    return Row(sharding, devices, per_chip, False, floor, None, None, note, variant.pipeline_stages)


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
    remat_policy: str = "",
) -> Row:
    stages = strategy.pipeline_stages
    microbatches = _microbatches(strategy, args) if stages > 1 else 0
    chosen = row_options(sharding, stages, microbatches, remat_policy)
    compiled_step = _configured(strategy, step, chosen)
    where = (sharding, model, str(strategy.topology), stages, microbatches, remat_policy,
             ROW_VERSION)  # fmt: skip
    key = fingerprint(print_graph(compiled_step.graph(*args)), strategy.topology, where)
    cached = verdict_cache.read("plan_rows", key)
    if cached is not None:
        return Row.from_json(cached)
    row = _compile(compiled_step, strategy, args, sharding, model, per_chip)
    row = dataclasses.replace(
        row, stages=stages, microbatches=microbatches, remat_policy=remat_policy
    )
    verdict_cache.write("plan_rows", key, dataclasses.asdict(row))
    return row


def _configured(strategy: Strategy, step: Callable[..., Any], chosen: dict[str, Any]) -> Any:
    """`step` compiled by `strategy` with its own options and a row's `chosen` ones."""
    options = dataclasses.replace(_options_of(step), **chosen)
    return strategy.compile(getattr(step, "fn", step), options=options)


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
    base = _batch_per_chip(variant, _on(variant, args, 1, strategy))
    scaled = _on(variant, args, best.batch_per_chip // base if base else 1, strategy)
    chosen = row_options(best.sharding, best.stages, best.microbatches, best.remat_policy)
    text = _configured(variant, step, chosen).lower(*scaled).compile().as_text()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_timeline(hlo_timeline(text, variant.topology, best.devices_per_replica), out)
    return out


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
    return dataclasses.replace(
        row,
        held_by_group=held.by_group(),
        largest_held=largest,
        heap_gaps_bytes=held.heap_gaps_bytes,
    )


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
