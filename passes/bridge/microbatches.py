"""A step traced on microbatches: the batch's rows split into M microbatches, and the
step run on each as one `jax.vmap` over them.

Pipeline stages need the step's loss as a function of one microbatch: its shapes (a
`jnp.mean`'s row count, a reshape's sizes) are a microbatch's, and the batch it reads,
as an argument or from a closure, is one microbatch's. So a step with stages is traced
under a `vmap` over the microbatches: every value computed from the batch is batched over
them, and the pipelined gradient (`pipelined_gradients`) finds each such value's
microbatches stacked (`stacked_microbatches`), and returns the gradient of them all,
unbatched. What the step returns is the step's again: a value that does not depend on
the batch (the new parameters) as it is; one that does (a metric computed outside the
gradient) combined over the microbatches. A compiled step with stages uses only the
gradients traced here: it runs the step again on the whole batch (`gradient_replay`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import batching

from xla_strategies.core.patching import patched, set_in_this_thread

_traces = threading.local()  # the vmap traces of the steps being traced, innermost last


def microbatched(
    fn: Callable[..., list[Any]], rows: Sequence[bool], microbatches: int, mean: bool = True
) -> Callable[..., list[Any]]:
    """`fn(*flat) -> flat outputs` run on `microbatches` microbatches of the arguments
    flagged in `rows` (split on their first dimension). An output that depends on the
    batch comes back as one row per example where it has the microbatch's rows first,
    else as the microbatches' mean (`mean=False`: their sum; integers always sum)."""
    from jax._src import core

    def run(*flat: Any) -> list[Any]:
        for x, r in zip(flat, rows, strict=True):
            if r and (jnp.ndim(x) == 0 or jnp.shape(x)[0] % microbatches):
                raise ValueError(
                    f"microbatches={microbatches} does not divide the {jnp.shape(x)[:1]} "
                    "rows of a batch argument each replica sees"
                )
        split = [
            x.reshape(microbatches, -1, *x.shape[1:]) if r else x
            for x, r in zip(flat, rows, strict=True)
        ]
        batched: list[bool] = []
        once: dict[int, Any] = {}  # what does not depend on the batch: its one value

        def body(*args: Any) -> list[Any]:
            stack = _stack()
            stack.append(core.trace_ctx.trace)
            try:
                out = list(fn(*args))
                batched[:] = [stacked_microbatches(o) is not None for o in out]
                # taken out as it is, not broadcast over the microbatches and sliced:
                # held in blocks (new parameters), a broadcast's slice is gathered whole
                once.update((i, outside(o)) for i, o in enumerate(out) if not batched[i])
            finally:
                stack.pop()
            return [o for o, b in zip(out, batched, strict=True) if b]

        in_axes = [0 if r else None for r in rows]
        per_microbatch = rows_per_microbatch(flat, rows, microbatches)
        with (
            set_in_this_thread(_draws, "rows", (per_microbatch, microbatches)),
            patched(batching.BatchTrace, "process_primitive", _drawing_the_whole_batch),
        ):
            outs = iter(jax.vmap(body, in_axes=in_axes, out_axes=0)(*split))
        return [
            combined(next(outs), per_microbatch, mean) if b else once[i]
            for i, b in enumerate(batched)
        ]

    return run


