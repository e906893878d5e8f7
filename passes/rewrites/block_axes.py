"""Which replica axes a value's blocks are numbered over, in which order: the choice the
two sharding passes make before the block rewrite (`block_sharder.py`) runs."""

from __future__ import annotations

from xla_strategies.passes.base import PassContext
from xla_strategies.passes.cost.model import fast_first, split_levels


def block_order(ctx: PassContext) -> list[str]:
    """The replica axes in the order blocks are numbered over: fast levels first on a
    topology, so that decompose-all-reduces' reduce-scatter crosses a slow level (DCN)
    last, with 1/(fast replicas) of the data; the mesh's order otherwise."""
    if ctx.topology is None:
        return list(ctx.mesh_axes)
    return [a.name for a in fast_first(ctx.topology.axis_links(tuple(ctx.mesh_axes)))]


def within_slice(ctx: PassContext) -> list[str]:
    """The axes parameter sharding splits over: the fast levels (a slice's ICI), fast
    first. Across a slow level (DCN) the blocks are replicated: a layer's gathers then
    never cross it, and only the gradient blocks' sums do (HSDP)."""
    if ctx.topology is None:
        return list(ctx.mesh_axes)
    fast, _ = split_levels(ctx.topology.axis_links(tuple(ctx.mesh_axes)))
    order = [a.name for a in fast_first(fast)]
    return order or block_order(ctx)
