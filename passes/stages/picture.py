"""A pipeline schedule drawn: stages by ticks as text, and as a trace a profiler opens.

    >>> from xla_strategies.passes.stages.schedules import schedule
    >>> print(picture(schedule("1f1b", 2, 3)))
    1f1b: 2 stages, 3 microbatches, 8 ticks, bubble 25.0 % (theory 25.0 %)
    tick     0  1  2  3  4  5  6  7
    stage 0  F0 F1 .  B0 F2 B1 .  B2
    stage 1  .  F0 B0 F1 B1 F2 B2 .

Each cell is a stage's action in a tick: `F3` the forward of microbatch 3, `B3` its
backward (with zero-bubble schedules, its input gradient), `W3` its weight gradient, `.`
idle (the bubble); interleaved chunks add their chunk, `F3c1`; a paired tick's two
actions are joined, `F3+B1`. The trace is the Chrome trace event format
(`chrome://tracing`, Perfetto): one row per stage, one event per action, a tick a
millisecond (half of it for each of a paired tick's actions).
"""

from __future__ import annotations

import json
from typing import Any

from xla_strategies.passes.stages.schedules import Schedule


def picture(table: Schedule) -> str:
    """The schedule as text: a header line, then a row of cells per stage."""
    labels: list[list[list[str]]] = [[[] for _ in range(table.ticks)] for _ in table.steps]
    for stage, steps in enumerate(table.steps):
        for step in steps:
            labels[stage][step.tick].append(_label(step.action, table.virtual_stages))
    cells = [["+".join(cell) or "." for cell in row] for row in labels]
    width = max(len(c) for row in cells for c in row)
    head = (
        f"{table.name}: {table.stages} stages, {table.microbatches} microbatches"
        + (f", {table.virtual_stages} chunks a stage" if table.virtual_stages > 1 else "")
        + f", {table.ticks} ticks, bubble {100 * table.bubble:.1f} %"
        + f" (theory {100 * table.theoretical_bubble:.1f} %)"
    )
    label = len(f"stage {table.stages - 1}")
    ticks = " ".join(str(t).ljust(width) for t in range(table.ticks))
    rows = [f"{'tick'.ljust(label)}  {ticks}".rstrip()]
    for stage, row in enumerate(cells):
        line = " ".join(c.ljust(width) for c in row)
        rows.append(f"{f'stage {stage}'.ljust(label)}  {line}".rstrip())
    return "\n".join([head, *rows])


def trace(table: Schedule) -> str:
    """The schedule as Chrome trace events (JSON): a process per stage, a tick 1 ms."""
    events: list[dict[str, Any]] = []
    for stage, steps in enumerate(table.steps):
        events.append(
            {"ph": "M", "name": "process_name", "pid": stage, "args": {"name": f"stage {stage}"}}
        )
        for step, before in zip(steps, (None, *steps), strict=False):
            action = step.action
            second = before is not None and before.tick == step.tick  # a paired tick's backward
            events.append(
                {
                    "name": _label(action, table.virtual_stages),
                    "cat": {"F": "forward", "B": "backward", "W": "weight gradient"}[action.kind],
                    "ph": "X",
                    "pid": stage,
                    "tid": 0,
                    "ts": step.tick * 1000 + (500 if second else 0),
                    "dur": 500 if table.paired else 1000,
                    "args": {"microbatch": action.microbatch, "chunk": action.chunk},
                }
            )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1)


def _label(action: Any, chunks: int) -> str:
    return f"{action.kind}{action.microbatch}" + (f"c{action.chunk}" if chunks > 1 else "")
