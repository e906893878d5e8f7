"""Pipeline schedules as data: what each stage runs in each tick of one SPMD loop.

A schedule is first each stage's ordered list of actions, as torchtitan and Megatron
write them: the forward (`F`) or backward (`B`) of microbatch m through one chunk of layers,
and for zero-bubble schedules the backward split into its input gradient (`B`) and its
weight gradient (`W`). `simulate` then runs the lists in lockstep: in each tick every stage
starts its next action once what it needs arrived (a neighbour's activation or gradient,
sent at the end of an earlier tick). The result, `Schedule`, is the table the executor
indexes by (tick, stage), with the buffer slot every value waits in, so the compiled
program holds exactly as many microbatches' activations as the schedule keeps alive.

With `virtual_stages=V` (interleaved 1F1B) each of the S devices holds V chunks of layers,
round robin: chunk v of device d is global stage v*S + d, and activations go around the
ring of devices V times.

    >>> s = simulate(one_f_one_b(stages=2, microbatches=4))
    >>> s.ticks, round(s.bubble, 3)
    (10, 0.2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from xla_strategies.passes.stages.schedule_table import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    Step,
)

#: the schedules `compile(schedule=...)` takes, each a function of (stages, microbatches,
#: virtual_stages) giving every device's list of actions
SCHEDULES: dict[str, Callable[..., list[list[Action]]]] = {}
#: the schedules whose stages each hold `virtual_stages` chunks of layers
INTERLEAVED_SCHEDULES = ("interleaved-1f1b", "interleaved-1f1b-paired", "looped-bfs")
#: the schedules whose ticks each run a forward and a backward on a stage (`simulate`)
PAIRED_SCHEDULES = ("1f1b-paired", "interleaved-1f1b-paired")
#: the schedule a step with stages runs unless it names one: 1F1B in paired ticks, as fast
#: as GPipe by the estimate and in less memory than 1F1B in one-action ticks on the models
#: compiled (GPT-2 medium on 2xv5e-256, Llama-2-7B on 2xv5e-16: `docs/pipelines.md`)
DEFAULT_SCHEDULE = "1f1b-paired"


def gpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """All forwards, then all backwards (in reverse order, as autodiff runs them)."""
    _check(stages, microbatches, virtual_stages, "gpipe", virtual=False)
    return [
        [Action(FORWARD, m) for m in range(microbatches)]
        + [Action(BACKWARD, m) for m in reversed(range(microbatches))]
        for _ in range(stages)
    ]


def one_f_one_b(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): stage d runs S-1-d forwards, then alternates one forward and
    one backward, so it keeps at most S-d microbatches alive instead of M."""
    _check(stages, microbatches, virtual_stages, "1f1b", virtual=False)
    return [_warm_steady_cool(stages - 1 - d, microbatches, 1, stages, d) for d in range(stages)]


def one_f_one_b_paired(
    stages: int, microbatches: int, virtual_stages: int = 1
) -> list[list[Action]]:
    """1F1B in ticks that each run a forward and then a backward on a stage (of two
    microbatches; the last stage's of the same one), where 1F1B runs one action a tick.
    In one SPMD program a tick lasts as long as its slowest stage's action, so 1F1B's
    ticks, where one stage runs a forward beside another's backward, each last a
    backward: a paired tick lasts a forward and a backward, and the schedule GPipe's
    time and bubble. Stage d runs 2(S-1-d) forwards before its first backward (the
    gradient takes as long to come back as the activations to go), so the first stage
    keeps 2S-1 microbatches' layer inputs (1F1B: S; GPipe: M)."""
    _check(stages, microbatches, virtual_stages, "1f1b-paired", virtual=False)
    return [
        _warm_steady_cool(2 * (stages - 1 - d), microbatches, 1, stages, d) for d in range(stages)
    ]


def interleaved_one_f_one_b(
    stages: int, microbatches: int, virtual_stages: int = 2
) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: V chunks per device, microbatches in groups of S, so
    the bubble is V times smaller than 1F1B's."""
    return _interleaved(stages, microbatches, virtual_stages, "interleaved-1f1b")


