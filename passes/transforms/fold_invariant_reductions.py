"""fold-invariant-reductions: drop reductions of values that are the same on every replica.

Code written for `pmap` reduces its gradients itself: `grads = lax.pmean(grads, "batch")`.
Under a strategy those gradients are already reduced (autodiff's reduction, MEAN by
default), so they are identical on every replica, and JAX spells the user's reduction as
`pvary` (make the value varying) followed by an all-reduce. Reducing N identical copies
needs no communication: a SUM is N times the value, MEAN, MAX and MIN are the value itself.
This pass rewrites exactly that pattern, so such code runs unchanged without paying a
second all-reduce, and keeps its numbers.

    Before:
      %1: f32[3]{replica} = pvary(%0) {"axes": ["replica"]}
      %2: f32[3] = all_reduce(%1) {"axes": ["replica"], "origin": "user", "reduce_op": "sum"}
    After:
      %2: f32[3] = scale(%0) {"factor": 8}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.ir.graph import Graph, Node


@dataclass(frozen=True)
class FoldInvariantReductions(Pass):
    name = "fold-invariant-reductions"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        folded = 0
        for region in graph.graphs():
            producers = region.producers()
            for position, node in enumerate(region.nodes):
                source = self._invariant_operand(node, producers)
                if source is not None:
                    region.nodes[position] = self._fold(node, source, ctx)
                    folded += 1
        ctx.stats[self.name] = {"folded": folded}
        return folded > 0

    @staticmethod
    def _invariant_operand(node: Node, producers: dict) -> Node | None:
        """The `pvary` feeding `node`, when `node` reduces only axes that pvary added."""
        if node.op != "all_reduce" or len(node.inputs) != 1:
            return None
        source = producers.get(node.inputs[0])
        if source is None or source.op != "pvary":
            return None
        original = source.inputs[0].varying_axes
        reduced = set(node.attrs["axes"])
        if reduced & original or reduced != set(source.attrs["axes"]):
            return None
        return source

    def _fold(self, node: Node, source: Node, ctx: PassContext) -> Node:
        """`node` as a scale of the invariant value `source` (its `pvary`) made varying."""
        copies = math.prod(ctx.mesh_axes[a] for a in node.attrs["axes"])
        factor = copies if node.attrs["reduce_op"] == "sum" else 1
        return Node(
            "scale", [source.inputs[0]], node.outputs, {"factor": factor}, created_by=self.name
        )
