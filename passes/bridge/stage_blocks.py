"""A pipeline's layer stack held in blocks over the replicas of each stage (FSDP within a
stage, `compile(shard_parameters=True)` with `pipeline_stages`).

The stage program takes this replica's block of each stacked weight (`replica_block`),
gathers a layer where a tick reads it (`gathered`; JAX's transpose of that gather
reduce-scatters the layer's gradient into the block), and the stack's gradient leaves as
its blocks' gather (`whole`). Each is traced in a named scope the importer reads:
shard-parameters holds the stack as those blocks between steps and drops the slice, and
the update runs on the gradient's blocks, so no stack is ever whole on a device.

With a model axis inside each stage (`logical_devices_per_replica`), a stacked weight the
model axis splits keeps its blocks off that dimension, and its gathers and scatters run on
each device's part (`partial_manual`): XLA's partitioner would first gather the layer
whole over the model axis. The trace learns each step argument's model dimension from the
step's interface (`split_over_the_model_axis`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xla_strategies.passes.bridge import partial_manual
from xla_strategies.passes.bridge.trace_hooks import (
    AUTODIFF_SCOPE,
    REPLICA_BLOCK_SCOPE,
    STAGE_SPLIT_SCOPE,
)
from xla_strategies.passes.rewrites.blocks import shard_dimension, without

_model_dims = threading.local()  # id of a step argument -> the dim the model axis splits


@contextlib.contextmanager
def split_over_the_model_axis(arguments: Sequence[Any], dims: Sequence[int | None]) -> Iterator:
    """While a step is traced on `arguments`, the dimension the model axis splits each on
    (`dims`, None: whole over it), read back by `model_dim_of`."""
    known = {id(a): d for a, d in zip(arguments, dims, strict=True) if d is not None}
    saved = getattr(_model_dims, "by_id", {})
    _model_dims.by_id = {**saved, **known}
    try:
        yield
    finally:
        _model_dims.by_id = saved


def model_dim_of(x: Any) -> int | None:
    """The dimension the model axis splits the step argument `x` on; None for a value
    that is not one, or is whole over it."""
    return getattr(_model_dims, "by_id", {}).get(id(x))


def block_dims(
    axes: tuple[str, ...],
    stacks: list[Any],
    stacked: bool = True,
    model_dims: Sequence[int | None] | None = None,
) -> list[int | None]:
    """Per stacked weight, the dimension its blocks over the replica `axes` split: the
    first besides the layer dimension (and the one the model axis splits, `model_dims`)
    that divides by their replicas, shard-parameters' rule for a stack, so its optimizer
    moments line up; None: held whole (no dimension divides, one replica, or a stack with
    no gradient: integers, keys). With `stacked=False`, for weights that are not stacks
    (the head's): the first that divides."""
    mesh = jax.sharding.get_abstract_mesh()
    count = int(np.prod([mesh.shape[a] for a in axes]))
    model_dims = model_dims or [None] * len(stacks)
    return [
        shard_dimension(without(without(jnp.shape(x), 0 if stacked else None), m), count)
        if count > 1 and jnp.issubdtype(jnp.result_type(x), jnp.floating)
        else None
        for x, m in zip(stacks, model_dims, strict=True)
    ]


def scattered(
    gradient: Any, dim: int | None, axes: tuple[str, ...], model_dim: int | None = None
) -> Any:
    """A replica's whole gradient of a weight held in blocks on `dim`, summed over the
    replicas of `axes` into this replica's block: a reduce-scatter, so the sum is never
    whole on a device (`whole` then marks it for shard-parameters). Where the model axis
    splits the weight on `model_dim`, on each device's part."""
    if dim is None or gradient is None:
        return gradient
    with jax.named_scope(AUTODIFF_SCOPE):
        if model_dim is not None and partial_manual.is_partial_manual():
            parts = jax.lax.axis_size(axes)
            return partial_manual.reduce_scatter(gradient, axes, dim, parts, model_dim)
        return jax.lax.psum_scatter(gradient, axes, scatter_dimension=dim, tiled=True)


def _block_scope(axes: tuple[str, ...]) -> Any:
    return jax.named_scope(f"{REPLICA_BLOCK_SCOPE}({','.join(axes)})")


def replica_block(x: Any, dim: int, axes: tuple[str, ...]) -> Any:
    """This replica's block of the mirrored stack `x` on `dim`, numbered over `axes` as
    tiled collectives number them (the importer reads it as shard-parameters' slice)."""
    with _block_scope(axes):
        size = x.shape[dim] // jax.lax.axis_size(axes)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, dim)


def gathered(
    block: Any,
    dim: int | None,
    axes: tuple[str, ...],
    read_as: Any = None,
    model_dim: int | None = None,
) -> Any:
    """One layer of a stack held in blocks (`dim`: the stack's), gathered whole; as
    `read_as` where the layer reads it only as that narrower type (the values it sees are
    the same), so the gather and its transpose, the gradient's reduce-scatter, move that
    type. Where the model axis splits the stack on `model_dim`, on each device's part."""
    if dim is None:
        return block
    narrow = block if read_as is None else block.astype(read_as)
    if model_dim is not None and partial_manual.is_partial_manual():
        parts = jax.lax.axis_size(axes)
        layer = partial_manual.all_gather(narrow, axes, dim - 1, parts, model_dim - 1)
    else:
        layer = jax.lax.all_gather(narrow, axes, axis=dim - 1, tiled=True)
    return layer.astype(block.dtype)


def whole(block: Any, dim: int, axes: tuple[str, ...], replicas: frozenset[str]) -> Any:
    """A stack's gradient from its blocks, each summed across the replicas of `axes` by
    its layer's reduce-scatter, then across the other `replicas` (the slices, over which
    the blocks are replicated): whole, the same on every replica. Held in blocks by
    shard-parameters, it is gathered only where something reads it whole."""
    across = tuple(sorted(replicas - set(axes)))
    if across:
        with jax.named_scope(f"{AUTODIFF_SCOPE}/{STAGE_SPLIT_SCOPE}"):
            block = jax.lax.psum(block, across)
    with _block_scope(axes):
        return jax.lax.all_gather(block, axes, axis=dim, tiled=True, to="invarying")
