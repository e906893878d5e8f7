"""Slot buffers of the pipeline executor, and the pytree arithmetic it runs on them: every
leaf of a buffer has its slot (or microbatch, or chunk) first; a value with no gradient (a
token id, a PRNG key) has None in its place."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def is_float(a: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def zero_cotangent(x: Any) -> Any:
    """The gradient of `x` that is nothing: zeros like it, or float0 for a value that has
    no gradient (an integer)."""
    if is_float(x):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def float_zeros(tree: Any) -> Any:
    """Zeros like the float leaves of `tree`; None for the others (they get no gradient)."""
    return jax.tree.map(lambda a: jnp.zeros_like(a) if is_float(a) else None, tree)


def get(tree: Any, index: Any) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def put(tree: Any, index: Any, value: Any) -> Any:
    """`tree` with `value` at `index`; unchanged where `index` is -1 (nothing to store)."""
    at = jnp.maximum(index, 0)

    def put_leaf(a, v):
        kept = lax.dynamic_index_in_dim(a, at, keepdims=False)
        return lax.dynamic_update_index_in_dim(
            a, jnp.where(index >= 0, v, kept).astype(a.dtype), at, 0
        )

    return jax.tree.map(put_leaf, tree, value, is_leaf=lambda v: v is None)


def add_at(tree: Any, index: Any, value: Any) -> Any:
    return jax.tree.map(
        lambda a, v: lax.dynamic_update_index_in_dim(
            a, lax.dynamic_index_in_dim(a, index, keepdims=False) + v.astype(a.dtype), index, 0
        ),
        tree,
        value,
    )


def plus(tree: Any, value: Any) -> Any:
    return jax.tree.map(lambda a, v: a + v.astype(a.dtype), tree, value)
