"""insert-reductions: give autodiff's cross-replica reductions the strategy's semantics.

Capture already finds a reduction wherever a mirrored value's gradient is complete (JAX's
varying-axes types put a `psum` there). This pass decides what that reduction means:
the strategy's `gradient_reduction`, MEAN by default so that N replicas on N slices of a
batch give the same parameters as one device on the whole batch. Collectives the user wrote
keep their meaning. It also classifies outputs: invariant ones come back mirrored, varying
ones per replica, and an output the user declared mirrored that still varies is an error.

    Before:
      %3: f32[4,3] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
    After (gradient-reduction=mean):
      %3: f32[4,3] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "mean"}
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.ir import Graph


class MirroredOutputError(ValueError):
    """An output declared mirrored still differs across replicas."""


@dataclass(frozen=True)
class InsertReductions(Pass):
    """Options:
    gradient_reduction: ``mean`` (default) or ``sum``, applied to autodiff reductions.
    """

    name = "insert-reductions"
    gradient_reduction: str = "mean"

    def __post_init__(self) -> None:
        if self.gradient_reduction not in ("mean", "sum"):
            raise ValueError(
                f"insert-reductions: gradient-reduction must be 'mean' or 'sum', "
                f"got {self.gradient_reduction!r}"
            )

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        changed = False
        for node in graph.walk():
            if node.op == "all_reduce" and node.attrs.get("origin") == "autodiff":
                if node.attrs.get("reduce_op") != self.gradient_reduction:
                    node.attrs["reduce_op"] = self.gradient_reduction
                    node.created_by = self.name
                    changed = True
        _check_declared_mirrored(graph)
        per_replica = sum(1 for v in graph.outputs if v.varying_axes)
        ctx.stats[self.name] = {
            "mirrored_outputs": len(graph.outputs) - per_replica,
            "per_replica_outputs": per_replica,
        }
        return changed


def _check_declared_mirrored(graph: Graph) -> None:
    varying = [i for i in sorted(graph.declared_mirrored) if graph.outputs[i].varying_axes]
    if varying:
        names = ", ".join(
            f"{graph.output_name(i)} (varies over {sorted(graph.outputs[i].varying_axes)})"
            for i in varying
        )
        raise MirroredOutputError(
            f"outputs declared mirrored still differ across replicas: {names}. Reduce them "
            "in the step (e.g. xs.get_replica_context().all_reduce) or declare them per-replica."
        )
