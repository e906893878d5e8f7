"""A step's pass pipeline, composed in one place by one rule.

1. The base: the pipeline the user wrote (`compile(pipeline=...)`, or
   `XLA_STRATEGIES_PIPELINE`), taken as written; else `DEFAULT_PIPELINE` with the
   strategy's `PipelineChanges` (passes it adds or leaves out).
2. The settings: options that user-facing settings give a pass (the strategy's, such as
   `CommunicationOptions(bytes_per_pack=...)`, then the step's `gradient_reduction`), filled
   in where the base left them unset; a base that set another value is an error naming both.
3. The step's forcing options: `shard_parameters` and `shard_weight_updates` turn those
   passes on (inserted where `PASS_ORDER` puts them) or off (disabled), in place of the cost
   model's choice.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.passes import DEFAULT_PIPELINE
from xla_strategies.passes.pipeline import (
    PassPipeline,
    dropping_pass,
    fill_options,
    with_pass,
    without_pass,
)
from xla_strategies.passes.transforms.insert_reductions import InsertReductions
from xla_strategies.passes.transforms.shard_parameters import ShardParameters
from xla_strategies.passes.transforms.shard_weight_updates import ShardWeightUpdates
from xla_strategies.step.step_strategy import Setting, StepStrategy


@dataclass(frozen=True)
class PipelineOptions:
    """A step's compile options that shape its pipeline (each None: not chosen)."""

    spec: str | PassPipeline | None = None
    gradient_reduction: ReduceOp | None = None
    shard_weight_updates: bool | None = None
    shard_parameters: bool | None = None

    def settings(self) -> tuple[Setting, ...]:
        if self.gradient_reduction is None:
            return ()
        source = f"compile(gradient_reduction={self.gradient_reduction.name})"
        return (
            Setting(
                InsertReductions, source, {"gradient_reduction": self.gradient_reduction.value}
            ),
        )


def step_pipeline(strategy: StepStrategy, options: PipelineOptions) -> PassPipeline:
    """The pipeline a step of `strategy` runs, by the rule in this module's docstring."""
    pipeline = _base(strategy, options.spec)
    for setting in (*strategy.pipeline_settings(), *options.settings()):
        pipeline = fill_options(pipeline, setting.pass_class, setting.source, **setting.options)
    return _forced(pipeline, options.shard_weight_updates, options.shard_parameters)


def _base(strategy: StepStrategy, spec: str | PassPipeline | None) -> PassPipeline:
    if isinstance(spec, PassPipeline):
        return spec
    if spec is not None:
        pipeline = PassPipeline.from_spec(spec)
        _warn_if_dropping_strategy_passes(strategy, pipeline)
        return pipeline
    pipeline = PassPipeline.from_spec(DEFAULT_PIPELINE)
    changes = strategy.pipeline_changes()
    for name in changes.leave_out:
        pipeline = dropping_pass(pipeline, name)
    for pass_ in changes.add:
        pipeline = with_pass(pipeline, pass_)
    return pipeline


def _warn_if_dropping_strategy_passes(strategy: StepStrategy, pipeline: PassPipeline) -> None:
    """A spec is taken as written: say so when it leaves out a pass the strategy adds
    (a spec built from DEFAULT_PIPELINE drops TPUStrategy's decompose-all-reduces)."""
    names = {p.name for p in pipeline.passes}
    dropped = [p.name for p in strategy.pipeline_changes().add if p.name not in names]
    if dropped:
        warnings.warn(
            f"the pipeline spec {pipeline.spec()!r} is run as written, without "
            f"{', '.join(dropped)}, which {type(strategy).__name__} adds to its default "
            "pipeline; add it to the spec to keep it (strategy.pipeline().spec() shows the "
            "strategy's own)",
            stacklevel=5,
        )


def _forced(
    pipeline: PassPipeline, shard_weight_updates: bool | None, shard_parameters: bool | None
) -> PassPipeline:
    """Parameter sharding brings weight-update sharding, which updates its blocks."""
    if shard_parameters is False:
        pipeline = without_pass(pipeline, ShardParameters.name)
    elif shard_parameters:
        pipeline = with_pass(pipeline, ShardParameters(mode="on"))
        if ShardWeightUpdates.name not in pipeline.enabled_names():
            pipeline = with_pass(pipeline, ShardWeightUpdates())
    if shard_weight_updates is None:
        return pipeline
    if not shard_weight_updates:
        return without_pass(pipeline, ShardWeightUpdates.name)
    return with_pass(pipeline, ShardWeightUpdates(mode="on"))


def check_sharding_options(
    strategy: StepStrategy, shard_weight_updates: bool | None, shard_parameters: bool | None
) -> None:
    """The step's sharding options are each True, False or None, and agree with each
    other and with the strategy."""
    for name, flag in (
        ("shard_weight_updates", shard_weight_updates),
        ("shard_parameters", shard_parameters),
    ):
        if flag not in (None, True, False):
            raise TypeError(f"{name} must be True, False or None, got {flag!r}")
        if flag and not strategy.shards_weight_updates:
            raise ValueError(
                f"{name}=True: {type(strategy).__name__} keeps the variables on one device "
                "and updates them there, so there is nothing to shard"
            )
    if shard_parameters and shard_weight_updates is False:
        raise ValueError(
            "shard_parameters=True needs weight-update sharding (the update runs on the "
            "parameters' blocks); drop shard_weight_updates=False"
        )
