"""The pipeline a step runs on a strategy with stages, from its compile options.

`pipeline_stages` is the strategy's (its mesh has the stage axis); `microbatches`,
`schedule` and `virtual_stages` are the step's. Options that pipeline a step on a strategy
without stages are an error, not ignored; a plan that does not fit (a schedule's rule on
microbatches, an unknown schedule) fails at `strategy.compile`, before any trace.
"""

from __future__ import annotations

from typing import Any

from xla_strategies.core.layout import STAGE_AXIS
from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.passes.bridge.pipelined_gradients import Pipelined, StagePlan
from xla_strategies.step.compile_options import CompileOptions

_OPTIONS = ("microbatches", "schedule", "virtual_stages")


def stage_plan(strategy: Any, options: CompileOptions) -> StagePlan | None:
    """The step's `StagePlan`, or None on a strategy without stages."""
    stages = getattr(strategy, "pipeline_stages", 1)
    asked = [name for name in _OPTIONS if getattr(options, name) is not None]
    if stages == 1:
        if asked:
            raise ValueError(
                f"{', '.join(f'{name}=' for name in asked)} pipeline a step over stages, "
                f"and {type(strategy).__name__} has none: give it pipeline_stages > 1"
            )
        return None
    schedule = options.schedule or "1f1b"
    interleaved = schedule == "interleaved-1f1b"
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
    )
    plan.table()  # a plan that does not fit fails here, naming what
    return plan


def check_pipelined(plan: StagePlan | None, pipelined: Pipelined, name: str) -> None:
    """Raise where a step with stages took no gradient the stages could pipeline: its
    stages would sit idle, silently."""
    if plan is not None and not pipelined.gradients:
        raise ValueError(
            f"{name}: the strategy has pipeline_stages={plan.stages}, and the step takes no "
            "gradient with jax.grad or jax.value_and_grad to pipeline"
        )
