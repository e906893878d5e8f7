"""The SPMD loop that runs a pipeline schedule: one program, a tick per iteration.

Run inside a program manual over the stage axis. In each tick every stage looks up its
action in the schedule's table by (tick, its stage index) and runs it under
`lax.switch`: idle, the forward of one microbatch through its chunk of layers, that
microbatch's backward (each layer recomputed from the input the forward kept of it), or
for zero-bubble schedules the input and weight gradients as two actions. A paired
schedule's tick runs two lanes, each its own switch: a forward (or idle), then a
backward (or idle). A chunk runs one layer at a time, each layer's weights read in place
from the stage's stack and its gradient added in place into the stage's: a chunk's
gradient taken out of the stack and added back whole was a copy of the chunk each tick
(a dynamic slice XLA does not fuse into the layer loop; for two 1024-wide f32 layers on
v5e, 20 us a tick, now 10). At the end of the tick each stage sends its forward's output
to the next stage and its backward's input gradient to the previous one with
collective-permutes (a run of ticks without backwards sends nothing back, and one
without forwards nothing on). XLA's TPU compiler moves them to the top of the next tick
and waits for them there, before the tick's conditional: a value read two ticks later
(sent during the next tick's compute) was tried, and the compiler still waited before
the conditional. Values wait in slot buffers whose sizes the schedule computed, so
1F1B's program holds S microbatches' layer inputs where GPipe's holds M. Keeping only
the chunk's input (`keeps="stage-inputs"`, the step's `stage_keeps`) holds a chunk's
depth times less, and the backward runs the chunk's forward again to find them: a fifth
more compute, and with parameters in blocks a third more layer gathers.

The last stage runs the head (what follows the layers, up to the loss) of each
microbatch in its forward and seeds the backward with the head's gradient (where every
forward runs before any backward, every stage runs the heads once, between the two); the first
stage reads the microbatch's input and keeps its input gradient. Results that only one
stage has (the loss, the input gradients) are summed over the stage axis at the end; the
head's own gradients every stage takes after the ticks, from the last stage's outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from xla_strategies.passes.stages.chunk import (
    chunk_backward,
    chunk_forward,
    chunk_forward_into,
    depth,
    stacked,
    stashed,
)
from xla_strategies.passes.stages.heads import (
    head_and_seed,
    head_gradients,
    heads,
    seeds_where_read,
)
from xla_strategies.passes.stages.microbatch_draws import drawing_for
from xla_strategies.passes.stages.schedule_table import BACKWARD, FORWARD, WEIGHT, Schedule
from xla_strategies.passes.stages.slots import add_at, float_zeros, get, put
from xla_strategies.passes.stages.tick_tables import KINDS, arrivals, branch_of, runs_of, tables

#: what a stage's forward can keep of a microbatch for its backward (`StageProgram.keeps`)
KEEPS = ("layer-inputs", "stage-inputs")


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
    #: what a forward keeps for its backward: each layer's input ("layer-inputs"), or the
    #: chunk's input alone ("stage-inputs"; the backward runs the chunk forward again)
    keeps: str = "layer-inputs"
    #: where the head's weights are held in blocks over the replicas: its shared values'
    #: gradients (a list, None where a value has none) summed into those blocks
    head_blocks: Callable[[Any], Any] | None = None
    #: the dtype each microbatch's loss is kept in: float32, or the loss's own where wider
    #: (float64 under `jax_enable_x64`), so a pipelined loss loses no precision
    loss_dtype: Any = jnp.float32


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
    # a tick's actions: one lane, or a paired schedule's forward then backward
    lane_kinds = [(FORWARD,), (BACKWARD, WEIGHT)] if schedule.paired else [tuple(KINDS)]
    lane_tables = [tables(schedule, kinds) for kinds in lane_kinds]
    lanes = [{k: jnp.asarray(v) for k, v in t.items()} for t in lane_tables]
    arrive = {k: jnp.asarray(v) for k, v in arrivals(schedule).items()}
    m_count, stages = schedule.microbatches, schedule.stages
    last = schedule.virtual_stages * stages - 1
    x0 = jax.tree.map(lambda a: a[0], inputs)
    aux_shape = program.aux
    zeros = float_zeros
    buffers = lambda n, *per: jax.tree.map(  # noqa: E731
        lambda a: jnp.zeros((max(n, 1), *per, *a.shape), a.dtype), x0
    )
    state = {
        "F": buffers(schedule.slots["F"]),
        "B": buffers(schedule.slots["B"]),
        "stash": buffers(schedule.slots["stash"], *_kept_depth(program, weights)),
        "seed": buffers(schedule.slots["stash"]),
        "grad": buffers(schedule.slots["grad"]),  # zero-bubble: B's gradient kept for W
        "loss": jnp.zeros((m_count,), program.loss_dtype),
        "aux": jax.tree.map(lambda s: jnp.zeros((m_count, *s.shape), s.dtype), aux_shape),
        "d_weights": zeros(weights),
        "d_inputs": zeros(inputs),
        "d_layer_rows": zeros(layer_rows),
        "d_layer_shared": zeros(layer_shared),
        "head_in": buffers(m_count),  # the last stage's outputs, the head's inputs
        "recv_f": zeros(x0),
        "recv_b": zeros(x0),
    }
    ring = schedule.virtual_stages > 1
    forward_perm = [(d, (d + 1) % stages) for d in range(stages if ring else stages - 1)]
    backward_perm = [(d, (d - 1) % stages) for d in range(1 if not ring else 0, stages)]

    runs = runs_of([t["kind"] for t in lane_tables])
    # where every forward runs before any backward (GPipe, looped BFS), the head runs once
    # between the two, not in the forwards' ticks: there it made every stage wait, each
    # tick, for what the last stage runs in M of them
    head_between = len(runs) == 2 and all(KINDS[FORWARD] not in k for k in runs[1][2])
    head_in_ticks = None if head_between else (head_rows, head_shared)

    def tick(t: Any, state: dict, kinds: tuple[tuple[int, ...], ...]) -> dict:
        state = dict(state)
        state["F"] = put(state["F"], arrive["arrive_f"][t, stage], state["recv_f"])
        state["B"] = put(state["B"], arrive["arrive_b"][t, stage], state["recv_b"])
        send_f = send_b = zeros(x0)
        for lane, lane_run_kinds in zip(lanes, kinds, strict=True):
            if lane_run_kinds:
                state, f, b = action(
                    state, {k: v[t, stage] for k, v in lane.items()}, lane_run_kinds
                )
                send_f = f if KINDS[FORWARD] in lane_run_kinds else send_f
                send_b = b if KINDS[BACKWARD] in lane_run_kinds else send_b
        present = {k for lane_run_kinds in kinds for k in lane_run_kinds}
        # a run sends only the ways its actions send: a run of forwards sent zeros back
        # too, as long a permute as the activations', over the same link (for
        # Llama-3.1-405B's looped BFS, 8.5 of its 41.6 GB over DCN a step)
        state["recv_f"] = _sent(send_f, KINDS[FORWARD] in present, axis, forward_perm)
        state["recv_b"] = _sent(send_b, KINDS[BACKWARD] in present, axis, backward_perm)
        return state

    def action(state: dict, row: dict, kinds: tuple[int, ...]) -> tuple[dict, Any, Any]:
        """One lane's action in a tick: the state, and what it sends on and back."""
        g = row["chunk"] * stages + stage
        where = _Where(row, g == 0, g == last)
        actions = [
            lambda s: (s, zeros(x0), zeros(x0)),
            lambda s: _forward(
                s, where, program, weights, inputs, layer_rows, layer_shared, head_in_ticks
            ),
            lambda s: _backward(s, where, program, weights, layer_rows, layer_shared, split=False),
            lambda s: _weight_grad(s, where, program, weights, layer_rows, layer_shared),
        ]
        if schedule.slots["grad"]:  # zero-bubble: B is the input gradient only
            actions[2] = lambda s: _backward(
                s, where, program, weights, layer_rows, layer_shared, split=True
            )
        # only the kinds this run of ticks holds are branches, so a conditional's costliest
        # branch (what the step estimate charges a tick) is one some stage runs in it
        branch = jnp.asarray(branch_of(kinds))[row["kind"]]
        return lax.switch(branch, [actions[k] for k in (0, *kinds)], state)

    total = lambda tree: jax.tree.map(lambda v: lax.psum(v, axis), tree)  # noqa: E731
    for i, (start, stop, kinds) in enumerate(runs):
        if head_between and i == 1:
            state = heads(state, program, total(state["head_in"]), head_rows, head_shared)
            state = seeds_where_read(state, schedule, stage == stages - 1)
        state = lax.fori_loop(start, stop, functools.partial(tick, kinds=kinds), state)
    # every stage takes the head's gradients from the last one's outputs (sent across the
    # stages, not the gradients: a microbatch's activations, not an output layer's f32)
    d_head_rows, d_head_shared = head_gradients(
        program, total(state["head_in"]), head_rows, head_shared, m_count
    )
    return StageResult(
        loss=total(state["loss"]),
        aux=total(state["aux"]),
        weights=state["d_weights"],
        inputs=total(state["d_inputs"]),
        layer_rows=total(state["d_layer_rows"]),
        layer_shared=total(state["d_layer_shared"]),
        head_rows=d_head_rows,
        head_shared=d_head_shared,
    )


