"""The collective ledger: every cross-replica collective of a graph, pass by pass.

For each pass: every collective with its op, axes, dtype, bytes, how often it runs per
step (loop trips), its bucket and members (parameter paths or source lines), and its
estimated time on the strategy's topology; totals; and what changed since the pass before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xla_strategies.passes.base import Instrument, Pass, PassContext
from xla_strategies.passes.cost.timeline import collective_seconds, step_estimate
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.passes.ir.walk import collectives_per_step, payload_bytes

if TYPE_CHECKING:
    from xla_strategies.passes.cost.topology_like import TopologyLike


def collectives(graph: Graph, topology: TopologyLike | None = None) -> list[dict[str, Any]]:
    """One entry per collective node, in schedule order."""
    entries = []
    for node, trips in collectives_per_step(graph):
        nbytes = payload_bytes(node)
        seconds = collective_seconds(node, topology)  # the timeline's own price
        estimate = None if seconds is None else trips * seconds
        label = node.label
        entries.append(
            {
                "id": len(entries),
                "op": node.op,
                "axes": list(node.attrs["axes"]),
                "reduce_op": node.attrs.get("reduce_op"),
                "dtype": node.inputs[0].dtype,
                "bytes": nbytes,
                "per_step": trips,
                "bucket": node.attrs.get("bucket"),
                "members": node.attrs.get("members") or ([label] if label else []),
                "origin": node.attrs.get("origin"),
                "created_by": node.created_by,
                "estimated_s": estimate,
            }
        )
    return entries


def totals(entries: list[dict[str, Any]]) -> dict[str, Any]:
    estimates = [e["estimated_s"] for e in entries]
    return {
        "collectives_per_step": sum(e["per_step"] for e in entries),
        "bytes_per_step": sum(e["bytes"] * e["per_step"] for e in entries),
        "estimated_s": None if None in estimates else sum(estimates),
    }


@dataclass
class LedgerRecorder(Instrument):
    """Records the ledger after capture and after every pass."""

    topology: TopologyLike | None = None
    passes: list[dict[str, Any]] = field(default_factory=list)

    def before_pipeline(self, graph: Graph, ctx: PassContext) -> None:
        self.passes = []
        self._record("capture", graph, changed=True, seconds=0.0)

    def after_pass(
        self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool, seconds: float
    ) -> None:
        self._record(pass_.name, graph, changed, seconds)

    def _record(self, name: str, graph: Graph, changed: bool, seconds: float) -> None:
        entries = collectives(graph, self.topology)
        summary = totals(entries)
        # collective time no compute hides, per step (the timeline's schedule); like the
        # collectives' own estimates, only where a topology gives their times
        summary["exposed_s"] = (
            None if self.topology is None else step_estimate(graph, self.topology)["exposed_s"]
        )
        before = self.passes[-1]["totals"] if self.passes else summary
        self.passes.append(
            {
                "pass": name,
                "changed": changed,
                "seconds": seconds,
                "collectives": entries,
                "totals": summary,
                "delta": {
                    "collectives_per_step": summary["collectives_per_step"]
                    - before["collectives_per_step"],
                    "bytes_per_step": summary["bytes_per_step"] - before["bytes_per_step"],
                },
            }
        )

    def to_json(self) -> dict[str, Any]:
        name = self.topology.name if self.topology is not None else None
        return {"topology": name, "passes": self.passes}
