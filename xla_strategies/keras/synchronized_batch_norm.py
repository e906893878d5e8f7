"""Keras' `BatchNormalization(synchronized=True)` under a strategy, on the JAX backend.

Keras implements synchronized batch statistics only for TensorFlow and refuses the
argument elsewhere. Here a layer built inside `strategy.scope()` with `synchronized=True`
is accepted (`accepting_synchronized`), and while its model's train step is traced it
normalizes with the statistics of the global batch (`global_moments`): each replica's mean
and mean square, averaged over the replicas, as torch's `SyncBatchNorm` does under the torch
frontend. The replicas hold equal parts of the batch, so the averages are the global ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from xla_strategies.core.context import get_replica_context
from xla_strategies.core.patching import patched
from xla_strategies.core.reduce_op import ReduceOp


@contextlib.contextmanager
def accepting_synchronized(keras: Any) -> Iterator[None]:
    """While active, `BatchNormalization(synchronized=True)` builds on any backend."""
    with patched(keras.layers.BatchNormalization, "__init__", _accepting):
        yield


@contextlib.contextmanager
def global_moments(keras: Any) -> Iterator[None]:
    """While active, a synchronized `BatchNormalization` inside a compiled step takes the
    mean and variance of the global batch."""
    with patched(keras.layers.BatchNormalization, "_moments", _global):
        yield


def _accepting(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(layer, *args, synchronized=False, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202, N807
        original(layer, *args, **kwargs)
        layer.synchronized = synchronized

    return __init__


def _global(original: Callable[..., Any]) -> Callable[..., Any]:
    def _moments(layer, inputs, mask):  # noqa: ANN001, ANN202
        # Keras' own moments of this replica's batch (it refuses synchronized on JAX)
        synchronized, layer.synchronized = layer.synchronized, False
        try:
            mean, variance = original(layer, inputs, mask)
        finally:
            layer.synchronized = synchronized
        context = get_replica_context()
        if not synchronized or mask is not None or context is None:
            return mean, variance  # a masked batch is normalized per replica
        mean, square = context.all_reduce(ReduceOp.MEAN, (mean, variance + mean * mean))
        return mean, square - mean * mean

    return _moments
