"""decompose-all-reduces: an all-reduce over several mesh axes becomes reduce-scatters,
an all-reduce of the shard over the last (slowest) axis, and all-gathers back.

The cost model picks, per reduction (per bucket after combine-all-reduces), among:
`flat` (left alone), `ordered` (axis by axis, fast to slow: on a multislice ICI, then DCN,
then ICI) and `rotated` (the data split over the fast axes, each part visiting them in a
rotated order so every dimension's links work at once). Small messages stay flat: their
cost is latency. Every decision and its estimates go into the dump as remarks.

    Before (topology v5e-16, 4x4):
      %1: f32[4096] = all_reduce(%0) {"axes": ["x", "y"], "reduce_op": "sum"}
    After (ordered, shown for one part):
      %2: f32[1024]{x,y} = reduce_scatter(%0) {"axes": ["y"], "dimension": 0}
      %3: f32[1024]{y} = all_reduce(%2) {"axes": ["x"], "reduce_op": "sum"}
      %4: f32[4096]{x,y} ... = all_gather(%3) {"axes": ["y"], "dimension": 0}

Weight-update sharding's reduce-scatters and all-gathers over several axes become a chain
of one-axis collectives in their own axis order (their blocks are numbered over the axes in
that order, so the order is fixed; shard-weight-updates puts the fast axes first), where
the cost model prefers that to the flat collective:

    Before (v5e-8, blocks numbered over (y, x)):
      %1: f32[1,256]{x,y} = reduce_scatter(%0) {"axes": ["y", "x"], "dimension": 0}
    After:
      %2: f32[2,256]{x,y} = reduce_scatter(%0) {"axes": ["y"], "dimension": 0}
      %1: f32[1,256]{x,y} = reduce_scatter(%2) {"axes": ["x"], "dimension": 0}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.cost import model as cost_model
from xla_strategies.passes.cost.decisions import block_collective_estimates
from xla_strategies.passes.ir.graph import Graph, NewNodes, Node, Value


@dataclass(frozen=True)
class DecomposeAllReduces(Pass):
    """Options:
    force: use this algorithm ("ordered" or "rotated") wherever possible instead of the
        cost model's choice (for tests and experiments); "" lets the cost model decide.
        Without a topology only "ordered" can be forced, with the mesh's axes from the
        last (innermost: a host's own devices) to the first, as tf.distribute's
        `HierarchicalCopyAllReduce` reduces within a group of devices before across groups.
    """

    name = "decompose-all-reduces"
    force: str = ""

    def __post_init__(self) -> None:
        if self.force not in ("", *cost_model.ALGORITHMS):
            raise ValueError(
                f"decompose-all-reduces: force must be one of {cost_model.ALGORITHMS} or empty, "
                f"got {self.force!r}"
            )

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if ctx.topology is None and not self.force:
            ctx.remarks.append(f"{self.name}: no topology, nothing decomposed")
            return False
        if ctx.topology is None and self.force != "ordered":
            raise ValueError(
                f"decompose-all-reduces{{force={self.force}}} needs a topology to plan "
                "with; without one only force=ordered can be used"
            )
        decisions: list[dict] = []
        for region in graph.graphs():
            for node in [n for n in region.nodes if self._candidate(n, ctx)]:
                decisions.append(self._decide(region, node, ctx))
            for node in [n for n in region.nodes if _block_chain_candidate(n, ctx)]:
                decisions.append(self._decide_chain(region, node, ctx))
        ctx.stats[self.name] = {"decisions": decisions}
        return any(d["algorithm"] != "flat" for d in decisions)

    def _candidate(self, node: Node, ctx: PassContext) -> bool:
        axes = node.attrs.get("axes", [])
        return (
            node.op == "all_reduce"
            and len(node.inputs) == 1
            and node.attrs.get("reduce_op") in ("sum", "mean")
            and sum(1 for a in axes if ctx.mesh_axes.get(a, 1) > 1) >= 2
            and not node.attrs.get("stage_split")  # its dim 0 is split over the stages
        )

    def _decide(self, graph: Graph, node: Node, ctx: PassContext) -> dict:
        axes = tuple(node.attrs["axes"])
        nbytes = node.inputs[0].nbytes
        if ctx.topology is None:  # forced ordered: innermost mesh axis first
            order = sorted(axes, key=list(ctx.mesh_axes).index, reverse=True)
            ctx.remarks.append(
                f"{self.name}: all_reduce of {nbytes:,} bytes over {list(axes)}: ordered "
                f"(forced, no topology: {order})"
            )
            _rewrite(graph, node, [order], {a: ctx.mesh_axes[a] for a in axes}, self.name)
            return {"bytes": nbytes, "axes": list(axes), "algorithm": "ordered", "estimates_s": {}}
        links = ctx.topology.axis_links(axes)
        choice, estimates = cost_model.best_algorithm("all_reduce", nbytes, links)
        if self.force:
            choice = self.force
        shown = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in sorted(estimates.items()))
        ctx.remarks.append(
            f"{self.name}: all_reduce of {nbytes:,} bytes over {list(axes)}: {choice} ({shown})"
        )
        if choice != "flat":
            if choice == "rotated":
                orders = cost_model.rotated_plan("all_reduce", nbytes, links)[1]
            else:
                orders = [cost_model.fast_first(links)]
            sizes = {a: ctx.mesh_axes[a] for a in axes}
            _rewrite(graph, node, [[a.name for a in order] for order in orders], sizes, self.name)
        return {"bytes": nbytes, "axes": list(axes), "algorithm": choice, "estimates_s": estimates}

    def _decide_chain(self, graph: Graph, node: Node, ctx: PassContext) -> dict:
        """A reduce-scatter or all-gather: flat, or one axis at a time in its order."""
        axes = tuple(node.attrs["axes"])
        if ctx.topology is None:  # forced ordered
            nbytes = node.whole_bytes
            _chain_block_collective(graph, node, ctx.mesh_axes, self.name)
            return {"bytes": nbytes, "axes": list(axes), "algorithm": "ordered", "estimates_s": {}}
        links = {a.name: a for a in ctx.topology.axis_links(axes)}
        ordered = [links[a] for a in axes]
        nbytes = node.whole_bytes
        estimates = block_collective_estimates(
            node.op, nbytes, ordered, ctx.topology.reduce_scatter_over_axes_is_all_reduce
        )
        choice = self.force if self.force == "ordered" else min(estimates, key=estimates.get)
        shown = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in sorted(estimates.items()))
        ctx.remarks.append(
            f"{self.name}: {node.op} of {nbytes:,} bytes over {list(axes)}: {choice} ({shown})"
        )
        if choice == "ordered":
            _chain_block_collective(graph, node, ctx.mesh_axes, self.name)
        return {"bytes": nbytes, "axes": list(axes), "algorithm": choice, "estimates_s": estimates}


def _block_chain_candidate(node: Node, ctx: PassContext) -> bool:
    axes = node.attrs.get("axes", [])
    return (
        node.op in ("reduce_scatter", "all_gather")
        and len(node.inputs) == 1
        and sum(1 for a in axes if ctx.mesh_axes.get(a, 1) > 1) >= 2
    )


def _chain_block_collective(
    graph: Graph, node: Node, sizes: dict[str, int], created_by: str
) -> None:
    """A tiled reduce-scatter over axes (a, b, ...) is one over a, then over b, ...: the
    block numbered i over the tuple is block i_b of block i_a. An all-gather runs the
    chain backwards."""
    dim, axes = node.attrs["dimension"], list(node.attrs["axes"])
    scatter = node.op == "reduce_scatter"
    kept = {k: v for k, v in node.attrs.items() if k not in ("axes", "dimension")}
    current, varying = node.inputs[0], set(node.inputs[0].varying_axes)
    shape = list(current.shape)
    nodes = NewNodes(created_by)
    for step, axis in enumerate(axes if scatter else reversed(axes)):
        shape[dim] = shape[dim] // sizes[axis] if scatter else shape[dim] * sizes[axis]
        if not scatter:
            varying.discard(axis)
        last = step == len(axes) - 1
        out = node.outputs[0] if last else Value(tuple(shape), current.dtype, frozenset(varying))
        attrs = {**kept, "axes": [axis], "dimension": dim}
        nodes.add(node.op, [current], [out], attrs)
        current = out
    position = graph.nodes.index(node)
    graph.nodes[position : position + 1] = nodes.nodes


def _rewrite(
    graph: Graph, node: Node, orders: list[list[str]], sizes: dict[str, int], created_by: str
) -> None:
    """Replace `node` by per-part reduce-scatter / all-reduce / all-gather chains."""
    source, result = node.inputs[0], node.outputs[0]
    total = math.prod(sizes.values())
    n, dtype, varying = source.size, source.dtype, source.varying_axes
    part = -(-n // (total * len(orders))) * total  # each part divides by every axis
    nodes = NewNodes(created_by)

    def emit(op: str, inputs: list[Value], shape: tuple[int, ...], vary, **attrs) -> Value:
        return nodes(op, inputs, Value(shape, dtype, frozenset(vary)), **attrs)

    flat = emit("reshape", [source], (n,), varying)
    if part * len(orders) != n:
        zeros = emit("constant", [], (part * len(orders) - n,), (), value=0)
        flat = emit("concatenate", [flat, zeros], (part * len(orders),), varying, dimension=0)
    pieces = []
    for index, order in enumerate(orders):
        piece = (
            flat
            if len(orders) == 1
            else emit(
                "slice", [flat], (part,), varying, start=[index * part], limit=[(index + 1) * part]
            )
        )
        pieces.append(_chain(emit, piece, order, sizes, varying))
    joined = (
        pieces[0]
        if len(pieces) == 1
        else emit("concatenate", pieces, (part * len(orders),), result.varying_axes, dimension=0)
    )
    trimmed = (
        joined
        if joined.size == n
        else emit("slice", [joined], (n,), result.varying_axes, start=[0], limit=[n])
    )
    if node.attrs["reduce_op"] == "mean":
        trimmed = emit("scale", [trimmed], (n,), result.varying_axes, factor=1.0 / total)
    nodes.add("reshape", [trimmed], [result])
    position = graph.nodes.index(node)
    graph.nodes[position : position + 1] = nodes.nodes


def _chain(emit, piece: Value, order: list[str], sizes: dict[str, int], varying) -> Value:
    """Reduce-scatter along all but the last axis, all-reduce the shard along the last,
    then all-gather back in reverse order."""
    current, size, vary = piece, piece.shape[0], set(varying)
    for axis in order[:-1]:
        size //= sizes[axis]
        current = emit(
            "reduce_scatter", [current], (size,), vary, axes=[axis], dimension=0, reduce_op="sum"
        )
    vary -= {order[-1]}
    current = emit("all_reduce", [current], (size,), vary, axes=[order[-1]], reduce_op="sum")
    for axis in reversed(order[:-1]):
        size *= sizes[axis]
        vary -= {axis}
        current = emit("all_gather", [current], (size,), vary, axes=[axis], dimension=0)
    return current
