"""Counting what a graph communicates per step: collectives and bytes, loops unrolled.

A collective inside a `scan` body runs once per iteration, so it counts `length` times.
A `while` body counts once (its trip count is unknown) and a `cond` counts its most
expensive branch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from xla_strategies.passes.ir import Graph


def collective_counts(graph: Graph) -> tuple[Counter[str], Counter[str]]:
    """(executions per step, bytes per step per replica) for each collective op."""
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for node in graph.nodes:
        if node.is_collective:
            counts[node.op] += 1
            nbytes[node.op] += sum(v.nbytes for v in node.inputs)
        if not node.regions:
            continue
        region_stats = [collective_counts(region) for region in node.regions]
        if node.op == "jax.cond":
            region_stats = [max(region_stats, key=lambda s: sum(s[1].values()))]
        trips = node.attrs.get("length", 1) if node.op == "jax.scan" else 1
        for region_counts, region_bytes in region_stats:
            for op, n in region_counts.items():
                counts[op] += n * trips
            for op, n in region_bytes.items():
                nbytes[op] += n * trips
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
