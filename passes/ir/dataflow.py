"""Dataflow facts the reduction passes share: use counts, and which ops commute with a
cross-replica sum, so a reduction can move past them without changing the numbers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.traits import Trait

LINEAR_REDUCE_OPS = frozenset({"sum", "mean"})


def use_counts(graph: Graph) -> Counter[Value]:
    """How often each value is read in `graph`: by its nodes and by its outputs."""
    counts: Counter[Value] = Counter()
    for node in graph.nodes:
        counts.update(node.inputs)
    counts.update(graph.outputs)
    return counts


def commutes_with_sum(node: Node, operand: Value) -> bool:
    """Whether `node`, read through `operand`, commutes with a cross-replica sum."""
    if node.has(Trait.LINEAR) and node.inputs == [operand]:
        return True
    dividing = node.has(Trait.DIVIDING)
    if (
        (node.has(Trait.SCALING) or dividing)
        and len(node.inputs) == 2
        and node.inputs.count(operand) == 1
    ):
        other = node.inputs[1 - node.inputs.index(operand)]
        if dividing and (other is node.inputs[0] or "int" in operand.dtype):
            return False  # c / x is not linear in x, and integer division truncates
        return not other.varying_axes
    return False


@dataclass
class ReducedChain:
    """`end` = ops(all_reduce(source)), every link read once, each op commuting with sums."""

    reduction: Node
    ops: list[Node]
    end: Value

    @property
    def source(self) -> Value:
        return self.reduction.inputs[0]


def reduced_chain(
    value: Value, producers: dict[Value, Node], uses: Counter[Value]
) -> ReducedChain | None:
    """Walk back from `value` through single-use linear ops to a single-operand sum or mean
    all_reduce whose result is read only by that chain. None if there is no such chain."""
    if uses[value] != 1:
        return None
    ops: list[Node] = []
    current = value
    while True:
        node = producers.get(current)
        if node is None or len(node.outputs) != 1:
            return None
        if node.op == "all_reduce":
            if len(node.inputs) != 1 or node.attrs.get("reduce_op") not in LINEAR_REDUCE_OPS:
                return None
            if uses[node.outputs[0]] != 1:
                return None
            return ReducedChain(node, list(reversed(ops)), value)
        operand = next(
            (v for v in node.inputs if uses[v] == 1 and commutes_with_sum(node, v)), None
        )
        if operand is None:
            return None
        ops.append(node)
        current = operand


def unreduce(chain: ReducedChain, graph: Graph) -> set[str]:
    """Delete the chain's all_reduce: its ops now read the unreduced source, and their
    values vary over the reduction's axes. Returns those axes."""
    axes = set(chain.reduction.attrs["axes"])
    reduced = chain.reduction.outputs[0]
    graph.nodes.remove(chain.reduction)
    graph.replace_uses(reduced, chain.source)
    for node in chain.ops:
        for out in node.outputs:
            out.varying_axes = frozenset(out.varying_axes | axes)
    return axes


def make_all_reduce(source: Value, result: Value, like: Node, created_by: str) -> Node:
    """A new all_reduce of `source` into `result`, with `like`'s axes, op and provenance."""
    keys = ("axes", "reduce_op", "origin", "source", "param")
    attrs = {k: like.attrs[k] for k in keys if k in like.attrs}
    return Node("all_reduce", [source], [result], attrs, created_by=created_by)