def _sent(values: Any, sends: bool, axis: str, perm: list[tuple[int, int]]) -> Any:
    """`values` permuted along `perm`, or zeros where the run sends nothing that way."""
    if not sends:
        return jax.tree.map(jnp.zeros_like, values)
    return jax.tree.map(lambda v: lax.ppermute(v, axis, perm), values)


def _kept_depth(program: StageProgram, weights: Any) -> tuple[int, ...]:
    """The stash's per-microbatch leading dimensions: one per layer, or none (the chunk's
    input alone)."""
    return (depth(weights),) if program.keeps == "layer-inputs" else ()


def _layer_inputs(s, where, program, weights, rows, shared):
    """Layer i's input of the microbatch `where` runs back through, as a function of i: the
    forward's, read in place, or found by running the chunk forward again from the chunk
    input it kept."""
    if program.keeps == "layer-inputs":
        return stashed(s["stash"], where.stash_slot)
    kept = get(s["stash"], where.stash_slot)
    return stacked(chunk_forward(program, weights, where.chunk, kept, rows, shared)[1])


@dataclass(frozen=True)
class _Where:
    """One stage's action in one tick: its table row and where its chunk sits."""

    row: dict
    first: Any
    last: Any

    def __getattr__(self, name: str) -> Any:
        return self.row[name]


