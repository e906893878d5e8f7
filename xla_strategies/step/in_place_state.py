"""flax NNX's in-place state: a step that changes its NNX objects' variables in place, as
`nnx.jit` allows (`train_step(model, optimizer, metrics, batch)` returning nothing).

The step is traced on copies of its arguments, so the changes are collected at the end of
the trace and returned as extra outputs, and the caller's variables are set to them after
the step runs (`write_back`), as `nnx.jit` updates its arguments. Each replica's new value
is made the same everywhere, by what the variable is:

- `nnx.BatchStat` (running statistics of a per-replica batch): the mean over replicas, as
  tf.distribute's `SyncOnRead` variables read;
- `nnx.metrics.MetricState` (a metric's running totals and counts): the value before the
  step plus the sum of every replica's change, so `metrics.compute()` covers the global
  batch. An `Average` updated with a scalar (a loss already averaged over the replica's
  rows) is one update of the global batch, as under `nnx.jit`: its total gains the mean of
  the replicas' values and its count 1 (`scalar_metric_updates`);
- anything else (parameters, optimizer state, RNG counts): must already be the same on
  every replica, or the step fails naming it (`MirroredOutputError`).

A change to anything that is not an NNX variable is still a `DroppedMutationError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from xla_strategies.core.context import ReplicaContext
from xla_strategies.core.patching import patched
from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.core.trees import arg_path


@dataclass(frozen=True)
class WrittenState:
    """The leaves (positions in the flattened arguments) a step changed in place, their
    paths, and their new values as every replica agrees on them."""

    indices: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()


# ids of the MetricStates the step being traced updated with per-replica scalars
_scalar_updated: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar(
    "scalar_metric_updates", default=None
)


@contextlib.contextmanager
def scalar_metric_updates() -> Iterator[set[int]]:
    """While a step is traced, note each `nnx.metrics.Average` (Accuracy included) updated
    with a scalar and no mask: its value already reduces the replica's rows, so across
    replicas it is averaged, not counted once per replica. Yields the noted states' ids."""
    noted: set[int] = set()
    metrics = getattr(sys.modules.get("flax.nnx"), "metrics", None)
    if metrics is None:
        yield noted
        return

    def noting(update: Any) -> Any:
        def update_noting_scalars(self: Any, mask: Any = None, **kwargs: Any) -> Any:
            current = _scalar_updated.get()
            values = kwargs.get(self.argname)
            if current is not None and mask is None and values is not None:
                if np.ndim(values) == 0:
                    current.update((id(self.total), id(self.count)))
            return update(self, mask=mask, **kwargs)

        return update_noting_scalars

    token = _scalar_updated.set(noted)
    try:
        with patched(metrics.Average, "update", noting):
            yield noted
    finally:
        _scalar_updated.reset(token)


def collect(
    before: tuple[list[tuple[Any, Any]], Any],
    args: tuple,
    kwargs: dict,
    result: Any,
    context: ReplicaContext,
    scalar_updated: set[int] = frozenset(),
) -> WrittenState:
    """The NNX variables of the step's arguments that the step changed and does not
    return, with their new values made the same on every replica (a step that returns its
    objects, functional style, is left as it was). Call inside the replica scope, after
    the step."""
    variable_type = _variable_type()
    if variable_type is None:
        return WrittenState()
    leaves, treedef = before
    now, now_treedef = jax.tree_util.tree_flatten((args, kwargs))
    if now_treedef != treedef:
        return WrittenState()  # a structural change is the caller's error to report
    holders = _variables_by_leaf((args, kwargs), variable_type)
    returned = {id(leaf) for leaf in jax.tree_util.tree_leaves(result)}
    written = [
        (index, path, old, new, holder)
        for index, ((path, old), new, holder) in enumerate(zip(leaves, now, holders, strict=True))
        if new is not old and id(new) not in returned and holder is not None
    ]
    return WrittenState(
        tuple(index for index, *_ in written),
        tuple(arg_path(path) for _, path, *_ in written),
        tuple(
            _agreed(holder, old, new, context, id(holder) in scalar_updated)
            for _, _, old, new, holder in written
        ),
    )


def write_back(written: tuple[int, ...], values: list[Any], args: tuple, kwargs: dict) -> None:
    """Set the caller's NNX variables at leaf positions `written` to `values`."""
    if not written:
        return
    holders = _variables_by_leaf((args, kwargs), _variable_type())
    for index, value in zip(written, values, strict=True):
        holders[index].set_value(value)


def _variables_by_leaf(tree: Any, variable_type: type) -> list[Any]:
    """For each leaf of `tree`, the NNX variable that holds it alone, else None (a plain
    leaf, or a variable whose value has several leaves, which is not written back)."""
    holders: list[Any] = []
    for holder in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, variable_type)):
        count = len(jax.tree_util.tree_leaves(holder)) if isinstance(holder, variable_type) else 1
        holders += [holder] if isinstance(holder, variable_type) and count == 1 else [None] * count
    return holders


def _agreed(holder: Any, old: Any, new: Any, context: ReplicaContext, scalar_updated: bool) -> Any:
    from flax import nnx

    if isinstance(holder, nnx.BatchStat):
        return context.all_reduce(ReduceOp.MEAN, new)
    if isinstance(holder, nnx.metrics.MetricState) and scalar_updated:
        if jax.numpy.issubdtype(new.dtype, jax.numpy.integer):
            return new  # a count: the same number of updates on every replica
        return old + context.all_reduce(ReduceOp.MEAN, new - old)
    if isinstance(holder, nnx.metrics.MetricState):
        return old + context.all_reduce(ReduceOp.SUM, new - old)
    return new


def _variable_type() -> type | None:
    """flax NNX's `Variable`, when the program uses flax (never imported here)."""
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None)
