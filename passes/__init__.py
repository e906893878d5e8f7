"""The compiler: IR, pass pipeline, JAX capture and lowering, one file per pass.

`PASS_REGISTRY` (`registry.py`) maps each pass's spec name to its class; pipelines are built
from it.
"""

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.text import IRParseError, parse, print_graph
from xla_strategies.passes.ir.verifier import VerificationError, verify
from xla_strategies.passes.pipeline import PassPipeline, PipelineSpecError
from xla_strategies.passes.registry import PASS_REGISTRY
from xla_strategies.passes.transforms.combine_all_reduces import CombineAllReduces
from xla_strategies.passes.transforms.decompose_all_reduces import DecomposeAllReduces
from xla_strategies.passes.transforms.fold_invariant_reductions import FoldInvariantReductions
from xla_strategies.passes.transforms.hoist_all_reduces import HoistAllReduces
from xla_strategies.passes.transforms.insert_reductions import InsertReductions, MirroredOutputError
from xla_strategies.passes.transforms.prefetch_all_gathers import PrefetchAllGathers
from xla_strategies.passes.transforms.reassociate_all_reduces import ReassociateAllReduces
from xla_strategies.passes.transforms.reduce_to_one_device import ReduceToOneDevice
from xla_strategies.passes.transforms.schedule_all_reduces import ScheduleAllReduces
from xla_strategies.passes.transforms.shard_parameters import ShardParameters
from xla_strategies.passes.transforms.shard_weight_updates import ShardWeightUpdates

# What every synchronous strategy runs by default, in this order: give autodiff's
# reductions their meaning, drop reductions of values already the same everywhere, hold
# the state split where it does not fit a chip (before the loops' reductions move), move
# reductions out of loops or leave them pipelined there (the topology's cost model
# decides), merge the parts of tied weights, shard the weight update where the cost model
# says it pays, bucket what is left, then let layer loops gather their next layer's
# parameters while the current one computes.
DEFAULT_PIPELINE = (
    "insert-reductions,fold-invariant-reductions,shard-parameters{mode=auto},"
    "schedule-all-reduces,reassociate-all-reduces,shard-weight-updates{mode=auto},"
    "combine-all-reduces,prefetch-all-gathers{mode=auto}"
)

__all__ = [
    "DEFAULT_PIPELINE",
    "PASS_REGISTRY",
    "CombineAllReduces",
    "DecomposeAllReduces",
    "FoldInvariantReductions",
    "HoistAllReduces",
    "ReassociateAllReduces",
    "ReduceToOneDevice",
    "ScheduleAllReduces",
    "ShardParameters",
    "ShardWeightUpdates",
    "Graph",
    "IRParseError",
    "InsertReductions",
    "MirroredOutputError",
    "Node",
    "Pass",
    "PassContext",
    "PassPipeline",
    "PipelineSpecError",
    "PrefetchAllGathers",
    "Value",
    "VerificationError",
    "parse",
    "print_graph",
    "verify",
]
