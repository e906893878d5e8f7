"""Gather a held parameter again for a read that comes after other layers' gathers,
instead of keeping the first gather alive until then (FSDP's reshard after forward).

Parameter sharding holds each parameter split and gathers it just before the first op
that reads it whole. In a model whose layers are not a scan, autodiff's backward pass
reads the same gathered weights again, in reverse order: held from the forward read to
the backward one, every layer's gathered weights are alive at once at the turn of the
step, which is the whole model per chip, the memory parameter sharding exists to save
(a scan's layers are gathered again in the backward loop by `regather_residuals`).

Here a read of a gathered value (or of a pure op's result on it: a cast, `pvary`) is given
its own copy of the gather, with the pure ops before and after it, when another held
value was gathered between it and the previous read. The copy's block waits for the
read's first other operand (`after`), so the compiler neither merges the two gathers nor
issues the copy at the start of the step, which would hold it as long as before. Reads
between which the other gathers produce fewer bytes than this one (one layer's forward and
its backward, with at most its own bias gathered between, or two uses in one layer) share
one gather: a span shorter than a layer's weights is not worth a second gather.

    Before (%0 and %1 two layers' blocks; %9 layer 0's backward read):
      %2: f32[16,4] = all_gather(%0) {"axes": ["replica"], "dimension": 0}
      %3: f32[2,16]{replica} = jax.dot_general(%x, %2)
      %4: f32[16,4] = all_gather(%1) {"axes": ["replica"], "dimension": 0}
      ...
      %9: f32[2,16]{replica} = jax.dot_general(%g, %2)
    After:
      ...
      %10: f32[2,4]{replica} = after(%0, %g)
      %11: f32[16,4] = all_gather(%10) {"axes": ["replica"], "dimension": 0}
      %9: f32[2,16]{replica} = jax.dot_general(%g, %11)
"""

from __future__ import annotations

from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.rewrites.gather_prologue import ancestors, clone, derived

#: attribute of a gather of a held parameter at the program's top level (its copies too):
#: `combine-all-reduces` leaves these apart where it leaves a layer loop's gathers apart
PARAMETER_GATHER = "parameter"


def regather_reads(graph: Graph, created_by: str, held_bytes_limit: float | None) -> int:
    """Tag the gathers of `graph`'s held values (not its regions'), and give the reads
    after another layer's gather gathers of their own, where the gathered bytes that
    would be held from an earlier read to a later one exceed `held_bytes_limit` (None:
    always); returns how many gathers were copied."""
    held = {graph.inputs[k] for k, a in enumerate(graph.io.inputs) if a.sharded}
    pure = derived(graph, held)  # the held blocks' casts, gathers and their pure results
    gathers = [n for n in pure if n.op == "all_gather"]
    for gather in gathers:
        gather.attrs[PARAMETER_GATHER] = True
    position = {node: i for i, node in enumerate(graph.nodes)}
    gathered = _bytes_gathered_before(graph, gathers)
    in_pure, producers = set(pure), {out: n for n in pure for out in n.outputs}
    users = graph.users()
    later: list[tuple[list[Node], set[Value]]] = []  # the reads that gather again
    for gather in gathers:
        values = {v for n in _descendants(gather, pure) for v in n.outputs}
        readers = {n for v in values for n in users.get(v, ()) if n not in in_pure}
        reads = sorted(readers, key=position.__getitem__)
        groups = [reads[:1]]
        own_bytes = gather.outputs[0].nbytes
        for earlier, read in zip(reads, reads[1:], strict=False):
            between = gathered[position[read]] - gathered[position[earlier] + 1]
            if between >= own_bytes:  # other layers' weights between: gather again
                groups.append([])
            groups[-1].append(read)
        later.extend((group, values) for group in groups[1:])
    held_across = sum(max(v.nbytes for v in values) for _, values in later)
    if not later or (held_bytes_limit is not None and held_across <= held_bytes_limit):
        return 0
    later.sort(key=lambda item: position[item[0][0]])
    # Each copy waits for the operand of the copy before it (one layer ahead in the
    # backward pass), so it can run beside that layer's compute; the first for its own.
    previous: Value | None = None
    for group, values in later:
        own = _other_operand(group[0], values)
        copies = _copy_for(group, values, producers, previous or own, created_by)
        at = graph.nodes.index(group[0])
        graph.nodes[at:at] = copies
        previous = own
    return len(later)


def _bytes_gathered_before(graph: Graph, gathers: list[Node]) -> list[int]:
    """For each position in `graph.nodes` (and one past the end), the bytes the held
    values' gathers before it produce: a span's gathered bytes are a difference of two."""
    gathering = {g: g.outputs[0].nbytes for g in gathers}
    totals = [0]
    for node in graph.nodes:
        totals.append(totals[-1] + gathering.get(node, 0))
    return totals


def _other_operand(read: Node, values: set[Value]) -> Value | None:
    """The first operand of `read` that is not the gathered value: what it waits for."""
    return next((v for v in read.inputs if v not in values), None)


def _descendants(gather: Node, pure: list[Node]) -> list[Node]:
    """`gather` and the pure nodes computed from its result."""
    values, found = set(gather.outputs), [gather]
    for node in pure:
        if node is not gather and any(v in values for v in node.inputs):
            values.update(node.outputs)
            found.append(node)
    return found


def _copy_for(
    group: list[Node],
    values: set[Value],
    producers: dict[Value, Node],
    anchor: Value | None,
    created_by: str,
) -> list[Node]:
    """Copies of the pure nodes the `group`'s reads take from `values`, from the held
    blocks on, which wait for `anchor`; the reads are rewired to the copies."""
    read_values = [v for n in group for v in n.inputs if v in values]
    chain = ancestors([producers[v] for v in read_values], list(producers.values()))
    ordered = [n for n in producers.values() if n in chain]
    ordered = list(dict.fromkeys(ordered))  # a node with several results once
    env: dict[Value, Value] = {}
    copies: list[Node] = []
    for node in ordered:
        for source in node.inputs:
            if anchor is not None and source not in producers and source not in env:
                env[source] = source.like()  # a held block: read once the anchor is ready
                copies.append(Node("after", [source, anchor], [env[source]], created_by=created_by))
        copies.append(clone(node, env, created_by))
    for read in group:
        read.inputs = [env.get(v, v) for v in read.inputs]
    return copies
