"""reduce-to-one-device: gradients go to one device, the update runs there, results come back.

CentralStorageStrategy keeps the parameters on one device. Its gradients are therefore
*reduced to* that device (tf.distribute's ReductionToOneDevice), not all-reduced. This pass
turns each top-level autodiff `all_reduce` into `reduce_to_one`, whose result is correct on
the root replica only. Everything computed from such a value is then "rooted" as well: the
optimizer update runs on the root. Each rooted value is broadcast from the root where it
leaves the rooted part of the program: at a graph output (the new parameters and optimizer
state), and where it feeds a per-replica computation, a region or a user collective.

    Before:
      %3: f32[4,3] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "mean"}
      %4: f32[4,3] = jax.sub(%0, %3)
      return %4
    After:
      %3: f32[4,3] = reduce_to_one(%2) {"axes": ["replica"], ..., "root": 0, "size": 8}
      %4: f32[4,3] = jax.sub(%0, %3)
      %5: f32[4,3] = broadcast(%4) {"axes": ["replica"], "root": 0, "size": 8}
      return %5

Both collectives are lowered as binomial trees of collective permutes (log2 N rounds), so
the root receives (and sends) each byte once per round, as tf.distribute's reduce to one
device and its broadcast do. Reductions inside loop bodies stay all-reduces, with a remark;
the pass needs a one-axis mesh (CentralStorageStrategy's).
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.ir.graph import Graph, Node, Origin, Value


@dataclass(frozen=True)
class ReduceToOneDevice(Pass):
    """Options:
    root: the replica (position on the mesh axis) that holds the parameters.
    broadcast_outputs: broadcast rooted outputs from the root; when false they are marked
        `rooted` instead and the runtime keeps only the root's copy (CentralStorageStrategy:
        the new state stays on the parameter device until the next step reads it).
    """

    name = "reduce-to-one-device"
    root: int = 0
    broadcast_outputs: bool = True

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if ctx.num_replicas == 1:
            return False
        if len(ctx.mesh_axes) != 1:  # one root on one axis; a 2-d mesh would need one per row
            ctx.remarks.append(f"{self.name}: needs a one-axis mesh, not {dict(ctx.mesh_axes)}")
            return False
        if not 0 <= self.root < ctx.num_replicas:
            raise ValueError(
                f"reduce-to-one-device: root={self.root} is not a replica of {ctx.num_replicas}"
            )
        ((axis, size),) = ctx.mesh_axes.items()
        tree = {"axes": [axis], "root": self.root, "size": size}  # both collectives' attrs
        rooted: set[Value] = set()
        for node in graph.nodes:
            if _is_gradient_reduction(node):
                node.op = "reduce_to_one"
                node.attrs |= tree
                node.created_by = self.name
                rooted.update(node.outputs)
        self._remark_skipped(graph, ctx)
        if not rooted:
            return False
        broadcasts = self._broadcast_where_rooted_values_leave(graph, rooted, tree)
        ctx.stats[self.name] = {
            "reduced_to_one": graph.count_ops("reduce_to_one"),
            "broadcasts": broadcasts,
        }
        return True

    def _broadcast_where_rooted_values_leave(
        self, graph: Graph, rooted: set[Value], attrs: dict
    ) -> int:
        made: dict[Value, Value] = {}

        def broadcast(value: Value, into: list[Node]) -> Value:
            if value not in made:
                out = value.like(name=value.name)
                into.append(Node("broadcast", [value], [out], dict(attrs), created_by=self.name))
                made[value] = out
            return made[value]

        nodes: list[Node] = []
        for node in graph.nodes:
            if any(v in rooted for v in node.inputs):  # a reduce_to_one's too (collective)
                if _stays_rooted(node):
                    rooted.update(node.outputs)
                else:
                    node.inputs = [broadcast(v, nodes) if v in rooted else v for v in node.inputs]
            nodes.append(node)
        if self.broadcast_outputs:
            graph.outputs = [broadcast(v, nodes) if v in rooted else v for v in graph.outputs]
        else:
            # Every mirrored output: the state computed without the gradients (Adam's step
            # count) belongs on the parameter device with the rest of it.
            for value, attrs in zip(graph.outputs, graph.io.outputs, strict=True):
                attrs.rooted = not value.varying_axes
        graph.nodes = nodes
        return len(made)

    def _remark_skipped(self, graph: Graph, ctx: PassContext) -> None:
        for outer in graph.nodes:
            for region in outer.regions:
                if any(_is_gradient_reduction(n) for n in region.walk()):
                    ctx.remarks.append(
                        f"{self.name}: a gradient reduction inside {outer.op} stays an "
                        "all_reduce (hoist it out of the loop to reduce it to one device)"
                    )


def _is_gradient_reduction(node: Node) -> bool:
    return (
        node.op == "all_reduce"
        and node.attrs.get("origin") == Origin.AUTODIFF
        and node.attrs.get("reduce_op") in ("sum", "mean")
    )


def _stays_rooted(node: Node) -> bool:
    """A plain computation whose results are mirrored stays on the root; anything per
    replica, any region and any collective must see the broadcast value."""
    return (
        not node.regions
        and not node.is_collective
        and not any(v.varying_axes for v in node.outputs)
    )
