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
  batch;
- anything else (parameters, optimizer state, RNG counts): must already be the same on
  every replica, or the step fails naming it (`MirroredOutputError`).

A change to anything that is not an NNX variable is still a `DroppedMutationError`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import jax

from xla_strategies.arguments import arg_path
from xla_strategies.context import ReplicaContext
from xla_strategies.reduce_op import ReduceOp


@dataclass(frozen=True)
class WrittenState:
    """The leaves (positions in the flattened arguments) a step changed in place, their
    paths, and their new values as every replica agrees on them."""

    indices: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()


def collect(
    before: tuple[list[tuple[Any, Any]], Any],
    args: tuple,
    kwargs: dict,
    result: Any,
    context: ReplicaContext,
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
        tuple(_agreed(holder, old, new, context) for _, _, old, new, holder in written),
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


def _agreed(holder: Any, old: Any, new: Any, context: ReplicaContext) -> Any:
    from flax import nnx

    if isinstance(holder, nnx.BatchStat):
        return context.all_reduce(ReduceOp.MEAN, new)
    if isinstance(holder, nnx.metrics.MetricState):
        return old + context.all_reduce(ReduceOp.SUM, new - old)
    return new


def _variable_type() -> type | None:
    """flax NNX's `Variable`, when the program uses flax (never imported here)."""
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None)
