"""Block collectives in a program that is manual over the replica axes only.

With a model axis (a replica spanning several devices) the program is a `shard_map` manual
over the replica axes, and XLA's SPMD partitioner lays values out over the model axis. Its
partitioner keeps an all-reduce's operand split over the model axis, but gives a
reduce-scatter or an all-gather over the replica axes an operand whole over it: it first
gathers the operand over the model axis. Measured on JAX 0.12 (CPU and XLA's GPU and TPU
compilers): a [1024, 1024] value split over a model axis of 2 went through an all-gather
of the whole value on every device before each of them. For state held split over both
(FSDP x tensor parallel) that gathers every weight whole on every device of a replica.

So in such a program the two are written as all-reduces, which XLA keeps split: an
all-gather is a sum of the blocks, each placed at its offset in zeros, and a reduce-scatter
is the sum's block. Each moves twice the bytes of the collective it stands for over the
replica axes, and never the whole value over the model axis.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax


def is_partial_manual() -> bool:
    """Whether the program being traced leaves some mesh axes to XLA's partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", None)
    return manual is not None and len(manual) < len(mesh.axis_names)


def all_gather_by_sum(block: Any, axes: tuple[str, ...], dim: int, parts: int) -> Any:
    """`lax.all_gather(block, axes, axis=dim, tiled=True)`, as a sum over `axes`."""
    shape = list(block.shape)
    shape[dim] *= parts
    placed = lax.dynamic_update_slice_in_dim(
        jax.numpy.zeros(shape, block.dtype), block, lax.axis_index(axes) * block.shape[dim], dim
    )
    return lax.psum(placed, axes)


def reduce_scatter_by_sum(x: Any, axes: tuple[str, ...], dim: int, parts: int) -> Any:
    """`lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)`, as a sum's block."""
    size = x.shape[dim] // parts
    return lax.dynamic_slice_in_dim(lax.psum(x, axes), lax.axis_index(axes) * size, size, dim)
