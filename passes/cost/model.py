"""Alpha-beta cost model of collectives over named mesh axes.

Each mesh axis is a ring of `size` participants whose links carry `bandwidth` bytes/s one
way, with `latency` seconds per step. A torus dimension with wraparound runs a
bidirectional ring (each half of the data goes one way round, doubling the bandwidth);
without wraparound the ring is embedded in a line and gets one direction's bandwidth.

Algorithms for a reduction over several axes:

- `flat`: the runtime's own collective over every participant at once: inside a TPU slice
  XLA's multi-dimensional torus algorithm (every dimension's links at once); across TPU
  slices XLA's own hierarchy (that algorithm in each slice, the slices' share over DCN);
  elsewhere a tree's latency and a ring's bandwidth on the slowest axis;
- `ordered`: reduce-scatter axis by axis (fastest first), then all-gather back; across a
  slow level (DCN) this is the hierarchical form (ICI, then DCN, then ICI);
- `rotated`: the data split in parts that run concurrently, each visiting the fast axes in
  a rotated order, so every dimension's links are busy at once (as TPU ICI collectives
  are); the slow levels stay last in every order, and with several parts one part's slow
  phase overlaps another's fast ones (pipelining, as NCCL's hierarchical rings do). Its
  time is the makespan of scheduling the parts' phases on the axes they use.

An all-to-all (`all_to_all_time`) has no algorithm to choose: XLA's TPU backend routes it
through the network (its backend config records `NetRouterEmitter`), so on a torus it is
bounded by the bisection as well as by each chip's links. An estimate from that bound,
not calibrated against hardware.

`lower_bound` is what no algorithm can beat: every participant must receive 2(p-1)/p of
the data through all its links at once (per level), and combining p inputs takes
log2(p) rounds of latency each way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ALGORITHMS = ("flat", "ordered", "rotated")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


@dataclass(frozen=True)
class AxisLink:
    """One mesh axis as the network sees it.

    Attributes:
        name: the mesh axis name.
        size: participants along it.
        bandwidth: one-way bytes/s per participant on this axis (sum over the links a
            one-direction ring uses).
        latency: seconds per ring step (hop latency plus software overhead).
        bidirectional: whether a ring can use both directions (torus with wraparound).
        level: "ici", "dcn", "nvlink" or "infiniband"; lower levels are faster.
        scatter_efficiency: the fraction of `bandwidth` a reduce-scatter or all-gather
            reaches; 1 on accelerators, lower where the runtime implements them poorly
            (gloo on CPU hosts).
    """

    name: str
    size: int
    bandwidth: float
    latency: float
    bidirectional: bool
    level: str
    scatter_efficiency: float = 1.0

    @property
    def ring_bandwidth(self) -> float:
        return self.bandwidth * (2 if self.bidirectional else 1)

    @property
    def injection_bandwidth(self) -> float:
        """What the lower bound may use on this axis. A torus dimension has a link each way
        (+ and -) per chip; a line without wraparound is limited by its middle link; a
        switch port or a NIC is one link."""
        return self.ring_bandwidth


SLOW_LEVELS = ("dcn", "infiniband")


def ring_time(op: str, nbytes: float, axis: AxisLink) -> float:
    """One ring collective of `nbytes` per participant (the full tensor) along `axis`."""
    p = axis.size
    if p == 1 or nbytes == 0:
        return 0.0
    steps = (2 if op == "all_reduce" else 1) * (p - 1)
    bandwidth = axis.ring_bandwidth * (1.0 if op == "all_reduce" else axis.scatter_efficiency)
    return steps * axis.latency + steps / p * nbytes / bandwidth


def flat_time(op: str, nbytes: float, axes: Sequence[AxisLink]) -> float:
    """The runtime's own collective over every participant at once.

    A tree's latency (2 log2 p steps for an all-reduce: XLA and NCCL pick a short-message
    emitter for small data). Bandwidth: inside a TPU slice (every axis a torus dimension
    of ICI), XLA drives all dimensions at once (its backend config records `StrategyND`
    or `RotatedPincer` with the torus's `dim_sizes`), so each dimension's rings carry a
    share of the data and the bandwidth is their sum; across TPU slices, XLA's hierarchy
    (`slices_time`); elsewhere (NCCL, gloo) a ring's bandwidth on the slowest axis."""
    p = math.prod(a.size for a in axes)
    if p == 1:
        return 0.0
    fast, slow = split_levels(axes)
    if across_tpu_slices(fast, slow):
        return slices_time(op, nbytes, fast, slow)
    factor = 2 if op == "all_reduce" else 1
    latency = factor * math.ceil(math.log2(p)) * max(a.latency for a in axes)
    used = [a for a in axes if a.size > 1]
    if len(used) > 1 and all(a.level == "ici" for a in used):
        bandwidth = sum(a.ring_bandwidth for a in used)
    else:
        bandwidth = min(a.ring_bandwidth for a in axes)
    return latency + factor * (p - 1) / p * nbytes / bandwidth


def slices_time(
    op: str, nbytes: float, slice_axes: Sequence[AxisLink], dcn: Sequence[AxisLink]
) -> float:
    """XLA's own collective across TPU slices. Each slice's program keeps the part inside
    the slice, and hands the slices' part to the DCN runtime on the slice's shard: an
    all-reduce is a reduce-scatter in the slice, an all-reduce of each chip's shard among
    the slices, and an all-gather back (its compiled HLO: `reduce-scatter`, a `send`/`recv`
    pair of `_xla_megascale_transfer_type="ALL_REDUCE"`, `all-gather`)."""
    shard = nbytes / math.prod(a.size for a in slice_axes)
    if op == "all_gather":  # the shard among the slices, then within each
        return flat_time(op, shard, dcn) + flat_time(op, nbytes, slice_axes)
    inside = flat_time("reduce_scatter", nbytes, slice_axes)
    across = flat_time(op, shard, dcn)
    back = flat_time("all_gather", nbytes, slice_axes) if op == "all_reduce" else 0.0
    return inside + across + back


def all_to_all_time(nbytes: float, axes: Sequence[AxisLink]) -> float:
    """An all-to-all of `nbytes` per participant (its whole buffer; (p-1)/p of it leaves).

    Each participant sends through its links at once, as an all-gather of those bytes
    does; on a torus the half of the data that must cross to the other half of the
    participants also passes the links a cut through one dimension severs. Cutting a
    dimension of size k in two crosses p/k of its rings (each twice, with wraparound)
    and p*nbytes/4 bytes each way: k * nbytes / (4 * the ring's bandwidth), which on a
    16x16 torus is 8 times the all-gather's time. A switched network (DCN, NVLink,
    InfiniBand) has no such cut: injection bounds it."""
    p = math.prod(a.size for a in axes)
    if p == 1 or nbytes == 0:
        return 0.0
    used = [a for a in axes if a.size > 1]
    torus = all(a.level == "ici" for a in used)
    injection = (
        sum(a.ring_bandwidth for a in used) if torus else min(a.ring_bandwidth for a in used)
    )
    bound = (p - 1) / p * nbytes / injection
    if torus:
        bound = max(bound, max(a.size * nbytes / (4 * a.ring_bandwidth) for a in used))
    return math.ceil(math.log2(p)) * max(a.latency for a in axes) + bound


def flat_ring_time(op: str, nbytes: float, axes: Sequence[AxisLink]) -> float:
    """One ring through every participant, at the slowest axis's speed (a naive baseline)."""
    p = math.prod(a.size for a in axes)
    if p == 1:
        return 0.0
    slowest = min(axes, key=lambda a: a.ring_bandwidth)
    latency = max(a.latency for a in axes)
    line = AxisLink("ring", p, slowest.bandwidth, latency, False, slowest.level)
    return ring_time(op, nbytes, line)


def ordered_time(op: str, nbytes: float, axes: Sequence[AxisLink]) -> float:
    """Reduce-scatter along each axis in order, then all-gather back in reverse order."""
    total, size = 0.0, float(nbytes)
    phases = []
    for axis in axes:
        phases.append((axis, size))
        size /= axis.size
    if op in ("all_reduce", "reduce_scatter"):
        total += sum(ring_time("reduce_scatter", s, a) for a, s in phases)
    if op in ("all_reduce", "all_gather"):
        total += sum(ring_time("all_gather", s, a) for a, s in phases)
    return total


PART_COUNTS = (1, 2, 4, 8)  # parts per rotation the `rotated` algorithm may use


def rotations(axes: Sequence[AxisLink], repeats: int = 1) -> list[list[AxisLink]]:
    """Part orders of the `rotated` algorithm: the rotations of the fast axes, each used
    `repeats` times; slow levels last in every order."""
    fast, slow = split_levels(axes)
    turns = [fast[k:] + fast[:k] + slow for k in range(max(len(fast), 1))]
    return turns * repeats


def rotated_plan(
    op: str, nbytes: float, axes: Sequence[AxisLink]
) -> tuple[float, list[list[AxisLink]]]:
    """The fastest number of parts: (seconds, part orders). More parts pipeline better and
    pay more latency."""
    plans = [
        (_makespan(op, nbytes, orders), orders)
        for k in PART_COUNTS
        for orders in [rotations(axes, k)]
    ]
    return min(plans, key=lambda plan: plan[0])


def rotated_time(op: str, nbytes: float, axes: Sequence[AxisLink]) -> float:
    return rotated_plan(op, nbytes, axes)[0]


def _makespan(op: str, nbytes: float, orders: list[list[AxisLink]]) -> float:
    """The parts run concurrently, each axis serving one phase at a time. Two list
    schedules, the better counts: phase k of every part before phase k + 1 (in rounds),
    and always the phase that can start earliest (greedy)."""
    part = nbytes / len(orders)
    phases = [_phases(op, part, order) for order in orders]
    return min(_schedule(phases, greedy=False), _schedule(phases, greedy=True))


def _schedule(phases: list[list[tuple[str, float]]], greedy: bool) -> float:
    done, ready = [0] * len(phases), [0.0] * len(phases)
    free: dict[str, float] = {}
    for _ in range(sum(len(p) for p in phases)):
        waiting = [i for i in range(len(phases)) if done[i] < len(phases[i])]
        if not greedy:  # the parts furthest behind go first, in part order
            least = min(done[i] for i in waiting)
            waiting = [i for i in waiting if done[i] == least][:1]
        start, i = min((max(ready[i], free.get(phases[i][done[i]][0], 0.0)), i) for i in waiting)
        axis, seconds = phases[i][done[i]]
        ready[i] = free[axis] = start + seconds
        done[i] += 1
    return max(ready)


def _phases(op: str, nbytes: float, order: Sequence[AxisLink]) -> list[tuple[str, float]]:
    """(axis, seconds) of each step of the ordered algorithm for one part."""
    sizes, size = [], float(nbytes)
    for axis in order:
        sizes.append(size)
        size /= axis.size
    scatter = [
        (a.name, ring_time("reduce_scatter", s, a)) for a, s in zip(order, sizes, strict=True)
    ]
    gather = [(a.name, ring_time("all_gather", s, a)) for a, s in zip(order, sizes, strict=True)]
    if op == "reduce_scatter":
        return scatter
    if op == "all_gather":
        return gather[::-1]
    return scatter + gather[::-1]


def collective_time(
    op: str, nbytes: float, axes: Sequence[AxisLink], algorithm: str = "best"
) -> float:
    """Estimated seconds for `op` of `nbytes` per participant over `axes` (an all-to-all
    has one way: `algorithm` does not apply to it)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "all_to_all":
        return all_to_all_time(nbytes, axes)
    times = {
        "flat": lambda: flat_time(op, nbytes, axes),
        "ordered": lambda: ordered_time(op, nbytes, fast_first(axes)),
        "rotated": lambda: rotated_time(op, nbytes, axes),
    }
    if algorithm == "best":
        return min(t() for t in times.values())
    if algorithm not in times:
        raise ValueError(f"algorithm must be 'best' or one of {ALGORITHMS}, got {algorithm!r}")
    return times[algorithm]()


def best_algorithm(
    op: str, nbytes: float, axes: Sequence[AxisLink]
) -> tuple[str, dict[str, float]]:
    """The fastest algorithm and every algorithm's estimate; on a tie XLA's own (`flat`):
    a rewrite must be faster to be worth its extra collectives."""
    estimates = {name: collective_time(op, nbytes, axes, name) for name in ALGORITHMS}
    return min(ALGORITHMS, key=lambda name: (estimates[name], name != "flat")), estimates


def lower_bound(op: str, nbytes: float, axes: Sequence[AxisLink]) -> float:
    """No algorithm beats this: per level, 2(p-1)/p of the data through all of that level's
    links (1(p-1)/p for scatter/gather); the slow level sees the fast levels' shard."""
    factor = 2 if op == "all_reduce" else 1
    fast, slow = split_levels(axes)
    bound = 0.0
    shard = float(nbytes)
    for group in (fast, slow):
        if not group:
            continue
        p = math.prod(a.size for a in group)
        injection = sum(a.injection_bandwidth for a in group)
        bound = max(bound, factor * (p - 1) / p * shard / injection)
        shard /= p
    # combining p inputs takes log2(p) rounds, and spreading the result as many
    p = math.prod(a.size for a in fast + slow)
    latency = factor * math.ceil(math.log2(p)) * min(a.latency for a in axes) if p > 1 else 0.0
    return max(bound, latency)


def fast_first(axes: Sequence[AxisLink]) -> list[AxisLink]:
    """The `ordered` algorithm's axis order: fast levels first, fastest first."""
    return sorted(axes, key=lambda a: (a.level in SLOW_LEVELS, -a.ring_bandwidth))


def split_levels(axes: Sequence[AxisLink]) -> tuple[list[AxisLink], list[AxisLink]]:
    """(fast axes, slow-level axes), leaving out axes of one participant."""
    fast = [a for a in axes if a.level not in SLOW_LEVELS and a.size > 1]
    slow = [a for a in axes if a.level in SLOW_LEVELS and a.size > 1]
    return fast, slow


def across_tpu_slices(fast: Sequence[AxisLink], slow: Sequence[AxisLink]) -> bool:
    """Whether `split_levels`' (fast, slow) axes are TPU slices (ICI inside each) joined by
    a slow level (DCN): where XLA's own hierarchy runs a collective (`slices_time`)."""
    return bool(fast and slow) and all(a.level == "ici" for a in fast)
