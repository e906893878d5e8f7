"""The head of a pipelined loss (what follows the layers, up to the loss): its loss and the
gradient that seeds each microbatch's backward, and its own gradients, taken after the
ticks from the last stage's outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xla_strategies.passes.stages.chunk import vjp
from xla_strategies.passes.stages.microbatch_draws import drawing_for
from xla_strategies.passes.stages.schedules import FORWARD
from xla_strategies.passes.stages.slots import float_zeros, get, plus, put


def head_and_seed(program, y, rows, shared):
    """`((loss, aux), dy)`: the head's loss of the last stage's output `y`, and the
    gradient that seeds the microbatch's backward."""
    (loss, aux), pullback = vjp(lambda y: program.head(y, rows, shared), y, has_aux=True)
    (dy,) = pullback(jnp.full_like(loss, program.seed))
    return (loss, aux), dy


def heads(s, program, head_in, head_rows, head_shared):
    """Every microbatch's head, run between the forwards and the backwards on the last
    stage's outputs (`head_in`, on every stage): its loss and auxiliary outputs, and the
    gradients that seed the backwards, by microbatch in `s["seed_of"]`."""

    def one(_, m):
        with drawing_for(m):
            (loss, aux), dy = head_and_seed(
                program, get(head_in, m), get(head_rows, m), head_shared
            )
        return None, (loss.astype(program.loss_dtype), aux, dy)

    _, (loss, aux, dy) = lax.scan(one, None, jnp.arange(s["loss"].shape[0]))
    return dict(s, loss=loss, aux=aux, seed_of=dy)


def seeds_where_read(s, schedule, last_device):
    """The seeds `heads` made, put in the slots the last stage's backwards read them from
    (each microbatch's stage input's); the loss and auxiliary outputs kept on the last
    device alone, as the ticks keep them (they are summed across the stages)."""
    slots = np.zeros(schedule.microbatches, np.int32)
    for step in schedule.steps[-1]:
        if step.action.kind == FORWARD and step.action.chunk == schedule.virtual_stages - 1:
            slots[step.action.microbatch] = step.stash_slot
    s = dict(s)
    seeds, seed = s.pop("seed_of"), s["seed"]
    for m, slot in enumerate(slots.tolist()):
        seed = put(seed, slot, get(seeds, m))
    keep = lambda v: jnp.where(last_device, v, jnp.zeros_like(v))  # noqa: E731
    return dict(s, seed=seed, loss=keep(s["loss"]), aux=jax.tree.map(keep, s["aux"]))


def head_gradients(program, head_in, head_rows, head_shared, microbatches):
    """The head's gradients of each microbatch's rows and of its shared values (summed),
    from the head's input each microbatch's forward kept, taken after the ticks: in them,
    a sum of the shared values' gradients (an output layer's, f32) was a loop value each
    tick's conditional and each loop of ticks held a copy of (Llama-3.1-405B: 5 of 8 GiB
    each, a chip). Where the program says how (`StageProgram.head_blocks`), each
    microbatch's is summed into the blocks its weights are held in: a whole sum beside
    each microbatch's whole gradient was another 8 GiB."""
    to_blocks = program.head_blocks or (lambda d: d)

    def one(d_shared, m):
        with drawing_for(m):
            (loss, _), pullback = vjp(
                program.head, get(head_in, m), get(head_rows, m), head_shared, has_aux=True
            )
        _, d_rows, d_m = pullback(jnp.full_like(loss, program.seed))
        return plus(d_shared, to_blocks(d_m)), d_rows

    blocks = jax.eval_shape(to_blocks, float_zeros(head_shared))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), blocks)
    d_shared, d_rows = lax.scan(one, zeros, jnp.arange(microbatches))
    return d_rows, d_shared
