"""A chunk of a stage's layers, run one layer at a time: each layer's weights read in place
from the stage's stack, its gradient added in place into the stage's (a chunk's gradient
taken out of the stack and added back whole is a copy of the chunk each tick)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from xla_strategies.passes.stages.slots import float_zeros, get, is_float, plus


def chunk_forward(program, weights, chunk, x, rows, shared):
    """The chunk's output, and each of its layers' inputs (stacked), which the backward
    reads: the values JAX's gradient of a scan of checkpointed layers keeps."""

    def one(x, i):
        return program.layer(layer_of(weights, chunk, i), x, rows, shared), x

    return lax.scan(one, x, jnp.arange(depth(weights)))


def chunk_forward_into(program, weights, chunk, x, rows, shared, stash, slot):
    """The chunk's output, each layer's input written where the backward reads it: layer
    i's at `[slot, i]` of `stash` (stacked and then stored, they were a copy of the chunk's
    inputs beside the stash: 4 GiB a chip for Llama-3.1-405B)."""

    def one(carry, i):
        x, stash = carry
        stash = jax.tree.map(lambda b, v: _write(b, (slot, i), v), stash, x)
        return (program.layer(layer_of(weights, chunk, i), x, rows, shared), stash), None

    (y, stash), _ = lax.scan(one, (x, stash), jnp.arange(depth(weights)))
    return y, stash


def stashed(stash, slot):
    """Layer i's input as `chunk_forward_into` wrote it, read in place."""
    return lambda i: jax.tree.map(lambda b: _read(b, (slot, i)), stash)


def stacked(inputs):
    """Layer i's input from the layers' inputs stacked."""
    return lambda i: get(inputs, i)


@dataclass(frozen=True)
class ChunkGradients:
    x: Any  # the chunk input's
    rows: Any  # the microbatch's rows', summed over the layers
    state: dict  # with the layers' weight and shared gradients added, when asked


def chunk_backward(program, weights, chunk, input_of, dy, rows, shared, s, with_weights):
    """`dy` taken back through the chunk's layers, each layer's input (`input_of(i)`, read
    where the forward kept it): from the last layer, the layer recomputed and its pullback
    applied. (Keeping each layer's pullback instead would keep its weights as one of its
    values: a copy of the chunk.) With `with_weights`, each layer's weight gradient is
    added into `s["d_weights"]` where its weights sit, and the shared values' into
    `s["d_layer_shared"]`."""
    layer_indices = jnp.arange(depth(weights))

    def back(carry, i):
        dy, d_rows, acc = carry
        w, x_i = layer_of(weights, chunk, i), input_of(i)
        if with_weights:
            _, pullback = vjp(program.layer, w, x_i, rows, shared)
            d_w, dx, d_r, d_shared = pullback(dy)
            acc = {
                "d_weights": add_layer(acc["d_weights"], chunk, i, d_w),
                "d_layer_shared": plus(acc["d_layer_shared"], d_shared),
            }
        else:
            _, pullback = vjp(lambda x, r: program.layer(w, x, r, shared), x_i, rows)
            dx, d_r = pullback(dy)
        return (dx, plus(d_rows, d_r), acc), None

    kept = {k: s[k] for k in ("d_weights", "d_layer_shared")} if with_weights else {}
    (dx, d_rows, kept), _ = lax.scan(
        back, (dy, float_zeros(rows), kept), layer_indices, reverse=True
    )
    return ChunkGradients(dx, d_rows, {**s, **kept})


def depth(weights: Any) -> int:
    """Layers per chunk: every weight leaf is [chunks, layers per chunk, ...]."""
    return jax.tree.leaves(weights)[0].shape[1]


def layer_of(weights: Any, chunk: Any, i: Any) -> Any:
    """Layer `i` of chunk `chunk`, read where it sits in the stage's stack."""
    return jax.tree.map(lambda a: _read(a, (chunk, i)), weights)


def add_layer(weights: Any, chunk: Any, i: Any, value: Any) -> Any:
    """`weights` with `value` added to layer `i` of chunk `chunk`, in place."""
    return jax.tree.map(
        lambda a, v: _write(a, (chunk, i), _read(a, (chunk, i)) + v), weights, value
    )


def _read(a: Any, at: tuple) -> Any:
    """`a[at]` for the two leading indices `at`, sliced in place."""
    return lax.dynamic_slice(a, _start(a, at), (1, 1, *a.shape[2:]))[0, 0]


def _write(a: Any, at: tuple, value: Any) -> Any:
    """`a` with `value` at the two leading indices `at`, in place."""
    return lax.dynamic_update_slice(a, value.astype(a.dtype)[None, None], _start(a, at))


def _start(a: Any, at: tuple) -> tuple:
    """The indices of `a[at]`'s first element, all int32: the schedule's tables index as
    int32, and under `jax_enable_x64` the loop counters and the zeros are int64, a mix
    `dynamic_slice` refuses."""
    return tuple(jnp.asarray(i, jnp.int32) for i in (*at, *(0,) * (a.ndim - 2)))


def vjp(fn: Callable[..., Any], *args: Any, has_aux: bool = False) -> tuple[Any, Callable]:
    """`jax.vjp` of `fn` over the float leaves of `args`; the others (token ids, PRNG
    keys) get None for a cotangent. With `has_aux`, `fn` returns `(loss, aux)` and the
    result is `((loss, aux), pullback)`."""
    leaves, tree = jax.tree.flatten(args)
    floats = [is_float(a) for a in leaves]

    def of_floats(*diff: Any) -> Any:
        it = iter(diff)
        full = [next(it) if f else a for a, f in zip(leaves, floats, strict=True)]
        return fn(*jax.tree.unflatten(tree, full))

    diff = [a for a, f in zip(leaves, floats, strict=True) if f]
    out, pull, *aux = jax.vjp(of_floats, *diff, has_aux=has_aux)

    def pullback(ct: Any) -> Any:
        it = iter(pull(ct))
        return jax.tree.unflatten(tree, [next(it) if f else None for f in floats])

    return ((out, aux[0]) if has_aux else out), pullback
