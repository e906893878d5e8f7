"""Reading XLA's compiled HLO text: its computations and instructions, which collectives
survived compilation, and how many devices take part in each (how often a step runs each
computation: `hlo_loops`).

What it cannot read it says so (`HloReadError`), naming the instruction: a collective whose
group it cannot size is never counted as free."""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from typing import Any

import numpy as np

from xla_strategies.passes.ir.graph import itemsize

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")
#: An array type in HLO text (`f32[8,4]`): its element type and dimensions.
ARRAY_TYPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
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
