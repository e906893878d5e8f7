"""Where a graph's inputs and outputs live: their `shard_map` specs and global shardings
(split batches, stacked per-replica values, mirrored values whole or held split).

A mesh may have a model axis (`MODEL_AXIS`): a replica spans its devices, the `shard_map`
is manual over the replica axes only, and a mirrored value's `model_dim` (from the
interface) is the dimension it is split on over the model axis between steps."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_strategies.core.layout import MODEL_AXIS, STAGE_AXIS, replica_axes
from xla_strategies.passes.ir.graph import Graph, Node, Origin, Split, Value


def replica_spec(mesh: Mesh) -> PartitionSpec:
    """Dim 0 split (or stacked) over `mesh`'s replica axes: a per-replica value's spec."""
    axes = replica_axes(mesh.axis_names)
    return PartitionSpec(axes if len(axes) > 1 else axes[0])


def manual_over(mesh: Mesh) -> dict[str, Any]:
    """`shard_map`'s keywords for `mesh`: manual over the replica axes only
    (`axis_names`) where it has a model axis; none otherwise, so such a program is built
    as it always was."""
    axes = replica_axes(mesh.axis_names)
    return {"axis_names": frozenset(axes)} if len(axes) < len(mesh.axis_names) else {}


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


def _with_model_split(
    spec: PartitionSpec, model_dim: int | None, mesh: Mesh, block: tuple[int, ...]
) -> PartitionSpec:
    """`spec` (over replica axes) also split over `mesh`'s model axis on `model_dim`: on a
    dimension the replicas split too, each replica's block is split further. A replica's
    `block` whose dimension does not divide by the model axis stays whole over it."""
    if model_dim is None:
        return spec
    name = next(a for a in mesh.axis_names if str(a).rpartition(":")[2] == MODEL_AXIS)
    if block[model_dim] % mesh.shape[name]:
        return spec
    entries = list(spec) + [None] * (model_dim + 1 - len(spec))
    held = entries[model_dim]
    held = () if held is None else held if isinstance(held, tuple) else (held,)
    entries[model_dim] = (*held, name) if held else name
    return PartitionSpec(*entries)


def input_shardings(
    graph: Graph, mesh: Mesh, stacked_mesh: Mesh | None = None, sharded_mesh: Mesh | None = None
) -> list[Any]:
    """The global sharding of each graph input: stacked inputs live on `stacked_mesh`,
    inputs held sharded on `sharded_mesh`, the rest on `mesh`."""
    meshes = (mesh, stacked_mesh, sharded_mesh)
    return [
        _global_sharding(v, a.stacked, a.sharded, a.model_dim, meshes, a.stage_split)
        for v, a in zip(graph.inputs, graph.io.inputs, strict=True)
    ]


def output_shardings(
    graph: Graph, mesh: Mesh, stacked_mesh: Mesh | None = None, sharded_mesh: Mesh | None = None
) -> list[Any]:
    """The global sharding of each graph output: varying outputs come back stacked, those
    the graph holds sharded come back sharded."""
    meshes = (mesh, stacked_mesh, sharded_mesh)
    return [
        _global_sharding(
            v, comes_back_stacked(graph, i), a.sharded, a.model_dim, meshes, a.stage_split
        )
        for i, (v, a) in enumerate(zip(graph.outputs, graph.io.outputs, strict=True))
    ]


def comes_back_stacked(graph: Graph, index: int) -> bool:
    return bool(graph.outputs[index].varying_axes) and graph.io.outputs[index].sharded is None


def _global_sharding(
    value: Value,
    stacked: bool,
    split: Split | None,
    model_dim: int | None,
    meshes: tuple[Mesh, ...],
    stage_split: bool = False,
) -> NamedSharding:
    mesh, stacked_mesh, sharded_mesh = meshes
    if stacked:
        target = stacked_mesh or mesh
        return NamedSharding(target, replica_spec(target))
    if split is not None:
        target = sharded_mesh or mesh
        held = split_spec(split, mesh, target)
        held = _with_model_split(held, model_dim, target, value.shape)
        return NamedSharding(target, _with_stage_split(held, target) if stage_split else held)
    spec = _with_model_split(value_spec(value, mesh), model_dim, mesh, value.shape)
    return NamedSharding(mesh, _with_stage_split(spec, mesh) if stage_split else spec)


def _with_stage_split(spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """`spec` of a stacked layer weight a pipeline holds split over `mesh`'s stage axis on
    its layer dimension (0): each stage its layers, in blocks over the replicas where the
    weight is held so."""
    name = next(a for a in mesh.axis_names if str(a).rpartition(":")[2] == STAGE_AXIS)
    if not spec:
        return PartitionSpec(name)
    return PartitionSpec(name, *spec[1:]) if spec[0] is None else spec


def mark_model_dims(graph: Graph) -> None:
    """Give each autodiff reduction of a parameter split over the model axis its
    `model_dim`: the gradient is laid out as its parameter, and a pass that splits it over
    the replicas must pick another dimension. The parameter is the input its `param`
    attribute names, or else the reduction reads or feeds a sharding constraint that
    splits the model axis (autodiff's transpose of the parameter's own constraint, as
    flax's `nn.with_partitioning` writes it): two parameters of one shape split on
    different dimensions (Megatron's q and o projections) are told apart so."""
    dims = {
        v.name: a.model_dim
        for v, a in zip(graph.inputs, graph.io.inputs, strict=True)
        if a.model_dim is not None
    }
    for region in graph.graphs():
        constrained = any(_model_dim_of_constraint(n) is not None for n in region.nodes)
        producers, users = (region.producers(), region.users()) if constrained else ({}, {})
        for node in region.nodes:
            if node.op != "all_reduce" or node.attrs.get("origin") is not Origin.AUTODIFF:
                continue
            if node.attrs.get("param") in dims:
                node.attrs["model_dim"] = dims[node.attrs["param"]]
            elif (dim := _constrained_model_dim(node, producers, users)) is not None:
                node.attrs["model_dim"] = dim


def _constrained_model_dim(
    node: Node, producers: dict[Value, Node], users: dict[Value, list[Node]]
) -> int | None:
    """The model axis's dimension of the one sharding constraint `node` reads or feeds."""
    near = [producers.get(v) for v in node.inputs] + users.get(node.outputs[0], [])
    dims = {_model_dim_of_constraint(n) for n in near if n is not None} - {None}
    return dims.pop() if len(dims) == 1 else None


def _model_dim_of_constraint(node: Node) -> int | None:
    return node.attrs.get("model_dim") if node.op == "jax.sharding_constraint" else None
