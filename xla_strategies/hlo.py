"""Reading XLA's compiled HLO text: its computations and instructions, how often a step
runs each computation (a while body once per trip), and which collectives survived
compilation."""

from __future__ import annotations

import math
import re
from collections import Counter

from xla_strategies.passes.ir.graph import itemsize

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
CALLEE = re.compile(r"(?:body|calls|to_apply|condition)=%([\w.\-]+)")
OPERAND = re.compile(r"%([\w.\-]+)")

#: One instruction: its name, result types, opcode, and the rest of its line.
Op = tuple[str, str, str, str]


def hlo_bytes(types: str) -> int:
    """The bytes of every array in an HLO type (`f32[8,4]`, a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(types):
        total += math.prod(int(d) for d in dims.split(",") if d) * itemsize(dtype)
    return total


def computations(hlo_text: str) -> tuple[dict[str, list[Op]], str | None]:
    """Each computation's instructions in schedule order, and the entry's name."""
    found: dict[str, list[Op]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = found.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
            continue
        op = _OP.match(line) if current is not None else None
        if op:
            current.append(op.groups())  # type: ignore[arg-type]
    return found, entry


def executions(comps: dict[str, list[Op]], entry: str | None) -> dict[str, int]:
    """How many times one step runs each computation not fused into an instruction."""
    times: dict[str, int] = {}

    def visit(name: str, count: int) -> None:
        times[name] = times.get(name, 0) + count
        for _, _, opcode, rest in comps.get(name, []):
            if opcode == "fusion":
                continue  # its instructions are the fusion's, counted as one op
            trips = trip_count(rest, comps) if opcode == "while" else 1
            for callee in CALLEE.findall(rest):
                body = opcode == "while" and f"body=%{callee}" in rest
                visit(callee, count * (trips if body else 1))

    if entry is not None:
        visit(entry, 1)
    return times


def trip_count(rest: str, comps: dict[str, list[Op]]) -> int:
    """A while loop's trips: XLA's known trip count, or the bound its condition compares
    the counter with (`i < N`, the form scans lower to); 1 when neither says."""
    known = _TRIP.search(rest)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%([\w.\-]+)", rest)
    ops = comps.get(condition.group(1), []) if condition else []
    constants = {
        name: int(value.group(1))
        for name, _, opcode, op_rest in ops
        if opcode == "constant" and (value := re.match(r"(-?\d+)\)", op_rest))
    }
    for _, _, opcode, op_rest in ops:
        if opcode == "compare" and "direction=LT" in op_rest:
            bound = [constants[o] for o in OPERAND.findall(op_rest) if o in constants]
            if bound:
                return bound[0]
    return 1


def collective_kind(opcode: str) -> str | None:
    """The collective an opcode is (`all-reduce` for `all-reduce-start` too), or None."""
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES and not opcode.endswith("-done") else None


def count_hlo_collectives(hlo_text: str) -> dict[str, int]:
    """Collective instructions in the program text, per kind (async pairs count once)."""
    comps, _ = computations(hlo_text)
    total = Counter(
        kind for ops in comps.values() for op in ops if (kind := collective_kind(op[2]))
    )
    return {kind: total[kind] for kind in COLLECTIVES}


def executed_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per kind: `count` and `bytes` executed per run of the entry computation, with while
    bodies multiplied by their trip count (1 when it cannot be read)."""
    comps, entry = computations(hlo_text)
    times = executions(comps, entry)
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for name, ops in comps.items():
        for _, types, opcode, _ in ops:
            kind = collective_kind(opcode)
            if kind and times.get(name):
                counts[kind] += times[name]
                nbytes[kind] += times[name] * hlo_bytes(types)
    return {kind: {"count": counts[kind], "bytes": nbytes[kind]} for kind in COLLECTIVES}
