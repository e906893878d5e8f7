"""The SPMD loop that runs a pipeline schedule: one program, a tick per iteration.

Run inside a program manual over the stage axis. In each tick every stage looks up its
action in the schedule's table by (tick, its stage index) and runs it under `lax.switch`:
idle, the forward of one microbatch through its chunk of layers, that microbatch's
backward (each layer recomputed from the input the forward kept of it), or for
zero-bubble schedules the input and weight gradients as two actions. A chunk runs one
layer at a time, each layer's weights read in place from the stage's stack and its
gradient added in place into the stage's: a chunk's gradient taken out of the stack and
added back whole was a copy of the chunk each tick (a dynamic slice XLA does not fuse into
the layer loop; for two 1024-wide f32 layers on v5e, 20 us a tick, now 10). At the end of the
tick each stage sends its forward's output to the next stage and its backward's input
gradient to the previous one with two collective-permutes, which XLA can overlap with the
next tick's compute. Values wait in slot buffers whose sizes the schedule computed, so
1F1B's program holds S microbatches' layer inputs where GPipe's holds M. (Keeping only the
chunk's input, the backward ran the chunk's forward again to find them: a fifth more
compute, and with parameters in blocks a third more layer gathers.)

The last stage runs the head (what follows the layers, up to the loss) of each
microbatch in its forward and seeds the backward with the head's gradient; the first
stage reads the microbatch's input and keeps its input gradient. Results that only one
stage has (the loss, the head's gradients, the input gradients) are summed over the
stage axis at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xla_strategies.passes.stages.schedules import BACKWARD, FORWARD, WEIGHT, Schedule

_KINDS = {FORWARD: 1, BACKWARD: 2, WEIGHT: 3}


@dataclass(frozen=True)
class StageProgram:
    """What the executor runs, as functions of pytrees.

    `layer(weights, x, rows, shared) -> y`: one layer, `weights` its own; `head(y, rows,
    shared) -> (loss, aux)`: what follows the last chunk, for one microbatch. `rows` are a
    microbatch's per-row values, `shared` the rest."""

    layer: Callable[..., Any]
    head: Callable[..., tuple[Any, Any]]
    seed: float  # the weight of each microbatch's loss in the total: 1/M for their mean
    aux: Any  # the head's auxiliary output, as `jax.ShapeDtypeStruct`s


@dataclass(frozen=True)
class StageResult:
    """Each microbatch's loss and auxiliary output (stacked over the microbatches), and the
    gradients of their losses' total, each weighted by the program's seed."""

    loss: Any  # [M]
    aux: Any  # each leaf stacked over the microbatches
    weights: Any  # [V, layers per chunk, ...]: this stage's chunks
    inputs: Any  # [M, ...]: each microbatch's input gradient
    layer_rows: Any
    layer_shared: Any
    head_rows: Any
    head_shared: Any


