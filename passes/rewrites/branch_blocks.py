"""Blocks through branches: a `cond` whose operands are blocks runs its branches on them.

optax's `MultiSteps` chooses between accumulating a gradient and applying the update with
a `cond` over the whole optimizer state; read whole, every leaf would be gathered for it.
Instead each branch takes the blocks (a mirrored operand of a block operand's shape is cut
the same way) and is rewritten on them like a loop body; an output every branch returns
as a block of the same dimension leaves the `cond` as that block, and a branch that holds
any other output as a block gathers it before returning.
"""

from __future__ import annotations

from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.rewrites.blocks import DEFERRED, BlockRewriter


def shard_branches(sharder: BlockRewriter, node: Node) -> bool:
    """Rewrite the branching `node` on blocks; False when its predicate is a block or
    differs across replicas (replicas in different branches would not meet in the
    branches' collectives)."""
    predicate, operands = node.inputs[0], node.inputs[1:]
    if predicate in sharder.blocks or predicate.varying_axes:
        return False
    split = _operand_blocks(sharder, operands)
    returned = [_rewrite_branch(sharder, region, split) for region in node.regions]
    common = {
        index: dim
        for index, dim in returned[0].items()
        if all(other.get(index) == dim for other in returned[1:])
    }
    for region, dims in zip(node.regions, returned, strict=True):
        for index, dim in dims.items():
            if common.get(index) != dim:  # not a block in every branch: whole here too
                whole = node.outputs[index].like()
                _gather_into(sharder, region, index, whole, dim)
    inputs = [predicate, *(split[k][0] if k in split else v for k, v in enumerate(operands))]
    outputs = [
        sharder.block_of(out, common[i]) if i in common else out
        for i, out in enumerate(node.outputs)
    ]
    sharder.nodes.append(
        Node(
            node.op,
            inputs,
            outputs,
            dict(node.attrs),
            node.regions,
            node.payload,
            created_by=sharder.created_by,
        )
    )
    for index, dim in common.items():
        sharder.blocks[node.outputs[index]] = (outputs[index], dim)
    return True


def _operand_blocks(sharder: BlockRewriter, operands: list[Value]) -> dict[int, tuple]:
    """Operand position -> (block, dim): blocks as they are, and mirrored operands with a
    block operand's shape cut as it is (the accumulated gradient beside the gradient)."""
    split = {k: sharder.blocks[v] for k, v in enumerate(operands) if v in sharder.blocks}
    dims = {v.shape: sharder.blocks[v][1] for v in operands if v in sharder.blocks}
    for k, value in enumerate(operands):
        dim = dims.get(value.shape)
        if k not in split and dim is not None and not value.varying_axes and value.shape:
            split[k] = (sharder.slice(value, dim), dim)
    return split


def _rewrite_branch(sharder: BlockRewriter, region: Graph, split: dict) -> dict[int, int]:
    """The branch on its blocks (each defined again by a deferred gather, so the rewrite
    gathers only where something reads it whole); returns the outputs left as blocks."""
    prologue = []
    for k, (_, dim) in sorted(split.items()):
        whole = region.inputs[k]
        region.inputs[k] = block = sharder.block_of(whole, dim)
        attrs = {"axes": sharder.axes, "dimension": dim, DEFERRED: True}
        prologue.append(Node("all_gather", [block], [whole], attrs, created_by=sharder.created_by))
    region.nodes[:0] = prologue
    inner = type(sharder)(sharder.axes, sharder.mesh_axes, sharder.created_by)
    returned = inner.rewrite_region(region, range(len(region.outputs)))
    for key in ("sharded_gradients", "replicated_gradients", "gathered_for_ops"):
        sharder.stats[key] += inner.stats[key]
    sharder.stats["gathered"] += inner.stats["gathered"]
    sharder.remarks.extend(inner.remarks)
    return returned


def _gather_into(sharder: BlockRewriter, region: Graph, index: int, whole: Value, dim: int) -> None:
    block = region.outputs[index]
    attrs = {"axes": sharder.axes, "dimension": dim}
    region.nodes.append(Node("all_gather", [block], [whole], attrs, created_by=sharder.created_by))
    region.outputs[index] = whole
