"""Preparing one global (or per-host) batch on the host: checks, and the partial-batch policy.

Runs on the input pipeline's background thread, so its numpy work overlaps the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from xla_strategies.core.trees import as_array, path_str

SKIP = object()  # a partial batch dropped by policy


@dataclass(frozen=True)
class HostBatch:
    """A batch ready to place: numpy leaves, and the mask when the policy is "pad"."""

    tree: Any
    mask: np.ndarray | None
    nbytes: int


def prepare(batch: Any, divisor: int, policy: str, where: str) -> HostBatch | object:
    """Check `batch` (arrays with one leading batch size), then apply `policy` when that
    size does not divide by `divisor` (the replicas this batch is split over)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
    if not leaves:
        raise ValueError(f"{where} has no arrays")
    arrays, size, first_path = [], None, None
    for path, leaf in leaves:
        name = path_str(where, path)
        array = np.asarray(as_array(leaf, name))
        if array.ndim == 0:
            raise ValueError(f"{name} is a scalar; a batch needs a leading batch dimension")
        if size is None:
            size, first_path = array.shape[0], name
        elif array.shape[0] != size:
            raise ValueError(f"{name} has batch size {array.shape[0]} but {first_path} has {size}")
        arrays.append(array)
    padded = -(-size // divisor) * divisor
    mask = None
    if padded != size:
        if policy == "error":
            raise ValueError(
                f"{first_path} has a global batch of {size}, which does not divide across "
                f"{divisor} replicas; use a multiple of {divisor}, or "
                "InputOptions(partial_batch='drop' or 'pad')"
            )
        if policy == "drop":
            return SKIP
        arrays = [_pad(a, padded) for a in arrays]
    if policy == "pad":
        mask = np.arange(padded) < size
    tree = jax.tree_util.tree_unflatten(treedef, arrays)
    return HostBatch(tree, mask, sum(a.nbytes for a in arrays))


def _pad(array: np.ndarray, size: int) -> np.ndarray:
    widths = [(0, size - array.shape[0])] + [(0, 0)] * (array.ndim - 1)
    return np.pad(array, widths)
