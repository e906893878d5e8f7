"""An estimated one-step timeline as a Chrome trace / Perfetto JSON file.

Compute runs on one track in schedule order; collectives run on a second track as soon as
their operands are ready (asynchronously), and a consumer waits for them. Durations are
estimates: collectives from the topology's cost model, compute from a roofline with the
rates below (rough; they place events, they do not predict step time). A loop is one
event containing its first iteration's events, so events nest properly.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from xla_strategies.passes.cost.fusion import fused_bytes, fuses_into_neighbours
from xla_strategies.passes.cost.model import OPS
from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.traits import Trait
from xla_strategies.passes.ir.walk import regions_per_step, walk_per_step

if TYPE_CHECKING:
    from xla_strategies.passes.cost.topology_like import TopologyLike

# Rough device rates for compute estimates on unknown hardware (no topology, or one whose
# file gives no rate); a topology's own peak flops and memory bandwidth win.
FLOPS_PER_S = 1e12
BYTES_PER_S = 1e11
COLLECTIVE_BYTES_PER_S = 1e10  # without a topology
_COMPUTE, _COLLECTIVES = 1, 2
# type casts of the capture (varying across replicas or not), constants and orderings: no work
_FREE = frozenset({"pvary", "pinvariant", "constant", "after"})


def compute_seconds(
    node: Node, topology: TopologyLike | None = None, moved: int | None = None
) -> float:
    """Estimated seconds of one run of `node` (no regions): a roofline of flops and bytes,
    at the topology's peak flops and memory bandwidth where it knows them. A replica that
    spans several devices (the topology's model axis) splits its work among them.
    `moved`: the bytes the node reads and writes as XLA fuses it (`fusion.fused_bytes`),
    where not its operands and results (nothing, for an op fused into its neighbours)."""
    out = sum(v.size for v in node.outputs)
    flops = out
    if node.has(Trait.CONTRACTION) and len(node.inputs) == 2:
        contracting = node.attrs.get("dimension_numbers", [[[], []]])[0][0]
        flops = 2 * out * math.prod(node.inputs[0].shape[d] for d in contracting)
    elif node.has(Trait.CONVOLUTION) and len(node.inputs) == 2:
        flops = _convolution_flops(node)
    if node.op in _FREE:
        return 0.0
    if moved is None:
        moved = 0 if fuses_into_neighbours(node) else _operand_and_result_bytes(node)
    if topology is None:  # unknown hardware: the fallback rates, one device a replica
        peak, bandwidth, devices = FLOPS_PER_S, BYTES_PER_S, 1
    else:
        peak = topology.peak_flops or FLOPS_PER_S
        bandwidth = topology.memory_bandwidth or BYTES_PER_S
        devices = topology.devices_per_replica
    return max(flops / peak, moved / bandwidth) / devices


def _operand_and_result_bytes(node: Node) -> int:
    return sum(v.nbytes for v in node.inputs) + sum(v.nbytes for v in node.outputs)


def _convolution_flops(node: Node) -> int:
    """2 flops per multiply-add of a real input element: each output position sums the
    kernel's input features over the window taps that land on the operand, not on its
    padding or on the zeros a strided convolution's input gradient dilates it with (as
    XLA's cost analysis counts them)."""
    (lhs, kernel), (out,) = node.inputs, node.outputs
    lhs_spec, kernel_spec, out_spec = node.attrs["dimension_numbers"]
    taps = 1
    spatial = zip(lhs_spec[2:], kernel_spec[2:], out_spec[2:], strict=True)
    for d, (in_dim, window_dim, out_dim) in enumerate(spatial):
        taps *= _real_taps(
            lhs.shape[in_dim],
            kernel.shape[window_dim],
            out.shape[out_dim],
            node.attrs["window_strides"][d],
            node.attrs["padding"][d][0],
            node.attrs["lhs_dilation"][d],
            node.attrs["rhs_dilation"][d],
        )
    positions = math.prod(out.shape[o] for o in out_spec[2:])
    return 2 * (out.size // positions) * kernel.shape[kernel_spec[1]] * taps


@functools.cache  # a step's convolutions repeat a few shapes, priced after every pass
def _real_taps(
    size: int, window: int, outputs: int, stride: int, low: int, dilation: int, window_dilation: int
) -> int:
    """The (output, window tap) pairs of one spatial dimension that read an element of the
    operand (`size` elements, `dilation` apart, after `low` padding)."""
    span = (size - 1) * dilation + 1
    return sum(
        1
        for o in range(outputs)
        for t in range(window)
        if 0 <= (at := o * stride + t * window_dilation - low) < span and at % dilation == 0
    )


def compute_estimate(
    graph: Graph, topology: TopologyLike | None = None, whole_step: bool = True
) -> float:
    """Estimated compute seconds of one run of `graph`: the timeline's compute track, each
    region's nodes as often as they run (`walk_per_step`). Collectives aside, so it needs
    no mesh axes of the topology, only its rates. `whole_step`: `graph` is a step, not a
    loop's body (`fusion.fused_bytes`)."""
    moved = {
        node: n
        for region in graph.graphs()
        for node, n in fused_bytes(region, whole_step and region is graph).items()
    }
    return sum(
        times * compute_seconds(node, topology, moved.get(node))
        for node, times in walk_per_step(graph)
        if not node.is_collective and not node.regions
    )


class _Timeline:
    def __init__(self, topology: TopologyLike | None) -> None:
        self.topology = topology
        self.events: list[dict[str, Any]] = []
        self.ready: dict[Value, float] = {}
        self.network_free = 0.0
        self.busy = 0.0  # compute seconds per step, loops counted per trip

    def event(
        self, name: str, track: int, start: float, end: float, args: dict | None = None
    ) -> None:
        self.events.append(_event(name, track, start, end, args))

    def run(self, graph: Graph, clock: float, whole_step: bool = False) -> float:
        """Lay out `graph`'s nodes from `clock`; return when its compute ends."""
        moved = fused_bytes(graph, whole_step)
        for node in graph.nodes:
            start = max([clock] + [self.ready.get(v, 0.0) for v in node.inputs])
            if node.is_collective:
                clock = self.collective(node, start, clock)
                continue
            if node.regions:
                end = self.loop(node, start)
            else:
                end = start + compute_seconds(node, self.topology, moved.get(node))
                if node.op not in ("constant", "pvary"):
                    self.event(node.op, _COMPUTE, start, end)
                    self.busy += end - start
            for out in node.outputs:
                self.ready[out] = end
            clock = end
        return clock

    def collective(self, node: Node, ready: float, clock: float) -> float:
        nbytes = node.whole_bytes
        seconds = collective_seconds(node, self.topology)
        if seconds is None:
            seconds = nbytes / COLLECTIVE_BYTES_PER_S
        start = max(ready, self.network_free)
        self.network_free = start + seconds
        args = {"bytes": nbytes, "axes": node.attrs["axes"]}
        self.event(node.op, _COLLECTIVES, start, self.network_free, args)
        for out in node.outputs:
            self.ready[out] = self.network_free
        return clock

    def loop(self, node: Node, start: float) -> float:
        """One event for the node; the first run of each region it runs nests inside it."""
        index = len(self.events)
        self.events.append({})  # placeholder: the parent must precede its children
        end, trips = start, 1
        for region, trips in regions_per_step(node):
            for value, operand in zip(
                region.inputs, node.inputs[-len(region.inputs) :], strict=False
            ):
                self.ready[value] = self.ready.get(operand, start)
            body_start, busy = end, self.busy
            body_end = self.run(region, body_start)
            self.busy += (trips - 1) * (self.busy - busy)
            self.network_free = max(self.network_free, body_end)
            end = body_start + trips * (body_end - body_start)
        self.events[index] = _event(f"{node.op} x{trips}", _COMPUTE, start, end)
        return end


def _event(name: str, track: int, start: float, end: float, args: dict | None = None) -> dict:
    """A complete ("X") event in microseconds; start and end are rounded alike, so events
    that touch in time still nest after rounding."""
    ts, stop = round(start * 1e6, 3), round(end * 1e6, 3)
    return {
        "name": name,
        "ph": "X",
        "pid": 1,
        "tid": track,
        "ts": ts,
        "dur": round(stop - ts, 3),
        "args": args or {},
    }


def _laid_out(graph: Graph, topology: TopologyLike | None) -> tuple[_Timeline, dict[str, float]]:
    timeline = _Timeline(topology)
    end = max(timeline.run(graph, 0.0, whole_step=True), timeline.network_free)
    exposed = max(0.0, end - timeline.busy)
    return timeline, {"step_s": end, "compute_s": timeline.busy, "exposed_s": exposed}


def collective_seconds(node: Node, topology: TopologyLike | None) -> float | None:
    """The cost model's time for one run of collective `node`, priced on the whole tensor
    it moves; None without a topology, or for an op the model does not price."""
    if topology is None or node.op not in OPS:
        return None
    return topology.collective_time(node.op, node.whole_bytes, tuple(node.attrs["axes"]))


def step_estimate(graph: Graph, topology: TopologyLike | None = None) -> dict[str, float]:
    """The estimated step: its length, the compute in it, and the **exposed
    communication**, the collective time no compute overlaps (the step minus its compute:
    what the compute track spends waiting for collectives, and collectives after it)."""
    return _laid_out(graph, topology)[1]


def chrome_trace(graph: Graph, topology: TopologyLike | None = None) -> dict[str, Any]:
    """The estimated schedule of one step of `graph`, as Chrome trace JSON: compute and
    collectives on tracks of their own, and the step estimate in its metadata."""
    timeline, estimate = _laid_out(graph, topology)
    names = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": _COMPUTE, "args": {"name": "compute"}},
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 1,
            "tid": _COLLECTIVES,
            "args": {"name": "collectives"},
        },
    ]
    return {
        "traceEvents": names + timeline.events,
        "displayTimeUnit": "ms",
        "metadata": estimate,
    }
