"""A pipeline schedule's table: the actions (`Action`), where each runs (`Step`), and the
whole table the executor indexes by (tick, stage) (`Schedule`), with its bubble and the
memory it keeps. `schedules` builds tables from each schedule's lists of actions."""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
#: an action's time in a forward's, for a paired schedule's bubble (a backward computes
#: the input and weight gradients: twice a forward)
_COST = {"F": 1, "B": 2, "W": 1}


@dataclass(frozen=True)
class Action:
    """One stage's work in one tick: `kind` of microbatch `microbatch` through its
    `chunk`-th chunk of layers."""

    kind: str
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Step:
    """An action placed in the table: when it runs, and where its values wait.

    `input_slot`: the slot of the arriving activation (F) or gradient (B) it reads, -1
    where it reads none (the first stage's F reads the microbatch, the last stage's B the
    loss's gradient); `stash_slot`: the slot of the stage input F saves and B reads."""

    action: Action
    tick: int
    input_slot: int = -1
    stash_slot: int = -1


@dataclass(frozen=True)
class Schedule:
    """The table of one schedule: `steps[d]` are device d's placed actions; `arrivals`
    maps (tick, device, kind) to the slot an arriving value is stored in."""

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    ticks: int
    steps: tuple[tuple[Step, ...], ...]
    arrivals: dict[tuple[int, int, str], int]
    slots: dict[str, int]
    #: whether a tick runs a forward and then a backward on a stage (`simulate`)
    paired: bool = False

    @property
    def bubble(self) -> float:
        """The fraction of device-ticks that are idle; of a paired schedule, of its time,
        a tick lasting its stages' longest pair (a backward twice a forward)."""
        if not self.paired:
            busy = sum(len(s) for s in self.steps)
            return 1 - busy / (self.ticks * self.stages)
        per_tick = [[0] * self.ticks for _ in self.steps]
        for d, steps in enumerate(self.steps):
            for step in steps:
                per_tick[d][step.tick] += _COST[step.action.kind]
        time = sum(max(column) for column in zip(*per_tick, strict=True))
        return 1 - sum(map(sum, per_tick)) / (time * self.stages)

    @property
    def theoretical_bubble(self) -> float:
        """The schedule's textbook bubble with every action one tick: (S-1)/(V*M + S-1)
        ((S-1)/(M+S-1) for GPipe and 1F1B); ZB-H1's weight gradients fill two thirds of
        1F1B's idle ticks, (S-1)/(3M + S-1)."""
        s, m, v = self.stages, self.microbatches, self.virtual_stages
        if self.name == "zero-bubble-h1":
            return (s - 1) / (3 * m + s - 1)
        return (s - 1) / (v * m + s - 1)

    def kept_alive(self) -> int:
        """The most stage inputs any device holds for its backward at once."""
        return self.slots["stash"]
