"""The bytes each op of a graph moves through device memory as XLA's TPU compiler fuses it.

A roofline per op of our graph would charge every value to memory twice, once written and
once read. XLA's compiled programs do not (measured on the table's programs, read from
their HLO, `benchmarks.tpu_aot --compute-check`):
- elementwise ops, broadcasts and reshapes fuse into the ops that read or write their
  values, which move them;
- a reduction fused with the elementwise ops that make its operand reads what they read
  (a bf16 activation, not its f32 cast), and reductions that read one value are one
  multi-output fusion, which reads it once (BatchNorm's mean and mean of squares);
- a reduction of a matmul's or convolution's result is fused into that op's output
  fusion (attention's softmax statistics, BatchNorm's of a convolution): it reads
  nothing of its own;
- a transpose next to a matmul or convolution is the layout that op reads or writes;
- the step's own results made by elementwise ops (the optimizer update) are a loop
  fusion of their own: it reads each of its sources once (parameters, gradients,
  moments) and writes each result.
"""

from __future__ import annotations

from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.traits import Trait


def fuses_into_neighbours(node: Node) -> bool:
    """XLA fuses elementwise ops, broadcasts and reshapes into the ops that read or write
    their values: their memory traffic is those ops', counted there."""
    return (
        node.has(Trait.ELEMENTWISE) or node.has(Trait.BROADCAST_IN_DIM) or node.has(Trait.RESHAPE)
    )


def fused_bytes(graph: Graph, whole_step: bool = False) -> dict[Node, int]:
    """The bytes each node of `graph` (not of nested regions) reads and writes as XLA fuses
    it, for the nodes where that is not its operands and results (`compute_seconds`
    prices the rest so). `whole_step`: `graph` is the step itself, whose results its
    elementwise ops write."""
    producers, users = graph.producers(), graph.users()
    moved: dict[Node, int] = {}
    read: set[Value] = set()
    for node in graph.nodes:
        if node.has(Trait.DIMENSION_REDUCTION):
            sources = {
                v
                for v in _fused_sources(node.inputs, producers)
                if not _is_matmul(producers.get(v))
            }
            moved[node] = sum(v.nbytes for v in sources - read) + _written(node.outputs)
            read |= sources
        elif node.has(Trait.TRANSPOSE) and _next_to_matmul(node, producers, users):
            moved[node] = 0
    if whole_step:
        moved.update(_update_fusion_bytes(graph, producers))
    return moved


def _update_fusion_bytes(graph: Graph, producers: dict[Value, Node]) -> dict[Node, int]:
    """The step's results that elementwise ops make, as one loop fusion: each of its
    sources read once, each result written."""
    returned = set(graph.outputs)
    moved, read = {}, set()
    for node in graph.nodes:
        roots = [v for v in node.outputs if v in returned]
        if not roots or node.regions or not fuses_into_neighbours(node):
            continue
        sources = _fused_sources(node.inputs, producers)
        moved[node] = sum(v.nbytes for v in sources - read) + _written(roots)
        read |= sources
    return moved


def _written(values: list[Value]) -> int:
    return sum(v.nbytes for v in values)


def _is_matmul(node: Node | None) -> bool:
    return node is not None and (node.has(Trait.CONTRACTION) or node.has(Trait.CONVOLUTION))


def _next_to_matmul(
    node: Node, producers: dict[Value, Node], users: dict[Value, list[Node]]
) -> bool:
    """Whether a matmul makes `node`'s operand or reads its result."""
    around = [producers.get(v) for v in node.inputs]
    around += [user for v in node.outputs for user in users.get(v, [])]
    return any(_is_matmul(other) for other in around)


def _fused_sources(values: list[Value], producers: dict[Value, Node]) -> set[Value]:
    """The values that the fused ops making `values` read (`values` themselves where no
    fused op makes them)."""
    stack, seen, sources = list(values), set(), set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        producer = producers.get(value)
        if producer is not None and not producer.regions and fuses_into_neighbours(producer):
            stack.extend(producer.inputs)
        else:
            sources.add(value)
    return sources