def interleaved_one_f_one_b_paired(
    stages: int, microbatches: int, virtual_stages: int = 2
) -> list[list[Action]]:
    """Interleaved 1F1B in paired ticks (`one_f_one_b_paired`): its warm-up already lets
    the gradient come back, so it keeps interleaved 1F1B's memory, in GPipe's time."""
    return _interleaved(stages, microbatches, virtual_stages, "interleaved-1f1b-paired")


def _interleaved(stages: int, microbatches: int, virtual_stages: int, name: str) -> list:
    _check(stages, microbatches, virtual_stages, name, virtual=True)
    return [
        _warm_steady_cool(
            (virtual_stages - 1) * stages + 2 * (stages - 1 - d),
            microbatches,
            virtual_stages,
            stages,
            d,
        )
        for d in range(stages)
    ]


def looped_bfs(stages: int, microbatches: int, virtual_stages: int = 2) -> list[list[Action]]:
    """torchtitan's LoopedBFS, the order of MaxText's circular pipeline: V chunks per
    device, round robin, each chunk's forward run on every microbatch before the next
    chunk's, every forward before the backwards, as GPipe. GPipe's memory (every
    microbatch's inputs of every chunk) with interleaving's bubble, (S-1)/(V*M + S-1), and
    in lockstep ticks no forward waits beside a backward."""
    _check(stages, microbatches, virtual_stages, "looped-bfs", virtual=True)
    chunks = range(virtual_stages)
    forwards = [Action(FORWARD, m, c) for c in chunks for m in range(microbatches)]
    backwards = [Action(BACKWARD, m, c) for c in reversed(chunks) for m in range(microbatches)]
    return [forwards + backwards for _ in range(stages)]


