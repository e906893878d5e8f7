"""The pass registry: each pass's spec name -> its class. Pipelines are built from it."""

from __future__ import annotations

from xla_strategies.passes.base import Pass
from xla_strategies.passes.transforms.combine_all_reduces import CombineAllReduces
from xla_strategies.passes.transforms.decompose_all_reduces import DecomposeAllReduces
from xla_strategies.passes.transforms.fold_invariant_reductions import FoldInvariantReductions
from xla_strategies.passes.transforms.hoist_all_reduces import HoistAllReduces
from xla_strategies.passes.transforms.insert_reductions import InsertReductions
from xla_strategies.passes.transforms.prefetch_all_gathers import PrefetchAllGathers
from xla_strategies.passes.transforms.reassociate_all_reduces import ReassociateAllReduces
from xla_strategies.passes.transforms.reduce_to_one_device import ReduceToOneDevice
from xla_strategies.passes.transforms.schedule_all_reduces import ScheduleAllReduces
from xla_strategies.passes.transforms.shard_parameters import ShardParameters
from xla_strategies.passes.transforms.shard_weight_updates import ShardWeightUpdates

PASS_REGISTRY: dict[str, type[Pass]] = {
    cls.name: cls
    for cls in (
        InsertReductions,
        FoldInvariantReductions,
        HoistAllReduces,
        ScheduleAllReduces,
        ReassociateAllReduces,
        ShardParameters,
        ShardWeightUpdates,
        CombineAllReduces,
        DecomposeAllReduces,
        PrefetchAllGathers,
        ReduceToOneDevice,
    )
}

# The order passes run in when present: a pass a strategy or a compile option adds goes
# before the first pass that comes after it here. Autodiff's reductions get their meaning
# first; the state is split before the loop passes move reductions, so each layer's
# gradient is reduce-scattered inside the loop; weight-update sharding and the reduction to
# one device go before bucketing, so their collectives are bucketed and decomposed too.
PASS_ORDER: tuple[str, ...] = (
    InsertReductions.name,
    FoldInvariantReductions.name,
    ShardParameters.name,
    ScheduleAllReduces.name,
    HoistAllReduces.name,
    ReassociateAllReduces.name,
    ShardWeightUpdates.name,
    ReduceToOneDevice.name,
    CombineAllReduces.name,
    PrefetchAllGathers.name,
    DecomposeAllReduces.name,
)
