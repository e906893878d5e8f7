"""insert-reductions: give autodiff's cross-replica reductions the strategy's semantics.

Capture already finds a reduction wherever a mirrored value's gradient is complete (JAX's
varying-axes types put a `psum` there), and with those sums JAX's gradient is exactly that
of the sum of the replicas' losses. Capture also marks, with a `scale` node of origin
`gradient`, each gradient of a mirrored value taken of a per-replica loss. This pass
decides what the gradient means: the strategy's `gradient_reduction`, MEAN by default, sets
those scales to 1/N so that N replicas on N slices of a batch give the same parameters as
one device on the whole batch; SUM leaves them at 1 (tf.distribute's custom-loop
convention). Scaling the finished gradient, not each reduction, keeps gradients that cross
two reductions right (BatchNorm statistics `pmean`ed in the forward pass), and leaves a
loss that is already the same on every replica, and input gradients, as they are.
Collectives the user wrote keep their meaning. It also classifies outputs: invariant ones
come back mirrored, varying ones per replica, and an output the user declared mirrored
that still varies is an error.

Outputs declared aggregated (`compile(mirrored_outputs=(True, xs.ReduceOp.MEAN))`,
tf.distribute's `VariableAggregation`) get their reduction here, as an `all_reduce` with
origin `aggregation` placed right after the value is computed, so that combine-all-reduces
can put it into the same bucket as the gradients (BatchNorm statistics ride the gradient
all-reduce); a MEAN is a sum followed by a 1/N scale, like the gradients' own. The
aggregate of a value that is already the same on every replica follows `lax.psum`: a SUM
is N times the value, MEAN, MAX and MIN leave it as it is.

    Before:
      %3: f32[4,3] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
      %4: f32[4,3] = scale(%3) {"axes": ["replica"], "factor": 1, "origin": "gradient"}
    After (gradient-reduction=mean, 8 replicas):
      %3: f32[4,3] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
      %4: f32[4,3] = scale(%3) {"axes": ["replica"], "factor": 0.125, "origin": "gradient"}

    Before (an output declared aggregated):
      %1: f32[3]{replica} = jax.reduce_sum(%0) {"axes": [0]}
      return %1 aggregate=mean
    After (8 replicas):
      %1: f32[3]{replica} = jax.reduce_sum(%0) {"axes": [0]}
      %2: f32[3] = all_reduce(%1) {"axes": ["replica"], "origin": "aggregation", ...}
      %3: f32[3] = scale(%2) {"factor": 0.125, "output": "output[1]"}
      return %3
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.ir.graph import Graph, Node, Origin, Value
from xla_strategies.passes.ir.replica_identical import replica_identical


class MirroredOutputError(ValueError):
    """An output declared mirrored still differs across replicas."""


@dataclass(frozen=True)
class InsertReductions(Pass):
    """Options:
    gradient_reduction: ``mean`` (default) or ``sum``: what gradients of mirrored values
        taken of per-replica losses are.
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
        scales = [
            n for n in graph.walk() if n.op == "scale" and n.attrs.get("origin") == Origin.GRADIENT
        ]
        for node in scales:
            replicas = math.prod(ctx.mesh_axes[a] for a in node.attrs["axes"])
            factor = 1 / replicas if self.gradient_reduction == "mean" else 1
            if node.attrs["factor"] != factor:
                node.attrs["factor"] = factor
                node.created_by = self.name
                changed = True
        autodiff = any(n.attrs.get("origin") == Origin.AUTODIFF for n in graph.walk())
        if autodiff and not scales and self.gradient_reduction == "mean":
            ctx.remarks.append(
                f"{self.name}: gradients were reduced but none was taken with jax.grad or "
                "jax.vjp, so none was scaled: they are sums over the replicas"
            )
        changed |= _aggregate_outputs(graph, ctx, self.name)
        changed |= _type_declared_mirrored(graph, ctx, self.name)
        per_replica = sum(1 for v in graph.outputs if v.varying_axes)
        ctx.stats[self.name] = {
            "mirrored_outputs": len(graph.outputs) - per_replica,
            "per_replica_outputs": per_replica,
        }
        return changed


def _type_declared_mirrored(graph: Graph, ctx: PassContext, created_by: str) -> bool:
    """Outputs declared mirrored that are varying-typed but the same on every replica (an
    all-gather's result) are typed invariant (`pinvariant`); any other varying one is an
    error."""
    declared = [i for i, a in enumerate(graph.io.outputs) if a.mirrored]
    typed_varying = [i for i in declared if graph.outputs[i].varying_axes]
    identical = replica_identical(graph, ctx.mesh_axes) if typed_varying else set()
    varying = [i for i in typed_varying if graph.outputs[i] not in identical]
    if varying:
        names = ", ".join(
            f"{graph.output_name(i)} (varies over {sorted(graph.outputs[i].varying_axes)})"
            for i in varying
        )
        raise MirroredOutputError(
            f"outputs declared mirrored still differ across replicas: {names}. Reduce them "
            "in the step (e.g. xs.get_replica_context().all_reduce) or declare them per-replica."
        )
    retyped: dict[Value, Value] = {}
    for index in typed_varying:
        value = graph.outputs[index]
        if value not in retyped:
            retyped[value] = Value(value.shape, value.dtype, frozenset(), value.name)
            node = Node("pinvariant", [value], [retyped[value]], created_by=created_by)
            graph.nodes.append(node)
        graph.outputs[index] = retyped[value]
    return bool(retyped)


def _aggregate_outputs(graph: Graph, ctx: PassContext, created_by: str) -> bool:
    """Reduce each output declared aggregated, right after its value is computed."""
    declared = {i: a.aggregation for i, a in enumerate(graph.io.outputs) if a.aggregation}
    if not declared:
        return False
    made: dict[tuple[Value, str], Value] = {}
    producers = graph.producers()  # node objects: still right after insertions
    for index, op in declared.items():
        value = graph.outputs[index]
        if (value, op) not in made:
            nodes = _aggregation(value, op, ctx, created_by)
            for node in nodes:
                node.attrs["output"] = graph.output_name(index)
            at = graph.nodes.index(producers[value]) + 1 if value in producers else 0
            graph.nodes[at:at] = nodes
            made[value, op] = nodes[-1].outputs[0] if nodes else value
        graph.outputs[index] = made[value, op]
        graph.io.outputs[index].aggregation = None  # aggregated: mirrored from here on
    return True


def _aggregation(value: Value, op: str, ctx: PassContext, created_by: str) -> list[Node]:
    """The nodes that make `value` mirrored under `op`. A MEAN is a sum and a 1/N scale,
    so it shares the gradients' sum buckets."""
    varying = [a for a in ctx.mesh_axes if a in value.varying_axes]
    copies = math.prod(ctx.mesh_axes[a] for a in varying)  # different values averaged
    nodes: list[Node] = []
    if varying:
        reduce_op = "sum" if op == "mean" else op
        attrs = {"axes": varying, "origin": Origin.AGGREGATION, "reduce_op": reduce_op}
        reduced = value.like(varying_axes=frozenset(value.varying_axes - set(varying)))
        nodes.append(Node("all_reduce", [value], [reduced], attrs, created_by=created_by))
        value = reduced
    # a SUM counts every replica: the identical copies along the axes it does not vary on
    invariant = math.prod(ctx.mesh_axes[a] for a in ctx.mesh_axes if a not in varying)
    factor = {"sum": invariant, "mean": 1 / copies}.get(op, 1)
    if factor != 1:
        attrs = {"factor": factor}
        nodes.append(Node("scale", [value], [value.like()], attrs, created_by=created_by))
    return nodes
