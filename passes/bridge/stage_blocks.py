"""A pipeline's layer stack held in blocks over the replicas of each stage (FSDP within a
stage, `compile(shard_parameters=True)` with `pipeline_stages`).

The stage program takes this replica's block of each stacked weight (`replica_block`),
gathers a layer where a tick reads it (`gathered`; JAX's transpose of that gather
reduce-scatters the layer's gradient into the block), and the stack's gradient leaves as
its blocks' gather (`whole`). Each is traced in a named scope the importer reads:
shard-parameters holds the stack as those blocks between steps and drops the slice, and
the update runs on the gradient's blocks, so no stack is ever whole on a device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xla_strategies.passes.bridge.trace_hooks import (
    AUTODIFF_SCOPE,
    REPLICA_BLOCK_SCOPE,
    STAGE_SPLIT_SCOPE,
)
from xla_strategies.passes.rewrites.blocks import shard_dimension, without


def block_dims(axes: tuple[str, ...], stacks: list[Any], stacked: bool = True) -> list[int | None]:
    """Per stacked weight, the dimension its blocks over the replica `axes` split: the
    first besides the layer dimension that divides by their replicas, shard-parameters'
    rule for a stack, so its optimizer moments line up; None: held whole (no dimension
    divides, one replica, or a stack with no gradient: integers, keys). With
    `stacked=False`, for weights that are not stacks (the head's): the first that divides."""
    mesh = jax.sharding.get_abstract_mesh()
    count = int(np.prod([mesh.shape[a] for a in axes]))
    return [
        shard_dimension(without(jnp.shape(x), 0 if stacked else None), count)
        if count > 1 and jnp.issubdtype(jnp.result_type(x), jnp.floating)
        else None
        for x in stacks
    ]


def scattered(gradient: Any, dim: int | None, axes: tuple[str, ...]) -> Any:
    """A replica's whole gradient of a weight held in blocks on `dim`, summed over the
    replicas of `axes` into this replica's block: a reduce-scatter, so the sum is never
    whole on a device (`whole` then marks it for shard-parameters)."""
    if dim is None or gradient is None:
        return gradient
    with jax.named_scope(AUTODIFF_SCOPE):
        return jax.lax.psum_scatter(gradient, axes, scatter_dimension=dim, tiled=True)


def _block_scope(axes: tuple[str, ...]) -> Any:
    return jax.named_scope(f"{REPLICA_BLOCK_SCOPE}({','.join(axes)})")


def replica_block(x: Any, dim: int, axes: tuple[str, ...]) -> Any:
    """This replica's block of the mirrored stack `x` on `dim`, numbered over `axes` as
    tiled collectives number them (the importer reads it as shard-parameters' slice)."""
    with _block_scope(axes):
        size = x.shape[dim] // jax.lax.axis_size(axes)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, dim)


def gathered(block: Any, dim: int | None, axes: tuple[str, ...], read_as: Any = None) -> Any:
    """One layer of a stack held in blocks (`dim`: the stack's), gathered whole; as
    `read_as` where the layer reads it only as that narrower type (the values it sees are
    the same), so the gather and its transpose, the gradient's reduce-scatter, move that
    type."""
    if dim is None:
        return block
    if read_as is None:
        return jax.lax.all_gather(block, axes, axis=dim - 1, tiled=True)
    narrow = jax.lax.all_gather(block.astype(read_as), axes, axis=dim - 1, tiled=True)
    return narrow.astype(block.dtype)


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
