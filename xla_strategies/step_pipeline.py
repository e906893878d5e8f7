"""A step's pass pipeline: the strategy's, with what the step's compile options force on
or off (weight-update and parameter sharding in place of the cost model's choice)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xla_strategies.passes.pipeline import PassPipeline, with_pass, without_pass
from xla_strategies.passes.transforms.shard_parameters import ShardParameters
from xla_strategies.passes.transforms.shard_weight_updates import ShardWeightUpdates

if TYPE_CHECKING:
    from xla_strategies.strategy import Strategy

# Passes that bucket or split collectives: weight-update sharding goes before them, so its
# reduce-scatters and all-gathers are bucketed and decomposed like the all-reduces.
_AFTER_SHARDING = ("combine-all-reduces", "decompose-all-reduces")
# Passes that move reductions out of loops: parameter sharding goes before them, so each
# layer's gradient is reduce-scattered inside the backward loop.
_BEFORE_LOOPS = ("schedule-all-reduces", "hoist-all-reduces", *_AFTER_SHARDING)


def step_pipeline(
    pipeline: PassPipeline, shard_weight_updates: bool | None, shard_parameters: bool | None
) -> PassPipeline:
    """`pipeline` with weight-update and parameter sharding forced on or off where the
    step says so (None: as the pipeline has it). Parameter sharding brings weight-update
    sharding, which updates its blocks."""
    if shard_parameters is False:
        pipeline = without_pass(pipeline, ShardParameters.name)
    elif shard_parameters:
        pipeline = with_pass(pipeline, ShardParameters(mode="on"), before=_BEFORE_LOOPS)
        if ShardWeightUpdates.name not in pipeline.enabled_names():
            pipeline = with_pass(pipeline, ShardWeightUpdates(), before=_AFTER_SHARDING)
    if shard_weight_updates is None:
        return pipeline
    if not shard_weight_updates:
        return without_pass(pipeline, ShardWeightUpdates.name)
    return with_pass(pipeline, ShardWeightUpdates(mode="on"), before=_AFTER_SHARDING)


def check_sharding_options(
    strategy: Strategy, shard_weight_updates: bool | None, shard_parameters: bool | None
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
