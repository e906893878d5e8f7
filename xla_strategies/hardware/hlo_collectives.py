"""The collectives XLA kept in a compiled program, read from its scheduled HLO text: each
with its bytes, replica groups, XLA's algorithm, how often a step runs it, and the compute
XLA scheduled beside it; a multislice program's collectives across the slices included
(XLA's TPU compiler hands them to the DCN runtime as host transfers)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from xla_strategies.hardware.hlo import (
    ARRAY_TYPE,
    CALLEE,
    COLLECTIVES,
    FUSIONS,
    OPERAND,
    Op,
    collective_kind,
    computations,
    dcn_collective,
    group_members,
    group_size,
    hlo_bytes,
    operand_text,
    participants,
    replica_groups,
    started_result,
)
from xla_strategies.hardware.hlo_loops import executions

_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_EMITTER = re.compile(r'"emitter":"(\w+)"')
_STRATEGY = re.compile(r'"strategy":"(\w+)"')
_UNKNOWN_CYCLES = 1 << 62
_BOOKKEEPING = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}
_TRANSFERS = {"send", "recv", "after-all"}  # a cross-slice collective's own instructions
_SKIP = set(COLLECTIVES)


@dataclass(frozen=True)
class Collective:
    """One collective instruction XLA kept."""

    kind: str
    name: str
    computation: str
    times: int  # per step: a while body's collective runs once per trip
    nbytes: int  # of its result, per participant
    group_size: int
    replica_groups: str
    algorithm: str | None  # XLA's emitter/strategy, where the backend records one
    asynchronous: bool
    overlapped_ops: int  # compute instructions scheduled between its start and done
    overlapped_cycles: int  # XLA's cycle estimates of those instructions
    #: every group within one replica's devices: XLA's partitioner added it for the model
    #: axis (a replica spanning several devices), not a reduction across replicas
    inside_replica: bool = False
    #: between the slices of a multislice program, over DCN: `group_size` counts slices
    across_slices: bool = False


def collectives(hlo_text: str, devices_per_replica: int = 1) -> list[Collective]:
    """Every collective of the scheduled HLO, with how often a step runs it and the
    compute XLA scheduled behind it: between an asynchronous start and its done, or, for
    libtpu's `async_collective_fusion`, the compute fused with it. With several devices per
    replica (consecutive device ids, the model axis last), a collective whose groups
    each stay within one replica is marked `inside_replica`."""
    comps, entry = computations(hlo_text)
    times = executions(comps, entry)
    everyone = participants(hlo_text)
    found: list[Collective] = []
    continued: list[int] = []  # steps of a collective started in another computation
    for name, ops in comps.items():
        if not times.get(name):
            continue
        in_flight: list[int] = []  # libtpu's async collectives started, not yet done
        for position, (op_name, types, opcode, rest) in enumerate(ops):
            across = dcn_collective(opcode, rest, op_name)
            if across is not None:
                found.append(_across_slices(ops, position, across, name, times[name]))
                continue
            inner = _collective(opcode, types, rest, comps, op_name)
            if inner is None:
                continue
            # libtpu runs an async collective in steps from its start to its done, each
            # step fused with other compute: one collective, whose overlap adds up
            step = next(
                (i for i in in_flight if (found[i].kind, found[i].nbytes) == _key(inner)), None
            )
            if opcode == "fusion" and step is not None:
                found[step] = dataclasses.replace(
                    found[step],
                    overlapped_ops=found[step].overlapped_ops + _fused_compute(rest, comps),
                    overlapped_cycles=found[step].overlapped_cycles + _cycles(rest),
                )
                if "collective-done" in op_name:
                    in_flight.remove(step)
                continue
            kind, inner_types, inner_rest = inner
            if opcode == "fusion":  # the collective runs beside the compute fused with it
                between = [None] * _fused_compute(rest, comps)
                asynchronous, cycles = True, _cycles(rest)
            else:
                asynchronous = opcode.endswith("-start")
                between = scheduled_between(ops, position, op_name) if asynchronous else []
                cycles = sum(_cycles(r) for *_, r in between)
            config = rest if _EMITTER.search(rest) else inner_rest
            found.append(
                Collective(
                    kind=kind,
                    name=op_name,
                    computation=name,
                    times=times[name],
                    nbytes=_result_bytes(opcode if collective_kind(opcode) else kind, inner_types),
                    group_size=group_size(kind, inner_rest, everyone, op_name),
                    replica_groups=replica_groups(inner_rest),
                    algorithm=_algorithm(config),
                    asynchronous=asynchronous,
                    overlapped_ops=len(between),
                    overlapped_cycles=cycles,
                    inside_replica=devices_per_replica > 1
                    and all(
                        len({d // devices_per_replica for d in group}) == 1
                        for group in group_members(kind, inner_rest, everyone, op_name)
                    ),
                )
            )
            if "collective-start" in op_name:
                in_flight.append(len(found) - 1)
            elif opcode == "fusion" and _continues(rest, comps):
                continued.append(len(found) - 1)
    return _merged_into_their_starts(found, continued)


def _continues(rest: str, comps: dict[str, list[Op]]) -> bool:
    """Whether a fusion that wraps a collective is a step of one in flight: libtpu runs an
    async collective in steps, each passing the collective's operand on to the next (its
    fused computation returns that parameter as it took it). A collective of its own
    returns its result, not its operand."""
    for callee in CALLEE.findall(rest):
        ops = comps.get(callee, [])
        operands = {
            o
            for _, _, opcode, r in ops
            if collective_kind(opcode)
            for o in OPERAND.findall(operand_text(r))
        }
        root = ops[-1] if ops else None
        if root is not None and root[2] == "tuple":
            if operands & set(OPERAND.findall(operand_text(root[3]))):
                return True
    return False


def _merged_into_their_starts(found: list[Collective], continued: list[int]) -> list[Collective]:
    """`found` with each step of a collective started in another computation (libtpu
    starts a gradient's all-reduce before a loop and advances it in the loop's body, once
    per trip: one all-reduce, which was counted once per trip) merged into its start:
    the compute fused with its steps, as often as they run, is what hides it. A step whose
    start is not found stays a collective of its own (counted, not lost)."""
    merged, gone = list(found), set()
    for i in continued:
        step = found[i]
        start = next(
            (
                j
                for j, c in enumerate(found)
                if "collective-start" in c.name
                and c.computation != step.computation
                and (c.kind, c.nbytes) == (step.kind, step.nbytes)
            ),
            None,
        )
        if start is None:
            continue
        runs = step.times / max(merged[start].times, 1)
        merged[start] = dataclasses.replace(
            merged[start],
            overlapped_ops=merged[start].overlapped_ops + round(step.overlapped_ops * runs),
            overlapped_cycles=merged[start].overlapped_cycles
            + round(step.overlapped_cycles * runs),
        )
        gone.add(i)
    return [c for i, c in enumerate(merged) if i not in gone]


def _across_slices(
    ops: list[Op], position: int, across: tuple[str, int], computation: str, times: int
) -> Collective:
    """The cross-slice collective whose `recv` is `ops[position]`: asynchronous from the
    transfer's start to its `recv-done`, its result the `recv`'s first element."""
    op_name, types, _, rest = ops[position]
    between = scheduled_between(ops, position, op_name)
    result = ARRAY_TYPE.search(types)
    return Collective(
        kind=across[0],
        name=op_name,
        computation=computation,
        times=times,
        nbytes=hlo_bytes(result.group(0)) if result else 0,
        group_size=across[1],
        replica_groups=replica_groups(rest),
        algorithm="dcn",
        asynchronous=True,
        overlapped_ops=len(between),
        overlapped_cycles=sum(_cycles(r) for *_, r in between),
        across_slices=True,
    )


def executed_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per kind: `count` and `bytes` a step runs (while bodies per trip), as `collectives`
    reads them: a collective fused into an asynchronous fusion counts too."""
    found = collectives(hlo_text)
    return {
        kind: {
            "count": sum(c.times for c in found if c.kind == kind),
            "bytes": sum(c.times * c.nbytes for c in found if c.kind == kind),
        }
        for kind in COLLECTIVES
    }


