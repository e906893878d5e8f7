"""Reduce-to-one and broadcast as binomial trees of collective permutes.

XLA has all-reduce but no reduce-to-one-device or broadcast collective, so these are built
from `lax.ppermute`: in round k every replica whose distance to the root is a multiple of
2^(k+1) receives from the replica 2^k further away (reduce), or sends to it (broadcast).
N replicas take ceil(log2 N) rounds; every round is one collective permute.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax


def _rounds(size: int) -> list[int]:
    strides, stride = [], 1
    while stride < size:
        strides.append(stride)
        stride *= 2
    return strides


def _pairs(size: int, root: int, stride: int) -> list[tuple[int, int]]:
    """(sender, receiver) of one round, by distance from the root."""
    return [
        ((root + d + stride) % size, (root + d) % size)
        for d in range(0, size, 2 * stride)
        if d + stride < size
    ]


def reduce_to_one(x: Any, axis: str, size: int, root: int, mean: bool) -> Any:
    """The sum (or mean) over `axis` on replica `root`; partial sums elsewhere."""
    for stride in _rounds(size):
        x = x + lax.ppermute(x, axis, _pairs(size, root, stride))  # non-receivers get zeros
    return x / size if mean else x


def broadcast(x: Any, axis: str, size: int, root: int) -> Any:
    """Replica `root`'s value of `x` on every replica."""
    distance = (lax.axis_index(axis) - root) % size
    for stride in reversed(_rounds(size)):
        pairs = [(dst, src) for src, dst in _pairs(size, root, stride)]
        received = lax.ppermute(x, axis, pairs)
        x = jnp.where(distance % (2 * stride) == stride, received, x)
    return x
