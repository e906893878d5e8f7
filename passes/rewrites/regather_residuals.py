"""Recompute gathered layer weights in the backward loop instead of stacking them.

Without `nn.remat`, autodiff keeps what the backward pass needs from each forward layer as
a stacked output of the forward `scan` (its residuals), and a layer's weights, gathered
and made per-replica (`pvary`) for its matmul, are among them: the whole stack of gathered
weights would stay alive from the forward pass into the backward, every replica holding
all of it. Parameter sharding instead hands the backward loop the weights' blocks and
gathers them again there, one layer at a time (rematerialisation of the gather).

A residual qualifies when the forward body computes it from its per-layer slices by pure
ops and at least one all-gather (`gather_prologue.derived`), and every reader of the
stacked residual is another scan of the same length that takes it as `xs`: that scan
takes the slices' stacks instead, and its body runs a copy of the ops.
"""

from __future__ import annotations

from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.traits import Trait
from xla_strategies.passes.rewrites.gather_prologue import ancestors, clone, derived, drop_dead


def regather_residuals(graph: Graph, created_by: str) -> int:
    """Rewrite every qualifying residual of `graph`'s scans; returns how many."""
    count = 0
    for forward in [n for n in graph.nodes if n.has(Trait.COUNTED_LOOP)]:
        body, a = forward.regions[0], forward.attrs
        first_xs = a["num_consts"] + a["num_carry"]
        nodes = derived(body, set(body.inputs[first_xs:]))
        producers = {out: n for n in nodes for out in n.outputs}
        for index in reversed(range(a["num_carry"], len(body.outputs))):
            value, stacked = body.outputs[index], forward.outputs[index]
            readers = graph.users().get(stacked, [])
            chain = ancestors([producers[value]], nodes) if value in producers else set()
            if any(n.op == "all_gather" for n in chain) and _all_scan_xs(readers, stacked, a):
                ordered = [n for n in nodes if n in chain]
                for reader in readers:
                    _recompute(reader, stacked, (forward, value), ordered, created_by)
                del body.outputs[index], forward.outputs[index]
                count += 1
        drop_dead(body, nodes)
    return count


def _all_scan_xs(readers: list[Node], stacked: Value, attrs: dict) -> bool:
    """Whether every reader is a scan of the same length that reads `stacked` as xs."""
    for reader in readers:
        if not reader.has(Trait.COUNTED_LOOP) or reader.attrs["length"] != attrs["length"]:
            return False
        first_xs = reader.attrs["num_consts"] + reader.attrs["num_carry"]
        if any(v is stacked for v in reader.inputs[:first_xs]):
            return False
    return bool(readers)


def _recompute(
    reader: Node,
    stacked: Value,
    residual: tuple[Node, Value],
    chain: list[Node],
    created_by: str,
) -> None:
    """`reader` takes the forward loop's slices that `chain` reads, as new xs, and runs
    `chain` at the top of its body in place of its `stacked` input: the forward body's
    `residual` value, stacked."""
    forward, value = residual
    body, forward_body = reader.regions[0], forward.regions[0]
    reads = {v for n in chain for v in n.inputs}
    env: dict[Value, Value] = {}
    for position, inner in enumerate(forward_body.inputs):
        if inner in reads:
            env[inner] = inner.like()
            reader.inputs.append(forward.inputs[position])
            body.inputs.append(env[inner])
    copies = [clone(n, env, created_by) for n in chain]
    for position in reversed([i for i, v in enumerate(reader.inputs) if v is stacked]):
        body.replace_uses(body.inputs[position], env[value])
        del reader.inputs[position], body.inputs[position]
    body.nodes[:0] = copies
