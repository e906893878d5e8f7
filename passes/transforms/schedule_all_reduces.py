"""schedule-all-reduces: per loop, hoist the gradient reductions or pipeline them.

Under `lax.scan` over layers autodiff reduces each layer's gradients inside the backward
loop body. There are two ways to run those reductions:

- hoisted (`hoist-all-reduces`): one reduction of the stacked gradients after the loop,
  one collective's latency, but every byte of it exposed: the update waits for it;
- pipelined: left in the body, where layer i's reduction runs while the backward of the
  layers below it computes (XLA issues it asynchronously and its collective pipeliner
  carries it across iterations), L collectives' latency, hidden behind compute.

A readiness analysis gives, per reduction in a loop body, when in the iteration its
operand is ready and how much of the iteration's compute is left after it (the timeline's
per-op compute estimates). With the strategy's topology the pass estimates the exposed
communication of both ways (`exposed_estimates`) and picks the smaller, recording both in
the dump. Without a topology (emulated CPU devices, whose collectives are synchronous and
hide nothing) it hoists, as the default pipeline always did. Call-once regions
(`remat2`) always give up their reductions, to the loop around them.

    Before (v5e-256, 24 layers of 12 MB gradients, 2 ms of backward each):
      %5: f32[], %6: f32[24,...] = jax.scan(...)
        region (...) {
          %9: f32[...] = all_reduce(%8) {"axes": ["x", "y"], "reduce_op": "sum"}
          ...
    After: unchanged, with the remark
      schedule-all-reduces: jax.scan x24, 12,582,912 bytes per iteration: pipelined
      (exposed: hoisted 19.3 ms, pipelined 0.6 ms)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.cost.decisions import pipelined_exposure
from xla_strategies.passes.cost.fusion import fused_bytes
from xla_strategies.passes.cost.timeline import compute_estimate, compute_seconds
from xla_strategies.passes.ir.graph import Graph, Node
from xla_strategies.passes.ir.traits import Trait
from xla_strategies.passes.ir.walk import payload_bytes, regions_per_step
from xla_strategies.passes.transforms.hoist_all_reduces import HoistAllReduces

if TYPE_CHECKING:
    from xla_strategies.passes.cost.topology_like import TopologyLike

CHOICES = ("hoist", "pipeline")


@dataclass(frozen=True)
class Readiness:
    """One reduction in a loop body: its bytes, the iteration's compute before its operand
    is ready, and the compute left in the iteration after that."""

    node: Node
    nbytes: int
    ready_s: float
    compute_after_s: float


@dataclass(frozen=True)
class ScheduleAllReduces(Pass):
    """Options:
    force: ``hoist`` or ``pipeline`` every loop instead of the cost model's choice (for
        tests and experiments); "" lets the cost model decide.
    """

    name = "schedule-all-reduces"
    force: str = ""

    def __post_init__(self) -> None:
        if self.force not in ("", *CHOICES):
            raise ValueError(
                f"schedule-all-reduces: force must be one of {CHOICES} or empty, got {self.force!r}"
            )

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        hoist = HoistAllReduces()
        hoisted, decisions = 0, []
        for parent in reversed(graph.graphs()):  # innermost loops first
            for node in [n for n in parent.nodes if n.has(Trait.CALL_ONCE)]:
                hoisted += hoist.hoist_from(node, parent, ctx)
            for loop in [n for n in parent.nodes if n.is_loop]:
                decision = self._decide(loop, ctx)
                if decision is not None:
                    decisions.append(decision)
                if decision is None or decision["choice"] == "hoist":
                    hoisted += hoist.hoist_from(loop, parent, ctx)
        ctx.stats[self.name] = {"hoisted": hoisted, "decisions": decisions}
        return hoisted > 0

    def _decide(self, loop: Node, ctx: PassContext) -> dict | None:
        """Hoist or pipeline `loop`'s reductions; None when it has none to schedule."""
        ready = readiness(loop, ctx.topology)
        if not ready:
            return None
        trips = regions_per_step(loop)[-1][1]
        estimates = {} if ctx.topology is None else exposed_estimates(ready, trips, ctx.topology)
        if self.force:
            choice = self.force
        elif not estimates:  # synchronous collectives have nothing to hide behind, and
            choice = "hoist"  # unknown hardware no estimate: one reduction per step
        else:
            choice = "pipeline" if estimates["pipeline"] < estimates["hoist"] else "hoist"
        per_iteration = sum(r.nbytes for r in ready)
        shown = (
            ", ".join(f"{k}ed {v * 1e3:.3f} ms" for k, v in sorted(estimates.items()))
            if estimates
            else "synchronous collectives"
            if ctx.synchronous_collectives
            else "no topology"
        )
        ctx.remarks.append(
            f"{self.name}: {loop.op} x{trips}, {per_iteration:,} bytes reduced per "
            f"iteration: {choice} (exposed: {shown})"
        )
        return {
            "loop": loop.op,
            "trips": trips,
            "bytes_per_iteration": per_iteration,
            "choice": choice,
            "exposed_s": estimates,
        }


def readiness(loop: Node, topology: TopologyLike | None = None) -> list[Readiness]:
    """The all-reduces directly in `loop`'s body (the last region: a while loop's body
    follows its condition), each with when its operand is ready in the iteration, at the
    topology's compute rates."""
    body = loop.regions[-1]
    moved = fused_bytes(body)
    costs = [_node_compute(node, topology, moved) for node in body.nodes]
    total = sum(costs)
    found, elapsed = [], 0.0
    for node, cost in zip(body.nodes, costs, strict=True):
        if node.op == "all_reduce":
            found.append(Readiness(node, payload_bytes(node), elapsed, total - elapsed))
        elapsed += cost
    return found


def _node_compute(node: Node, topology: TopologyLike | None, moved: dict[Node, int]) -> float:
    """Estimated compute seconds of one run of `node`, nested regions included (`moved`:
    the bytes nodes move as XLA fuses them, `fused_bytes`)."""
    if node.is_collective:
        return 0.0
    if not node.regions:
        return compute_seconds(node, topology, moved.get(node))
    return sum(
        times * compute_estimate(region, topology, whole_step=False)
        for region, times in regions_per_step(node)
    )


def exposed_estimates(ready: list[Readiness], trips: int, topology) -> dict[str, float]:  # noqa: ANN001
    """Exposed communication of the loop's reductions, hoisted (one all-reduce of every
    iteration's bytes after the loop, all of it exposed) and pipelined
    (`decisions.pipelined_exposure`)."""
    axes = tuple(ready[0].node.attrs["axes"])

    def reduce(nbytes: float) -> float:
        return topology.collective_time("all_reduce", nbytes, axes)

    iteration = ready[0].ready_s + ready[0].compute_after_s
    total = trips * sum(r.nbytes for r in ready)
    pairs = [(r.nbytes, r.ready_s) for r in ready]
    return {
        "hoist": reduce(total),
        "pipeline": pipelined_exposure(pairs, iteration, trips, reduce),
    }
