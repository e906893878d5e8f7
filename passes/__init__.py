"""The compiler: IR, pass pipeline, JAX capture and lowering, one file per pass.

The passes are listed in `registry.py` (`PASSES`, in run order); each is public here under
its class name (`xs.passes.CombineAllReduces`), with `PASS_REGISTRY` (spec name -> class)
and `DEFAULT_PIPELINE`. A new pass goes into both lists (`tests/test_imports.py` checks).
"""

from xla_strategies.passes.base import Pass, PassContext

# The JAX frontend fills the IR's op-trait table from above, as JAX's rule tables are filled
# by registration; the package's import does it, so IR text names JAX ops with or without a
# capture.
from xla_strategies.passes.bridge import ops as _jax_ops  # noqa: F401
from xla_strategies.passes.ir.graph import Graph, Node, Value
from xla_strategies.passes.ir.text import IRParseError, parse, print_graph
from xla_strategies.passes.ir.verifier import VerificationError, verify
from xla_strategies.passes.pipeline import PassPipeline, PipelineSpecError
from xla_strategies.passes.registry import (
    DEFAULT_PIPELINE,
    PASS_ORDER,
    PASS_REGISTRY,
    PASSES,
    CombineAllReduces,
    DecomposeAllReduces,
    FoldInvariantReductions,
    HoistAllReduces,
    InlineNestedCalls,
    InsertReductions,
    MaterializeEarlyMatmuls,
    PrefetchAllGathers,
    ReassociateAllReduces,
    ReduceScattersBeforeLoops,
    ReduceToOneDevice,
    ScatterAddsAsSelects,
    ScheduleAllReduces,
    ShardParameters,
    ShardWeightUpdates,
    SinkCastsBelowLookups,
    SplitStackedAllReduces,
)
from xla_strategies.passes.transforms.insert_reductions import MirroredOutputError

__all__ = [
    "DEFAULT_PIPELINE",
    "PASSES",
    "PASS_ORDER",
    "PASS_REGISTRY",
    "Graph",
    "IRParseError",
    "MirroredOutputError",
    "Node",
    "Pass",
    "PassContext",
    "PassPipeline",
    "PipelineSpecError",
    "Value",
    "VerificationError",
    "parse",
    "print_graph",
    "verify",
    "CombineAllReduces",
    "DecomposeAllReduces",
    "FoldInvariantReductions",
    "HoistAllReduces",
    "InlineNestedCalls",
    "InsertReductions",
    "MaterializeEarlyMatmuls",
    "PrefetchAllGathers",
    "ReassociateAllReduces",
    "ReduceScattersBeforeLoops",
    "ReduceToOneDevice",
    "ScatterAddsAsSelects",
    "ScheduleAllReduces",
    "ShardParameters",
    "ShardWeightUpdates",
    "SinkCastsBelowLookups",
    "SplitStackedAllReduces",
]
