"""A compiled step drawn as XLA scheduled it: an estimated timeline read from the HLO, as a
Chrome trace (Perfetto and TensorBoard's trace viewer open it) and as a PNG.

The scheduled HLO lists each computation's instructions in the order they run. Walking it
from the entry, each instruction takes its roofline time (`hlo_roofline`: matmul flops at
the chip's peak or device-memory bytes at its bandwidth) on the compute track; a loop's
body runs once per trip, a call once, a conditional its costliest branch. A collective
takes the cost model's time (`compiled_report.collective_seconds`): a synchronous one on
the compute track, an asynchronous one on the collectives track from its start, and the
instruction that waits for it (its `-done`, or the end of its computation) waits on the
compute track until it ends: that wait is the communication nothing hid. An estimate,
labelled as one, with the same rates as the report's step estimate.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xla_strategies.hardware.compiled_report import calibration_label, collective_seconds
from xla_strategies.hardware.hlo import (
    CALLEE,
    FUSIONS,
    OPERAND,
    Op,
    computations,
)
from xla_strategies.hardware.hlo_collectives import Collective, collectives
from xla_strategies.hardware.hlo_loops import branches, trip_count
from xla_strategies.hardware.hlo_roofline import instruction_seconds

if TYPE_CHECKING:
    from xla_strategies.hardware.topology import Topology

COMPUTE, COLLECTIVES = 1, 2
#: events drawn at most; the ones after are timed but not drawn (the metadata counts them)
MAX_EVENTS = 50_000
_TRACKS = {COMPUTE: "compute", COLLECTIVES: "collectives"}


@dataclass
class _Walk:
    comps: dict[str, list[Op]]
    topology: Topology
    priced: dict[tuple[str, str], tuple[Collective, float]]
    events: list[dict[str, Any]] = field(default_factory=list)
    now: float = 0.0  # seconds, on the compute track
    waited: float = 0.0
    left_out: int = 0  # events past MAX_EVENTS: timed, not drawn

    def slice(
        self, name: str, track: int, start: float, seconds: float, cat: str = "compute", **args: Any
    ) -> None:
        if seconds <= 0:
            return
        if len(self.events) >= MAX_EVENTS:
            self.left_out += 1
        else:
            event = {"name": name, "cat": cat, "ph": "X", "pid": 1, "tid": track}
            event.update(ts=start * 1e6, dur=seconds * 1e6, args=args)
            self.events.append(event)

    def run(self, name: str) -> None:
        """Run computation `name` once from `now`, drawing what it runs."""
        ops = self.comps.get(name, [])
        types = {op[0]: op[1] for op in ops}
        in_flight: dict[str, float] = {}  # a started collective -> when it ends
        for op in ops:
            op_name, _, opcode, rest = op
            for started in [s for s in in_flight if opcode.endswith("done") and _uses(rest, s)]:
                self.wait(started, in_flight.pop(started))
            priced = self.priced.get((name, op_name))
            if priced is not None:
                collective, seconds = priced
                if collective.asynchronous:
                    self.slice(
                        collective.kind, COLLECTIVES, self.now, seconds, "collective", op=op_name
                    )
                    in_flight[op_name] = self.now + seconds
                    if opcode not in FUSIONS:
                        continue
                else:
                    self.slice(
                        collective.kind, COMPUTE, self.now, seconds, "collective", op=op_name
                    )
                    self.now += seconds
                    continue
            self.control_flow(op) or self.compute(op, types)
        for started, ends in in_flight.items():  # nothing waited for it in the text
            self.wait(started, ends)

    def wait(self, started: str, ends: float) -> None:
        if ends > self.now:
            self.slice(f"wait for {started}", COMPUTE, self.now, ends - self.now, "wait")
            self.waited += ends - self.now
            self.now = ends

    def control_flow(self, op: Op) -> bool:
        _, _, opcode, rest = op
        if opcode == "while":
            body = re.search(r"body=%([\w.\-]+)", rest)
            for _ in range(trip_count(rest, self.comps) if body else 0):
                self.run(body.group(1))
            return True
        if opcode == "call":
            for callee in CALLEE.findall(rest):
                self.run(callee)
            return True
        taken = branches(opcode, rest)
        if taken:  # the costliest branch, as the step estimate counts it
            self.run(max(taken, key=self.cost))
            return True
        return False

    def compute(self, op: Op, types: dict[str, str]) -> None:
        seconds = instruction_seconds(op, self.comps, types, self.topology)
        self.slice(op[2] if op[2] not in FUSIONS else op[0], COMPUTE, self.now, seconds)
        self.now += seconds

    def cost(self, name: str) -> float:
        ops = self.comps.get(name, [])
        types = {op[0]: op[1] for op in ops}
        return sum(instruction_seconds(op, self.comps, types, self.topology) for op in ops)


def _uses(rest: str, name: str) -> bool:
    return name in OPERAND.findall(rest)


def hlo_timeline(
    hlo_text: str, topology: Topology | None, devices_per_replica: int = 1
) -> dict[str, Any]:
    """The estimated timeline of one step of a compiled program, as Chrome trace JSON (see
    the module); its metadata gives the step, the compute and the waits in seconds."""
    if topology is None or not topology.memory_bandwidth or not topology.peak_flops:
        raise ValueError(f"{topology}: the timeline needs its chip's peak flops and bandwidth")
    comps, entry = computations(hlo_text)
    priced = {
        (c.computation, c.name): (c, collective_seconds(c, topology))
        for c in collectives(hlo_text, devices_per_replica)
    }
    walk = _Walk(comps, topology, priced)
    walk.run(entry)
    names = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
        for tid, name in _TRACKS.items()
    ]
    return {
        "traceEvents": names + walk.events,
        "displayTimeUnit": "ms",
        "metadata": {
            "step_s": walk.now,
            "waited_s": walk.waited,
            "estimate": calibration_label(topology),
            "events_left_out": walk.left_out,
        },
    }


_COLOURS = {"compute": (66, 133, 244), "collective": (251, 140, 0), "wait": (219, 68, 55)}


def save_timeline(trace: dict[str, Any], out: Path) -> None:
    """`trace` at `out` (Perfetto, TensorBoard's trace viewer), its picture beside it
    (`.png`)."""
    out.write_text(json.dumps(trace) + "\n")
    out.with_suffix(".png").write_bytes(timeline_png(trace))


def timeline_png(trace: dict[str, Any], width: int = 1600, track_height: int = 40) -> bytes:
    """The trace as a PNG: a row per track across the step, compute blue, collectives
    orange (a synchronous one on the compute track: nothing runs beside it), waits red."""
    step = max((e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X"), default=1)
    rows = [[(255, 255, 255)] * width for _ in range(2 * track_height)]
    for e in trace["traceEvents"]:
        if e["ph"] != "X":
            continue
        colour = _COLOURS[e.get("cat", "compute")]
        first = int(e["ts"] / step * (width - 1))
        last = max(first, int((e["ts"] + e["dur"]) / step * (width - 1)))
        top = (e["tid"] - 1) * track_height
        for y in range(top + 2, top + track_height - 2):
            rows[y][first : last + 1] = [colour] * (last + 1 - first)
    raw = b"".join(b"\0" + bytes(c for pixel in row for c in pixel) for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, len(rows), 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
