"""Which values are the same on every replica, whatever their type says.

JAX types an all-gather's result as varying (the same type as its operand) and makes a
constant varying (`pvary`) wherever it meets one, so a value every replica computes alike
can carry a varying type. A value is the same on every replica when it is invariant, a
full all-gather's or all-reduce's result, or computed only from such values by ops that
see nothing of the replica but their operands (not `axis_index`, a collective, a side
effect, or a region that uses one of those).
"""

from __future__ import annotations

from collections.abc import Mapping

from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.traits import Trait


def replica_identical(graph: Graph, mesh_axes: Mapping[str, int]) -> set[Value]:
    """The values of `graph` (not its regions) that every replica holds alike."""
    same = {v for v in graph.inputs if not v.varying_axes}
    for node in graph.nodes:
        if _identical_result(node, same, mesh_axes):
            same.update(node.outputs)
        else:
            same.update(v for v in node.outputs if not v.varying_axes)
    return same


def _identical_result(node: Node, same: set[Value], mesh_axes: Mapping[str, int]) -> bool:
    if node.has(Trait.GATHERS) or node.op == "all_reduce":
        return set(_axes(node)) >= {a for a, size in mesh_axes.items() if size > 1}
    if _sees_the_replica(node):
        return False
    return all(v in same for v in node.inputs)


def _sees_the_replica(node: Node) -> bool:
    """Whether `node` (or anything in its regions) reads which replica runs it."""
    return any(
        n.is_collective or n.op == "axis_index" or n.has(Trait.SIDE_EFFECT) or n.has(Trait.GATHERS)
        for n in [node, *(inner for region in node.regions for inner in region.walk())]
    )


def _axes(node: Node) -> list[str]:
    names = node.attrs.get("axes", node.attrs.get("axis_name", ()))
    return [names] if isinstance(names, str) else list(names)
