"""The one walk over what a step runs: which regions of a node run, and how often.

The collective statistics, the ledger and the timeline all count through it, so they agree:
a counted loop's body runs `length` times; a while loop's regions count once (the trip
count is unknown); of a node with branches, only the one with the most collective bytes
counts (one branch runs, and the costliest bounds the step); a call-once region runs once.
"""

from __future__ import annotations

from collections.abc import Iterator

from xla_strategies.passes.ir.graph import Graph, Node
from xla_strategies.passes.ir.traits import Trait


def regions_per_step(node: Node) -> list[tuple[Graph, int]]:
    """The regions that run when `node` runs once, each with how many times."""
    if not node.regions:
        return []
    if node.has(Trait.COUNTED_LOOP):
        return [(node.regions[0], node.attrs.get("length", 1))]
    if node.has(Trait.BRANCHES):
        return [(max(node.regions, key=collective_bytes), 1)]
    return [(region, 1) for region in node.regions]


def walk_per_step(graph: Graph, times: int = 1) -> Iterator[tuple[Node, int]]:
    """Every node that runs in a step, with how many times it runs."""
    for node in graph.nodes:
        yield node, times
        for region, trips in regions_per_step(node):
            yield from walk_per_step(region, times * trips)


def collectives_per_step(graph: Graph) -> Iterator[tuple[Node, int]]:
    """Every collective that runs in a step, with how many times it runs."""
    return ((node, times) for node, times in walk_per_step(graph) if node.is_collective)


def payload_bytes(node: Node) -> int:
    """Bytes per replica one run of the collective `node` moves: its operands'. Every count
    of collective bytes (statistics, ledger, timeline) is made of this."""
    return sum(v.nbytes for v in node.inputs)


def collective_bytes(graph: Graph) -> int:
    """Bytes per replica that `graph`'s collectives move when it runs once."""
    return sum(times * payload_bytes(node) for node, times in collectives_per_step(graph))
