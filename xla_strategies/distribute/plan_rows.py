"""The planner's answer (`planner.plan`): a row per compiled configuration, and the plan
that ranks them, says what holds the memory and gives the lines to paste."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from xla_strategies.hardware.memory_at_peak import HEAP_GAPS
from xla_strategies.passes.stages.schedules import DEFAULT_SCHEDULE

#: the state's sharding, as compile options (each forced: the default pipeline's own
#: choice between them is what the plan checks)
SHARDINGS = {
    "replicated": {"shard_parameters": False, "shard_weight_updates": False},
    "weight-update sharding": {"shard_parameters": False, "shard_weight_updates": True},
    "parameter sharding": {"shard_parameters": True},
}
#: the remat policies the planner tries, as its table names them
REMAT_SHORT = {
    "": "written",
    "dots_with_no_batch_dims_saveable": "dots-nb",
    "dots_saveable": "dots",
    "everything_saveable": "all",
}


#: how the note of a row that never reached XLA's compiler begins
NOT_COMPILED = "not compiled"
#: part of a cached row's key: raised when a row gains a field an older row lacks, so a
#: plan never shows a row cached before the field as if the field were zero
ROW_VERSION = 3


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
    schedule: str = ""  # with stages: the pipeline's schedule ("": the default)
    virtual_stages: int = 0  # with an interleaved schedule: chunks of layers per stage
    remat_policy: str = ""  # the policy its remat blocks were given; "": as written
    #: what holds the memory at XLA's peak (`hardware.memory_at_peak`), fitting or not:
    #: bytes per group, and the largest buffers as (bytes, shape, what made it)
    held_by_group: dict[str, int] = dataclasses.field(default_factory=dict)
    largest_held: tuple[tuple[int, str, str], ...] = ()
    heap_gaps_bytes: int = 0  # XLA's heap free at the peak (`MemoryAtPeak.heap_gaps_bytes`)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Row:
        """A row read back from the cache (JSON keeps tuples as lists)."""
        largest = tuple(tuple(entry) for entry in row.get("largest_held", ()))
        return cls(**{**row, "largest_held": largest})

    def describe(self) -> str:
        return configuration(
            self.sharding, self.pipelining(), self.remat_policy, self.devices_per_replica,
            self.batch_per_chip,
        )  # fmt: skip

    def pipelining(self) -> str:
        """Its stages and their schedule in words ("" without stages)."""
        if self.stages == 1:
            return ""
        chunks = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{self.stages} stages {self.schedule or DEFAULT_SCHEDULE}{chunks}"

    def options(self) -> dict[str, Any]:
        """The compile options that configure it (`row_options`)."""
        return row_options(
            self.sharding, self.stages, self.microbatches, self.remat_policy, self.schedule,
            self.virtual_stages,
        )  # fmt: skip

    def held(self) -> str:
        """What holds this configuration's memory, a line per group and largest buffer."""
        if not self.held_by_group:
            return "  (XLA wrote no buffer assignment for this configuration)"
        lines = [f"  {n / 2**30:8.2f} GiB  {group}" for group, n in self.held_by_group.items()]
        unlisted = (self.memory_bytes or 0) - sum(self.held_by_group.values())
        gaps = min(max(unlisted, 0), self.heap_gaps_bytes)
        if gaps > 0:
            lines.append(f"  {gaps / 2**30:8.2f} GiB  {HEAP_GAPS}")
        if unlisted - gaps > 0:  # libtpu's temporaries exceed its own buffer assignment
            beyond = (unlisted - gaps) / 2**30
            lines.append(f"  {beyond:8.2f} GiB  counted by XLA beyond its buffer assignment")
        lines += [
            f"  {n / 2**20:10.1f} MiB  {shape:<24} {what}" for n, shape, what in self.largest_held
        ]
        return "\n".join(lines)

    def line(self) -> str:
        gib = "   -   " if self.memory_bytes is None else f"{self.memory_bytes / 2**30:7.2f}"
        step = "    -    " if self.step_s is None else f"{self.step_s * 1e3:9.2f}"
        rate = "-" if self.items_per_s_per_chip is None else rate_text(self.items_per_s_per_chip)
        fits = "yes" if self.fits else "NO"
        remat = REMAT_SHORT.get(self.remat_policy, self.remat_policy)
        return (
            f"{self.sharding:<24} {self.pipelining() or '1 stage':<30} "
            f"{self.devices_per_replica:>5} {remat:>8} "
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
            f"{'configuration':<24} {'stages':<30} {'model':>5} {'remat':>8} {'batch':>7} "
            f"{'GiB':>7} {'fits':>4} {'step ms':>9} {'items/s/chip':>14}"
        )
        lines = [f"plan for {self.strategy} (estimate: {self.calibration})", header]
        lines += [row.line() for row in self.rows]
        if not self.finished:
            lines.append("(the budget ran out: the rows above are what was compiled)")
        return "\n".join(lines)

    def memory(self) -> str:
        """What holds the memory of the recommended row and of the smallest that does not
        fit (the configuration one step too big), at XLA's peak."""
        best = self.best()
        missed = [r for r in self.rows if not r.fits and r.held_by_group]
        shown = [("recommended", best)] if best else []
        if missed:
            shown.append(("does not fit", min(missed, key=lambda r: r.memory_bytes or 0)))
        return "\n".join(
            f"what holds the memory, {label}: {row.describe()}\n{row.held()}"
            for label, row in shown
        )

    def recommendation(self, step_name: str = "step") -> str:
        """The lines to paste, and the reason in one line."""
        best = self.best()
        if best is None:
            return "# no configuration fits: a larger topology, or a smaller batch per chip"
        options = ", ".join(f"{k}={v!r}" for k, v in best.options().items())
        return (
            f"# {best.describe()}: the most items/s per chip that fits\n"
            f"strategy = strategy.with_logical_devices_per_replica({best.devices_per_replica})"
            + (f".with_pipeline_stages({best.stages})" if best.stages > 1 else "")
            + f"\n{step_name} = strategy.compile({step_name}{', ' if options else ''}{options})"
        )


