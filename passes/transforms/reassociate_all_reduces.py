"""reassociate-all-reduces: a sum of reduced values becomes one reduction of the sum.

A tied weight's gradient arrives in two parts, each reduced across replicas by autodiff;
adding first and reducing once halves the traffic. The rewrite also looks through ops
that commute with the reduction (transpose, reshape, negation, scaling by a
replica-invariant value; never a dtype conversion, since summing in another precision
changes the numbers), and repeats until nothing changes, so sums of several collapse.

    Before:
      %3: f32[32,64] = all_reduce(%1) {"axes": ["replica"], "reduce_op": "mean"}
      %4: f32[64,32] = jax.transpose(%3) {"permutation": [1, 0]}
      %5: f32[64,32] = all_reduce(%2) {"axes": ["replica"], "reduce_op": "mean"}
      %6: f32[64,32] = jax.add_any(%4, %5)
    After:
      %3: f32[64,32]{replica} = jax.transpose(%1) {"permutation": [1, 0]}
      %4: f32[64,32]{replica} = jax.add_any(%3, %2)
      %5: f32[64,32] = all_reduce(%4) {"axes": ["replica"], "reduce_op": "mean"}
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.ir.dataflow import (
    make_all_reduce,
    reduced_chain,
    unreduce,
    use_counts,
)
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.passes.ir.traits import Trait


@dataclass(frozen=True)
class ReassociateAllReduces(Pass):
    name = "reassociate-all-reduces"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        changed = False
        for region in graph.graphs():
            while self._rewrite_one(region, ctx):
                changed = True
        return changed

    def _rewrite_one(self, graph: Graph, ctx: PassContext) -> bool:
        producers, uses = graph.producers(), use_counts(graph)
        for add in graph.nodes:
            if (
                not add.has(Trait.ADDING)
                or len(add.inputs) < 2
                or len(set(add.inputs)) != len(add.inputs)
            ):
                continue
            chains = [reduced_chain(v, producers, uses) for v in add.inputs]
            if any(c is None for c in chains):
                continue
            first = chains[0].reduction
            key = (tuple(first.attrs["axes"]), first.attrs["reduce_op"])
            if any(
                (tuple(c.reduction.attrs["axes"]), c.reduction.attrs["reduce_op"]) != key
                for c in chains
            ):
                continue
            for chain in chains:
                axes = unreduce(chain, graph)
            result = add.outputs[0]
            summed = result.like(varying_axes=frozenset(result.varying_axes | axes))
            add.outputs = [summed]
            add.created_by = self.name
            graph.nodes.insert(
                graph.nodes.index(add) + 1, make_all_reduce(summed, result, first, self.name)
            )
            ctx.stats.setdefault(self.name, {"merged": 0})["merged"] += len(chains) - 1
            return True
        return False