def _key(inner: tuple[str, str, str]) -> tuple[str, int]:
    return inner[0], _result_bytes(inner[0], inner[1])


def _fused_compute(rest: str, comps: dict[str, list[Op]]) -> int:
    """How many compute instructions a fusion that wraps a collective runs beside it."""
    fused = [o for c in CALLEE.findall(rest) for o in comps.get(c, [])]
    return sum(1 for o in fused if o[2] not in _BOOKKEEPING and o[2] not in _SKIP)


def total_cycles(hlo_text: str) -> int:
    """XLA's cycle estimates of every instruction a step runs, while bodies once per trip."""
    comps, entry = computations(hlo_text)
    times = executions(comps, entry)
    return sum(
        times.get(name, 0) * sum(_cycles(rest) for *_, rest in ops) for name, ops in comps.items()
    )


def _collective(
    opcode: str, types: str, rest: str, comps: dict[str, list[Op]], name: str = ""
) -> tuple[str, str, str] | None:
    """(kind, result types, attributes) of the collective this instruction is or wraps."""
    kind = collective_kind(opcode)
    if kind is not None:
        return kind, types, rest
    fused = opcode == "fusion" and ("collective" in rest or "collective" in name)
    wraps = opcode == "async-start" or fused
    for callee in CALLEE.findall(rest) if wraps else ():
        for _, inner_types, inner, inner_rest in comps.get(callee, []):
            found = _collective(inner, inner_types, inner_rest, comps)
            if found is not None:
                return found
    return None


def scheduled_between(ops: list[Op], start: int, start_name: str) -> list[Op]:
    """The compute instructions scheduled after `start` and before the done that reads it."""
    between = []
    for op in ops[start + 1 :]:
        name, _, opcode, rest = op
        if opcode.endswith("-done") and start_name in OPERAND.findall(operand_text(rest)):
            return between
        waits = opcode.endswith(("-start", "-done")) and opcode not in FUSIONS
        if opcode not in _BOOKKEEPING | _TRANSFERS and not waits:  # XLA:GPU's async fusions
            between.append(op)  # compute
    return between


def _result_bytes(opcode: str, types: str) -> int:
    """The bytes of the result of a collective instruction `opcode` (a wrapped one's own
    opcode): of a start's result, not its operands' (`started_result`)."""
    return hlo_bytes(started_result(opcode, types))


def _algorithm(rest: str) -> str | None:
    """XLA's emitter, and its strategy where it records one (`RotatedPincerShortEmitter/
    StrategyND`), from a collective's backend config."""
    names = [m.group(1) for m in (_EMITTER.search(rest), _STRATEGY.search(rest)) if m]
    return "/".join(names) or None


def _cycles(rest: str) -> int:
    """XLA's cycle estimate of an instruction; 0 where it has none, or where it writes
    int64's maximum for "unknown" (libtpu 0.0.42 does on v5p and v6e)."""
    found = _CYCLES.search(rest)
    cycles = int(found.group(1)) if found else 0
    return cycles if cycles < _UNKNOWN_CYCLES else 0
