"""How one leaf of a restore target is read from a checkpoint: the shape, dtype and
sharding to read, and what to make of the array read (kept, or per-replica values folded
into their mean)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from xla_strategies.core.layout import Layout, fold_stacked
from xla_strategies.runtime.checkpoint_tree import CheckpointError, normalized

if TYPE_CHECKING:
    from xla_strategies.core.strategy_like import StrategyLike


def restore_plan(
    strategy: StrategyLike, path: Any, leaf: Any, layout: dict[str, Any]
) -> tuple[Any, Any]:
    """How to restore one leaf: what to read (shape, dtype, sharding) and what to make
    of it. A stacked leaf restores as it is into a stacked target of the saved replica
    count; otherwise its replicas' mean is every replica's value."""
    state = strategy.state_sharding()
    keep = lambda value: value  # noqa: E731
    if list(normalized(path)) not in layout.get("stacked", []):
        # optimizer state a step holds sharded is read straight into its blocks
        sharding = leaf.sharding if strategy.is_held_sharded(leaf) else state
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), keep
    saved_replicas = layout["replicas"]
    stacked = strategy.layout(leaf) is Layout.STACKED
    per_replica = leaf.shape[1:] if stacked else leaf.shape
    if stacked and leaf.shape[0] == saved_replicas:
        sharding = strategy.stacked_sharding()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), keep
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        raise CheckpointError(
            f"{jax.tree_util.keystr(path)} was saved per replica ({saved_replicas} "
            f"values of {leaf.dtype}), and integer values have no mean to restore "
            f"into one value or another replica count; restore it into a stacked "
            f"target under {saved_replicas} replicas"
        )
    target_sharding = strategy.stacked_sharding() if stacked else state

    def aggregate(value: jax.Array) -> jax.Array:
        mean = fold_stacked(value, jax.tree_util.keystr(path))
        if stacked:
            mean = jnp.broadcast_to(mean, leaf.shape)
        return jax.device_put(mean, target_sharding)

    raw = (saved_replicas, *per_replica)
    return jax.ShapeDtypeStruct(raw, leaf.dtype, sharding=state), aggregate