def configuration(
    sharding: str, pipelining: str, remat_policy: str, devices_per_replica: int, per_chip: int
) -> str:
    """A configuration in words: sharding, stages and schedule (`Row.pipelining`), remat
    policy, devices, batch."""
    staged = f", {pipelining}" if pipelining else ""
    remat = f", remat {remat_policy}" if remat_policy else ""
    return f"{sharding}{staged}{remat}, {devices_per_replica} per replica, {per_chip} per chip"


def row_options(
    sharding: str,
    stages: int,
    microbatches: int,
    remat_policy: str = "",
    schedule: str = "",
    virtual_stages: int = 0,
) -> dict[str, Any]:
    """The compile options of a row: its sharding's, with stages its microbatches and
    schedule, and the remat policy it tried."""
    found = dict(SHARDINGS[sharding])
    if stages > 1:
        found["microbatches"] = microbatches
        found.update({"schedule": schedule} if schedule else {})
        found.update({"virtual_stages": virtual_stages} if virtual_stages > 1 else {})
    return {**found, **({"remat_policy": remat_policy} if remat_policy else {})}


def best_so_far(rows: list[Row]) -> str:
    best = Plan(tuple(rows), "", "", True).best()
    if best is None:
        return ""
    return f"; best so far: {best.describe()}, {rate_text(best.items_per_s_per_chip)} items/s/chip"


def rate_text(items_per_s: float) -> str:
    """Items a second, to a tenth, or to three figures below 100 (a 405B model's chip
    trains a sequence in seconds: 0.0311, not 0.0)."""
    return f"{items_per_s:,.1f}" if items_per_s >= 100 else f"{items_per_s:.3g}"
