"""Where a graph's inputs and outputs live: their `shard_map` specs and global shardings
(split batches, stacked per-replica values, mirrored values whole or held split)."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_strategies.passes.ir.graph import Graph, Split, Value


def replica_spec(mesh: Mesh) -> PartitionSpec:
    """Dim 0 split (or stacked) over all of `mesh`'s axes: a per-replica value's spec."""
    axes = tuple(mesh.axis_names)
    return PartitionSpec(axes if len(axes) > 1 else axes[0])


def value_spec(value: Value, mesh: Mesh, split: Split | None = None) -> PartitionSpec:
    """The `shard_map` spec of a graph input or output: varying values are split (or
    stacked) on dim 0 over the replica axes; a value held sharded is split on its dimension
    over its axes, in its order; invariant ones are whole."""
    if split is not None:
        return split_spec(split, mesh, mesh)
    return replica_spec(mesh) if value.varying_axes else PartitionSpec()


def split_spec(split: Split, graph_mesh: Mesh, mesh: Mesh) -> PartitionSpec:
    """The spec of a `Split` value on `mesh`, a mesh over the same devices as the graph's
    whose axes may carry other names (the sharded mesh's `sharded:` prefix)."""
    names = dict(zip(graph_mesh.axis_names, mesh.axis_names, strict=True))
    axes = tuple(names[a] for a in split.axes)
    return PartitionSpec(*[None] * split.dim, axes if len(axes) > 1 else axes[0])


def input_shardings(
    graph: Graph, mesh: Mesh, stacked_mesh: Mesh | None = None, sharded_mesh: Mesh | None = None
) -> list[Any]:
    """The global sharding of each graph input: stacked inputs live on `stacked_mesh`,
    inputs held sharded on `sharded_mesh`, the rest on `mesh`."""
    meshes = (mesh, stacked_mesh, sharded_mesh)
    return [
        _global_sharding(v, a.stacked, a.sharded, meshes)
        for v, a in zip(graph.inputs, graph.io.inputs, strict=True)
    ]


def output_shardings(
    graph: Graph, mesh: Mesh, stacked_mesh: Mesh | None = None, sharded_mesh: Mesh | None = None
) -> list[Any]:
    """The global sharding of each graph output: varying outputs come back stacked, those
    the graph holds sharded come back sharded."""
    meshes = (mesh, stacked_mesh, sharded_mesh)
    return [
        _global_sharding(v, comes_back_stacked(graph, i), graph.io.outputs[i].sharded, meshes)
        for i, v in enumerate(graph.outputs)
    ]


def comes_back_stacked(graph: Graph, index: int) -> bool:
    return bool(graph.outputs[index].varying_axes) and graph.io.outputs[index].sharded is None


def _global_sharding(
    value: Value, stacked: bool, split: Split | None, meshes: tuple[Mesh, ...]
) -> NamedSharding:
    mesh, stacked_mesh, sharded_mesh = meshes
    if stacked:
        target = stacked_mesh or mesh
        return NamedSharding(target, replica_spec(target))
    if split is not None:
        target = sharded_mesh or mesh
        return NamedSharding(target, split_spec(split, mesh, target))
    return NamedSharding(mesh, value_spec(value, mesh))