def run(
    schedule: Schedule,
    program: StageProgram,
    weights: Any,
    inputs: Any,
    layer_rows: Any,
    layer_shared: Any,
    head_rows: Any,
    head_shared: Any,
    axis: str,
) -> StageResult:
    """Run `schedule` in a program manual over `axis` (its size the schedule's stages).

    `weights`: this stage's chunks, each leaf [V, layers per chunk, ...]; `inputs` and the
    `*_rows`: each leaf [M, ...], the microbatches (whole on every stage); `*_shared`:
    the same for every microbatch. Gradients are of the microbatches' losses summed, each
    weighted by `program.seed`."""
    stage = lax.axis_index(axis)
    tables = {k: jnp.asarray(v) for k, v in _tables(schedule).items()}
    m_count, stages = schedule.microbatches, schedule.stages
    last = schedule.virtual_stages * stages - 1
    x0 = jax.tree.map(lambda a: a[0], inputs)
    aux_shape = program.aux
    zeros = _float_zeros
    buffers = lambda n, *per: jax.tree.map(  # noqa: E731
        lambda a: jnp.zeros((max(n, 1), *per, *a.shape), a.dtype), x0
    )
    state = {
        "F": buffers(schedule.slots["F"]),
        "B": buffers(schedule.slots["B"]),
        "stash": buffers(schedule.slots["stash"], _depth(weights)),  # each layer's input
        "seed": buffers(schedule.slots["stash"]),
        "grad": buffers(schedule.slots["grad"]),  # zero-bubble: B's gradient kept for W
        "loss": jnp.zeros((m_count,), jnp.float32),
        "aux": jax.tree.map(lambda s: jnp.zeros((m_count, *s.shape), s.dtype), aux_shape),
        "d_weights": zeros(weights),
        "d_inputs": zeros(inputs),
        "d_layer_rows": zeros(layer_rows),
        "d_layer_shared": zeros(layer_shared),
        "d_head_rows": zeros(head_rows),
        "d_head_shared": zeros(head_shared),
        "recv_f": zeros(x0),
        "recv_b": zeros(x0),
    }
    ring = schedule.virtual_stages > 1
    forward_perm = [(d, (d + 1) % stages) for d in range(stages if ring else stages - 1)]
    backward_perm = [(d, (d - 1) % stages) for d in range(1 if not ring else 0, stages)]

    def tick(t: Any, state: dict) -> dict:
        row = {k: v[t, stage] for k, v in tables.items()}
        state = dict(state)
        state["F"] = _put(state["F"], row["arrive_f"], state["recv_f"])
        state["B"] = _put(state["B"], row["arrive_b"], state["recv_b"])
        g = row["chunk"] * stages + stage
        where = _Where(row, g == 0, g == last)
        actions = [
            lambda s: (s, zeros(x0), zeros(x0)),
            lambda s: _forward(
                s, where, program, weights, inputs, layer_rows, layer_shared, head_rows, head_shared
            ),
            lambda s: _backward(s, where, program, weights, layer_rows, layer_shared, split=False),
            lambda s: _weight_grad(s, where, program, weights, layer_rows, layer_shared),
        ]
        if schedule.slots["grad"]:  # zero-bubble: B is the input gradient only
            actions[2] = lambda s: _backward(
                s, where, program, weights, layer_rows, layer_shared, split=True
            )
        state, send_f, send_b = lax.switch(row["kind"], actions, state)
        state["recv_f"] = jax.tree.map(lambda v: lax.ppermute(v, axis, forward_perm), send_f)
        state["recv_b"] = jax.tree.map(lambda v: lax.ppermute(v, axis, backward_perm), send_b)
        return state

    state = lax.fori_loop(0, schedule.ticks, tick, state)
    total = lambda tree: jax.tree.map(lambda v: lax.psum(v, axis), tree)  # noqa: E731
    return StageResult(
        loss=total(state["loss"]),
        aux=total(state["aux"]),
        weights=state["d_weights"],
        inputs=total(state["d_inputs"]),
        layer_rows=total(state["d_layer_rows"]),
        layer_shared=total(state["d_layer_shared"]),
        head_rows=total(state["d_head_rows"]),
        head_shared=total(state["d_head_shared"]),
    )


@dataclass(frozen=True)
class _Where:
    """One stage's action in one tick: its table row and where its chunk sits."""

    row: dict
    first: Any
    last: Any

    def __getattr__(self, name: str) -> Any:
        return self.row[name]


def _forward(s, where, program, weights, inputs, layer_rows, layer_shared, head_rows, head_shared):
    m, chunk = where.micro, where.chunk
    arrived = _get(s["F"], jnp.maximum(where.in_slot, 0))
    x = jax.tree.map(lambda a, b: jnp.where(where.first, a, b), _get(inputs, m), arrived)
    y, layer_inputs = _chunk_forward(program, weights, chunk, x, _get(layer_rows, m), layer_shared)
    s = dict(s, stash=_put(s["stash"], where.stash_slot, layer_inputs))
    rows = _get(head_rows, m)

    def head_and_seed(y):
        (loss, aux), pullback = _vjp(program.head, y, rows, head_shared, has_aux=True)
        dy, d_rows, d_shared = pullback(jnp.full_like(loss, program.seed))
        return loss, aux, dy, d_rows, d_shared

    def no_head(y):
        aux = program.aux
        return (
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux),
            _float_zeros(y),
            _float_zeros(rows),
            _float_zeros(head_shared),
        )

    loss, aux, dy, d_rows, d_shared = lax.cond(where.last, head_and_seed, no_head, y)
    s["loss"] = _put(s["loss"], m, loss.astype(jnp.float32))
    s["aux"] = _put(s["aux"], m, aux)
    s["seed"] = _put(s["seed"], where.stash_slot, dy)
    s["d_head_rows"] = _add_at(s["d_head_rows"], m, d_rows)
    s["d_head_shared"] = _plus(s["d_head_shared"], d_shared)
    return s, y, jax.tree.map(jnp.zeros_like, y)


