"""Reading XLA's compiled HLO text: its computations and instructions, how often a step
runs each computation (a while body once per trip), which collectives survived
compilation, and how many devices take part in each.

What it cannot read it says so (`HloReadError`), naming the instruction: a collective whose
group it cannot size is never counted as free."""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

from xla_strategies.passes.ir.graph import itemsize

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")
#: An array type in HLO text (`f32[8,4]`): its element type and dimensions.
ARRAY_TYPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
CALLEE = re.compile(r"(?:body|calls|to_apply|condition)=%([\w.\-]+)")
OPERAND = re.compile(r"%([\w.\-]+)")

#: One instruction: its name, result types, opcode, and the rest of its line.
Op = tuple[str, str, str, str]

_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)?\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# JAX 0.12's spelling: the mesh, then the axes each group spans (`{}`: none, so each
# device alone). Axis names are quoted and may hold any character but a quote
# (`'sharded:x'`).
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*(\{[^}]*\})?")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_QUOTED = re.compile(r"'([^']+)'")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_PAIR = re.compile(r"\{(\d+),(\d+)\}")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS = re.compile(r"\breplica_count=(\d+)")


class HloReadError(ValueError):
    """HLO text the reader does not understand; the message quotes it."""


def participants(hlo_text: str) -> int:
    """Devices that run the program: the module's partitions times its replicas."""
    header = hlo_text.split("\n", 1)[0]
    partitions, replicas = _PARTITIONS.search(header), _REPLICAS.search(header)
    return int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)


def replica_groups(rest: str) -> str:
    """The replica groups attribute as XLA wrote it ("" where the instruction has none)."""
    for pattern in (_MESH_GROUPS, _IOTA_GROUPS, _EXPLICIT_GROUPS):
        found = pattern.search(rest)
        if found:
            return found.group(0).removeprefix("replica_groups=")
    return ""


def group_size(kind: str, rest: str, everyone: int, name: str = "") -> int:
    """Devices in each group of a collective, from any of XLA's spellings of its groups:
    explicit lists, iota (`[4,4]<=[16]`, with or without a transpose), JAX 0.12's mesh
    axes, or none (every device). A permute moves between pairs: 2. Raises HloReadError
    on a spelling it does not know."""
    if kind == "collective-permute":
        return 2
    return len(group_members(kind, rest, everyone, name)[0])


def group_members(kind: str, rest: str, everyone: int, name: str = "") -> list[list[int]]:
    """The device ids of each group of a collective (a permute's: each source-target
    pair), read as `group_size` reads them. Raises HloReadError on a spelling it does not
    know, or on groups of different sizes."""
    if kind == "collective-permute":
        pairs = _PAIRS.search(rest)
        return [list(map(int, p)) for p in _PAIR.findall(pairs.group(1))] if pairs else []
    if "replica_groups=" not in rest:
        return [list(range(everyone))]
    mesh = _MESH_GROUPS.search(rest)
    if mesh:
        sizes = {a: int(n) for a, n in _MESH_AXIS.findall(mesh.group(1))}
        named = _QUOTED.findall(mesh.group(2)) if mesh.group(2) else list(sizes)
        unknown = [a for a in named if a not in sizes]
        if not sizes or unknown:
            raise HloReadError(f"{name}: mesh replica groups name unknown axes {unknown}: {rest}")
        ids = np.arange(math.prod(sizes.values())).reshape(tuple(sizes.values()))
        last = [list(sizes).index(a) for a in named]
        order = [i for i in range(len(sizes)) if i not in last] + last
        size = math.prod(sizes[a] for a in named)
        return ids.transpose(order).reshape(-1, size).tolist()
    iota = _IOTA_GROUPS.search(rest)
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        perm = [int(p) for p in iota.group(3).split(",")] if iota.group(3) else range(len(dims))
        return (
            np.arange(math.prod(dims))
            .reshape(dims)
            .transpose(list(perm))
            .reshape(-1, shape[-1])
            .tolist()
        )
    explicit = _EXPLICIT_GROUPS.search(rest)
    if explicit:
        if explicit.group(1) is None:  # `{}`: one group of every device
            return [list(range(everyone))]
        groups = [
            list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", explicit.group(1))
        ]
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise HloReadError(f"{name}: replica groups of different sizes {sorted(sizes)}")
        return groups
    raise HloReadError(f"{name}: cannot read the replica groups of this {kind}: {rest[:300]}")


def hlo_bytes(types: str) -> int:
    """The bytes of every array in an HLO type (`f32[8,4]`, a tuple of them)."""
    total = 0
    for dtype, dims in ARRAY_TYPE.findall(types):
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
