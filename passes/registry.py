"""The passes, listed once: their run order, the registry of spec names pipelines are built
from, and the default pipeline."""

from __future__ import annotations

from xla_strategies.passes.base import Pass
from xla_strategies.passes.transforms.combine_all_reduces import CombineAllReduces
from xla_strategies.passes.transforms.decompose_all_reduces import DecomposeAllReduces
from xla_strategies.passes.transforms.fold_invariant_reductions import FoldInvariantReductions
from xla_strategies.passes.transforms.hoist_all_reduces import HoistAllReduces
from xla_strategies.passes.transforms.inline_nested_calls import InlineNestedCalls
from xla_strategies.passes.transforms.insert_reductions import InsertReductions
from xla_strategies.passes.transforms.materialize_early_matmuls import MaterializeEarlyMatmuls
from xla_strategies.passes.transforms.prefetch_all_gathers import PrefetchAllGathers
from xla_strategies.passes.transforms.reassociate_all_reduces import ReassociateAllReduces
from xla_strategies.passes.transforms.reduce_scatters_before_loops import (
    ReduceScattersBeforeLoops,
)
from xla_strategies.passes.transforms.reduce_to_one_device import ReduceToOneDevice
from xla_strategies.passes.transforms.scatter_adds_as_selects import ScatterAddsAsSelects
from xla_strategies.passes.transforms.schedule_all_reduces import ScheduleAllReduces
from xla_strategies.passes.transforms.shard_parameters import ShardParameters
from xla_strategies.passes.transforms.shard_weight_updates import ShardWeightUpdates
from xla_strategies.passes.transforms.sink_casts_below_lookups import SinkCastsBelowLookups
from xla_strategies.passes.transforms.split_stacked_all_reduces import SplitStackedAllReduces

# Every pass, in the order passes run when present: a pass a strategy or a compile option
# adds goes before the first pass that comes after it here. Autodiff's reductions get their
# meaning first; the state is split before the loop passes move reductions, so each layer's
# gradient is reduce-scattered inside the loop; weight-update sharding and the reduction to
# one device go before bucketing, so their collectives are bucketed and decomposed too.
PASSES: tuple[type[Pass], ...] = (
    InsertReductions,
    FoldInvariantReductions,
    ShardParameters,
    ScheduleAllReduces,
    HoistAllReduces,
    ReassociateAllReduces,
    ShardWeightUpdates,
    ReduceToOneDevice,
    CombineAllReduces,
    PrefetchAllGathers,
    DecomposeAllReduces,
    SplitStackedAllReduces,
    SinkCastsBelowLookups,
    ScatterAddsAsSelects,
    ReduceScattersBeforeLoops,
    MaterializeEarlyMatmuls,
    InlineNestedCalls,
)
PASS_REGISTRY: dict[str, type[Pass]] = {cls.name: cls for cls in PASSES}
PASS_ORDER: tuple[str, ...] = tuple(cls.name for cls in PASSES)

# What every synchronous strategy runs by default, in this order: give autodiff's
# reductions their meaning, drop reductions of values already the same everywhere, hold
# the state split where it does not fit a chip (before the loops' reductions move), move
# reductions out of loops or leave them pipelined there (the topology's cost model
# decides), merge the parts of tied weights, shard the weight update where the cost model
# says it pays, bucket what is left, then let layer loops gather their next layer's
# parameters while the current one computes, and across TPU slices reduce small stacked
# statistics row by row; in a step whose state is held split, look up before casting, take
# the loss's label gradient as a select, and have layer loops wait for the reduce-scatters
# before them (those three where the hardware file says they were measured to pay), and
# materialize the matmuls a sum adds after a loop, so XLA does not fuse them past it; for
# GPUs, inline the user's nested calls.
DEFAULT_PIPELINE = (
    "insert-reductions,fold-invariant-reductions,shard-parameters{mode=auto},"
    "schedule-all-reduces,reassociate-all-reduces,shard-weight-updates{mode=auto},"
    "combine-all-reduces,prefetch-all-gathers{mode=auto},split-stacked-all-reduces{mode=auto},"
    "sink-casts-below-lookups{mode=auto},scatter-adds-as-selects{mode=auto},"
    "reduce-scatters-before-loops{mode=auto},materialize-early-matmuls{mode=auto},"
    "inline-nested-calls{mode=auto}"
)
