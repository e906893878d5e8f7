"""`xla-strategies plan`: a compile-only step's first call plans the step on its arguments
(`strategy.plan`), prints the plan and stops the script, instead of compiling it."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from xla_strategies.core.errors import StoppedAfterCompile
from xla_strategies.step.dumping import (
    PLAN,
    PLAN_TIMELINE,
    DumpOptions,
    note_progress,
    step_directory,
)


def plan_and_stop(step: Any, args: tuple, kwargs: dict, budget: str) -> NoReturn:
    """Plan `step` (a compiled step) on `args` within `budget` seconds ("none": no bound):
    the table, what holds the memory and the lines to paste on stdout, progress on stderr
    and in the dump folder's progress file (the command line's heartbeat reads it), the
    recommended step's timeline beside it; then stop."""
    if kwargs:
        raise TypeError(f"{step.name}: plan takes a step called with positional arguments")
    seconds = None if budget == "none" else float(budget)
    directory = DumpOptions.from_env().directory
    timeline = step_directory(directory, step.name) / PLAN_TIMELINE if directory else None

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        note_progress(directory, f"{step.name}: {line}")

    found = step.strategy.plan(step, *args, budget=seconds, log=log, timeline_to=timeline)
    print(found.table())
    print(found.memory())
    print(found.recommendation(step.name), flush=True)
    raise StoppedAfterCompile(f"{step.name} planned; stopping ({PLAN})")
