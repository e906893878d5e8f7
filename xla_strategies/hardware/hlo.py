"""Reading XLA's compiled HLO text: its computations and instructions, how often a step
runs each computation (a while body once per trip, each branch of a conditional once per
execution: a bound) or what it adds up (a conditional's costliest branch), which
collectives survived
compilation, and how many devices take part in each.

What it cannot read it says so (`HloReadError`), naming the instruction: a collective whose
group it cannot size is never counted as free."""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from xla_strategies.passes.ir.graph import itemsize

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")
#: An array type in HLO text (`f32[8,4]`): its element type and dimensions.
ARRAY_TYPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INIT_STEP = re.compile(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"\}')
CALLEE = re.compile(r"(?:body|calls|to_apply|condition)=%([\w.\-]+)")
OPERAND = re.compile(r"%([\w.\-]+)")

#: One instruction: its name, result types, opcode, and the rest of its line.
Op = tuple[str, str, str, str]
#: A fusion, and XLA:GPU's asynchronous one (`fusion-start`, whose `fusion-done` hands
#: over its result): one instruction each, that runs its fused computation once.
FUSIONS = frozenset({"fusion", "fusion-start"})

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
# A collective across the slices of a multislice TPU program. XLA's TPU compiler keeps
# each slice's program on the slice's own chips, and hands the slices' share to the DCN
# runtime as a host transfer: a `send`/`recv` pair whose `recv` result is the collective's.
# Its target names the slices (`"{1,2}x{0:255}"`: slices 1 and 2, each chip with its peer)
# or the groups of global chip ids (`{{100000,200000},...}`, `{{100000->300000},...}`).
_DCN_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_DCN_SLICES = re.compile(r'_xla_megascale_target="\{([\d,:]+)\}x')
_DCN_GROUP = re.compile(r"_xla_megascale_target=\{\{([\d,>\-]+)\}")
_DCN_TARGET = re.compile(r'_xla_megascale_target=("[^"]*"|\{\{.*?\}\})')
_DCN_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_GATHER": "all-gather",
    "ALL_TO_ALL": "all-to-all",
    "ONE_TO_ONE": "collective-permute",
}
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
    """The replica groups attribute as XLA wrote it, or a cross-slice transfer's target
    ("" where the instruction has neither)."""
    for pattern in (_MESH_GROUPS, _IOTA_GROUPS, _EXPLICIT_GROUPS):
        found = pattern.search(rest)
        if found:
            return found.group(0).removeprefix("replica_groups=")
    target = _DCN_TARGET.search(rest)
    return target.group(1).strip('"') if target else ""


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


def dcn_collective(opcode: str, rest: str, name: str = "") -> tuple[str, int] | None:
    """(kind, slices in each group) of a `recv` that is a collective across the slices
    (see `_DCN_TYPE`); None for any other instruction. Raises HloReadError on a transfer
    it cannot read, so a cross-slice collective is never left out as free."""
    if opcode != "recv" or "_xla_megascale_transfer_type" not in rest:
        return None
    kind = _DCN_TYPE.search(rest)
    kind = _DCN_KINDS.get(kind.group(1)) if kind else None
    slices, group = _DCN_SLICES.search(rest), _DCN_GROUP.search(rest)
    if kind is None or not (slices or group):
        raise HloReadError(f"{name}: cannot read this cross-slice transfer: {rest[:300]}")
    if group:
        return kind, len(re.split(r",|->", group.group(1)))
    return kind, sum(_count_ids(part) for part in slices.group(1).split(","))


def _count_ids(part: str) -> int:
    """How many ids `7` or the inclusive range `0:255` names."""
    low, _, high = part.partition(":")
    return int(high) - int(low) + 1 if high else 1


def operand_text(rest: str) -> str:
    """The text of an instruction's operand list (`rest`: its line after the opening
    parenthesis), up to the parenthesis that closes it: operand types printed inline hold
    parentheses of their own (`f32[8,128]{1,0:T(8,128)} %p`), so the first `)` is not it."""
    depth = 0
    for at, char in enumerate(rest):
        if char in "([{":
            depth += 1
        elif char in "]}" or (char == ")" and depth > 0):
            depth -= 1
        elif char == ")":
            return rest[:at]
    return rest


