"""The compiler: IR, pass pipeline, JAX capture and lowering, one file per pass.

`PASS_REGISTRY` maps each pass's spec name to its class; pipelines are built from it.
"""

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.insert_reductions import InsertReductions, MirroredOutputError
from xla_strategies.passes.ir import Graph, Node, Value
from xla_strategies.passes.ir_text import IRParseError, parse, print_graph
from xla_strategies.passes.pipeline import PassPipeline, PipelineSpecError
from xla_strategies.passes.verifier import VerificationError, verify

PASS_REGISTRY: dict[str, type[Pass]] = {
    InsertReductions.name: InsertReductions,
}

__all__ = [
    "PASS_REGISTRY",
    "Graph",
    "IRParseError",
    "InsertReductions",
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
]
