"""flax NNX random streams draw per replica: each replica's dropout mask differs.

An `nnx.Rngs` stream is state (`RngKey`, `RngCount`) that every replica holds mirrored, so
without help every replica would fold the same key with the same count and draw the same
mask: the noise of one replica's batch repeated R times. While a step is traced, the
replica id is folded into the key of every stream in its arguments, so replica r draws
from `fold_in(key, r)` with the shared count, and the key is put back afterwards, in the
arguments and in any variable the step returns, so the state stays mirrored and advances
as under `nnx.jit` (the count goes up by the number of draws). On one replica nothing is
folded, and a step draws exactly what `nnx.jit` draws. (With pipeline stages, each
microbatch's draws in the loss fold in its index too: `stages.microbatch_draws`.) This is
the NNX twin of the Keras trainer's seed offset (`keras/trainer.py`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from xla_strategies.core.context import ReplicaContext


@contextlib.contextmanager
def drawn_per_replica(args: tuple, kwargs: dict, context: ReplicaContext) -> Iterator[Any]:
    """Fold the replica id into the NNX stream keys of `(args, kwargs)` for the body;
    call the yielded `restore(result)` after the step, before its outputs are read."""
    nnx = sys.modules.get("flax.nnx")
    keys = _stream_keys((args, kwargs), nnx) if nnx is not None else []
    if not keys or context.num_replicas_in_sync == 1:
        yield lambda result: None
        return
    replica = context.replica_id_in_sync_group
    original: dict[int, Any] = {}  # id(folded key) -> the key before the step
    for variable in keys:
        key = variable.get_value()
        folded = _fold_in(key, replica)
        original[id(folded)] = key
        variable.set_value(folded)

    def restore(result: Any) -> None:
        for variable in keys + _stream_keys(result, nnx):
            if id(variable.get_value()) in original:
                variable.set_value(original[id(variable.get_value())])

    yield restore


def _stream_keys(tree: Any, nnx: Any) -> list[Any]:
    """The `nnx.RngKey` variables in `tree` (nnx.Rngs streams' keys)."""
    found = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [v for v in found if isinstance(v, nnx.RngKey)]


def _fold_in(key: jax.Array, replica: Any) -> jax.Array:
    """`jax.random.fold_in` of every key in `key` (a stream split by `nnx.split_rngs`
    holds an array of them), typed or raw."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    keys = key if typed else jax.random.wrap_key_data(key)
    folded = jax.vmap(lambda one: jax.random.fold_in(one, replica))(keys.reshape(-1))
    folded = folded.reshape(keys.shape)
    return folded if typed else jax.random.key_data(folded)
