"""The mesh a step's own code sees, and a clear error for a layout on any other.

A library that lays out its activations with `NamedSharding`s on a mesh it is handed
(MaxText's model takes one) must be handed the mesh the step is traced on: its replica
axes manual, a model axis (if any) left to XLA's partitioner. A sharding on that mesh
that names no replica axis is exactly the replica's own value, so the library's layout
means within a replica what it means on one device. A sharding on a mesh of the
library's own making fails deep in JAX's tracing, with a message that names neither the
step nor what to do; `diagnose_foreign_mesh` says both."""

from __future__ import annotations

from jax.sharding import AxisType, Mesh

from xla_strategies.core.layout import replica_axes

# What JAX says when a value is laid out on another mesh than the one it is traced on
# (JAX 0.10 and 0.12: a constraint's, then an operation's `out_sharding=`).
_FOREIGN_MESH = ("use_abstract_mesh cannot change", "should match the mesh of sharding")


class ForeignMeshError(ValueError):
    """The step lays out a value on a mesh other than the one its replicas run on."""


def replica_view(mesh: Mesh) -> Mesh:
    """`mesh` as the step sees it: the same devices and axes, the replica axes manual."""
    manual = set(replica_axes(mesh.axis_names))
    types = tuple(
        AxisType.Manual if axis in manual else kind
        for axis, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
    )
    return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def diagnose_foreign_mesh(step: str, mesh: Mesh, original: Exception) -> None:
    """Raise `ForeignMeshError` if `original` is JAX refusing a layout on a foreign mesh;
    return quietly when it is something else."""
    if not any(text in str(original) for text in _FOREIGN_MESH):
        return
    shape = ", ".join(f"{a!r}: {n}" for a, n in mesh.shape.items())
    raise ForeignMeshError(
        f"step {step!r} lays out a value with a sharding on a mesh of its own, but its "
        f"replicas are traced on the strategy's mesh ({{{shape}}}, replica axes manual). "
        "Hand the library that builds the sharding `xs.get_replica_context().mesh` from "
        "inside the step (a sharding there that names no replica axis is the replica's "
        f"whole value). JAX said: {str(original).splitlines()[0]}"
    ) from original
