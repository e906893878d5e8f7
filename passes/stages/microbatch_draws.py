"""Random draws per microbatch: what a pipelined loss draws, each microbatch draws anew.

A step with pipeline stages runs its loss once per microbatch, where the user wrote it for
the whole batch: `jax.jit` draws one dropout mask over all the rows, and a key read as it
was would draw the same mask for every microbatch, the noise of one microbatch repeated M
times. While a microbatch's part of the loss is evaluated (`jaxpr_eval.evaluate`: the
embedding, each layer, the head), every `random_bits` it runs draws from its key folded
with the microbatch's index. The forward and the backward's recomputation of a layer fold
the same index, so they draw the same mask.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax

_drawing = threading.local()  # the microbatch index folded into this thread's draws


@contextlib.contextmanager
def drawing_for(microbatch: Any) -> Iterator[None]:
    """While open, this thread's evaluated `random_bits` draw for `microbatch` (an integer
    array, traced)."""
    before = getattr(_drawing, "index", None)
    _drawing.index = microbatch
    try:
        yield
    finally:
        _drawing.index = before


def for_the_microbatch(keys: Any) -> Any:
    """`keys` (what a `random_bits` draws from) folded with the microbatch being drawn
    for, if any; else as they are."""
    index = getattr(_drawing, "index", None)
    if index is None:
        return keys
    flat = keys.reshape(-1)
    return jax.vmap(lambda key: jax.random.fold_in(key, index))(flat).reshape(keys.shape)
