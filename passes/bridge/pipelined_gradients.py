"""Pipelined gradients: the user's `jax.grad` of a scanned model, run as a schedule.

A step with pipeline stages is traced on microbatches (`microbatches.microbatched`: a
vmap over M microbatches of its batch). There `jax.value_and_grad` and `jax.grad` (which
both take their pullback from `jax._src.api.vjp`) differentiate a loss through
`pipelined_vjp`: the loss, traced at one microbatch's shapes, is split at its layer scan
(`layer_stack`); every value it reads that depends on the batch (an argument, or read from
its closure) is found with its microbatches stacked; the stacked weights are split over
the stage axis; and the schedule's loop of ticks (`stages.executor`) computes every
microbatch's loss and the gradient of all of them in one pass, inside a `shard_map`
manual over the stage axis. What precedes the layers (the embedding) runs on each
microbatch and is differentiated by JAX as usual, so the gradients of mirrored weights are
reduced across replicas as in a step without stages.

The step sees its microbatch's loss and auxiliary outputs; the gradient is of them all,
combined as the replicas' are (their mean, or with `ReduceOp.SUM` their sum), so a loss
that is a mean over its rows gives the gradient of the whole batch's mean. Each gradient
is recorded (`gradient_replay.Taken`), and the step is then run on its whole batch with
the gradients recorded (`pipelined_then_replayed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from xla_strategies.core.patching import patched, set_in_this_thread
from xla_strategies.passes.bridge.gradient_replay import Replay, Taken
from xla_strategies.passes.bridge.layer_stack import split
from xla_strategies.passes.bridge.microbatches import (
    around_the_microbatches,
    as_microbatches,
    outside,
    stacked_microbatches,
    tracing_microbatches,
)
from xla_strategies.passes.bridge.stage_blocks import block_dims, model_dim_of, whole
from xla_strategies.passes.bridge.stage_program import (
    Held,
    loss_dtype,
    manual_axes,
    merge,
    pick,
    run_stages,
)
from xla_strategies.passes.bridge.trace_hooks import (
    AUTODIFF_SCOPE,
    STAGE_SPLIT_SCOPE,
    varying_axes,
    varying_over,
    vma,
)
from xla_strategies.passes.stages import executor
from xla_strategies.passes.stages.microbatch_draws import drawing_for
from xla_strategies.passes.stages.schedules import DEFAULT_SCHEDULE, Schedule, schedule
from xla_strategies.passes.stages.slots import is_float, zero_cotangent

STAGE_AXIS = "stage"


@dataclass(frozen=True)
class StagePlan:
    """How a step's gradients are pipelined: `stages` over the mesh axis `axis`,
    `microbatches` per replica's batch, and the schedule by name. With `block_axes`,
    each stage holds its layers in blocks over those replica axes (FSDP within a stage)."""

    stages: int
    microbatches: int
    schedule: str = DEFAULT_SCHEDULE
    virtual_stages: int = 1
    axis: str = STAGE_AXIS
    seed: float = 0.0  # each microbatch loss's weight: 1/M (a mean) unless given
    # parameter sharding within each stage: the replica axes the stack's layers are held
    # split over (shard-parameters' own), each layer gathered where a tick reads it
    block_axes: tuple[str, ...] = ()
    # what a forward keeps for its backward (`executor.StageProgram.keeps`)
    keeps: str = "layer-inputs"

    def __post_init__(self) -> None:
        if not self.seed:
            object.__setattr__(self, "seed", 1.0 / self.microbatches)

    def table(self) -> Schedule:
        return schedule(self.schedule, self.stages, self.microbatches, self.virtual_stages)


@dataclass
class Pipelined:
    """What a trace pipelined: how many gradients (a step that pipelined none asked for
    stages it does not use), and the values its layer scans took as stacked weights (the
    arrays the step passed in; a compiled step holds those split over the stages)."""

    gradients: int = 0
    stacked: list[Any] = dataclasses.field(default_factory=list)
    taken: list[Taken] = dataclasses.field(default_factory=list)  # each gradient's values
    replay: Replay | None = None  # while the step runs on its whole batch (`gradient_replay`)


@contextlib.contextmanager
def pipelining_gradients(plan: StagePlan | None) -> Iterator[Pipelined]:
    """While a step is traced on microbatches (`microbatches.microbatched`), gradients
    taken with `jax.grad`/`jax.value_and_grad`/`jax.vjp` in this thread are pipelined by `plan`;
    yields what was (`Pipelined`). Does nothing for `plan=None`. Other threads' traces
    (the planner's, which capture several configurations at once) keep their own plans."""
    record = Pipelined()
    if plan is None:
        yield record
        return
    from jax._src import api

    # False: not inside a pipelined gradient
    with (
        set_in_this_thread(_pipelining, "state", [plan, record, False]),
        patched(api, "vjp", _pipelining_the_threads_gradients),
        # a step's own `jax.vjp` (`jax.grad` calls the module's)
        patched(jax, "vjp", _pipelining_the_threads_gradients),
    ):
        yield record


_pipelining = threading.local()  # this thread's [plan, record, inside], while it pipelines


def pipelined_then_replayed(
    on_microbatches: Callable[[], Any],
    on_the_batch: Callable[[], Any],
    rows_per_microbatch: int,
    mean: bool,
) -> Any:
    """`on_microbatches()` (the step traced on microbatches, where its gradients are
    pipelined), then what `on_the_batch()` (the step on the whole batch) returns, its
    gradients those the microbatches took, in order (`gradient_replay`)."""
    record = _pipelining.state[1]
    start = len(record.taken)
    on_microbatches()
    record.replay = Replay(record.taken[start:], rows_per_microbatch, mean)
    try:
        result = on_the_batch()
        record.replay.check_all_given()
        return result
    finally:
        record.replay = None


def _pipelining_the_threads_gradients(original: Callable[..., Any]) -> Callable[..., Any]:
    def vjp(fun: Callable[..., Any], *primals: Any, has_aux: bool = False, **kw: Any) -> Any:
        state = getattr(_pipelining, "state", None)
        # a gradient the pipelined loss itself takes is JAX's
        if state is None or state[2]:
            return original(fun, *primals, has_aux=has_aux, **kw)
        plan, record, _ = state
        if record.replay is not None:  # the step on its whole batch
            given = functools.partial(record.replay.next, fun, primals, has_aux)
        elif tracing_microbatches():
            record.gradients += 1
            given = functools.partial(
                pipelined_vjp, plan, fun, primals, has_aux, record.stacked, record.taken
            )
        else:
            return original(fun, *primals, has_aux=has_aux, **kw)
        state[2] = True  # the loss, run in there, takes JAX's own gradients
        try:
            return given()
        finally:
            state[2] = False

    return vjp


def pipelined_vjp(
    plan: StagePlan,
    fun: Callable[..., Any],
    primals: tuple,
    has_aux: bool,
    stacked: list[Any] | None = None,
    taken: list[Taken] | None = None,
) -> tuple[Any, ...]:
    """`jax.vjp(fun, *primals, has_aux=has_aux)` of a scalar loss, pipelined by `plan`,
    traced on microbatches: the values it reads that depend on the batch, as arguments or
    from its closure, are one microbatch's, and their microbatches are found stacked
    (`stacked_microbatches`). The inputs the layer scan takes as its stacked weights are
    appended to `stacked`; what it gives the step, to `taken` (`gradient_replay.Taken`)."""
    flat, in_tree = jax.tree.flatten(tuple(primals))
    trees: dict[str, Any] = {}

    def flat_fun(*leaves: Any) -> list[Any]:
        result = fun(*jax.tree.unflatten(in_tree, leaves))
        out, aux = result if has_aux else (result, None)
        if jnp.shape(out) != ():
            raise ValueError(
                f"pipeline stages differentiate a scalar loss; got shape {jnp.shape(out)}"
            )
        aux_leaves, trees["aux"] = jax.tree.flatten(aux)
        return [out, *aux_leaves]

    stack = split(flat_fun, flat, plan.stages * plan.virtual_stages)
    inputs = [*stack.closed_over, *flat]
    row_mask = [stacked_microbatches(x) is not None for x in inputs]
    wanted = [False] * len(stack.closed_over) + [is_float(x) for x in flat]
    mb_mask = stack.depends(row_mask)
    if not all(mb_mask[0]):
        raise ValueError(
            "pipeline stages split the layers' activations into microbatches of the batch; "
            "the activations the layers carry do not depend on the step's batch"
        )
    if stacked is not None:
        stacked.extend(inputs[i] for i in stack.xs_inputs if i is not None)
    replicas = manual_axes()
    with around_the_microbatches():  # one program for all microbatches, unbatched
        values = [outside(x) for x in inputs]
        # the dimension the model axis splits each stacked weight and each value the head
        # reads on, where it is an argument of the step
        model_of = lambda at: [None if i is None else model_dim_of(values[i]) for i in at]  # noqa: E731
        result, before_pullback, outputs, held = _pipelined(
            plan, stack, values, row_mask, wanted, mb_mask,
            (model_of(stack.xs_inputs), model_of(stack.kept_inputs)),
        )  # fmt: skip
        losses = varying_over(result.loss.astype(loss_dtype(stack)), replicas)
        aux = [varying_over(a, replicas) for a in result.aux]
        cotangents, stacked_at, head_at = _cotangents(result, mb_mask)
    # the step sees its microbatch's loss and auxiliary outputs, as it was traced; one the
    # layers do not reach (the model state flax NNX's gradients return, an advanced RNG
    # count) is computed here from the step's own values, not taken out of the stages as
    # each replica's copy, once per microbatch
    loss = as_microbatches(losses)
    staged, apart = iter(aux), iter(stack.outputs_apart(*inputs))
    aux = [next(apart) if a else as_microbatches(next(staged)) for a in stack.apart[1:]]
    given = Taken(
        outside(loss),
        [outside(a) for a in aux],
        [stacked_microbatches(a) is not None for a in aux],
        trees["aux"],
        in_tree,
        stack.reductions[1:],
    )
    if taken is not None:
        taken.append(given)

    def pullback(ct: Any) -> tuple[Any, ...]:
        # `jax.grad`'s seed, one on every microbatch: the gradient is of all of them, the
        # sum of each one's weighted by the plan's seed (their mean), whole, not one each
        del ct
        with around_the_microbatches():
            at = [*stacked_at, *head_at]  # the head's summed into its blocks (`scattered`)
            dims = [*held.stack, *held.head]
            in_blocks = {i: d for i, d in zip(at, dims, strict=True) if d is not None}
            summed = [
                whole(c, in_blocks[i], plan.block_axes, replicas).astype(p.dtype)
                if i in in_blocks
                else _summed_like(
                    p, None if c is None else varying_over(c, replicas), i in stacked_at
                )
                for i, (p, c) in enumerate(zip(outputs, cotangents, strict=True))
            ]
            grads = iter(before_pullback(summed))
            full = [next(grads) if w else None for w in wanted][len(stack.closed_over) :]
            cts = [
                g if g is not None else zero_cotangent(x)
                for g, x in zip(full, values[len(stack.closed_over) :], strict=True)
            ]
        given.cotangents = cts
        return tuple(jax.tree.unflatten(in_tree, cts))

    aux_tree = jax.tree.unflatten(trees["aux"], aux)
    return (loss, pullback, aux_tree) if has_aux else (loss, pullback)


def _pipelined(plan, stack, flat, row_mask, wanted, mb_mask, model_dims):
    """`before` run on every microbatch (`flat`: the inputs, each flagged in `row_mask`
    stacked over the microbatches; its outputs that depend on them stacked too) and the
    rest once, differentiated by JAX; then the schedule. Returns the executor's result,
    `before`'s pullback, its outputs, and where the weights are held (`Held`;
    `model_dims`: the model axis's dimension of each stacked weight and each value the
    head reads, where known)."""
    stacked_args = flat
    flags = [f for group in mb_mask for f in group]

    def before(*diff: Any) -> list:
        it = iter(diff)
        args = [next(it) if w else x for x, w in zip(stacked_args, wanted, strict=True)]
        in_axes = [0, *(0 if r else None for r in row_mask)]

        def before_one(m, *a):  # what precedes the layers draws for its microbatch
            with drawing_for(m):
                return _flat(stack.before(*a))

        per_microbatch = jax.vmap(before_one, in_axes=in_axes)(jnp.arange(plan.microbatches), *args)
        once = _flat(stack.before(*[a[0] if r else a for a, r in zip(args, row_mask, strict=True)]))
        return [p if f else o for p, o, f in zip(per_microbatch, once, flags, strict=True)]

    diff = [x for x, w in zip(stacked_args, wanted, strict=True) if w]
    outputs, before_pullback = jax.vjp(before, *diff)
    sizes = [len(g) for g in mb_mask]
    carry, consts, xs, kept = _groups(outputs, sizes)
    xs_model, kept_model = model_dims
    head_model = pick(kept_model or [None] * len(kept), mb_mask[3], False)
    held = Held(
        block_dims(plan.block_axes, xs, model_dims=xs_model),
        xs_model,
        block_dims(plan.block_axes, pick(kept, mb_mask[3], False), False, head_model),
        head_model,
    )
    result = run_stages(plan, stack, carry, consts, xs, kept, (mb_mask[1], mb_mask[3]), held)
    return result, before_pullback, outputs, held


def _flat(groups: tuple) -> list:
    return [x for group in groups for x in group]


def _groups(values: list, sizes: list[int]) -> list[list]:
    out, at = [], 0
    for n in sizes:
        out.append(list(values[at : at + n]))
        at += n
    return out


def _cotangents(result: executor.StageResult, mb_mask: tuple) -> tuple[list, range, list]:
    """The executor's gradients, one per output of `before` (per microbatch where that
    output is); where the layer stack's (held split over the stages) are among them, and
    where the head's shared values' are."""
    d_consts = merge(mb_mask[1], list(result.layer_rows), list(result.layer_shared))
    d_kept = merge(mb_mask[3], list(result.head_rows), list(result.head_shared))
    # each [S*V, chunk, ...], in the stack's order
    d_xs = [None if a is None else a.reshape(-1, *a.shape[2:]) for a in result.weights]
    start = len(result.inputs) + len(d_consts)
    kept_at = start + len(d_xs)
    head_at = [kept_at + j for j, is_row in enumerate(mb_mask[3]) if not is_row]
    return [*result.inputs, *d_consts, *d_xs, *d_kept], range(start, start + len(d_xs)), head_at


def _summed_like(primal: Any, cotangent: Any, stage_split: bool = False) -> Any:
    """`cotangent` as the gradient of `primal`: summed over the replica axes `primal` does
    not vary over (in autodiff's scope, as pvary's transpose sums; `stage_split`: a layer
    stack's, which the passes keep out of buckets), float0 for a value that has no
    gradient."""
    if cotangent is None:
        return zero_cotangent(primal)
    extra = tuple(sorted(vma(cotangent) - set(varying_axes(jax.typeof(primal)))))
    if extra:
        scope = f"{AUTODIFF_SCOPE}/{STAGE_SPLIT_SCOPE}" if stage_split else AUTODIFF_SCOPE
        with jax.named_scope(scope):
            cotangent = jax.lax.psum(cotangent, extra)
    return cotangent.astype(primal.dtype)