def _output_gradient(s, where):
    """The gradient of the chunk's output: the head's seed on the last stage, else what
    the next stage sent."""
    seed = _get(s["seed"], where.stash_slot)
    arrived = _get(s["B"], jnp.maximum(where.in_slot, 0))
    return jax.tree.map(lambda a, b: jnp.where(where.last, a, b), seed, arrived)


def _backward(s, where, program, weights, layer_rows, layer_shared, split):
    m, chunk = where.micro, where.chunk
    layer_inputs = _get(s["stash"], where.stash_slot)
    dy = _output_gradient(s, where)
    if split:  # the input gradients only; the weight gradient is its own action
        s = dict(s, grad=_put(s["grad"], where.stash_slot, dy))
    grads = _chunk_backward(
        program,
        weights,
        chunk,
        layer_inputs,
        dy,
        _get(layer_rows, m),
        layer_shared,
        s,
        not split,
    )
    s = dict(grads.state)
    s["d_layer_rows"] = _add_at(s["d_layer_rows"], m, grads.rows)
    s["d_inputs"] = _add_at(
        s["d_inputs"], m, jax.tree.map(lambda d: jnp.where(where.first, d, 0), grads.x)
    )
    return s, jax.tree.map(jnp.zeros_like, grads.x), grads.x


def _weight_grad(s, where, program, weights, layer_rows, layer_shared):
    m, chunk = where.micro, where.chunk
    layer_inputs = _get(s["stash"], where.stash_slot)
    dy = _get(s["grad"], where.stash_slot)
    rows = _get(layer_rows, m)
    grads = _chunk_backward(program, weights, chunk, layer_inputs, dy, rows, layer_shared, s, True)
    zero = jax.tree.map(lambda a: jnp.zeros_like(a[0]), layer_inputs)
    return grads.state, zero, zero


# a chunk, one layer at a time


def _chunk_forward(program, weights, chunk, x, rows, shared):
    """The chunk's output, and each of its layers' inputs (stacked), which the backward
    reads: the values JAX's gradient of a scan of checkpointed layers keeps."""

    def one(x, i):
        return program.layer(_layer(weights, chunk, i), x, rows, shared), x

    return lax.scan(one, x, jnp.arange(_depth(weights)))


@dataclass(frozen=True)
class _ChunkGradients:
    x: Any  # the chunk input's
    rows: Any  # the microbatch's rows', summed over the layers
    state: dict  # with the layers' weight and shared gradients added, when asked


def _chunk_backward(program, weights, chunk, inputs, dy, rows, shared, s, with_weights):
    """`dy` taken back through the chunk's layers, each layer's input (`inputs`, stacked)
    kept by the forward: from the last layer, the layer recomputed and its pullback
    applied. (Keeping each layer's pullback instead would keep its weights as one of its
    values: a copy of the chunk.) With `with_weights`, each layer's weight gradient is
    added into `s["d_weights"]` where its weights sit, and the shared values' into
    `s["d_layer_shared"]`."""
    layer_indices = jnp.arange(_depth(weights))

    def back(carry, i):
        dy, d_rows, acc = carry
        w, x_i = _layer(weights, chunk, i), _get(inputs, i)
        if with_weights:
            _, pullback = _vjp(program.layer, w, x_i, rows, shared)
            d_w, dx, d_r, d_shared = pullback(dy)
            acc = {
                "d_weights": _add_layer(acc["d_weights"], chunk, i, d_w),
                "d_layer_shared": _plus(acc["d_layer_shared"], d_shared),
            }
        else:
            _, pullback = _vjp(lambda x, r: program.layer(w, x, r, shared), x_i, rows)
            dx, d_r = pullback(dy)
        return (dx, _plus(d_rows, d_r), acc), None

    kept = {k: s[k] for k in ("d_weights", "d_layer_shared")} if with_weights else {}
    (dx, d_rows, kept), _ = lax.scan(
        back, (dy, _float_zeros(rows), kept), layer_indices, reverse=True
    )
    return _ChunkGradients(dx, d_rows, {**s, **kept})


