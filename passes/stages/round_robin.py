"""Interleaved chunks' weights, moved between the stack's order and the round robin.

Between steps each stage holds one block of the layer stack: with V chunks a stage, device
d holds global chunks dV .. dV+V-1. Interleaved schedules (interleaved 1F1B, looped BFS)
run chunk v of device d as global chunk v*S + d, round robin. Reshaped to that layout and
left to XLA, the move was an all-gather of the whole stack over the stages, each device
then keeping its share: for Llama-3.1-405B on 4xv5p-512 (2 stages), 12.6 GB gathered over
DCN a step, and the gradient's way back an all-reduce of 3.5 GB. Here each device sends
each other stage only the chunks that stage runs, with one collective-permute per shift
of the ring: (S-1)/S of its block, the least any layout move can send.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def round_robin(stack: Any, stages: int, axis: str) -> Any:
    """This device's chunks in the stack's order (`stack`: [V, ...], global chunks dV ..
    dV+V-1 of device d on `axis`), as it runs them: [V, ...], chunk v the global chunk
    v*S + d. Inside a program manual over `axis`."""
    if jnp.issubdtype(stack.dtype, jax.dtypes.prng_key):  # each layer's stream keys, as data
        moved = round_robin(jax.random.key_data(stack), stages, axis)
        return jax.random.wrap_key_data(moved, impl=jax.random.key_impl(stack))
    sends, places = (jnp.asarray(t) for t in _tables(stages, stack.shape[0]))
    device = lax.axis_index(axis)
    out = jnp.zeros_like(stack)
    for shift in range(stages):
        # a padded row reads chunk 0, and its place is past the end: dropped
        rows = jnp.take(stack, sends[device, shift], axis=0)
        if shift:
            ring = [(d, (d + shift) % stages) for d in range(stages)]
            rows = lax.ppermute(rows, axis, ring)
        out = out.at[places[device, shift]].add(rows, mode="drop")
    return out


def stack_order(chunks: Any, stages: int, axis: str) -> Any:
    """The inverse of `round_robin`: chunks as a device runs them ([V, ...], a gradient),
    back in the stack's order. A permutation's inverse is its transpose."""
    (back,) = jax.linear_transpose(lambda x: round_robin(x, stages, axis), chunks)(chunks)
    return back


def _tables(stages: int, virtual: int) -> tuple[np.ndarray, np.ndarray]:
    """For each device and shift of the ring: the rows of its block the device sends to
    the device `shift` ahead (`sends[d, shift]`), and where the receiving device puts what
    it got from the device `shift` behind (`places[t, shift]`); each padded to ceil(V/S)
    rows, a pad sending row 0 to row V (nowhere)."""
    width = -(-virtual // stages)
    sends = np.zeros((stages, stages, width), np.int32)
    places = np.full((stages, stages, width), virtual, np.int32)
    for d in range(stages):
        for shift in range(stages):
            to = (d + shift) % stages
            rows = [i for i in range(virtual) if (d * virtual + i) % stages == to]
            sends[d, shift, : len(rows)] = rows
            places[to, shift, : len(rows)] = [(d * virtual + i) // stages for i in rows]
    return sends, places
