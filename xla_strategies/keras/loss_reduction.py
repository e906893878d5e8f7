"""Keras losses that are not a mean over the batch, made right across replicas.

A replica's step sees its slice of the global batch, and its gradients are averaged (the
strategy's MEAN). That is the single-device gradient for Keras' default reduction,
`sum_over_batch_size`: the mean of the replicas' means is the global mean. It is not for
the others:

- `sum`: the global loss is the sum of the replicas' sums, so each replica's compiled loss
  is scaled by the replica count (its mean over replicas is then the sum);
- `mean_with_sample_weight`: the global loss is sum(w * l) / sum(w) over the whole batch,
  so each replica's is scaled by replicas * (its weights' sum) / (all weights' sum).

Only the compiled loss is scaled: regularization losses (`model.losses`) are counted once
per step on every replica already. The loss Keras reports is computed from the same scaled
value, so `fit`'s history matches single-device Keras too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from xla_strategies.core.context import get_replica_context
from xla_strategies.core.reduce_op import ReduceOp

_MEAN = frozenset({"sum_over_batch_size", "mean", None})


class _Scaled:
    """Keras' compiled loss, its value scaled for this replica; everything else as is."""

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)

    def __call__(self, y: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        loss = self._compiled(y, y_pred, sample_weight)
        context = get_replica_context()
        if loss is None or context is None or context.num_replicas_in_sync == 1:
            return loss
        reduction = _reduction(self._compiled)
        if reduction in _MEAN:
            return loss
        replicas = context.num_replicas_in_sync
        if reduction == "sum":
            return loss * replicas
        if reduction == "mean_with_sample_weight":
            local = _weight_total(y, sample_weight)
            return loss * replicas * local / context.all_reduce(ReduceOp.SUM, local)
        raise ValueError(
            f"a Keras loss with reduction={reduction!r} cannot be trained across replicas: "
            "it does not reduce to a scalar that the replicas' losses combine into"
        )


@contextlib.contextmanager
def replica_losses(model: Any) -> Iterator[None]:
    """While Keras' step is traced, its compiled loss is scaled for this replica."""
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None:
        yield
        return
    object.__setattr__(model, "_compile_loss", _Scaled(compiled))
    try:
        yield
    finally:
        object.__setattr__(model, "_compile_loss", compiled)


def _reduction(compiled: Any) -> str | None:
    """The one reduction of the compiled losses (built on their first call)."""
    found = {getattr(flat.loss, "reduction", None) for flat in compiled._flat_losses}
    if len(found) > 1 and not found <= _MEAN:
        raise ValueError(
            f"Keras losses with different reductions ({sorted(map(str, found))}) cannot be "
            "combined across replicas: give every output's loss the same reduction"
        )
    return found.pop() if found else None


def _weight_total(y: Any, sample_weight: Any) -> Any:
    """This replica's sum of sample weights (of the first output's; its rows, unweighted)."""
    if sample_weight is None:
        return jnp.asarray(jax.tree.leaves(y)[0].shape[0], jnp.float32)
    return jnp.sum(jnp.asarray(jax.tree.leaves(sample_weight)[0], jnp.float32))
