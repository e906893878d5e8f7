"""Reading XLA's compiled HLO text: which collectives survived compilation, and how often
they run per step (a collective in a while body runs once per trip)."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from xla_strategies.passes.ir import itemsize

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"=\s*(.*?)\s([a-z\-]+)\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEE = re.compile(r"(?:body|calls|to_apply)=%([\w.\-]+)")


@dataclass
class _Computation:
    collectives: Counter[str] = field(default_factory=Counter)
    nbytes: Counter[str] = field(default_factory=Counter)
    calls: list[tuple[str, int]] = field(default_factory=list)  # (callee, times per call)


def hlo_bytes(types: str) -> int:
    """The bytes of every array in an HLO type (`f32[8,4]`, a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(types):
        total += math.prod(int(d) for d in dims.split(",") if d) * itemsize(dtype)
    return total


def _parse(hlo_text: str) -> tuple[dict[str, _Computation], str | None]:
    computations: dict[str, _Computation] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), _Computation())
            entry = header.group(1) if line.startswith("ENTRY") else entry
            continue
        found = current is not None and _INSTRUCTION.search(line)
        if not found:
            continue
        types, opcode = found.group(1), found.group(2).removesuffix("-start")
        if opcode in COLLECTIVES:
            current.collectives[opcode] += 1
            current.nbytes[opcode] += hlo_bytes(types)
        trips = _TRIP.search(line)
        for callee in _CALLEE.findall(line):
            times = (
                int(trips.group(1))
                if opcode == "while" and trips and "body=%" + callee in line
                else 1
            )
            current.calls.append((callee, times))
    return computations, entry


def count_hlo_collectives(hlo_text: str) -> dict[str, int]:
    """Collective instructions in the program text, per kind (async pairs count once)."""
    computations, _ = _parse(hlo_text)
    total: Counter[str] = Counter()
    for computation in computations.values():
        total.update(computation.collectives)
    return {kind: total[kind] for kind in COLLECTIVES}


def executed_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per kind: `count` and `bytes` executed per run of the entry computation, with while
    bodies multiplied by their known trip count (1 when XLA does not know it)."""
    computations, entry = _parse(hlo_text)
    memo: dict[str, tuple[Counter[str], Counter[str]]] = {}

    def run(name: str) -> tuple[Counter[str], Counter[str]]:
        if name not in memo:
            comp = computations.get(name, _Computation())
            counts, nbytes = Counter(comp.collectives), Counter(comp.nbytes)
            for callee, times in comp.calls:
                sub_counts, sub_bytes = run(callee)
                for kind in sub_counts:
                    counts[kind] += times * sub_counts[kind]
                    nbytes[kind] += times * sub_bytes[kind]
            memo[name] = counts, nbytes
        return memo[name]

    counts, nbytes = run(entry) if entry else (Counter(), Counter())
    return {kind: {"count": counts[kind], "bytes": nbytes[kind]} for kind in COLLECTIVES}
