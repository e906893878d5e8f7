"""`ReduceOp`: how values from several replicas combine, as in `tf.distribute.ReduceOp`."""

from __future__ import annotations

import enum
from typing import Any

import jax.numpy as jnp


class ReduceOp(enum.StrEnum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"

    @classmethod
    def of(cls, value: ReduceOp | str, argument: str = "reduce_op") -> ReduceOp:
        """Accept a `ReduceOp` or its name (any case); raise naming `argument` otherwise."""
        if isinstance(value, ReduceOp):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            known = ", ".join(op.name for op in cls)
            raise ValueError(f"{argument} must be one of {known}, got {value!r}") from None


def reduce_replicas(
    op: ReduceOp, x: Any, stacked: bool, axis: int | None, num_replicas: int, where: str
) -> Any:
    """`reduce(op, ...)` of one leaf: `x` is `[replicas, ...]` when `stacked`, else the
    one value every replica holds; with `axis`, each replica's value is reduced along it."""
    per_replica_ndim = x.ndim - stacked
    if axis is not None:
        check_axis(axis, per_replica_ndim, where)
    axes = ([0] if stacked else []) + (
        [axis % per_replica_ndim + stacked] if axis is not None else []
    )
    if op is ReduceOp.SUM:
        total = jnp.sum(x, axis=tuple(axes)) if axes else x
        return total if stacked else total * num_replicas
    reducer = {ReduceOp.MEAN: jnp.mean, ReduceOp.MAX: jnp.max, ReduceOp.MIN: jnp.min}[op]
    return reducer(x, axis=tuple(axes)) if axes else x


def check_axis(axis: int, ndim: int, where: str) -> None:
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"axis={axis} is out of range for {where}, "
            f"whose per-replica value has {ndim} dimensions"
        )