def zero_bubble_h1(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into its input gradient (B),
    which the previous stage waits for, and its weight gradient (W), which nobody waits
    for: stage d defers its first d weight gradients into the cool-down's bubble. It keeps
    1F1B's memory (S stage inputs at most); its bubble lies between 1F1B's and the paper's
    (S-1)/(3M+S-1) (`theoretical_bubble`), which needs more memory in lockstep ticks."""
    _check(stages, microbatches, virtual_stages, "zero-bubble-h1", virtual=False)
    lists = []
    for d in range(stages):
        warm = min(stages - 1 - d, microbatches)
        actions = [Action(FORWARD, m) for m in range(warm)]
        deferred: list[Action] = []
        for i, m in enumerate(range(warm, microbatches)):
            actions += [Action(FORWARD, m), Action(BACKWARD, i)]
            (deferred if i < d else actions).append(Action(WEIGHT, i))
        for i in range(microbatches - warm, microbatches):
            actions.append(Action(BACKWARD, i))
            if deferred:
                actions.append(deferred.pop(0))
            actions.append(Action(WEIGHT, i))
        lists.append(actions + deferred)
    return lists


def _warm_steady_cool(
    warm: int, microbatches: int, chunks: int, stages: int, device: int
) -> list[Action]:
    """`warm` forwards, then one forward and one backward at a time, then the remaining
    backwards; with several chunks, in Megatron's order (groups of S microbatches)."""
    forwards = [_nth(k, microbatches, chunks, stages, False) for k in range(microbatches * chunks)]
    backwards = [_nth(k, microbatches, chunks, stages, True) for k in range(microbatches * chunks)]
    warm = min(warm, len(forwards))
    actions = forwards[:warm]
    for f, b in zip(forwards[warm:], backwards, strict=False):
        actions += [f, b]
    return actions + backwards[len(forwards) - warm :]


def _nth(k: int, microbatches: int, chunks: int, stages: int, backward: bool) -> Action:
    """The k-th forward (or backward) of a device in Megatron's interleaved order: groups of
    S microbatches through chunk 0, then the same group through chunk 1, ..."""
    group = stages if chunks > 1 else microbatches
    chunk = (k // group) % chunks
    microbatch = (k // (group * chunks)) * group + k % group
    if backward:
        chunk = chunks - 1 - chunk
    return Action(BACKWARD if backward else FORWARD, microbatch, chunk)


def _check(stages: int, microbatches: int, virtual_stages: int, name: str, virtual: bool) -> None:
    for label, value in (("pipeline_stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
        raise ValueError(f"virtual_stages must be a positive int, got {virtual_stages!r}")
    if not virtual and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} is for schedule='interleaved-1f1b' or "
            "'looped-bfs'; "
            f"schedule={name!r} runs one chunk of layers per stage"
        )
    if virtual and virtual_stages < 2:
        raise ValueError(f"schedule={name!r} needs virtual_stages >= 2, got {virtual_stages}")
    if virtual and microbatches % stages:
        raise ValueError(
            f"schedule={name!r} runs microbatches in groups of pipeline_stages: "
            f"microbatches={microbatches} is not a multiple of pipeline_stages={stages}"
        )


SCHEDULES.update(
    {
        "gpipe": gpipe,
        "1f1b": one_f_one_b,
        "1f1b-paired": one_f_one_b_paired,
        "interleaved-1f1b": interleaved_one_f_one_b,
        "interleaved-1f1b-paired": interleaved_one_f_one_b_paired,
        "looped-bfs": looped_bfs,
        "zero-bubble-h1": zero_bubble_h1,
    }
)


def schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The table of schedule `name` (one of `SCHEDULES`) for `stages` devices."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not one of {sorted(SCHEDULES)}")
    lists = SCHEDULES[name](stages, microbatches, virtual_stages)
    return simulate(lists, name, stages, microbatches, virtual_stages, name in PAIRED_SCHEDULES)


def simulate(
    lists: list[list[Action]],
    name: str = "custom",
    stages: int | None = None,
    microbatches: int | None = None,
    virtual_stages: int = 1,
    paired: bool = False,
) -> Schedule:
    """Run each device's `lists[d]` in lockstep ticks: an action starts once what it needs
    finished in an earlier tick. `paired`: a device also starts the action after it in
    the same tick where the two are a forward and a backward, the forward run first (so
    the backward may need it). Raises if the lists deadlock or are incomplete."""
    stages = len(lists) if stages is None else stages
    microbatches = (
        1 + max(a.microbatch for actions in lists for a in actions)
        if microbatches is None
        else microbatches
    )
    last = virtual_stages * stages - 1
    done: dict[tuple[str, int, int], int] = {}
    placed: list[list[tuple[Action, int]]] = [[] for _ in lists]
    tick = 0
    while any(len(p) < len(a) for p, a in zip(placed, lists, strict=True)):
        started = []
        for d, actions in enumerate(lists):
            upcoming = actions[len(placed[d]) : len(placed[d]) + (2 if paired else 1)]
            if upcoming and _ready(_needs(upcoming[0], d, stages, last), done, tick):
                started.append((d, upcoming[0]))
                first = _key(upcoming[0], d, stages)
                if (
                    len(upcoming) == 2
                    and {upcoming[0].kind, upcoming[1].kind} == {FORWARD, BACKWARD}
                    and _ready(_needs(upcoming[1], d, stages, last), done, tick, first)
                ):
                    started.append((d, upcoming[1]))
        if not started and tick > max(done.values(), default=0) + 1:
            raise ValueError(f"schedule {name!r} deadlocks at tick {tick}")
        for d, action in started:
            placed[d].append((action, tick))
            done[_key(action, d, stages)] = tick
        tick += 1
    _check_complete(
        done, name, microbatches, last, any(a.kind == WEIGHT for row in lists for a in row)
    )
    table = _with_slots(placed, name, stages, microbatches, virtual_stages, tick)
    return dataclasses.replace(table, paired=paired)


def _ready(needs: list, done: dict, tick: int, this_tick: tuple | None = None) -> bool:
    """Whether what an action needs finished before `tick`, or is `this_tick`: the
    forward a paired tick runs first."""
    return all(done.get(need, tick) < tick or need == this_tick for need in needs)


def _key(action: Action, device: int, stages: int) -> tuple[str, int, int]:
    """What `done` knows an action by: its kind, microbatch and global stage."""
    return (action.kind, action.microbatch, action.chunk * stages + device)


def _needs(action: Action, device: int, stages: int, last: int) -> list[tuple[str, int, int]]:
    g = action.chunk * stages + device
    m = action.microbatch
    if action.kind == FORWARD:
        return [(FORWARD, m, g - 1)] if g > 0 else []
    if action.kind == BACKWARD:
        return [(FORWARD, m, g)] + ([(BACKWARD, m, g + 1)] if g < last else [])
    return [(BACKWARD, m, g)]


def _check_complete(done: dict, name: str, microbatches: int, last: int, split: bool) -> None:
    kinds = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
    want = {(k, m, g) for k in kinds for m in range(microbatches) for g in range(last + 1)}
    if set(done) != want:
        missing = sorted(want - set(done))[:3]
        raise ValueError(f"schedule {name!r} does not run every microbatch everywhere: {missing}")


def _with_slots(
    placed: list[list[tuple[Action, int]]],
    name: str,
    stages: int,
    microbatches: int,
    virtual_stages: int,
    ticks: int,
) -> Schedule:
    """`placed` with a buffer slot for every value that waits: activations and gradients
    from the moment they arrive until read, stage inputs from their forward until their
    backward (and weight gradient), a backward's gradient until its weight gradient."""
    at = {
        (a.kind, a.microbatch, a.chunk * stages + d): t for d, p in enumerate(placed) for a, t in p
    }
    last = virtual_stages * stages - 1
    split = any(k == WEIGHT for k, _, _ in at)
    intervals: dict[str, list[list[tuple[int, int, tuple]]]] = {
        kind: [[] for _ in range(stages)] for kind in ("F", "B", "stash")
    }
    for (kind, m, g), t in at.items():
        d = g % stages
        if kind == FORWARD and g > 0:  # arrived from g-1 at the tick after it ran
            intervals["F"][d].append((at[(FORWARD, m, g - 1)] + 1, t, (m, g)))
        if kind == BACKWARD and g < last:
            intervals["B"][d].append((at[(BACKWARD, m, g + 1)] + 1, t, (m, g)))
        if kind == FORWARD:
            end = at[(WEIGHT, m, g)] if split else at[(BACKWARD, m, g)]
            intervals["stash"][d].append((t, end, (m, g)))
    slot_of = {kind: {} for kind in intervals}
    slots = {}
    for kind, per_device in intervals.items():
        slots[kind] = max((_color(iv, slot_of[kind]) for iv in per_device), default=0)
    # a split backward's gradient waits for its weight gradient in its stage input's slot
    slots["grad"] = slots["stash"] if split else 0
    arrivals = {}
    for kind in (FORWARD, BACKWARD):
        for d, per_device in enumerate(intervals[kind]):
            for start, _, key in per_device:
                arrivals[(start, d, kind)] = slot_of[kind][key]
    steps = []
    for d, p in enumerate(placed):
        row = []
        for a, t in p:
            key = (a.microbatch, a.chunk * stages + d)
            reads = slot_of.get(a.kind, {})  # W reads its slot in the stash
            row.append(Step(a, t, reads.get(key, -1), slot_of["stash"][key]))
        steps.append(tuple(row))
    return Schedule(
        name, stages, microbatches, virtual_stages, ticks, tuple(steps), arrivals, slots
    )


def _color(intervals: list[tuple[int, int, tuple]], slot_of: dict) -> int:
    """Give each (start, end, key) interval the lowest slot free from start to end
    (inclusive); return how many slots were used."""
    free_after: list[int] = []  # slot -> the last tick it is taken
    for start, end, key in sorted(intervals):
        slot = next((s for s, busy in enumerate(free_after) if busy < start), len(free_after))
        if slot == len(free_after):
            free_after.append(end)
        free_after[slot] = end
        slot_of[key] = slot
    return len(free_after)
