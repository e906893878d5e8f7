"""split-stacked-all-reduces: across TPU slices, a small all-reduce of stacked rows
reduces each row as an operand of its own (one tuple all-reduce).

flax's `BatchNorm` stacks its two statistics (the mean and the mean of squares, [C] each)
as one [2, C] value for one `pmean`. Across slices, XLA's TPU compiler splits an
all-reduce of a value whose first dimension is over 1 into three collectives: an
all-reduce inside each slice, each chip's 1/n share (padded to a tile of [rows, 128])
all-reduced among the slices, and a second collective inside each slice that puts the
shares together (an all-reduce of zeros on a 256-chip slice, an all-gather on a small
one). The same rows as operands of their own, [C] each, compile to two: the all-reduce
inside the slice and one among the slices of the whole rows. Measured (libtpu 0.0.50.1,
2xv5p-512, 2xv5e-256 and 2xv6e-256 alike, read by the HLO text reader): f32[2, 256]
106.6 us stacked, 63.5 us as rows; f32[16, 256] 107.8 against 65.9; f32[2, 65536] 110.6
against 169.0 (there the rows' bytes among the slices cost more than the second
collective inside the slice saves).

So the pass prices both forms with the cost model and splits where the rows cost less:
small statistics, whose every collective costs its latency. Each decision, with both
estimates, is in the pass's stats. Only all-reduces over TPU slices (ICI inside each, DCN
between) are touched, and only [rows, C] values of at most `MAX_ROWS` rows: stacked
vectors (a row of a higher rank, a [3, 3, 8] slice of a convolution's kernel, is split
by XLA the same way again, measured). A bucket (a flat buffer, or a tuple) is left as it
is. `mode=auto` (the default) and `mode=on` differ only in the pricing: `on` splits every
such all-reduce, and says so where the topology has no slices.

    Before (2xv5p-512):
      %1: f32[2,256] = all_reduce(%0) {"axes": ["dcn", "x", "y", "z"], "reduce_op": "mean"}
    After:
      %1: f32[1,256]{dcn,x,y,z} = slice(%0) {"limit": [1, 256], "start": [0, 0]}
      %2: f32[256]{dcn,x,y,z} = reshape(%1)
      %3: f32[1,256]{dcn,x,y,z} = slice(%0) {"limit": [2, 256], "start": [1, 0]}
      %4: f32[256]{dcn,x,y,z} = reshape(%3)
      %5: f32[256], %6: f32[256] = all_reduce(%2, %4) {"axes": ["dcn", "x", "y", "z"], ...}
      %7: f32[1,256] = reshape(%5)
      %8: f32[1,256] = reshape(%6)
      %9: f32[2,256] = concatenate(%7, %8) {"dimension": 0}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from xla_strategies.passes.base import ModePass, PassContext
from xla_strategies.passes.cost import model as cost_model
from xla_strategies.passes.ir.graph import Graph, NewNodes, Node, itemsize

# The most rows split so (measured up to 16: one operand per row beyond that is a long
# tuple for a value that is no longer a few stacked statistics).
MAX_ROWS = 16
# Lanes of a TPU tile: XLA pads each chip's share of a stacked value to [rows, LANES].
LANES = 128
# Up to this many bytes, XLA's combiner makes the rows' all-reduces among the slices one;
# beyond it each row goes on its own (measured: f32[2, 32768] one, f32[2, 65536] two).
COMBINED_ROWS_BYTES = 256 * 1024


@dataclass(frozen=True)
class SplitStackedAllReduces(ModePass):
    """Options:
    mode: ``auto`` splits where the cost model prices the rows cheaper than the stacked
        value; ``on`` splits every all-reduce of stacked rows across TPU slices.
    """

    name = "split-stacked-all-reduces"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if not _has_slices(ctx):
            ctx.stats[self.name] = {"split": 0, "reason": "no TPU slices to reduce across"}
            if self.mode == "on":
                ctx.remarks.append(
                    f"{self.name}{{mode=on}}: nothing to split: the topology "
                    f"({ctx.topology or 'none'}) has no TPU slices joined by DCN"
                )
            return False
        decisions = []
        for region in graph.graphs():
            for node in list(region.nodes):
                links = _across_slices(node, ctx)
                if links is None:
                    continue
                estimates = _estimates(node, *links)
                rows = self.mode == "on" or estimates["rows"] < estimates["stacked"]
                decisions.append(
                    {
                        "shape": list(node.inputs[0].shape),
                        "estimates_s": estimates,
                        "form": "rows" if rows else "stacked",
                    }
                )
                if rows:
                    _split(region, node, self.name)
        split = sum(d["form"] == "rows" for d in decisions)
        ctx.stats[self.name] = {"split": split, "decisions": decisions}
        return split > 0


def _has_slices(ctx: PassContext) -> bool:
    if ctx.topology is None:
        return False
    return cost_model.across_tpu_slices(*cost_model.split_levels(ctx.topology.axis_links()))


def _across_slices(node: Node, ctx: PassContext) -> tuple[list, list] | None:
    """The (inside a slice, among slices) links of an all-reduce of a few stacked rows
    across TPU slices; None for any other node."""
    if node.op != "all_reduce" or len(node.inputs) != 1 or "bucket" in node.attrs:
        return None
    shape = node.inputs[0].shape
    if len(shape) != 2 or not 1 < shape[0] <= MAX_ROWS:
        return None
    fast, slow = cost_model.split_levels(ctx.topology.axis_links(tuple(node.attrs["axes"])))
    return (fast, slow) if cost_model.across_tpu_slices(fast, slow) else None


def _estimates(node: Node, fast: Sequence, slow: Sequence) -> dict[str, float]:
    """Seconds for XLA's form of the stacked value (an all-reduce in the slice, each chip's
    padded share among the slices, an all-reduce in the slice again) and for the rows
    apart (an all-reduce in the slice, then the rows among the slices)."""
    value = node.inputs[0]
    nbytes = value.nbytes
    chips = math.prod(link.size for link in fast)
    share = max(nbytes / chips, value.shape[0] * LANES * itemsize(value.dtype))
    inside = cost_model.flat_time("all_reduce", nbytes, fast)
    apart = 1 if nbytes <= COMBINED_ROWS_BYTES else value.shape[0]
    return {
        "stacked": 2 * inside + cost_model.flat_time("all_reduce", share, slow),
        "rows": inside + apart * cost_model.flat_time("all_reduce", nbytes / apart, slow),
    }


def _split(graph: Graph, node: Node, created_by: str) -> None:
    """Replace `node` by one all-reduce of its operand's rows and their concatenation."""
    value, result = node.inputs[0], node.outputs[0]
    count, *row_shape = value.shape
    emit = NewNodes(created_by)
    rows = []
    for i in range(count):
        start, limit = [i] + [0] * len(row_shape), [i + 1, *row_shape]
        piece = emit("slice", [value], value.like(shape=(1, *row_shape)), start=start, limit=limit)
        rows.append(emit("reshape", [piece], value.like(shape=tuple(row_shape))))
    reduced = [result.like(shape=tuple(row_shape)) for _ in rows]
    emit.add(node.op, rows, reduced, node.attrs)
    stacked = [emit("reshape", [r], r.like(shape=(1, *row_shape))) for r in reduced]
    emit.add("concatenate", stacked, [result], {"dimension": 0})
    at = graph.nodes.index(node)
    graph.nodes[at : at + 1] = emit.nodes
