"""Arithmetic of a mirrored value split into one block per replica along a dimension, as
weight-update sharding holds it: which dimension, the block's shape, and which ops give a
block when run on blocks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from xla_strategies.passes.ir.graph import DEFERRED, Graph, Node, Value
from xla_strategies.passes.ir.traits import Trait


def shard_dimension(shape: tuple[int, ...], replicas: int) -> int | None:
    """The dimension a tensor's update is split on: the first that divides by `replicas`
    (a block is contiguous when every dimension before it is 1; combine-all-reduces
    transposes the others); None if none does."""
    candidates = [d for d in range(len(shape)) if divides(shape, d, replicas)]
    return candidates[0] if candidates else None


def without(shape: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    """`shape` with dimension `dim` counted as size 0: never split (a stack's layers)."""
    return shape if dim is None else (*shape[:dim], 0, *shape[dim + 1 :])


def divides(shape: tuple[int, ...], dim: int | None, replicas: int) -> bool:
    """Whether dimension `dim` of `shape` splits into `replicas` equal, non-empty blocks."""
    return dim is not None and shape[dim] >= replicas and shape[dim] % replicas == 0


def block_shape(shape: tuple[int, ...], dim: int, replicas: int) -> tuple[int, ...]:
    return (*shape[:dim], shape[dim] // replicas, *shape[dim + 1 :])


def block_value(full: Value, dim: int, replicas: int, axes: Iterable[str]) -> Value:
    """The value of one replica's block of `full`, split on `dim` over `axes`."""
    shape = block_shape(full.shape, dim, replicas)
    return full.like(shape=shape, varying_axes=full.varying_axes | frozenset(axes))


def sinks_to_blocks(node: Node, value: Value) -> bool:
    """Whether `node`, which computes the whole mirrored `value`, gives its block when run
    on blocks: elementwise over operands of `value`'s shape and scalars, or a scalar
    broadcast."""
    if len(node.outputs) != 1 or value.varying_axes or node.regions:
        return False
    if node.has(Trait.BROADCAST_IN_DIM):
        return node.inputs[0].shape == ()
    return node.has(Trait.ELEMENTWISE) and all(
        not x.varying_axes and x.shape in ((), value.shape) for x in node.inputs
    )


def unit_reshape_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """Where dimension `dim` of `src` lands in `dst`, for a reshape that only adds or drops
    unit dimensions; None for any other reshape."""
    kept_src = [d for d, n in enumerate(src) if n != 1]
    kept_dst = [d for d, n in enumerate(dst) if n != 1]
    if [src[d] for d in kept_src] != [dst[d] for d in kept_dst] or dim not in kept_src:
        return None
    return kept_dst[kept_src.index(dim)]


class BlockRewriter(Protocol):
    """What a rewrite of nested regions on blocks (`branch_blocks`) needs of the rewriter
    that found them (`block_sharder.BlockSharder`): its blocks so far, and a fresh rewriter
    of the same kind for each region (`type(rewriter)(axes, mesh_axes, created_by)`)."""

    axes: list[str]
    mesh_axes: Mapping[str, int]
    created_by: str
    blocks: dict[Value, tuple[Value, int]]
    nodes: list[Node]
    stats: dict[str, Any]
    remarks: list[str]

    def block_of(self, full: Value, dim: int) -> Value: ...
    def slice(self, value: Value, dim: int) -> Value: ...
    def rewrite_region(self, graph: Graph, returnable: range) -> dict[int, int]: ...


def held_dims_by_shape(graph: Graph, attr: str) -> dict[tuple[int, ...], int]:
    """A dimension of the parameters `graph` gathers from blocks (the deferred gathers
    shard-parameters leaves), by shape: the one the model axis splits (`model_dim`), or
    the one the blocks are split on (`dimension`), which a gradient's blocks then share. A
    gradient inside a loop body has no parameter name, but has its parameter's shape. A
    shape two parameters split on different dimensions says nothing."""
    found: dict[tuple[int, ...], set[int]] = {}
    for node in graph.nodes:
        if node.op == "all_gather" and node.attrs.get(DEFERRED) and attr in node.attrs:
            found.setdefault(node.outputs[0].shape, set()).add(node.attrs[attr])
    return {shape: dims.pop() for shape, dims in found.items() if len(dims) == 1}
