"""prefetch-all-gathers: a layer loop gathers the next layer's parameters while this layer
computes (FSDP prefetch).

Parameter sharding (`shard-parameters`) gathers each layer's slice inside the `scan` body,
where the layer reads it: the gather of layer i waits for nothing, but layer i's compute
waits for the gather, so the gather is exposed unless the compiler pipelines it across
iterations. This pass does that pipelining in the IR: the gathered parameters become loop
carries. The loop starts with layer 0's parameters gathered before it; iteration i gathers
layer i+1's (from a copy of the stacked blocks rotated by one layer) into the carry for the
next iteration, with nothing in iteration i depending on it, so the gather runs beside
layer i's compute. A reverse scan (the backward pass) prefetches layer i-1. Gathers inside
a checkpoint (`remat2`) region of the body are moved out of it first: the region then
takes the gathered parameters as operands.

What moves is the *prologue* of each gather: the ops from the body's `xs` slices to the
`all_gather` (a cast to bf16, a bucket's concatenation), which read nothing else. It costs
one more layer's gathered parameters alive at a time, a rotated copy of the stacked
blocks (1/N of the stack), and one wasted gather in the last iteration.

    Before (%1: f32[3,2,16] the stacked blocks, read by the scan as xs):
      %2: f32[2,16]{replica} = jax.scan(%0, %1) {"num_carry": 1, "num_consts": 0, ...}
        region (%3: f32[2,16]{replica}, %4: f32[2,16]{replica}) {
          %5: f32[16,16] = all_gather(%4) {"axes": ["replica"], "dimension": 0}
          ...
    After:
      %6: f32[1,2,16]{replica} = slice(%1) {"start": [0, 0, 0], "limit": [1, 2, 16]}
      %7: f32[2,16]{replica} = reshape(%6)
      %8: f32[16,16] = all_gather(%7) {"axes": ["replica"], "dimension": 0}
      ... %9 = concatenate(slice(%1) rows 1..3, slice(%1) row 0): the next layer's blocks
      %2: f32[2,16]{replica}, %10: f32[16,16] = jax.scan(%0, %8, %1, %9) {"num_carry": 2, ...}
        region (%3: f32[2,16]{replica}, %5: f32[16,16], %4: f32[2,16]{replica}, %11: ...) {
          %12: f32[16,16] = all_gather(%11) {"axes": ["replica"], "dimension": 0}
          ...
          return ..., %12, ...
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_strategies.passes.base import ModePass, PassContext
from xla_strategies.passes.ir.graph import Graph, NewNodes, Node, Value
from xla_strategies.passes.ir.traits import Trait
from xla_strategies.passes.rewrites.gather_prologue import clone, drop_dead, gather_prologue


@dataclass(frozen=True)
class PrefetchAllGathers(ModePass):
    """Options:
    mode: ``on`` prefetches in every layer loop whose body gathers its xs; ``auto`` does
        so with a topology whose compiler runs a loop's all-gathers beside compute, and
        not on emulated CPU devices, whose collectives are synchronous copies, nor where
        the topology says the compiler runs them synchronously
        (`Topology.loop_all_gathers_asynchronous`: TPU v5p and v6e): there a prefetch
        hides nothing and holds one more layer; nor where each weight is gathered apart
        and the compiler overlaps each gather itself (`Topology.bucket_layer_collectives`
        false and the gathers asynchronous: TPU v5e).
    """

    name = "prefetch-all-gathers"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        reason = self._off_reason(ctx) if self.mode == "auto" else None
        if reason is not None:
            ctx.stats[self.name] = {"loops": 0, "distance": 0, "reason": reason}
            return False
        loops = gathered_bytes = 0
        for node in [n for n in graph.nodes if n.has(Trait.COUNTED_LOOP)]:
            body = node.regions[0]
            for call in [n for n in body.nodes if n.has(Trait.CALL_ONCE)]:
                _hoist_prologues(body, call, self.name)
            prologue, gathers = _prologue(body, node)
            if gathers:
                _prefetch(graph, node, prologue, gathers, self.name)
                loops += 1
                gathered_bytes += sum(g.outputs[0].nbytes for g in gathers)
        ctx.stats[self.name] = {
            "loops": loops,
            "distance": 1 if loops else 0,
            "gathered_bytes_per_layer": gathered_bytes,
        }
        if loops:
            ctx.remarks.append(
                f"{self.name}: {loops} layer loops gather the next layer's parameters "
                f"({gathered_bytes:,} bytes per layer) while the current layer computes"
            )
        return loops > 0

    def _off_reason(self, ctx: PassContext) -> str | None:
        """Why `mode=auto` leaves the step alone, or None: nothing overlaps a synchronous
        gather, and unknown hardware has no estimate (an emulated topology keeps its
        passes: it runs the real slice's program). What the topology says of its compiler
        is also named in a remark."""
        if ctx.topology is None:
            return "synchronous collectives" if ctx.synchronous_collectives else "no topology"
        if not ctx.topology.loop_all_gathers_asynchronous:
            reason = "synchronous gathers"
            why = "runs a layer loop's all-gathers synchronously, so a prefetch would hide"
            why += " nothing and hold one more layer"
        elif not ctx.topology.bucket_layer_collectives:
            reason = "gathers overlapped per weight"
            why = "runs each weight's gather beside the compute before its use, so a prefetch"
            why += " would hold one more layer for nothing"
        else:
            return None
        ctx.remarks.append(
            f"{self.name}{{mode=auto}}: off: XLA's compiler for {ctx.topology.hardware} "
            f"{why}; mode=on turns it on"
        )
        return reason


def _prologue(body: Graph, loop: Node) -> tuple[list[Node], list[Node]]:
    first_xs = loop.attrs["num_consts"] + loop.attrs["num_carry"]
    return gather_prologue(body, set(body.inputs[first_xs:]))


def _hoist_prologues(body: Graph, call: Node, created_by: str) -> None:
    """Move the gathers a checkpoint region computes from its operands out of it: the
    region takes the gathered values as operands instead."""
    region = call.regions[0]
    prologue, gathers = gather_prologue(region, set(region.inputs))
    if not gathers:
        return
    outside = dict(zip(region.inputs, call.inputs, strict=True))
    at = body.nodes.index(call)
    for node in prologue:
        copy = clone(node, outside, created_by)
        body.nodes.insert(at, copy)
        at += 1
    for gather in gathers:
        inner = gather.outputs[0]
        call.inputs.append(outside[inner])
        region.inputs.append(inner)
    region.nodes = [n for n in region.nodes if n not in gathers]
    drop_dead(region, prologue)


def _prefetch(
    graph: Graph, loop: Node, prologue: list[Node], gathers: list[Node], created_by: str
) -> None:
    body, attrs = loop.regions[0], loop.attrs
    consts, carries = attrs["num_consts"], attrs["num_carry"]
    first_xs, length, reverse = consts + carries, attrs["length"], attrs.get("reverse", False)
    used = [i for i, v in enumerate(body.inputs) if i >= first_xs and _reads(prologue, v)]
    at = graph.nodes.index(loop)
    emit = NewNodes(created_by)
    # the first iteration's gathers, before the loop
    first = length - 1 if reverse else 0
    initial = {body.inputs[i]: _layer(emit, loop.inputs[i], first) for i in used}
    for node in prologue:
        emit.nodes.append(clone(node, initial, created_by))
    starts = [initial[g.outputs[0]] for g in gathers]
    # the next layer's blocks, for the body to gather from
    rotated = [_rotate(emit, loop.inputs[i], reverse) for i in used]
    graph.nodes[at:at] = emit.nodes
    # the body: this layer's gathers come in as carries; the next layer's go out as carries
    carried = [g.outputs[0] for g in gathers]
    nexts = {body.inputs[i]: body.inputs[i].like() for i in used}
    produced = dict(nexts)  # each prologue value -> its next layer's
    prefetch = [clone(n, produced, created_by) for n in prologue]
    body.nodes = prefetch + [n for n in body.nodes if n not in gathers]
    drop_dead(body, prologue)
    body.inputs[first_xs:first_xs] = carried
    body.inputs.extend(nexts.values())
    outputs = body.outputs
    body.outputs = [*outputs[:carries], *(produced[v] for v in carried), *outputs[carries:]]
    loop.inputs[first_xs:first_xs] = starts
    loop.inputs.extend(rotated)
    loop.outputs[carries:carries] = [v.like() for v in carried]
    loop.attrs = {**attrs, "num_carry": carries + len(carried)}


def _reads(nodes: list[Node], value: Value) -> bool:
    return any(value in n.inputs for n in nodes)


def _layer(emit, stack: Value, index: int) -> Value:
    """`stack[index]`: one layer's slice of a stacked operand."""
    start = [index] + [0] * (len(stack.shape) - 1)
    limit = [index + 1, *stack.shape[1:]]
    row = emit("slice", [stack], stack.like(shape=(1, *stack.shape[1:])), start=start, limit=limit)
    return emit("reshape", [row], stack.like(shape=stack.shape[1:]))


def _rotate(emit, stack: Value, reverse: bool) -> Value:
    """`stack` with each layer's slice at the position of the layer before it in loop order:
    rows 1..L then row 0 (rows L-1 then 0..L-1 for a reverse loop)."""
    length, rest = stack.shape[0], list(stack.shape[1:])
    cut = length - 1 if reverse else 1

    def rows(lo: int, hi: int) -> Value:
        shape = (hi - lo, *rest)
        return emit(
            "slice",
            [stack],
            stack.like(shape=shape),
            start=[lo] + [0] * len(rest),
            limit=[hi, *rest],
        )

    return emit("concatenate", [rows(cut, length), rows(0, cut)], stack.like(), dimension=0)
