"""What XLA's compiled program says about a step: memory per chip, the collectives it kept
(with their bytes, replica groups and XLA's algorithm), and the compute it scheduled behind
each asynchronous one.

The numbers come from the executable (`memory_analysis()`, its scheduled HLO text), not
from our cost model. Where an estimate is needed, it is labelled: communication time from
the topology's cost model, compute time from the HLO's own matmul flops (`hlo_flops`, every
loop body once per trip) at the chip's peak, and the share of that compute XLA scheduled
behind each asynchronous collective from XLA's own per-op cycle estimates. One reader for
every program: a step compiled here and any HLO text (a peer's dump) are read alike.
`cost_analysis()` is not used: it counts a loop body once, and scaling it per trip by XLA's
cycle estimates gave BERT-large 23.7 ms of compute on v5e-256 where its matmuls take 54.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from xla_strategies.core.layout import MODEL_AXIS
from xla_strategies.hardware.hlo import (
    ARRAY_TYPE,
    CALLEE,
    COLLECTIVES,
    OPERAND,
    HloReadError,
    Op,
    collective_kind,
    computations,
    dcn_collective,
    executions,
    group_members,
    group_size,
    hlo_bytes,
    participants,
    replica_groups,
)
from xla_strategies.hardware.hlo_flops import hlo_flops, matmul_seconds
from xla_strategies.passes.cost import model as cost_model

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


@dataclass(frozen=True)
class Memory:
    """Per-chip bytes from XLA's memory analysis."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int

    @property
    def total_bytes(self) -> int:
        """What the chip holds at the program's peak: arguments, outputs not aliased to
        them, temporaries and the program itself (XLA's own out-of-memory sum)."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.generated_code_bytes
        )

    @classmethod
    def of(cls, stats: Any) -> Memory:
        return cls(
            stats.argument_size_in_bytes,
            stats.output_size_in_bytes,
            stats.temp_size_in_bytes,
            stats.alias_size_in_bytes,
            stats.generated_code_size_in_bytes,
        )


@dataclass
class CompiledReport:
    """A compiled step, as XLA compiled it for the strategy's devices."""

    platform: str
    topology: str | None
    hbm_bytes: int | None
    memory: Memory | None  # None: read from HLO text alone, without the executable
    flops: float | None  # the HLO's matmul flops per step
    collectives: list[Collective]
    compile_seconds: float
    estimate: dict[str, float | None] = field(default_factory=dict)
    #: the HLO's matmul flops by element type (each type has its own peak)
    flops_by_dtype: dict[str, float] | None = None

    def bytes_per_step(self, synchronous_only: bool = False) -> int:
        """The bytes the collectives move per step (loop bodies once per trip); only
        those XLA left synchronous, nothing scheduled beside them, with
        `synchronous_only`."""
        return sum(
            c.times * c.nbytes
            for c in self.collectives
            if not (synchronous_only and c.asynchronous)
        )

    @property
    def fits(self) -> bool | None:
        if self.hbm_bytes is None or self.memory is None:
            return None
        return self.memory.total_bytes <= self.hbm_bytes

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.memory is not None:
            data["memory"]["total_bytes"] = self.memory.total_bytes
        data["fits"] = self.fits
        return data


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
                between = _between(ops, position, op_name) if asynchronous else []
                cycles = sum(_cycles(r) for *_, r in between)
            config = rest if _EMITTER.search(rest) else inner_rest
            found.append(
                Collective(
                    kind=kind,
                    name=op_name,
                    computation=name,
                    times=times[name],
                    nbytes=_result_bytes(inner_types, opcode.endswith("-start")),
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
    return found


def _across_slices(
    ops: list[Op], position: int, across: tuple[str, int], computation: str, times: int
) -> Collective:
    """The cross-slice collective whose `recv` is `ops[position]`: asynchronous from the
    transfer's start to its `recv-done`, its result the `recv`'s first element."""
    op_name, types, _, rest = ops[position]
    between = _between(ops, position, op_name)
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
    return inner[0], _result_bytes(inner[1], False)


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


def _between(ops: list[Op], start: int, start_name: str) -> list[Op]:
    """The compute instructions scheduled after `start` and before the done that reads it."""
    between = []
    for op in ops[start + 1 :]:
        name, _, opcode, rest = op
        if opcode.endswith("-done") and start_name in OPERAND.findall(rest.split(")")[0]):
            return between
        if opcode not in _BOOKKEEPING | _TRANSFERS and not opcode.endswith(("-start", "-done")):
            between.append(op)
    return between


def _result_bytes(types: str, asynchronous: bool) -> int:
    """An asynchronous start's result is a tuple that holds its operands too: count the
    last element (the result)."""
    if asynchronous and types.startswith("("):
        parts = [p for p in re.split(r",\s*(?![^\[]*\])", types.strip("()")) if "[" in p]
        return hlo_bytes(parts[-1]) if parts else 0
    return hlo_bytes(types)


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


def compiled_report(compiled: Any, strategy: Any) -> CompiledReport:
    """Read a step compiled for `strategy`'s devices: what `hlo_report` reads from its HLO
    text (the one reader every program is measured by), and its memory from the
    executable."""
    text = compiled.as_text()
    per_replica = getattr(strategy, "logical_devices_per_replica", 1)
    report = hlo_report(text, strategy.topology, per_replica)
    report.platform = strategy.devices[0].platform
    report.memory = Memory.of(compiled.memory_analysis())
    report.compile_seconds = float(getattr(compiled, "compile_seconds", 0.0))
    return report


def hlo_report(hlo_text: str, topology: Any, devices_per_replica: int = 1) -> CompiledReport:
    """Read a program from its compiled HLO text alone (ours, `jax.jit`'s, MaxText's dump):
    its collectives and their communication on `topology`, and its compute from the HLO's
    matmul flops (`hlo_flops`), every loop body once per trip. Memory needs the
    executable, so it is None."""
    by_dtype = dict(hlo_flops(hlo_text))
    report = CompiledReport(
        platform=getattr(topology, "hardware", None) or "unknown",
        topology=getattr(topology, "name", None),
        hbm_bytes=getattr(topology, "hbm_bytes", None),
        memory=None,
        flops=sum(by_dtype.values()),
        collectives=collectives(hlo_text, devices_per_replica),
        compile_seconds=0.0,
        flops_by_dtype=by_dtype,
    )
    report.estimate = step_estimate(report, topology, total_cycles(hlo_text))
    return report


def step_estimate(report: CompiledReport, topology: Any, cycles: int) -> dict[str, float | None]:
    """Seconds per step: compute from the HLO's matmul flops at each element type's peak
    (`hlo_flops`); communication from the topology's cost model per collective XLA kept;
    exposed communication from XLA's schedule (an asynchronous collective hides behind the
    share of the compute, by XLA's cycle estimates, scheduled between its start and done).
    None where the topology does not know a rate."""
    compute = matmul_seconds(report.flops_by_dtype or {}, topology)
    if topology is None:
        return {"compute_s": compute, "communication_s": None, "exposed_s": None, "step_s": None}
    communication = exposed = 0.0
    for c in report.collectives:
        seconds = _collective_seconds(c, topology)
        hidden = 0.0
        if c.asynchronous and compute is not None and cycles:
            hidden = compute * c.overlapped_cycles / cycles
        communication += c.times * seconds
        exposed += c.times * max(0.0, seconds - hidden)
    step = None if compute is None else compute + exposed
    return {
        "compute_s": compute,
        "communication_s": communication,
        "exposed_s": exposed,
        "step_s": step,
    }


_COST_OP = {"all-reduce": "all_reduce", "reduce-scatter": "reduce_scatter"}


def _collective_seconds(c: Collective, topology: Any) -> float:
    """The cost model's time for `c` over the fastest axes that hold its group: the model
    axis for a collective inside a replica, the replica axes for the others, and the
    slices' DCN for a collective across them."""
    op = _COST_OP.get(c.kind, "all_gather")  # all-to-all, permute: one pass of the bytes
    whole = c.nbytes * (c.group_size if c.kind == "reduce-scatter" else 1)
    if c.across_slices:
        return _dcn_seconds(c, topology, op, whole)
    axes, size = [], 1
    links = [a for a in topology.axes if (a.name == MODEL_AXIS) == c.inside_replica]
    for link in reversed(links):  # fastest (ICI minor) first
        if size >= max(c.group_size, 1):
            break
        axes.append(link.name)
        size *= link.size
    if not axes or c.group_size <= 1:
        return 0.0
    # XLA's own algorithm for the group: the cost model's `flat` (on a TPU slice, its
    # multi-dimensional torus algorithm), not the best of the algorithms passes choose from
    return topology.collective_time(op, whole, tuple(axes), algorithm="flat")


def _dcn_seconds(c: Collective, topology: Any, op: str, whole: int) -> float:
    """A cross-slice collective over DCN, among as many slices as its group holds."""
    if "dcn" not in topology.mesh_axes:
        raise HloReadError(
            f"{c.name} is a collective across {c.group_size} slices, but {topology.name} is "
            "one slice: read this program with its multislice topology (e.g. 2xv5p-512)"
        )
    (link,) = topology.axis_links(("dcn",))
    among = dataclasses.replace(link, size=c.group_size)
    return cost_model.collective_time(op, whole, [among], algorithm="flat")
