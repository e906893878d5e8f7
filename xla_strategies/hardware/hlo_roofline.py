"""A compiled program's compute time, read from its HLO as a roofline per instruction: each
executed instruction (a fusion as one) takes the longer of its matmul flops at the chip's
peak (`hlo_flops`) and the bytes it moves to and from device memory (HBM) at the memory's
bandwidth. An elementwise optimizer update has no matmul flops, yet reads every weight,
gradient and moment and writes them back: a flops-only estimate counts it as free.

What an instruction moves: each operand it reads and the result it writes, where they live
in device memory (a layout's `S(1)` and up is on-chip memory: free here; the copies that
fill it from HBM are counted); a compiled kernel's, what it declares (`bytes_accessed`).
Inside a fusion, an operand read only through slices (a layer of a stacked weight in a
scanned loop) moves only the slices, and an in-place `dynamic-update-slice` writes only
its update (XLA's buffer is updated where it lies).
Not counted: collectives and transfers (communication, priced apart), control flow
(`while`, `call`: their bodies are counted, a loop's once per trip; a `conditional`: its
costliest branch, once per execution), and instructions
that only rename buffers (`bitcast`, `tuple`, `get-tuple-element`, `parameter`).
Asynchronous copies (`copy-start`, `slice-start`: prefetches into on-chip memory) run
beside the compute: they add no time of their own, but the step is never shorter than
every byte, theirs too, at the memory's bandwidth.
An estimate, labelled as one: a lower bound on each instruction's time, not XLA's schedule.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from xla_strategies.hardware.hlo import (
    CALLEE,
    FUSIONS,
    OPERAND,
    Op,
    collective_kind,
    computations,
    hlo_bytes,
    operand_text,
    started_result,
)
from xla_strategies.hardware.hlo_collectives import scheduled_between
from xla_strategies.hardware.hlo_flops import declared_cost, instruction_flops, matmul_seconds
from xla_strategies.hardware.hlo_loops import step_total

if TYPE_CHECKING:
    from xla_strategies.hardware.hlo_collectives import Collective
    from xla_strategies.hardware.topology import Topology

#: Instructions that move no data through HBM of their own, or whose traffic is priced
#: elsewhere (communication; a loop's or call's body).
_NO_TRAFFIC = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "copy-done",
    "send",
    "send-done",
    "recv",
    "recv-done",
    "domain",
    # an asynchronous call's wrapper (an offload to another core, such as v5p's SparseCore
    # gathers): its called computation is counted
    "call-start",
    "call-update",
    "call-done",
    "async-start",
    "async-update",
}
_SLICING = ("dynamic-slice", "slice", "gather")
#: Asynchronous copies between device memory and on-chip memory (a prefetch, an eviction,
#: a slice fetched ahead): which array of the result tuple is the destination
#: (`copy-start`: (destination, source, context); `slice-start`: ((source), slice, ...)).
_DMA_DESTINATION = {"copy-start": 0, "slice-start": 1}
# an array type with its layout, if printed (`f32[8,4]{1,0:T(8,128)S(1)}`)
_LAID_OUT = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


def roofline_seconds(hlo_text: str, topology: Topology | None) -> float | None:
    """Seconds one step computes by the roofline (see the module's docstring); None where
    the topology knows no peak flops or no memory bandwidth."""
    return roofline_step(hlo_text, topology)[0]


def roofline_step(
    hlo_text: str,
    topology: Topology | None,
    beside: Callable[[str], Counter[str]] | None = None,
    rank: Callable[[Counter[str]], float] = lambda c: c["serial"],
) -> tuple[float | None, Counter[str]]:
    """The step's roofline seconds, and what `beside(computation)` adds up per run of a
    computation (a collective's exposed seconds) along the same path: a conditional's
    branch taken is the costliest by `rank` of its totals (its compute, `serial`, alone by
    default). None for the seconds where the topology knows no peak or bandwidth."""
    if topology is None or not topology.memory_bandwidth or not topology.peak_flops:
        return None, Counter()
    bandwidth = topology.memory_bandwidth
    comps, entry = computations(hlo_text)

    def own(name: str) -> Counter[str]:  # one run of a computation's own instructions
        ops = comps.get(name, [])
        types = {op[0]: op[1] for op in ops}
        found: Counter[str] = Counter(beside(name)) if beside else Counter()
        for op in ops:
            nbytes = hbm_bytes(op, comps, types)
            found["moved"] += nbytes
            if op[2] in _DMA_DESTINATION:  # beside the compute, sharing the bandwidth
                continue
            found["serial"] += instruction_seconds(op, comps, types, topology, nbytes)
        return found

    step = step_total(comps, entry, own, rank=rank)
    return max(step["serial"], step["moved"] / bandwidth), step


def overlapped_seconds(
    hlo_text: str, found: list[Collective], topology: Topology
) -> dict[tuple[str, str], float]:
    """Each asynchronous collective's compute scheduled between its start and its done, in
    roofline seconds, by (computation, start's name): what may hide it where the program
    carries no cycle estimates of XLA's (XLA:GPU writes none). A loop or call scheduled
    there counts nothing (its body is not read here): a lower bound on the overlap. Empty
    where the topology knows no peak or bandwidth."""
    if not topology.memory_bandwidth or not topology.peak_flops:
        return {}
    comps, _ = computations(hlo_text)
    seconds: dict[tuple[str, str], float] = {}
    started = {(c.computation, c.name) for c in found if c.asynchronous}
    for name in {computation for computation, _ in started}:
        ops = comps.get(name, [])
        types = {op[0]: op[1] for op in ops}
        for position, (op_name, _, opcode, _) in enumerate(ops):
            if (name, op_name) in started and opcode not in FUSIONS:  # a fused one: no wait
                between = scheduled_between(ops, position, op_name)
                seconds[name, op_name] = sum(
                    instruction_seconds(op, comps, types, topology) for op in between
                )
    return seconds


def instruction_seconds(
    op: Op,
    comps: dict[str, list[Op]],
    types: dict[str, str],
    topology: Topology,
    nbytes: int | None = None,
) -> float:
    """One execution of `op` by the roofline: the longer of its matmul flops at the chip's
    peak and its device-memory bytes (`nbytes`, `hbm_bytes` where not given) at the
    memory's bandwidth."""
    flops = matmul_seconds(instruction_flops(op, comps, types), topology) or 0.0
    moved = hbm_bytes(op, comps, types) if nbytes is None else nbytes
    return max(flops, moved / topology.memory_bandwidth)


def hbm_bytes(op: Op, comps: dict[str, list[Op]], types: dict[str, str]) -> int:
    """Bytes one execution of `op` reads from and writes to device memory."""
    _, result, opcode, rest = op
    if opcode in _NO_TRAFFIC or collective_kind(opcode) or opcode.endswith("-done"):
        return 0
    declared = declared_cost(opcode, rest)
    if declared and "bytes_accessed" in declared:  # a kernel that says what it moves
        return declared["bytes_accessed"]
    operands = _operands(rest)
    if opcode in _DMA_DESTINATION:
        return _dma_bytes(opcode, types.get(operands[0], "") if operands else "", result)
    if opcode not in FUSIONS:
        read = [_in_hbm(types.get(o, "")) for o in operands]
        if opcode in _SLICING and read:  # reads the slice it takes
            read[0] = min(read[0], _in_hbm(result))
        elif opcode == "dynamic-update-slice" and len(read) > 1:  # in place: the update
            return sum(read[1:]) + read[1]
        return sum(read) + _in_hbm(result)
    callee = CALLEE.search(rest)
    fused = comps.get(callee.group(1), []) if callee else []
    if any(collective_kind(op[2]) for op in fused):  # XLA's async collective fusions
        return 0
    return _fusion_bytes(operands, started_result(opcode, result), fused, types, comps)


def _dma_bytes(opcode: str, source: str, result: str) -> int:
    """The bytes a DMA copies, where either end is device memory."""
    arrays = [m.group(0) for m in _LAID_OUT.finditer(result)]
    index = _DMA_DESTINATION[opcode]
    destination = arrays[index] if index < len(arrays) else ""
    return hlo_bytes(destination) if _in_hbm(source) or _in_hbm(destination) else 0


def _fusion_bytes(
    operands: list[str],
    result: str,
    fused: list[Op],
    types: dict[str, str],
    comps: dict[str, list[Op]],
) -> int:
    updated, written = _in_place_updates(fused, result)
    params = _parameters(fused)
    total = written
    for index, outer in enumerate(operands):
        inner, whole = params.get(index), _in_hbm(types.get(outer, ""))
        if inner is None or whole == 0 or inner in updated:
            continue
        total += min(whole, _read_bytes(inner, fused, comps, whole))
    return total


def _parameters(fused: list[Op]) -> dict[int, str]:
    """A fused computation's parameters by index."""
    return {
        int(m.group(1)): name
        for name, _, opcode, rest in fused
        if opcode == "parameter" and (m := re.match(r"(\d+)\)", rest))
    }


def _read_bytes(param: str, fused: list[Op], comps: dict[str, list[Op]], whole: int) -> int:
    """What a fusion reads of its parameter `param` (`whole` bytes): the slices its
    readers take (also inside a nested fusion), or all of it."""
    total = 0
    for _, result, opcode, rest in fused:
        args = _operands(rest)
        if param not in args:
            continue
        if opcode in _SLICING and args[0] == param:
            total += hlo_bytes(result)
        elif opcode == "fusion" and (callee := CALLEE.search(rest)):
            nested = comps.get(callee.group(1), [])
            inner = _parameters(nested)
            total += sum(
                _read_bytes(inner[i], nested, comps, whole)
                for i, arg in enumerate(args)
                if arg == param and i in inner
            )
        else:
            return whole
    return total


def _in_place_updates(fused: list[Op], result: str) -> tuple[set[str], int]:
    """The fused parameters an in-place `dynamic-update-slice` at the root updates (not
    read), and the bytes the fusion writes: each such update's, the rest of the result
    whole."""
    if not fused or _in_hbm(result) == 0:
        return set(), 0
    root = fused[-1]
    if root[2] == "dynamic-update-slice":
        outputs = [root]
    elif root[2] == "tuple":
        by_name = {op[0]: op for op in fused}
        outputs = [by_name[o] for o in _operands(root[3]) if o in by_name]
    else:
        return set(), _in_hbm(result)
    fused_types = {name: t for name, t, _, _ in fused}
    updated, written = set(), 0
    for _, out_type, opcode, rest in outputs:
        args = _operands(rest)
        if opcode == "dynamic-update-slice" and len(args) > 1:
            updated.add(args[0])
            written += hlo_bytes(fused_types.get(args[1], ""))
        else:
            written += hlo_bytes(out_type)
    return updated, written


def _operands(rest: str) -> list[str]:
    """The names of an instruction's operands."""
    return OPERAND.findall(operand_text(rest))


def _in_hbm(types: str) -> int:
    """The bytes of the arrays in `types` that live in device memory (no `S(n)`, n > 0)."""
    total = 0
    for array in _LAID_OUT.finditer(types):
        space = _MEMORY_SPACE.search(array.group(3) or "")
        if not (space and int(space.group(1)) > 0):
            total += hlo_bytes(array.group(0))
    return total
