"""How the planner (`planner.plan`) compiles one configuration into a `Row`: the step
compiled by a variant of the strategy with the row's options, on the arguments laid out
for it, deviceless; what XLA says of its memory and step, and what holds the memory at
its peak. Rows are cached by the program's fingerprint (`step.verdict_cache`)."""

from __future__ import annotations

import dataclasses
import re
import tempfile
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from xla_strategies.core.errors import OutOfMemoryError
from xla_strategies.core.layout import Layout
from xla_strategies.distribute.plan_rows import NOT_COMPILED, ROW_VERSION, Row
from xla_strategies.hardware.compiled_report import compiled_report
from xla_strategies.hardware.memory_at_peak import (
    dump_options,
    library_directories,
    memory_at_peak,
)
from xla_strategies.passes.ir.text import print_graph
from xla_strategies.passes.stages.schedules import DEFAULT_SCHEDULE, INTERLEAVED_SCHEDULES
from xla_strategies.step import verdict_cache
from xla_strategies.step.compile_options import CompileOptions
from xla_strategies.step.verdict_cache import fingerprint

if TYPE_CHECKING:
    from collections.abc import Callable

    from xla_strategies.step.step_strategy import StepStrategy as Strategy

#: how many of the largest buffers at the peak a row keeps
HELD_SHOWN = 8


@dataclass(frozen=True)
class Job:
    """One configuration to compile: `variant` (the strategy with its stages and model
    axis) holding the state as `sharding`, and what the row tries beside: a remat policy,
    a schedule and its virtual stages. `factor`: the batch given times it, alone; 0: the
    batch given, then doubled while it fits."""

    variant: Strategy
    sharding: str
    model: int
    what: str
    remat_policy: str = ""
    schedule: str = ""
    virtual_stages: int = 0
    factor: int = 0


def pruned(variant: Strategy, sharding: str, args: tuple[Any, ...], given: Strategy) -> Row | None:
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
    per_chip = batch_per_chip(variant, laid_out(variant, args, 1, given))
    note = (
        f"{NOT_COMPILED}: the state alone needs {floor / 2**30:.2f} GiB per chip at best, "
        f"more than its {hbm / 2**30:.2f} GiB"
    )
    devices = variant.logical_devices_per_replica
    return Row(sharding, devices, per_chip, False, floor, None, None, note,
               stages=variant.pipeline_stages)  # fmt: skip


def laid_out(
    strategy: Strategy, args: tuple[Any, ...], factor: int, given: Strategy
) -> tuple[Any, ...]:
    """`args`, laid out for `given`, laid out for `strategy`: batches (leaves `given` splits
    over its replicas) with `factor` times the rows, the rest replicated."""

    def leaf(a: Any) -> Any:
        if given.layout(a) is Layout.SPLIT:
            shape = (a.shape[0] * factor, *a.shape[1:])
            return jax.ShapeDtypeStruct(shape, a.dtype, sharding=strategy.split_sharding())
        return strategy.replicate(jax.ShapeDtypeStruct(a.shape, a.dtype))

    return jax.tree.map(leaf, args)


def batch_per_chip(strategy: Strategy, args: tuple[Any, ...]) -> int:
    rows = [a.shape[0] for a in jax.tree.leaves(args) if strategy.layout(a) is Layout.SPLIT]
    return max(rows, default=0) // len(strategy.devices)


def row_of(job: Job, per_chip: int) -> Row:
    """The row `job` fills in at `per_chip` items a chip, before it is compiled."""
    stages = job.variant.pipeline_stages
    schedule = (job.schedule or DEFAULT_SCHEDULE) if stages > 1 else ""
    return Row(
        job.sharding, job.model, per_chip, False, None, None, None, stages=stages,
        remat_policy=job.remat_policy, schedule=schedule, virtual_stages=job.virtual_stages,
    )  # fmt: skip


