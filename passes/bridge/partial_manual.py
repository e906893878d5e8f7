"""Block collectives in a program that is manual over the replica axes only.

With a model axis (a replica spanning several devices) the program is a `shard_map` manual
over the replica axes, and XLA's SPMD partitioner lays values out over the model axis. Its
partitioner keeps an all-reduce's operand split over the model axis, but gives a
reduce-scatter or an all-gather over the replica axes an operand whole over it: it first
gathers the operand over the model axis. Measured on JAX 0.12 (CPU and XLA's GPU and TPU
compilers): a [1024, 1024] value split over a model axis of 2 went through an all-gather
of the whole value on every device before each of them. For state held split over both
(FSDP x tensor parallel) that gathers every weight whole on every device of a replica.

So in such a program the two are written where XLA's partitioner does not reach them:
- Where the IR knows the dimension the model axis splits the value on (`model_dim`: a
  parameter or its gradient), inside a region manual over the model axis too, its blocks
  split there on the way in and out. XLA then compiles the collective the IR asked for, on
  each device's part. On Llama-2-70B on v5p-512 with tensor parallelism over 4 chips, the
  replica-axis gathers run as gathers of those parts, not as all-reduces of twice the bytes
  (`benchmarks/HISTORY.md`, 2026-11-27).
- Elsewhere, as all-reduces, which XLA keeps split: an all-gather is a sum of the blocks,
  each placed at its offset in zeros, and a reduce-scatter is the sum's block. Each moves
  twice the bytes of the collective it stands for over the replica axes, and never the
  whole value over the model axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec

from xla_strategies.core.layout import MODEL_AXIS


def is_partial_manual() -> bool:
    """Whether the program being traced leaves some mesh axes to XLA's partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", None)
    return manual is not None and len(manual) < len(mesh.axis_names)


def all_gather(
    block: Any, axes: tuple[str, ...], dim: int, parts: int, model_dim: int | None
) -> Any:
    """`lax.all_gather(block, axes, axis=dim, tiled=True)` of one of `parts` blocks: on each
    device's part where the model axis splits `block` on `model_dim`, else as a sum."""
    gathered = _on_model_parts(
        lambda part: lax.all_gather(part, axes, axis=dim, tiled=True), block, dim, model_dim
    )
    return _all_gather_by_sum(block, axes, dim, parts) if gathered is None else gathered


def reduce_scatter(
    x: Any, axes: tuple[str, ...], dim: int, parts: int, model_dim: int | None
) -> Any:
    """`lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)` into `parts` blocks: on
    each device's part where the model axis splits `x` on `model_dim`, else as a sum's
    block."""
    scattered = _on_model_parts(
        lambda part: lax.psum_scatter(part, axes, scatter_dimension=dim, tiled=True),
        x,
        dim,
        model_dim,
    )
    return _reduce_scatter_by_sum(x, axes, dim, parts) if scattered is None else scattered


def _all_gather_by_sum(block: Any, axes: tuple[str, ...], dim: int, parts: int) -> Any:
    """`lax.all_gather(block, axes, axis=dim, tiled=True)`, as a sum over `axes`."""
    shape = list(block.shape)
    shape[dim] *= parts
    placed = lax.dynamic_update_slice_in_dim(
        jax.numpy.zeros(shape, block.dtype), block, lax.axis_index(axes) * block.shape[dim], dim
    )
    return lax.psum(placed, axes)


def _reduce_scatter_by_sum(x: Any, axes: tuple[str, ...], dim: int, parts: int) -> Any:
    """`lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)`, as a sum's block."""
    size = x.shape[dim] // parts
    return lax.dynamic_slice_in_dim(lax.psum(x, axes), lax.axis_index(axes) * size, size, dim)


def _on_model_parts(
    collective: Callable[[Any], Any], x: Any, dim: int, model_dim: int | None
) -> Any | None:
    """`collective(x)` run manual over the mesh's remaining (model) axes too, on each
    device's part of `x` split over them on `model_dim`, and its result split there; None
    where `model_dim` is unknown, is the collective's own dimension, or does not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    model = tuple(a for a in mesh.axis_names if a == MODEL_AXIS and a not in mesh.manual_axes)
    parts = math.prod(mesh.shape[a] for a in model)
    if not model or model_dim is None or model_dim == dim or x.shape[model_dim] % parts:
        return None
    spec = PartitionSpec(*[model if i == model_dim else None for i in range(x.ndim)])
    return jax.shard_map(
        collective, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=set(model), check_vma=False
    )(x)
