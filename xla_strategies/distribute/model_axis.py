"""The model axis of a strategy whose replicas span several devices.

tf.distribute's TPUStrategy gives a replica several cores through its device assignment
(`num_cores_per_replica`), "logical devices" that a step lays a tensor out on. Here the
same is a trailing mesh axis, `MODEL_AXIS`, of the devices one replica spans. They are cut
from the mesh's fastest axis (the last: a torus axis inside a slice, the GPUs of a node),
so the collectives XLA's partitioner adds inside a replica run over the fastest links.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_strategies.core.layout import (
    MODEL_AXIS,
    STAGE_AXIS,
    checked_devices_per_replica,
    model_dim,
)
from xla_strategies.core.trees import is_function_leaf


def with_model_axis(
    devices: np.ndarray, axis_names: tuple[str, ...], devices_per_replica: int
) -> tuple[np.ndarray, tuple[str, ...]]:
    """`devices` (one dimension per axis name) with a trailing model axis of
    `devices_per_replica` neighbours on the last axis; unchanged for 1."""
    last, size = axis_names[-1], devices.shape[-1]
    k = checked_devices_per_replica(devices_per_replica, last, size)
    if k == 1:
        return devices, axis_names
    if MODEL_AXIS in axis_names:
        raise ValueError(f"the mesh already has a {MODEL_AXIS!r} axis: {list(axis_names)}")
    shape = (*devices.shape[:-1], size // k, k)
    return devices.reshape(shape), (*axis_names, MODEL_AXIS)


def with_stage_axis(
    devices: np.ndarray, axis_names: tuple[str, ...], stages: int
) -> tuple[np.ndarray, tuple[str, ...]]:
    """`devices` with a stage axis of `stages` cut from the slowest (first) axis: across
    slices over DCN first, then across hosts, so stages pass activations over the slow
    links and replicas keep the fast ones; unchanged for 1. The axis is named after the
    replica axes (before a model axis): a program manual over the replica axes and then
    the stage axis lists its manual axes in the mesh's order, as XLA's partitioner
    requires where a model axis is left to it (out of order, it aborts the process)."""
    if isinstance(stages, bool) or not isinstance(stages, int | np.integer) or stages < 1:
        raise ValueError(f"pipeline_stages must be a positive int, not {stages!r}")
    if stages == 1:
        return devices, axis_names
    first, size = axis_names[0], devices.shape[0]
    if size % stages:
        raise ValueError(
            f"pipeline_stages={stages} does not divide the mesh's slowest axis {first!r} "
            f"({size} of {devices.size} devices); use a divisor of {size}"
        )
    cut = devices.reshape(stages, size // stages, *devices.shape[1:])
    at = axis_names.index(MODEL_AXIS) if MODEL_AXIS in axis_names else len(axis_names)
    names = (*axis_names[:at], STAGE_AXIS, *axis_names[at:])
    return np.moveaxis(cut, 0, at), names


class UnmappedLogicalNames(NamedTuple):
    """A flax linen box's logical axis names with no rules in scope to map them to mesh
    axes: flax would leave the value whole, silently."""

    names: tuple


def declared_model_dims(tree: Any) -> list[int | None | UnmappedLogicalNames]:
    """Per leaf of `tree` (in `jax.tree.leaves` order), the dimension its flax linen
    annotation splits over the model axis (`nn.with_partitioning`, or
    `nn.with_logical_partitioning` under its logical axis rules), or None; the names,
    `UnmappedLogicalNames`, where no rules are in scope to map them."""
    meta = sys.modules.get("flax.core.meta")  # only a tree flax made can hold its boxes
    if meta is None:
        return [None] * len(jax.tree.leaves(tree))
    dims: list[int | None | UnmappedLogicalNames] = []
    for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)):
        if isinstance(node, meta.Partitioned):
            axes = _mesh_axes(node)
            dim = axes if isinstance(axes, UnmappedLogicalNames) else model_dim(axes)
            dims += [dim] * len(jax.tree.leaves(node))
        else:
            dims += [None] * len(jax.tree.leaves(node))
    return dims


def _mesh_axes(box: Any) -> tuple | UnmappedLogicalNames:
    """A linen box's names as mesh axes: logical names through their rules (the box's
    own, else those `nn.logical_axis_rules` puts in scope)."""
    logical = getattr(sys.modules.get("flax.linen.spmd"), "LogicallyPartitioned", ())
    if logical and isinstance(box, logical):
        from flax import linen

        rules = box.rules or linen.get_logical_axis_rules()
        if not rules and any(isinstance(name, str) for name in box.names):
            return UnmappedLogicalNames(tuple(box.names))
        return tuple(linen.logical_to_mesh_axes(box.names, rules))
    return tuple(box.names)


def state_shardings(
    tree: Any, mesh: Mesh, model_dim_of: Callable[[Any], int | None]
) -> Iterator[NamedSharding]:
    """Where each array of `tree` (function leaves skipped) is kept as state: split over
    the model axis as flax linen annotates it or as it already is (`model_dim_of`), whole
    otherwise. Raises where a leaf has logical axis names that no rules map, and is not
    split already: it would be kept whole, and its update would not line up with its
    parameter's."""
    paths = jax.tree_util.tree_leaves_with_path(tree)
    for dim, (path, leaf) in zip(declared_model_dims(tree), paths, strict=True):
        if is_function_leaf(leaf):
            continue
        unmapped = dim if isinstance(dim, UnmappedLogicalNames) else None
        dim = model_dim_of(leaf) if dim is None or unmapped else dim
        if unmapped and dim is None:
            raise ValueError(
                f"replicate(tree): tree{jax.tree_util.keystr(path)} has flax logical axis "
                f"names {unmapped.names} but no logical axis rules are in scope to map "
                "them to the mesh; call replicate inside `nn.logical_axis_rules(rules)`, "
                "the rules the step applies the model under"
            )
        spec = PartitionSpec() if dim is None else PartitionSpec(*[None] * dim, MODEL_AXIS)
        yield NamedSharding(mesh, spec)


@contextlib.contextmanager
def scope_with_mesh(scope: Any, mesh: Mesh) -> Iterator[Any]:
    """`scope`, and inside it `mesh` as JAX's mesh context; yields what `scope` yields.
    `jax.set_mesh` sets the mesh when called, so it is called only once `scope` is in."""
    with scope as entered, jax.set_mesh(mesh):
        yield entered
