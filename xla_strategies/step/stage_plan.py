"""The pipeline a step runs on a strategy with stages, from its compile options.

`pipeline_stages` is the strategy's (its mesh has the stage axis); `microbatches`,
`schedule` and `virtual_stages` are the step's. Options that pipeline a step on a strategy
without stages are an error, not ignored; a plan that does not fit (a schedule's rule on
microbatches, an unknown schedule) fails at `strategy.compile`, before any trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from xla_strategies.core.layout import STAGE_AXIS, Layout
from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.passes.bridge.microbatches import microbatched, rows_per_microbatch
from xla_strategies.passes.bridge.pipelined_gradients import (
    Pipelined,
    StagePlan,
    pipelined_then_replayed,
)
from xla_strategies.passes.bridge.stage_blocks import split_over_the_model_axis
from xla_strategies.passes.pipeline import PassPipeline, with_pass
from xla_strategies.passes.stages.schedules import DEFAULT_SCHEDULE, INTERLEAVED_SCHEDULES
from xla_strategies.passes.transforms.shard_parameters import ShardParameters
from xla_strategies.passes.transforms.shard_weight_updates import ShardWeightUpdates
from xla_strategies.step.compile_options import CompileOptions
from xla_strategies.step.pipeline_choice import alternatives

_OPTIONS = ("microbatches", "schedule", "virtual_stages", "stage_keeps")


def stage_plan(
    strategy: Any, options: CompileOptions, block_axes: Callable[[], Sequence[str]] = tuple
) -> StagePlan | None:
    """The step's `StagePlan`, or None on a strategy without stages. With
    `shard_parameters=True` each stage holds its layers in blocks over `block_axes()` (the
    replica axes shard-parameters splits over)."""
    stages = getattr(strategy, "pipeline_stages", 1)
    asked = [name for name in _OPTIONS if getattr(options, name) is not None]
    if stages == 1:
        if asked:
            raise ValueError(
                f"{', '.join(f'{name}=' for name in asked)} pipeline a step over stages, "
                f"and {type(strategy).__name__} has none: give it pipeline_stages > 1"
            )
        return None
    schedule = options.schedule or DEFAULT_SCHEDULE
    interleaved = schedule in INTERLEAVED_SCHEDULES
    microbatches = stages if options.microbatches is None else options.microbatches
    # microbatch losses combine as the replicas' do: a mean, or a sum under ReduceOp.SUM
    per_microbatch = 1.0 if options.gradient_reduction is ReduceOp.SUM else 1.0 / microbatches
    plan = StagePlan(
        stages,
        microbatches,
        schedule,
        options.virtual_stages or (2 if interleaved else 1),
        STAGE_AXIS,
        seed=per_microbatch,
        block_axes=_block_axes(strategy, options, block_axes),
        keeps=options.stage_keeps or "layer-inputs",
    )
    plan.table()  # a plan that does not fit fails here, naming what
    return plan


def _block_axes(
    strategy: Any, options: CompileOptions, block_axes: Callable[[], Sequence[str]]
) -> tuple[str, ...]:
    if not options.shard_parameters:
        return ()
    axes = tuple(block_axes())
    if options.axis_name is None or tuple(strategy.replica_axes) == (options.axis_name,):
        return axes
    # the step is traced on one replica axis named `axis_name` (`capture_mesh`), the
    # strategy's replica axes merged in their order: blocks over them all (in that order;
    # an axis of one device numbers nothing) are blocks over it
    spanned = lambda names: [a for a in names if strategy.mesh.shape[a] > 1]  # noqa: E731
    if spanned(axes) != spanned(strategy.replica_axes):
        raise ValueError(
            f"shard_parameters=True with pipeline stages and axis_name="
            f"{options.axis_name!r} holds each stage's layers in blocks over {list(axes)}, "
            f"some of the replica axes {list(strategy.replica_axes)} that axis_name names "
            "as one: not supported yet, drop axis_name"
        )
    return (options.axis_name,)


def check_pipelined(plan: StagePlan | None, pipelined: Pipelined, name: str) -> None:
    """Raise where a step with stages took no gradient the stages could pipeline: its
    stages would sit idle, silently."""
    if plan is not None and not pipelined.gradients:
        raise ValueError(
            f"{name}: the strategy has pipeline_stages={plan.stages}, and the step takes no "
            "gradient with jax.grad or jax.value_and_grad to pipeline"
        )


def staged_pipeline(
    pipeline: PassPipeline, plan: StagePlan | None, options: CompileOptions
) -> PassPipeline:
    """The pass pipeline of a step with stages: only the passes that give its reductions
    their meaning (and, with `shard_parameters=True`, the two sharding passes), unless
    the step names its own. The others keep the layer stack's
    gradients (held split over the stages) out of their buckets and decompositions, and
    still lose: on 2xv5e-16 (an 8-layer, 1024-wide stack, 2 stages, GPipe over 8
    microbatches) every pass gives 36.55 MiB a chip and a 1.60 ms step, these 36.13 MiB
    and 1.47 ms (the embedding's and head's small reductions decomposed cost latency)."""
    if plan is None or options.pipeline is not None:
        return pipeline
    asked = ["remat_policy"] if options.remat_policy else []
    if options.shard_weight_updates and not options.shard_parameters:  # else implied
        asked.insert(0, "shard_weight_updates")
    if asked:  # their passes are the ones left out: the option would do nothing
        raise ValueError(
            f"{asked[0]}={getattr(options, asked[0])!r} is not supported with pipeline stages "
            "yet: a pipelined step runs only the passes that give its reductions meaning "
            "(and shard_parameters' own)"
        )
    staged = alternatives(pipeline).get("replicated", pipeline)
    if options.shard_parameters:  # the stage program gathers its layers from their blocks
        staged = with_pass(with_pass(staged, ShardParameters(mode="on")), ShardWeightUpdates())
    return staged


def on_microbatches(
    step: Callable[..., list[Any]],
    plan: StagePlan | None,
    specs: Sequence[Any],
    gradient_reduction: ReduceOp | None,
) -> Callable[..., list[Any]]:
    """`step` (flat arrays in and out) traced on the plan's microbatches of its batch
    arguments (`microbatches.microbatched`), the pipelined gradient told which dimension
    the model axis splits each argument on, then on the whole batch with the gradients
    the microbatches took (`gradient_replay`); itself without a plan. The loss is the
    microbatches' mean, or with `ReduceOp.SUM` their sum."""
    if plan is None:
        return step
    rows = [spec.layout is Layout.SPLIT for spec in specs]
    mean = gradient_reduction is not ReduceOp.SUM
    run = microbatched(step, rows, plan.microbatches, mean)
    model_dims = [getattr(spec, "model_dim", None) for spec in specs]

    def traced(*flat: Any) -> list[Any]:
        per_microbatch = rows_per_microbatch(flat, rows, plan.microbatches)
        with split_over_the_model_axis(flat, model_dims):
            return pipelined_then_replayed(
                lambda: run(*flat), lambda: step(*flat), per_microbatch, mean
            )

    return traced