def tuple_elements(types: str) -> list[str]:
    """The top-level elements of a tuple type, `(a, (b, c), d)`: a, (b, c) and d (commas
    inside shapes, layouts and nested tuples do not split)."""
    elements, depth, start = [], 0, 1
    for at, char in enumerate(types):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 1:
            elements.append(types[start:at].strip())
            start = at + 1
    elements.append(types[start : types.rindex(")")].strip())
    return elements


def started_result(opcode: str, types: str) -> str:
    """The result type of an instruction, of an asynchronous start the result it starts:
    XLA:GPU's `fusion-start` and `all-reduce-start`, and every other collective's start
    but libtpu's `all-reduce-start`, return `(operands, result, context...)`."""
    if not opcode.endswith("-start") or not types.startswith("("):
        return types
    if opcode == "all-reduce-start" and not types.startswith("(("):
        return types  # libtpu's: the result alone (a tuple of results for several)
    elements = tuple_elements(types)
    return elements[1] if len(elements) > 1 else types


def hlo_bytes(types: str) -> int:
    """The bytes of every array in an HLO type (`f32[8,4]`, a tuple of them)."""
    total = 0
    for dtype, dims in ARRAY_TYPE.findall(types):
        total += math.prod(int(d) for d in dims.split(",") if d) * itemsize(dtype)
    return total


@functools.lru_cache(maxsize=4)
def computations(hlo_text: str) -> tuple[dict[str, list[Op]], str | None]:
    """Each computation's instructions in schedule order, and the entry's name. Parsed
    once per text (a report reads it for flops, collectives, cycles and the roofline):
    callers read what it returns and never change it."""
    found: dict[str, list[Op]] = {}
    entry = current = None
    opened = 0  # the line the open computation started on
    for number, line in enumerate(hlo_text.splitlines(), 1):
        header = _HEADER.match(line)
        if header:
            current = found.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
            opened = number
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        op = _OP.match(line)
        if op and op.group(2).strip():
            current.append(op.groups())  # type: ignore[arg-type]
        elif _INSTRUCTION_LIKE.match(line):  # no opcode, or no result type to size
            raise HloReadError(f"line {number}: cannot read this instruction: {excerpt(line)}")
    _check_whole(found, entry, current, opened)
    return found, entry


# a line that starts as an instruction does (`%name =`, `ROOT %name =`)
_INSTRUCTION_LIKE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=")


def _check_whole(found: dict[str, list[Op]], entry: str | None, current: Any, opened: int) -> None:
    """Raise HloReadError for text that is not a whole HLO module: one that ends inside a
    computation (a truncated file) or has no entry computation. Reading what is there
    would report a partial program's collectives as the whole's."""
    if current is not None:
        raise HloReadError(
            f"the HLO text ends inside the computation that starts on line {opened} (no "
            "closing '}'): the file is truncated"
        )
    if entry is None:
        what = "no computation" if not found else "no ENTRY computation"
        raise HloReadError(f"the HLO text has {what}: it is not a whole compiled module")


def excerpt(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, saying how much was left out: error messages
    quote what they could not read, never a whole 10 MB line."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


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
    operands = OPERAND.findall(rest.split("),")[0])
    callee = re.search(r"calls=%([\w.\-]+)", rest) if opcode in FUSIONS else None
    inner = comps.get(callee.group(1), []) if callee else []
    params = {n: int(r.split(")")[0]) for n, _, o, r in inner if o == "parameter"}
    wrapped = [o for o in inner if o[2] != "parameter"]
    if len(wrapped) != 1:
        return opcode, operands, rest
    _, _, inner_opcode, inner_rest = wrapped[0]
    sides = [params.get(o) for o in OPERAND.findall(inner_rest.split("),")[0])]
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


def collective_kind(opcode: str) -> str | None:
    """The collective an opcode is (`all-reduce` for `all-reduce-start` too), or None."""
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES and not opcode.endswith("-done") else None


def count_hlo_collectives(hlo_text: str) -> dict[str, int]:
    """Collective instructions in the program text, per kind (async pairs, and a
    cross-slice collective's send and recv, count once)."""
    comps, _ = computations(hlo_text)
    total = Counter(kind for ops in comps.values() for op in ops if (kind := _kind_of(op)))
    return {kind: total[kind] for kind in COLLECTIVES}


def _kind_of(op: Op) -> str | None:
    name, _, opcode, rest = op
    across_slices = dcn_collective(opcode, rest, name)
    return across_slices[0] if across_slices else collective_kind(opcode)
