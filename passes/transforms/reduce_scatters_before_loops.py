"""reduce-scatters-before-loops: a loop that comes after a reduce-scatter in the program
waits for it, so XLA cannot run the reduce-scatter after the loop.

Under parameter sharding the output layer's gradient is reduce-scattered between the
forward and the backward layer loops: the whole gradient (Llama-2-7B: bf16[4096,32000],
250 MiB per chip) comes in, a block of it (1 MiB) goes out. Nothing in the backward loop
reads that block, and XLA's TPU scheduler is free to run the reduce-scatter after the loop,
which it does (v5e, v5p and v6e, libtpu 0.0.50): the whole gradient then stays alive
through the backward pass. Making the loop wait for the block (`after`: an optimization
barrier) keeps the program's order. Where that pays is measured per TPU generation
(`reduce_scatters_before_loops` in `tpu_configs/`; `mode=auto` follows it).

Only collectives whose result is smaller than their operand are held so: run early, they
free their operand. A gather is the other way round and stays free: the output layer's
gather held after the forward loop the same way measured worse (v5e-256, 3.24 against
2.97 GiB per chip); on v6e-256, where libtpu gathers it before the forward loop, it left
the loop's live values 262 MB smaller but not XLA's peak, which is elsewhere in the step
(3.153 GiB held, 3.163 free; 2026-11-27).

    Before:
      %8: bf16[16,32000]{x,y} = reduce_scatter(%7) {"axes": ["x", "y"], "dimension": 0}
      %10: bf16[1,2048,4096]{x,y}, ... = jax.scan(%9, ...)
    After:
      %8: bf16[16,32000]{x,y} = reduce_scatter(%7) {"axes": ["x", "y"], "dimension": 0}
      %11: bf16[1,2048,4096]{x,y} = after(%9, %8)
      %10: bf16[1,2048,4096]{x,y}, ... = jax.scan(%11, ...)
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_strategies.passes.base import ModePass, PassContext
from xla_strategies.passes.ir.graph import Graph, Node
from xla_strategies.passes.rewrites.gather_prologue import ancestors


@dataclass(frozen=True)
class ReduceScattersBeforeLoops(ModePass):
    """Options:
    mode: ``on`` holds every such loop; ``auto`` only on a topology whose hardware file
        says it pays (`reduce_scatters_before_loops`: TPU v5e, v6e, v5p across slices).
    """

    name = "reduce-scatters-before-loops"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        measured = ctx.topology is not None and ctx.topology.reduce_scatters_before_loops
        if self.mode == "auto" and not measured:
            return self.stays_off(
                ctx,
                {"held": 0, "reason": "not measured to pay here"},
                "the topology's hardware file does not say it pays (reduce_scatters_before_loops)",
            )
        held = 0
        for region in graph.graphs():
            held += self._hold(region)
        ctx.stats[self.name] = {"held": held}
        return held > 0

    def _hold(self, region: Graph) -> int:
        """Make each loop of `region` wait for the shrinking collectives before it that it
        does not read already; returns how many."""
        waiting: list[Node] = []
        nodes: list[Node] = []
        held = 0
        for node in region.nodes:
            if node.is_loop and node.inputs:
                read = ancestors([node], [*nodes, node]) if waiting else set()
                unread = [n.outputs[0] for n in waiting if n not in read]
                if unread:
                    first = node.inputs[0]
                    waited = first.like()
                    nodes.append(Node("after", [first, *unread], [waited], created_by=self.name))
                    node.inputs[0] = waited
                    held += len(unread)
                waiting = []
            elif _shrinks(node):
                waiting.append(node)
            nodes.append(node)
        region.nodes[:] = nodes
        return held


def _shrinks(node: Node) -> bool:
    """A collective whose one result is smaller than its one operand (a reduce-scatter)."""
    return (
        node.is_collective
        and len(node.inputs) == 1
        and len(node.outputs) == 1
        and node.outputs[0].nbytes < node.inputs[0].nbytes
    )
