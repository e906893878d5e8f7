"""`ReduceOp`: how values from several replicas combine, as in `tf.distribute.ReduceOp`."""

from __future__ import annotations

import enum


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
