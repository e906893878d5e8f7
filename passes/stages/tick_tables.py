"""A schedule as the int32 tables the executor indexes by (tick, stage): each lane's
actions (`tables`), the slot each arriving value goes in (`arrivals`), the ticks cut into
loops (`runs_of`), and each action kind's branch in a loop's switch (`branch_of`)."""

from __future__ import annotations

import numpy as np

from xla_strategies.passes.stages.schedule_table import BACKWARD, FORWARD, WEIGHT, Schedule

#: each action kind's number in the tables (0: idle)
KINDS = {FORWARD: 1, BACKWARD: 2, WEIGHT: 3}


def runs_of(lanes: list[np.ndarray]) -> list[tuple[int, int, tuple[tuple[int, ...], ...]]]:
    """The ticks in runs, each a loop of its own, with the action kinds each lane's ticks
    hold in it. One lane: the warm-up, where no stage runs more than a forward, then the
    rest. In one SPMD program a tick lasts as long as its slowest stage's action, and a
    backward is the slowest: one loop with every kind a branch was priced as a backward
    every tick, GPipe's forwards too (1.5x its lockstep time at S=4, M=8). Paired lanes:
    a run wherever the lanes that run change (forwards alone, pairs, backwards alone), so
    no tick is priced for a lane idle in it."""
    if len(lanes) == 1:
        marks = [bool(set(row) <= {0, KINDS[FORWARD]}) for row in lanes[0].tolist()]
    else:
        marks = list(zip(*(lane.any(axis=1).tolist() for lane in lanes), strict=True))
    runs, start = [], 0
    for t in range(1, len(marks) + 1):
        if t == len(marks) or marks[t] != marks[start]:
            present = [tuple(sorted(set(k[start:t].ravel().tolist()) - {0})) for k in lanes]
            runs.append((start, t, tuple(present)))
            start = t
    return runs


def branch_of(kinds: tuple[int, ...]) -> np.ndarray:
    """Each action kind's branch in a run holding `kinds` (idle is branch 0)."""
    branch = np.zeros(max(KINDS.values()) + 1, np.int32)
    for i, kind in enumerate(kinds):
        branch[kind] = i + 1
    return branch


def tables(schedule: Schedule, kinds: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The schedule's actions of `kinds` as int32 tables indexed [tick, stage]."""
    shape = (schedule.ticks, schedule.stages)
    tables = {
        k: np.zeros(shape, np.int32) for k in ("kind", "micro", "chunk", "in_slot", "stash_slot")
    }
    for d, steps in enumerate(schedule.steps):
        for step in steps:
            if step.action.kind not in kinds:
                continue
            t = step.tick
            tables["kind"][t, d] = KINDS[step.action.kind]
            tables["micro"][t, d] = step.action.microbatch
            tables["chunk"][t, d] = step.action.chunk
            tables["in_slot"][t, d] = step.input_slot
            tables["stash_slot"][t, d] = step.stash_slot
    return tables


def arrivals(schedule: Schedule) -> dict[str, np.ndarray]:
    """The slot each tick's arriving activation and gradient go in, [tick, stage]; -1
    where none arrives."""
    shape = (schedule.ticks, schedule.stages)
    tables = {"arrive_f": np.full(shape, -1, np.int32), "arrive_b": np.full(shape, -1, np.int32)}
    for (t, d, kind), slot in schedule.arrivals.items():
        tables["arrive_f" if kind == FORWARD else "arrive_b"][t, d] = slot
    return tables