def _drawing_for_its_microbatch(action: Callable[..., Any]) -> Callable[..., Any]:
    """A tick's action on the microbatch `where.micro`, its random draws that microbatch's."""

    @functools.wraps(action)
    def run(s, where, *args, **kwargs):
        with drawing_for(where.micro):
            return action(s, where, *args, **kwargs)

    return run


@_drawing_for_its_microbatch
def _forward(s, where, program, weights, inputs, layer_rows, layer_shared, head):
    """The microbatch `where` through the stage's chunk; on the last stage, its output kept
    for the head, and with `head` (its rows and shared values) the head run on it."""
    m, chunk = where.micro, where.chunk
    arrived = get(s["F"], jnp.maximum(where.in_slot, 0))
    x = jax.tree.map(lambda a, b: jnp.where(where.first, a, b), get(inputs, m), arrived)
    rows = get(layer_rows, m)
    if program.keeps == "layer-inputs":
        y, stash = chunk_forward_into(
            program, weights, chunk, x, rows, layer_shared, s["stash"], where.stash_slot
        )
    else:
        y, _ = chunk_forward(program, weights, chunk, x, rows, layer_shared)
        stash = put(s["stash"], where.stash_slot, x)
    s = dict(s, stash=stash)
    s["head_in"] = put(s["head_in"], jnp.where(where.last, m, -1), y)
    if head is None:  # it runs between the forwards and the backwards
        return s, y, jax.tree.map(jnp.zeros_like, y)
    head_rows, head_shared = head
    rows = get(head_rows, m)

    def head_and_seed_of(y):  # the head's own gradients are taken after the ticks
        (loss, aux), dy = head_and_seed(program, y, rows, head_shared)
        return loss, aux, dy

    def no_head(y):
        aux = program.aux
        return (
            jnp.zeros((), program.loss_dtype),
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux),
            float_zeros(y),
        )

    loss, aux, dy = lax.cond(where.last, head_and_seed_of, no_head, y)
    s["loss"] = put(s["loss"], m, loss.astype(program.loss_dtype))
    s["aux"] = put(s["aux"], m, aux)
    s["seed"] = put(s["seed"], where.stash_slot, dy)
    return s, y, jax.tree.map(jnp.zeros_like, y)


def _output_gradient(s, where):
    """The gradient of the chunk's output: the head's seed on the last stage, else what
    the next stage sent."""
    seed = get(s["seed"], where.stash_slot)
    arrived = get(s["B"], jnp.maximum(where.in_slot, 0))
    return jax.tree.map(lambda a, b: jnp.where(where.last, a, b), seed, arrived)


@_drawing_for_its_microbatch
def _backward(s, where, program, weights, layer_rows, layer_shared, split):
    m, chunk = where.micro, where.chunk
    rows = get(layer_rows, m)
    layer_inputs = _layer_inputs(s, where, program, weights, rows, layer_shared)
    dy = _output_gradient(s, where)
    if split:  # the input gradients only; the weight gradient is its own action
        s = dict(s, grad=put(s["grad"], where.stash_slot, dy))
    grads = chunk_backward(
        program, weights, chunk, layer_inputs, dy, rows, layer_shared, s, not split
    )
    s = dict(grads.state)
    s["d_layer_rows"] = add_at(s["d_layer_rows"], m, grads.rows)
    s["d_inputs"] = add_at(
        s["d_inputs"], m, jax.tree.map(lambda d: jnp.where(where.first, d, 0), grads.x)
    )
    return s, jax.tree.map(jnp.zeros_like, grads.x), grads.x


@_drawing_for_its_microbatch
def _weight_grad(s, where, program, weights, layer_rows, layer_shared):
    chunk, rows = where.chunk, get(layer_rows, where.micro)
    layer_inputs = _layer_inputs(s, where, program, weights, rows, layer_shared)
    dy = get(s["grad"], where.stash_slot)
    grads = chunk_backward(program, weights, chunk, layer_inputs, dy, rows, layer_shared, s, True)
    zero = jax.tree.map(jnp.zeros_like, layer_inputs(0))
    return grads.state, zero, zero
