"""The stage program of a pipelined gradient: the schedule's loop of ticks
(`stages.executor`) run as one `shard_map` manual over the stage axis, on microbatches of
the rows, each stage's layers taken from their blocks (`stage_blocks`) and, interleaved,
sent round the stages (`stages.round_robin`). `pipelined_gradients` builds its inputs and
takes its gradients back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from xla_strategies.passes.bridge.stage_blocks import gathered, replica_block, scattered
from xla_strategies.passes.stages import executor
from xla_strategies.passes.stages.round_robin import round_robin, stack_order


@dataclass(frozen=True)
class Held:
    """Where the stage program's weights are held in blocks over the replicas
    (`stage_blocks.block_dims`; None: whole) and where the model axis splits them (None:
    whole over it): the stacked weights', and the head's shared values'."""

    stack: list
    stack_model: list
    head: list
    head_model: list


def pick(values: list, mask: list[bool], want: bool) -> list:
    """The `values` whose flag in `mask` is `want`."""
    return [x for x, r in zip(values, mask, strict=True) if r == want]


def run_stages(plan, stack, carry, consts, xs, kept, rows_mask, held) -> executor.StageResult:
    """The schedule's loop, manual over the stage axis, on microbatches of the rows
    (`rows_mask`: the layers' and the head's), the weights held as `held` says."""
    s, v = plan.stages, plan.virtual_stages
    chunk = stack.length // (s * v)
    layer_rows, head_rows = rows_mask
    dims = held.stack
    xs = [
        x if d is None else replica_block(x, d, plan.block_axes)
        for x, d in zip(xs, dims, strict=True)
    ]
    # each stage gets its block of the stack as the stack is held between steps ([S*V]
    # chunks split over the stages): no weight moves. Interleaved chunks go round the
    # stages, stage d's chunk c the global chunk c*S + d: `round_robin` sends each stage
    # the chunks it runs
    weights = [x.reshape(s * v, chunk, *x.shape[1:]) for x in xs]
    weights_spec = P(plan.axis)

    read_as = stack.xs_read_as or (None,) * len(xs)

    def layer(w, x, rows, shared):
        # a layer held in blocks is gathered where it is read (as the type the layer reads
        # it as); JAX's transpose of the gather reduce-scatters its gradient into the
        # stage's blocks
        whole = [
            gathered(a, d, plan.block_axes, t, m)
            for a, d, t, m in zip(w, dims, read_as, held.stack_model, strict=True)
        ]
        return stack.layer(whole, x, merge(layer_rows, rows, shared))

    def head(y, rows, shared):
        out = stack.after(y, merge(head_rows, rows, shared))
        return out[0], out[1:]

    # the head's weights, where held in blocks, get their gradient summed into the blocks
    def head_blocks(grads):
        held_at = zip(grads, held.head, held.head_model, strict=True)
        return [scattered(g, d, plan.block_axes, m) for g, d, m in held_at]

    def body(w, inputs, lrows, lshared, hrows, hshared):
        if v > 1:  # each [V, chunk, ...], as the stage runs its chunks
            w = [round_robin(x, s, plan.axis) for x in w]
        program = executor.StageProgram(
            layer,
            head,
            plan.seed,
            stack.staged_aux,
            plan.keeps,
            head_blocks if any(d is not None for d in held.head) else None,
            jnp.promote_types(loss_dtype(stack), jnp.float32),
        )
        r = executor.run(
            plan.table(), program, w, inputs, lrows, lshared, hrows, hshared, plan.axis
        )
        if v == 1:
            return vars(r)
        in_stack_order = [None if g is None else stack_order(g, s, plan.axis) for g in r.weights]
        return {**vars(r), "weights": in_stack_order}

    args = (
        weights,
        list(carry),
        pick(consts, layer_rows, True),
        pick(consts, layer_rows, False),
        pick(kept, head_rows, True),
        pick(kept, head_rows, False),
    )
    # inside, unchecked types say nothing of the replicas, so no reduction across them runs
    # in the loop: every result is this replica's, summed across replicas once, after it
    # (`_summed_like`)
    specs = (weights_spec, P(), P(), P(), P(), P())
    out_specs = {f: weights_spec if f == "weights" else P() for f in _RESULT_FIELDS}
    out = jax.shard_map(
        body, in_specs=specs, out_specs=out_specs, axis_names={plan.axis}, check_vma=False
    )(*args)
    return executor.StageResult(**jax.tree.map(_the_replicas_own, out))


def _the_replicas_own(x: Any) -> Any:
    """`x`, a result of the stage program, typed and traced as what it is: this replica's
    own. The unchecked program types its results as the same on every replica, and the
    passes would take them at their word (a sum across replicas folded into N times one
    replica's value). Adding a zero computed from the replica's index says otherwise."""
    replicas = tuple(sorted(manual_axes()))
    if not replicas:
        return x
    return x + (jax.lax.axis_index(replicas) * 0).astype(x.dtype)


_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(executor.StageResult))


def merge(mask: list[bool], rows: list, shared: list) -> list:
    r, s = iter(rows), iter(shared)
    return [next(r) if is_row else next(s) for is_row in mask]


def loss_dtype(stack: Any) -> Any:
    """The dtype of the loss the function returns (the executor keeps it at least
    float32)."""
    return stack.outputs[0].dtype


def manual_axes() -> frozenset[str]:
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(getattr(mesh, "manual_axes", ()) or ())
