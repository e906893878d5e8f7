"""The pass registry: each pass's spec name -> its class. Pipelines are built from it."""

from __future__ import annotations

from xla_strategies.passes.base import Pass
from xla_strategies.passes.combine_all_reduces import CombineAllReduces
from xla_strategies.passes.decompose_all_reduces import DecomposeAllReduces
from xla_strategies.passes.fold_invariant_reductions import FoldInvariantReductions
from xla_strategies.passes.hoist_all_reduces import HoistAllReduces
from xla_strategies.passes.insert_reductions import InsertReductions
from xla_strategies.passes.prefetch_all_gathers import PrefetchAllGathers
from xla_strategies.passes.reassociate_all_reduces import ReassociateAllReduces
from xla_strategies.passes.reduce_to_one_device import ReduceToOneDevice
from xla_strategies.passes.schedule_all_reduces import ScheduleAllReduces
from xla_strategies.passes.shard_parameters import ShardParameters
from xla_strategies.passes.shard_weight_updates import ShardWeightUpdates

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
