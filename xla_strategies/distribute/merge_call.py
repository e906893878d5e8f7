"""`ReplicaContext.merge_call(merge_fn, args)`: a cross-replica stretch inside a step.

tf.distribute pauses every replica thread, calls `merge_fn(strategy, *args)` once with the
arguments grouped per replica (`PerReplica` values), and hands the result back to each
replica. A compiled step is one SPMD program, so here every replica computes the same
merge: each per-replica (varying) argument is first gathered into a `[replicas, ...]`
array, identical on every replica, and `merge_fn` sees the strategy through
`CrossReplicaView`, whose `reduce`, `gather`, `experimental_local_results` and
`extended.reduce_to` read those arrays as per-replica values. Mirrored arguments pass as
they are. What `merge_fn` computes from them is mirrored; a per-replica argument it returns
unchanged goes back to each replica as that replica's own value, as tf regroups it.

The gather is a `psum` of each replica's value placed in its row of zeros (exact: x + 0 is
x), not an all-gather, so the result is typed the same on every replica and JAX lets the
step return it as mirrored. It shows in the IR as a user all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from xla_strategies.core.context import cross_replica_scope
from xla_strategies.core.reduce_op import ReduceOp, reduce_replicas
from xla_strategies.distribute.extended import StrategyExtended
from xla_strategies.passes.bridge.trace_hooks import varying_axes

if TYPE_CHECKING:
    from xla_strategies.core.context import ReplicaContext
    from xla_strategies.core.strategy_like import StrategyLike


def merge_call(
    strategy: StrategyLike,
    context: ReplicaContext,
    merge_fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> Any:
    if not callable(merge_fn):
        raise TypeError(f"merge_fn must be callable, got {type(merge_fn).__name__}")
    if context.num_replicas_in_sync == 1:
        with cross_replica_scope():  # one replica: its values are the per-replica values
            return merge_fn(strategy, *args, **kwargs)
    replica = context.replica_id_in_sync_group
    stacked: dict[int, Any] = {}

    def gather(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array) or not varying_axes(jax.typeof(leaf)):
            return leaf  # mirrored: the same on every replica already
        # stacked in replica order, each replica's bits (a psum of masked rows would add
        # +0.0 to every -0.0)
        whole = lax.all_gather(leaf, context.axis_names, to="invarying")
        stacked[id(whole)] = whole
        return whole

    args, kwargs = jax.tree.map(gather, (args, kwargs))
    view = CrossReplicaView(strategy, stacked)
    with cross_replica_scope():
        result = merge_fn(view, *args, **kwargs)

    def regroup(leaf: Any) -> Any:
        return leaf[replica] if id(leaf) in stacked and stacked[id(leaf)] is leaf else leaf

    return jax.tree.map(regroup, result)


class CrossReplicaView:
    """The strategy as `merge_fn` sees it: the gathered `[replicas, ...]` arrays are
    per-replica values; everything else is asked of the strategy itself."""

    def __init__(self, strategy: StrategyLike, stacked: dict[int, Any]) -> None:
        self._strategy = strategy
        self._stacked = stacked
        self.extended = StrategyExtended(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)

    def _is_stacked(self, leaf: Any) -> bool:
        return self._stacked.get(id(leaf)) is leaf

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        op, n = ReduceOp.of(reduce_op), self._strategy.num_replicas_in_sync
        return jax.tree.map(
            lambda a: reduce_replicas(op, a, self._is_stacked(a), axis, n, "reduce(value)"), value
        )

    def gather(self, value: Any, axis: int) -> Any:
        return jax.tree.map(lambda a: jnp.concatenate(self._rows(a), axis=axis), value)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        per_leaf = jax.tree.map(self._rows, value)
        n = self._strategy.num_replicas_in_sync
        return tuple(
            jax.tree.map(lambda rows, i=i: rows[i], per_leaf, is_leaf=lambda x: isinstance(x, list))
            for i in range(n)
        )

    def _rows(self, leaf: Any) -> list[Any]:
        n = self._strategy.num_replicas_in_sync
        return [leaf[i] for i in range(n)] if self._is_stacked(leaf) else [leaf] * n

    def __repr__(self) -> str:
        return f"CrossReplicaView({self._strategy!r})"
