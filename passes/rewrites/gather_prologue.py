"""The prologue of a loop body's all-gathers: the pure ops that compute a gather from the
body's per-layer slices (a cast, a bucket's concatenation) and read nothing else. The
passes that move such gathers (`prefetch-all-gathers`, and `shard-parameters` when it
recomputes a gathered residual in the backward loop) find, copy and drop them here."""

from __future__ import annotations

from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.traits import Trait

# ops a prologue may hold: pure, no regions, no communication
_PURE_KNOWN = ("reshape", "concatenate", "slice", "convert", "constant", "transpose", "pvary")


def is_pure(node: Node) -> bool:
    return not node.regions and (
        node.op in _PURE_KNOWN
        or node.has(Trait.RESHAPE)
        or (node.has(Trait.ELEMENTWISE) and len(node.inputs) == 1)
    )


def derived(graph: Graph, sources: set[Value]) -> list[Node]:
    """The pure nodes and all-gathers of `graph` computed from `sources` only, in
    schedule order."""
    values, found = set(sources), []
    for node in graph.nodes:
        if all(v in values for v in node.inputs) and (node.op == "all_gather" or is_pure(node)):
            values.update(node.outputs)
            found.append(node)
    return found


def gather_prologue(graph: Graph, sources: set[Value]) -> tuple[list[Node], list[Node]]:
    """The all-gathers of `graph` computed from `sources` only, and the pure nodes that
    compute them (their prologue), in schedule order."""
    nodes = derived(graph, sources)
    gathers = [n for n in nodes if n.op == "all_gather"]
    needed = ancestors(gathers, nodes)
    return [n for n in nodes if n in needed], gathers


def ancestors(ends: list[Node], nodes: list[Node]) -> set[Node]:
    producers = {out: n for n in nodes for out in n.outputs}
    found, stack = set(), list(ends)
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(producers[v] for v in node.inputs if v in producers)
    return found


def clone(node: Node, env: dict[Value, Value], created_by: str) -> Node:
    """A copy of `node` reading `env`'s values, with fresh results added to `env`."""
    outputs = [v.like() for v in node.outputs]
    env.update(zip(node.outputs, outputs, strict=True))
    inputs = [env.get(v, v) for v in node.inputs]
    return Node(
        node.op, inputs, outputs, dict(node.attrs), payload=node.payload, created_by=created_by
    )


def drop_dead(graph: Graph, candidates: list[Node]) -> None:
    """Remove the `candidates` nothing in `graph` reads any more (last first)."""
    for node in reversed(candidates):
        read = {v for n in graph.nodes for v in n.inputs} | set(graph.outputs)
        if node in graph.nodes and not read & set(node.outputs):
            graph.nodes.remove(node)