def rows_per_microbatch(flat: Sequence[Any], rows: Sequence[bool], microbatches: int) -> int:
    """How many of its rows each microbatch of a batch argument (flagged in `rows`) holds;
    0 where none is one."""
    return next((jnp.shape(x)[0] // microbatches for x, r in zip(flat, rows, strict=True) if r), 0)


_draws = threading.local()  # (rows per microbatch, microbatches) of this thread's step
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def _drawing_the_whole_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    """The microbatches' vmap, where a step draws outside its gradient for a microbatch's
    rows first from a key that does not depend on the batch (noise that augments the
    batch): each microbatch draws its rows of the draw for the whole batch. That is the
    draw `jax.jit` makes, and the one the step makes again on its whole batch
    (`gradient_replay`); drawn as written, every microbatch read the same noise. A draw
    inside a call (`jax.random.normal` is one) runs with the call inline."""

    def process_primitive(self: Any, p: Any, tracers: Any, params: dict, /) -> Any:
        rows = getattr(_draws, "rows", None)
        if not (_stack() and self is _stack()[-1] and rows):
            return original(self, p, tracers, params)
        if p.name == "random_bits" and _whole_batchs(params["shape"], tracers[0], rows):
            return _rows_of_the_whole_draw(p, tracers[0], params, *rows)
        if p.name in _CALLS and _draws_rows(params["jaxpr"].jaxpr, rows[0]):
            closed = params["jaxpr"]
            with core.set_current_trace(self):  # binding took it
                return core.eval_jaxpr(closed.jaxpr, closed.consts, *tracers)
        return original(self, p, tracers, params)

    return process_primitive


def _whole_batchs(shape: tuple[int, ...], keys: Any, rows: tuple[int, int]) -> bool:
    return bool(shape) and shape[0] == rows[0] and stacked_microbatches(keys) is None


def _draws_rows(jaxpr: Any, rows: int) -> bool:
    """Whether a call draws for `rows` rows first, in it or in the calls it makes."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "random_bits" and eqn.params["shape"][:1] == (rows,):
            return True
        if eqn.primitive.name in _CALLS and _draws_rows(eqn.params["jaxpr"].jaxpr, rows):
            return True
    return False


def _rows_of_the_whole_draw(p: Any, keys: Any, params: dict, rows: int, microbatches: int) -> Any:
    with around_the_microbatches():
        keys = outside(keys)
        shape = params["shape"]
        bits = p.bind(keys, **{**params, "shape": (rows * microbatches, *shape[1:])})
        bits = bits.reshape(*keys.shape, microbatches, rows, *shape[1:])
        return as_microbatches(jnp.moveaxis(bits, keys.ndim, 0))


def stacked_microbatches(x: Any) -> Any | None:
    """`x`'s value on every microbatch, stacked on a leading axis, where `x` depends on
    the batch of the step being traced on microbatches; None otherwise."""
    from jax._src.interpreters import batching

    if not _ours(x) or not isinstance(x.batch_dim, int):
        return None
    return batching.moveaxis(x.val, x.batch_dim, 0)


def outside(x: Any) -> Any:
    """`x` as the program around the microbatches sees it: its stacked microbatches where
    it depends on the batch (`stacked_microbatches`), else its one value."""
    stacked = stacked_microbatches(x)
    if stacked is not None:
        return stacked
    return x.val if _ours(x) else x  # a value the trace holds without a batch axis


def around_the_microbatches() -> Any:
    """A context in which JAX traces into the program around the microbatches (the
    vmap's parent), as the pipelined gradient runs: on `outside` values, unbatched."""
    from jax._src import core

    return core.set_current_trace(_stack()[-1].parent_trace)


def _ours(x: Any) -> bool:
    from jax._src.interpreters import batching

    stack = _stack()
    return bool(stack) and isinstance(x, batching.BatchTracer) and x._trace is stack[-1]


def as_microbatches(stacked: Any) -> Any:
    """A value of every microbatch (`stacked` on a leading axis) as the step being traced
    on microbatches sees it: one microbatch's (the inverse of `stacked_microbatches`)."""
    from jax._src.interpreters import batching

    return batching.BatchTracer(_stack()[-1], stacked, 0)


def tracing_microbatches() -> bool:
    """Whether a step is being traced on microbatches (`microbatched`) in this thread."""
    return bool(_stack())


def _stack() -> list[Any]:
    if not hasattr(_traces, "stack"):
        _traces.stack = []
    return _traces.stack


_BY = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean}


def per_example(value: Any, rows_per_microbatch: int) -> bool:
    """Whether a value of every microbatch ([M, ...]) has each microbatch's rows first."""
    return value.ndim >= 2 and value.shape[1] == rows_per_microbatch


def combined(value: Any, rows_per_microbatch: int, mean: bool, by: str | None = None) -> Any:
    """A value of every microbatch ([M, ...]) as the batch's: one row per example where it
    has the microbatch's rows first; else by the reduction `by` that made each (`"sum"`,
    `"max"`, `"min"`, `"mean"`) where known; else their mean (`mean=False`: sum; integers
    sum)."""
    if per_example(value, rows_per_microbatch):
        return value.reshape(-1, *value.shape[2:])
    if by is not None:
        return _BY[by](value, axis=0).astype(value.dtype)
    if mean and jnp.issubdtype(value.dtype, jnp.inexact):
        return jnp.mean(value, axis=0)
    return jnp.sum(value, axis=0).astype(value.dtype)