def compiled_row(job: Job, step: Callable[..., Any], args: tuple[Any, ...]) -> Row:
    """`job`'s row: `step` compiled by its variant on `args` (laid out for it), or from the
    cache; a row saying why where the configuration never reached XLA's compiler."""
    strategy = job.variant
    row = row_of(job, batch_per_chip(strategy, args))
    if row.stages > 1:  # an interleaved schedule runs its microbatches in groups of stages
        interleaved = row.schedule in INTERLEAVED_SCHEDULES
        microbatches = _microbatches(strategy, args, row.stages if interleaved else 1)
        if microbatches is None:
            note = f"{NOT_COMPILED}: {row.schedule} needs microbatches a multiple of the stages"
            return dataclasses.replace(row, note=note)
        row = dataclasses.replace(row, microbatches=microbatches)
    try:  # a schedule's plan, or a stack the stages cannot split, is refused here
        compiled_step = configured(strategy, step, row.options())
        graph = compiled_step.graph(*args)
    except ValueError as exc:
        return dataclasses.replace(row, note=_refused(exc))
    where = (row.sharding, row.devices_per_replica, str(strategy.topology), row.stages,
             ROW_VERSION, *row.options().items())  # fmt: skip
    key = fingerprint(print_graph(graph), strategy.topology, where)
    cached = verdict_cache.read("plan_rows", key)
    if cached is not None:
        return Row.from_json(cached)
    compiled = _compile(compiled_step, strategy, args, row)
    verdict_cache.write("plan_rows", key, dataclasses.asdict(compiled))
    return compiled


def configured(strategy: Strategy, step: Callable[..., Any], chosen: dict[str, Any]) -> Any:
    """`step` compiled by `strategy` with its own options and a row's `chosen` ones."""
    options = dataclasses.replace(options_of(step), **chosen)
    return strategy.compile(getattr(step, "fn", step), options=options)


def _microbatches(strategy: Strategy, args: tuple[Any, ...], multiple_of: int = 1) -> int | None:
    """The most microbatches, at most 4 per stage and a multiple of `multiple_of`, that
    divide a replica's rows; None where none does."""
    rows = [a.shape[0] for a in jax.tree.leaves(args) if strategy.layout(a) is Layout.SPLIT]
    per_replica = max(rows, default=0) // strategy.num_replicas_in_sync
    most = min(per_replica, 4 * strategy.pipeline_stages)
    fits = (m for m in range(most, 0, -1) if per_replica % m == 0 and m % multiple_of == 0)
    return next(fits, 1 if multiple_of == 1 else None)


def _compile(compiled_step: Any, strategy: Strategy, args: tuple[Any, ...], row: Row) -> Row:
    """`row` filled in by XLA's compile of `compiled_step` on `args`."""
    with tempfile.TemporaryDirectory() as dump:
        try:
            with warnings.catch_warnings(record=True) as caught:  # an option that did nothing
                warnings.simplefilter("always")
                lowered = compiled_step.lower(*args)
                compiled = lowered.compile(compiler_options=dump_options(dump))
                report = compiled_report(compiled, strategy)
        except OutOfMemoryError as exc:
            needed = dataclasses.replace(
                row, memory_bytes=_needed_bytes(str(exc)), note=str(exc).split(":")[0]
            )
            return _with_held(needed, dump, args)
        except (ValueError, TypeError) as exc:  # a configuration this step cannot take
            return dataclasses.replace(row, note=_refused(exc))
        step_s = report.estimate.get("step_s")
        per_chip = row.batch_per_chip
        filled = dataclasses.replace(
            row,
            fits=report.fits is not False,
            memory_bytes=report.memory.total_bytes if report.memory else None,
            step_s=step_s,
            items_per_s_per_chip=per_chip / step_s if step_s and per_chip else None,
            note=str(caught[0].message).splitlines()[0][:160] if caught else "",
        )
        return _with_held(filled, dump, args)


def _refused(exc: Exception) -> str:
    """The note of a row whose configuration the step cannot take."""
    return f"{NOT_COMPILED}: {str(exc).splitlines()[0][:120]}"


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


def options_of(step: Any) -> CompileOptions:
    """A compiled step's own options (donation, static arguments...), the sharding and
    pipeline ones reset for the planner to set; none for a plain function. Each row
    compiles its own configuration: never swapped for another by `select_by_compiling`."""
    given = getattr(step, "options", None) or CompileOptions()
    pipeline = dict.fromkeys(("microbatches", "schedule", "virtual_stages", "stage_keeps"))
    return dataclasses.replace(
        given, shard_weight_updates=None, shard_parameters=None, select_by_compiling=False,
        **pipeline,
    )  # fmt: skip
