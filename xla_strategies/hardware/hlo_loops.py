"""How often one step of a compiled HLO program runs each computation: a while body once
per trip (`trip_count`), a called computation once per call, each branch of a
conditional once per execution (`executions`: a bound), or of the branches the costliest
(`step_total`: what a lockstep program adds up)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

from xla_strategies.hardware.hlo import CALLEE, FUSIONS, OPERAND, Op, operand_text

_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INIT_STEP = re.compile(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"\}')


def executions(comps: dict[str, list[Op]], entry: str | None) -> dict[str, int]:
    """How many times one step runs each computation not fused into an instruction."""
    times: dict[str, int] = {}

    def visit(name: str, count: int) -> None:
        times[name] = times.get(name, 0) + count
        for _, _, opcode, rest in comps.get(name, []):
            for callee, runs in called(opcode, rest, comps):
                visit(callee, count * runs)
            for branch in branches(opcode, rest):  # each as if it ran: a bound
                visit(branch, count)

    if entry is not None:
        visit(entry, 1)
    return times


def called(opcode: str, rest: str, comps: dict[str, list[Op]]) -> list[tuple[str, int]]:
    """The computations one execution of an instruction runs, each with how many times: a
    while body once per trip, its condition and any other callee once; none for a fusion
    (its instructions are the fusion's, counted as one op) or a conditional (`branches`)."""
    if opcode in FUSIONS:
        return []
    trips = trip_count(rest, comps) if opcode == "while" else 1
    return [
        (callee, trips if opcode == "while" and f"body=%{callee}" in rest else 1)
        for callee in CALLEE.findall(rest)
    ]


def step_total(
    comps: dict[str, list[Op]],
    entry: str | None,
    own: Callable[[str], Counter[str]],
    rank: Callable[[Counter[str]], float],
) -> Counter[str]:
    """What one step adds up of `own(computation)` (quantities that add: seconds, bytes,
    flops): a while body's once per trip, a called computation's once per call, and of a
    conditional's branches the costliest by `rank`, once per execution. One branch runs
    and the text does not say which: the costliest is the bound a lockstep program (a
    pipeline's tick: every stage waits for the slowest) runs at."""
    totals: dict[str, Counter[str]] = {}

    def total(name: str) -> Counter[str]:
        if name in totals:
            return totals[name]
        found = Counter(own(name))
        for _, _, opcode, rest in comps.get(name, []):
            for callee, runs in called(opcode, rest, comps):
                for key, value in total(callee).items():
                    found[key] += value * runs
            taken = [total(branch) for branch in branches(opcode, rest)]
            if taken:
                found.update(max(taken, key=rank))
        totals[name] = found
        return found

    return total(entry) if entry is not None else Counter()


def branches(opcode: str, rest: str) -> list[str]:
    """A `conditional`'s branch computations (`branch_computations={%a, %b}`, or
    `true_computation=`/`false_computation=`); none for any other instruction. One of them
    runs per execution and the text does not say which: `executions` counts each as run
    (an upper bound, for what must never be missed: collectives), `step_total` the
    costliest."""
    if opcode != "conditional":
        return []
    listed = _BRANCHES.search(rest)
    if listed:
        return OPERAND.findall(listed.group(1))
    return _TRUE_FALSE.findall(rest)


_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(?:true|false)_computation=%([\w.\-]+)")


def trip_count(rest: str, comps: dict[str, list[Op]]) -> int:
    """A while loop's trips: XLA's known trip count, or from its condition (`i < N`, the
    form scans lower to; a compare of its own or in a fusion) the bound less where the
    counter starts over its step (XLA's `known_init_step`, else read from the loop's
    operand and its body's root: 0 and 1 where they do not say); 1 when none says."""
    known = _TRIP.search(rest)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%([\w.\-]+)", rest)
    ops = comps.get(condition.group(1), []) if condition else []
    for operands in _less_than(ops, comps):
        bound = [c for o in operands if o is not None and (c := _constant(o)) is not None]
        counter = [o for o in operands if o is not None and o[2] == "get-tuple-element"]
        if not bound:
            continue
        if not counter:
            return bound[0]
        index = int(re.search(r"index=(\d+)", counter[0][3]).group(1))
        start, step = _counter(rest, comps, index)
        return max(0, -(-(bound[0] - start) // step))
    return 1


def _less_than(ops: list[Op], comps: dict[str, list[Op]]) -> list[list[Op | None]]:
    """The operands (as instructions of `ops`) of each `a < b` a loop condition computes."""
    by_name = {op[0]: op for op in ops}
    found = []
    for op in ops:
        opcode, operands, attributes = _unwrapped(op, comps)
        if opcode == "compare" and "direction=LT" in attributes:
            found.append([by_name.get(o) for o in operands[:2]])
    return found


def _unwrapped(op: Op, comps: dict[str, list[Op]]) -> tuple[str, list[str], str]:
    """An instruction's opcode, operand names and attributes; for a fusion that wraps one
    instruction (XLA:CPU's `wrapped_compare`, `wrapped_add`), that instruction's, its
    parameters taken for the fusion's operands."""
    _, _, opcode, rest = op
    operands = OPERAND.findall(operand_text(rest))
    callee = re.search(r"calls=%([\w.\-]+)", rest) if opcode in FUSIONS else None
    inner = comps.get(callee.group(1), []) if callee else []
    params = {n: int(r.split(")")[0]) for n, _, o, r in inner if o == "parameter"}
    wrapped = [o for o in inner if o[2] != "parameter"]
    if len(wrapped) != 1:
        return opcode, operands, rest
    _, _, inner_opcode, inner_rest = wrapped[0]
    sides = [params.get(o) for o in OPERAND.findall(operand_text(inner_rest))]
    if None in sides or max(sides, default=0) >= len(operands):
        return opcode, operands, rest
    return inner_opcode, [operands[i] for i in sides], inner_rest


def _counter(rest: str, comps: dict[str, list[Op]], index: int) -> tuple[int, int]:
    """Where a while loop's counter (its tuple's element `index`) starts, and its step:
    read from the loop's operand tuple and its body's root; 0 and 1 where they do not
    say (an operand computed at run time)."""
    told = _INIT_STEP.search(rest)
    if told and f'"tuple_index":"{index}"' in rest:
        return int(told.group(1)), int(told.group(2)) or 1
    names = _instructions(comps)
    operands = OPERAND.findall(rest)
    loop_in = names.get(operands[0]) if operands else None
    start = None
    if loop_in is not None and loop_in[2] == "tuple":
        element = names.get(OPERAND.findall(loop_in[3])[index])
        while element is not None and element[2] in ("copy", "bitcast"):
            element = names.get(OPERAND.findall(element[3])[0])
        start = None if element is None else _constant(element)
    body = re.search(r"body=%([\w.\-]+)", rest)
    body_ops = comps.get(body.group(1), []) if body else []
    by_name = {op[0]: op for op in body_ops}
    step = None
    root = next((op for op in reversed(body_ops) if op[2] == "tuple"), None)
    if root is not None:
        add = by_name.get(OPERAND.findall(root[3])[index])
        opcode, operands, _ = _unwrapped(add, comps) if add is not None else ("", [], "")
        if opcode == "add":
            steps = [_constant(by_name[o]) for o in operands if o in by_name]
            step = next((s for s in steps if s is not None and s > 0), None)
    return start or 0, step or 1


def _constant(op: Op) -> int | None:
    """The integer a scalar `constant` instruction holds, else None."""
    value = re.match(r"(-?\d+)\)", op[3]) if op[2] == "constant" else None
    return int(value.group(1)) if value else None


def _instructions(comps: dict[str, list[Op]]) -> dict[str, Op]:
    """Every instruction of the module by name (names are the module's own), indexed once
    per parsed text."""
    cached = _INDEX.get(id(comps))
    if cached is None or cached[0] is not comps:
        cached = (comps, {op[0]: op for ops in comps.values() for op in ops})
        _INDEX.clear()  # one parsed text at a time is walked
        _INDEX[id(comps)] = cached
    return cached[1]


_INDEX: dict[int, tuple[dict[str, list[Op]], dict[str, Op]]] = {}
