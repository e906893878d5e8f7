"""Counting what a graph communicates per step: collectives and bytes, loops unrolled.

Counted through `passes/ir/walk.py`: a collective inside a `scan` body runs once per
iteration, so it counts `length` times; a `while` body counts once (its trip count is
unknown); of a `cond`, the branch with the most collective bytes counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from xla_strategies.passes.ir.graph import Graph
from xla_strategies.passes.ir.walk import collectives_per_step, payload_bytes


def collective_counts(graph: Graph) -> tuple[Counter[str], Counter[str]]:
    """(executions per step, bytes per step per replica) for each collective op."""
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for node, times in collectives_per_step(graph):
        counts[node.op] += times
        nbytes[node.op] += times * payload_bytes(node)
    return counts, nbytes


def collective_summary(graph: Graph) -> dict[str, Any]:
    """All-reduce executions and bytes per step, plus all collectives together."""
    counts, nbytes = collective_counts(graph)
    return {
        "all_reduce_count": counts["all_reduce"],
        "all_reduce_bytes": nbytes["all_reduce"],
        "collective_count": sum(counts.values()),
        "collective_bytes": sum(nbytes.values()),
    }