def _depth(weights: Any) -> int:
    """Layers per chunk: every weight leaf is [chunks, layers per chunk, ...]."""
    return jax.tree.leaves(weights)[0].shape[1]


def _layer(weights: Any, chunk: Any, i: Any) -> Any:
    """Layer `i` of chunk `chunk`, read where it sits in the stage's stack."""

    def read(a):
        return lax.dynamic_slice(a, (chunk, i) + (0,) * (a.ndim - 2), (1, 1, *a.shape[2:]))[0, 0]

    return jax.tree.map(read, weights)


def _add_layer(weights: Any, chunk: Any, i: Any, value: Any) -> Any:
    """`weights` with `value` added to layer `i` of chunk `chunk`, in place."""

    def add(a, v):
        at = (chunk, i) + (0,) * (a.ndim - 2)
        layer = lax.dynamic_slice(a, at, (1, 1, *a.shape[2:]))
        return lax.dynamic_update_slice(a, layer + v.astype(a.dtype)[None, None], at)

    return jax.tree.map(add, weights, value)


def _vjp(fn: Callable[..., Any], *args: Any, has_aux: bool = False) -> tuple[Any, Callable]:
    """`jax.vjp` of `fn` over the float leaves of `args`; the others (token ids, PRNG
    keys) get None for a cotangent. With `has_aux`, `fn` returns `(loss, aux)` and the
    result is `((loss, aux), pullback)`."""
    leaves, tree = jax.tree.flatten(args)
    floats = [_is_float(a) for a in leaves]

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


def _is_float(a: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _float_zeros(tree: Any) -> Any:
    """Zeros like the float leaves of `tree`; None for the others (they get no gradient)."""
    return jax.tree.map(lambda a: jnp.zeros_like(a) if _is_float(a) else None, tree)


# slot buffers: every leaf has the slot (or microbatch, or chunk) first


def _get(tree: Any, index: Any) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def _put(tree: Any, index: Any, value: Any) -> Any:
    """`tree` with `value` at `index`; unchanged where `index` is -1 (nothing to store)."""
    at = jnp.maximum(index, 0)

    def put(a, v):
        kept = lax.dynamic_index_in_dim(a, at, keepdims=False)
        return lax.dynamic_update_index_in_dim(
            a, jnp.where(index >= 0, v, kept).astype(a.dtype), at, 0
        )

    return jax.tree.map(put, tree, value, is_leaf=lambda v: v is None)


def _add_at(tree: Any, index: Any, value: Any) -> Any:
    return jax.tree.map(
        lambda a, v: lax.dynamic_update_index_in_dim(
            a, lax.dynamic_index_in_dim(a, index, keepdims=False) + v.astype(a.dtype), index, 0
        ),
        tree,
        value,
    )


def _plus(tree: Any, value: Any) -> Any:
    return jax.tree.map(lambda a, v: a + v.astype(a.dtype), tree, value)


def _tables(schedule: Schedule) -> dict[str, np.ndarray]:
    """The schedule as int32 tables indexed [tick, stage]."""
    shape = (schedule.ticks, schedule.stages)
    tables = {
        k: np.zeros(shape, np.int32) for k in ("kind", "micro", "chunk", "in_slot", "stash_slot")
    }
    tables["arrive_f"] = np.full(shape, -1, np.int32)
    tables["arrive_b"] = np.full(shape, -1, np.int32)
    for d, steps in enumerate(schedule.steps):
        for step in steps:
            t = step.tick
            tables["kind"][t, d] = _KINDS[step.action.kind]
            tables["micro"][t, d] = step.action.microbatch
            tables["chunk"][t, d] = step.action.chunk
            tables["in_slot"][t, d] = step.input_slot
            tables["stash_slot"][t, d] = step.stash_slot
    for (t, d, kind), slot in schedule.arrivals.items():
        tables["arrive_f" if kind == FORWARD else "arrive_b"][t, d] = slot
    return tables
