"""hoist-all-reduces: move reductions out of loop bodies (XLA's WhileLoopAllReduceCodeMotion).

Under `lax.scan` over layers, autodiff reduces each layer's gradient inside the backward
loop body, so a step runs L reductions per parameter. When the reduced value only flows
linearly out of the loop, reduce once after it instead:

- a stacked output (`ys`): each iteration's reduced slice is stacked; reduce the stack
  (for a `remat2` region, which runs once, its output);
- a carry accumulator `carry + reduce(x)`: accumulate unreduced from zero, then add the
  loop's initial carry to one reduction of the total.

Anything else stays, with a remark in the dump saying why.

    Before:
      %5: f32[], %6: f32[3,4] = jax.scan(%0, %1) {"length": 3, "num_carry": 1, "num_consts": 0, ...}
        region (%7: f32[], %8: f32[4]{replica}) {
          %9: f32[4] = all_reduce(%8) {"axes": ["replica"], "reduce_op": "mean"}
          return %7, %9
        }
    After:
      %5: f32[], %6: f32[3,4]{replica} = jax.scan(%0, %1) {...}
        region (%7: f32[], %8: f32[4]{replica}) {
          return %7, %8
        }
      %9: f32[3,4] = all_reduce(%6) {"axes": ["replica"], "reduce_op": "mean"}
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.ir.dataflow import (
    make_all_reduce,
    reduced_chain,
    unreduce,
    use_counts,
)
from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.traits import Trait

# Loops, and call-once regions (`remat2`): autodiff puts a rematerialised layer's reductions
# inside the checkpoint region, which must give them up before the loop around it can.
_HOISTED_FROM = (Trait.COUNTED_LOOP, Trait.WHILE_LOOP, Trait.CALL_ONCE)


@dataclass(frozen=True)
class HoistAllReduces(Pass):
    name = "hoist-all-reduces"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        hoisted = 0
        for parent in reversed(graph.graphs()):  # innermost loops first
            for loop in [n for n in parent.nodes if any(map(n.has, _HOISTED_FROM))]:
                hoisted += self.hoist_from(loop, parent, ctx)
        ctx.stats[self.name] = {"hoisted": hoisted}
        return hoisted > 0

    def hoist_from(self, loop: Node, parent: Graph, ctx: PassContext) -> int:
        """Hoist what can leave `loop`'s body; returns how many reductions moved."""
        body, carry_offset, num_carry = _body(loop)
        hoisted = 0
        for j in range(len(body.outputs)):
            if j >= num_carry:
                chain = reduced_chain(body.outputs[j], body.producers(), use_counts(body))
                if chain is not None:
                    self._hoist_stacked(loop, parent, body, j, chain)
                    hoisted += 1
            elif self._hoist_accumulator(loop, parent, body, j, carry_offset + j):
                hoisted += 1
        _remark_kept(loop, body, ctx)
        return hoisted

    def _hoist_stacked(self, loop: Node, parent: Graph, body: Graph, j: int, chain) -> None:
        axes = unreduce(chain, body)
        stacked = loop.outputs[j]
        loop.outputs[j] = stacked.like(varying_axes=frozenset(stacked.varying_axes | axes))
        reduction = make_all_reduce(loop.outputs[j], stacked, chain.reduction, self.name)
        parent.nodes.insert(parent.nodes.index(loop) + 1, reduction)
        loop.created_by = self.name

    def _hoist_accumulator(self, loop: Node, parent: Graph, body: Graph, j: int, k: int) -> bool:
        """carry_j' = carry_j + ops(all_reduce(x)), carry_j read nowhere else."""
        producers, uses = body.producers(), use_counts(body)
        add = producers.get(body.outputs[j])
        carry_in = body.inputs[k]
        if (
            add is None
            or not add.has(Trait.ADDING)
            or len(add.inputs) != 2
            or carry_in not in add.inputs
        ):
            return False
        if uses[carry_in] != 1 or uses[add.outputs[0]] != 1 or _cond_reads(loop, j):
            return False
        chain = reduced_chain(add.inputs[1 - add.inputs.index(carry_in)], producers, uses)
        if chain is None:
            return False
        axes = unreduce(chain, body)
        for value in (carry_in, add.outputs[0], *_cond_inputs(loop, j)):
            value.varying_axes = frozenset(value.varying_axes | axes)
        operand = _carry_operand(loop, j)
        initial, final = loop.inputs[operand], loop.outputs[j]
        varying = frozenset(initial.varying_axes | axes)
        zeros = Node("constant", [], [initial.like()], {"value": 0}, created_by=self.name)
        start = Node(
            "pvary",
            [zeros.outputs[0]],
            [initial.like(varying_axes=varying)],
            {"axes": sorted(varying - initial.varying_axes)},
            created_by=self.name,
        )
        position = parent.nodes.index(loop)
        parent.nodes[position:position] = [zeros, start]
        loop.inputs[operand] = start.outputs[0]
        loop.outputs[j] = final.like(varying_axes=frozenset(final.varying_axes | axes))
        reduced = final.like()
        tail = [
            make_all_reduce(loop.outputs[j], reduced, chain.reduction, self.name),
            Node("add", [initial, reduced], [final], created_by=self.name),
        ]
        position = parent.nodes.index(loop) + 1
        parent.nodes[position:position] = tail
        loop.created_by = self.name
        return True


def _body(loop: Node) -> tuple[Graph, int, int]:
    """(body region, index of the first carry among its inputs, number of carries)."""
    if loop.has(Trait.COUNTED_LOOP):
        return loop.regions[0], loop.attrs["num_consts"], loop.attrs["num_carry"]
    if loop.has(Trait.CALL_ONCE):
        return loop.regions[0], 0, 0  # one pass, every output leaves as it is
    body = loop.regions[1]
    consts = loop.attrs["body_nconsts"]
    return body, consts, len(body.inputs) - consts


def _carry_operand(loop: Node, j: int) -> int:
    """The loop's operand index of carry j's initial value."""
    if loop.has(Trait.COUNTED_LOOP):
        return loop.attrs["num_consts"] + j
    return loop.attrs["cond_nconsts"] + loop.attrs["body_nconsts"] + j


def _cond_inputs(loop: Node, j: int) -> list[Value]:
    if not loop.has(Trait.WHILE_LOOP):
        return []
    cond = loop.regions[0]
    return [cond.inputs[loop.attrs["cond_nconsts"] + j]]


def _cond_reads(loop: Node, j: int) -> bool:
    """Whether a while loop's condition reads carry j (it would see unreduced values)."""
    values = _cond_inputs(loop, j)
    return bool(values) and use_counts(loop.regions[0])[values[0]] > 0


def _remark_kept(loop: Node, body: Graph, ctx: PassContext) -> None:
    users = body.users()
    for node in body.nodes:
        if node.op != "all_reduce":
            continue
        readers = [u.op for out in node.outputs for u in users.get(out, [])]
        why = (
            f"its result is read inside the loop by {', '.join(sorted(set(readers)))}"
            if readers
            else ("its result leaves the loop through a carry the loop also reads")
        )
        shape = "x".join(map(str, node.inputs[0].shape)) or "scalar"
        ctx.remarks.append(
            f"hoist-all-reduces: kept the all_reduce of {shape} in the {loop.op} body: {why}"
        )
