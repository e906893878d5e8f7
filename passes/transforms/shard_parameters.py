"""shard-parameters: hold the step's state split across the replicas and gather each
parameter where it is used (ZeRO-3 / FSDP without user changes).

Weight-update sharding (`shard-weight-updates`) keeps every parameter and every full
gradient on every replica. This pass holds all of the step's state (parameters and
optimizer state, as declared by the step's interface) as one block per replica between
steps, and places the gathers where the values are read:

- a state input becomes its block (`sharded=D{axes}`), and its logical value is defined by
  a *deferred* `all_gather`: the block rewrite (`block_sharder.py`) gathers it just before
  the first op that reads it whole, after running elementwise ops (a cast to bf16) on the
  block, so the gather moves the cast's bytes;
- a scan over a stack of layers (`nn.scan`) takes the stack's blocks as its `xs`: its body
  gathers one layer's slice, in the loop, where that layer reads it. The backward scan
  does the same, so the backward pass gathers again instead of keeping the forward's
  gathers alive; checkpoint (`remat2`) regions take blocks as well and gather inside;
- inside those loop bodies and checkpoints, autodiff's per-layer gradient all-reduce becomes
  a reduce-scatter straight into the split layout; the loop returns the stacked blocks,
  and the update (`shard-weight-updates`, which this pass implies) runs on them.

The split dimension is the first that divides by the replica count (skipping a stack's
layer dimension), the rule the block rewrite uses for gradients, so parameter and gradient
blocks line up. A value with no such dimension stays replicated, with a remark. On a
multislice topology the blocks are numbered over a slice's fast axes only and replicated
across slices (HSDP): the gathers stay on ICI, and each gradient block is summed across
DCN after its reduce-scatter.

    Before (8 replicas; %0 a stack of 3 layers' weights, read by the scan as xs):
      func @step(%0: f32[3,16,4] loc("w"), %1: f32[2,4]{replica})
      %2: f32[2,4]{replica} = jax.scan(%1, %0) {"num_carry": 1, "num_consts": 0, ...}
        region (%3: f32[2,4]{replica}, %4: f32[16,4]) {
          %5: f32[16,4]{replica} = pvary(%4) {"axes": ["replica"]}
          ...
    After:
      func @step(%0: f32[3,2,4]{replica} sharded=1{replica} loc("w"), %1: f32[2,4]{replica})
      %2: f32[2,4]{replica} = jax.scan(%1, %0) {"num_carry": 1, "num_consts": 0, ...}
        region (%3: f32[2,4]{replica}, %6: f32[2,4]{replica}) {
          %4: f32[16,4] = all_gather(%6) {"axes": ["replica"], "dimension": 0}
          %5: f32[16,4]{replica} = pvary(%4) {"axes": ["replica"]}
          ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xla_strategies.passes.base import ModePass, PassContext
from xla_strategies.passes.ir.graph import Graph, Node, Origin, Split, Value
from xla_strategies.passes.ir.text import format_type
from xla_strategies.passes.ir.traits import Trait
from xla_strategies.passes.rewrites.block_axes import within_slice
from xla_strategies.passes.rewrites.block_sharder import DEFERRED, BlockSharder
from xla_strategies.passes.rewrites.blocks import block_value, shard_dimension, without
from xla_strategies.passes.rewrites.held_state import require_state, warn_if_nothing_held
from xla_strategies.passes.rewrites.lookup_blocks import table_dims
from xla_strategies.passes.rewrites.regather_residuals import regather_residuals

# In auto mode, shard when the replicated state and its gradients take more than this
# share of a chip's memory: the rest is for activations and XLA's temporaries.
STATE_SHARE_OF_HBM = 0.5


@dataclass(frozen=True)
class ShardParameters(ModePass):
    """Options:
    mode: ``on`` holds the state split whenever the replicas are more than one; ``auto``
        lets the topology decide: on where the replicated state and its gradients take
        more than half a chip's memory (off without a topology or a chip memory size).
    """

    name = "shard-parameters"
    mode: str = "on"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if self.mode == "on":
            require_state(graph, ctx, self.name, "shard_parameters")
        decision = _memory_decision(graph, ctx) if self.mode == "auto" else None
        if ctx.num_replicas == 1 or (decision is not None and not decision["on"]):
            ctx.stats[self.name] = {"split_state": 0, "decision": decision}
            return False
        splitter = _Splitter(within_slice(ctx), ctx.mesh_axes, self.name)
        splitter.devices_per_replica = ctx.devices_per_replica
        splitter.split_state(graph)
        splitter.stats["regathered_residuals"] = regather_residuals(graph, self.name)
        splitter.shard_regions(graph)
        ctx.stats[self.name] = {**splitter.stats, "decision": decision, "axes": splitter.axes}
        ctx.parameters_split = splitter.stats["split_state"] > 0
        across = [a for a in ctx.mesh_axes if a not in splitter.axes and ctx.mesh_axes[a] > 1]
        if across:
            ctx.remarks.append(
                f"{self.name}: split within a slice over {', '.join(splitter.axes)} and "
                f"replicated across {', '.join(across)}: a layer's gathers stay on the "
                "slice's links; the gradient blocks are summed across"
            )
        ctx.remarks.extend(f"{self.name}: {r}" for r in splitter.remarks)
        if self.mode == "on":
            held = splitter.stats["split_state"]
            warn_if_nothing_held(self.name, "shard_parameters", held, splitter.remarks)
        return splitter.stats["split_state"] > 0 or splitter.stats["loop_reduce_scatters"] > 0


def _memory_decision(graph: Graph, ctx: PassContext) -> dict[str, Any]:
    """On when the replicated state and its gradients would take more than
    `STATE_SHARE_OF_HBM` of a chip's memory; the figures go in the stats and a remark."""
    where = f"{ShardParameters.name}{{mode=auto}}"
    hbm = ctx.topology.hbm_bytes if ctx.topology is not None else None
    if hbm is None:
        ctx.remarks.append(
            f"{where}: off: no chip memory size (no topology, or one without hbm_bytes); "
            "compile(shard_parameters=True) turns it on"
        )
        return {"on": False, "reason": "no chip memory size"}
    state = sum(graph.inputs[k].nbytes for k in graph.io.state_inputs())
    gradients = _gradient_bytes(graph)
    on = state + gradients > STATE_SHARE_OF_HBM * hbm
    ctx.remarks.append(
        f"{where}: {'on' if on else 'off'}: replicated state {state / 2**30:.2f} GiB and "
        f"gradients {gradients / 2**30:.2f} GiB per chip, against {STATE_SHARE_OF_HBM:.0%} "
        f"of {hbm / 2**30:.1f} GiB"
    )
    return {"on": on, "reason": "memory", "state_bytes": state, "gradient_bytes": gradients}


def _gradient_bytes(graph: Graph, iterations: int = 1) -> int:
    """Bytes of the gradients autodiff completes in `graph`: a loop's per-iteration
    reductions count once per iteration."""
    total = 0
    for node in graph.nodes:
        if node.op == "all_reduce" and node.attrs.get("origin") == Origin.AUTODIFF:
            total += node.outputs[0].nbytes * iterations
        trips = node.attrs.get("length", 1) if node.has(Trait.COUNTED_LOOP) else 1
        total += sum(_gradient_bytes(r, iterations * trips) for r in node.regions)
    return total


class _Splitter:
    def __init__(self, axes: list[str], mesh_axes: Mapping[str, int], created_by: str) -> None:
        self.axes, self.mesh_axes, self.created_by = axes, mesh_axes, created_by
        self.replicas = math.prod(mesh_axes[a] for a in axes)
        self.devices_per_replica = 1  # a value split over the model axis is split further
        self.remarks: list[str] = []
        self.stats: dict[str, Any] = {
            "split_state": 0,
            "split_state_bytes": 0,
            "replicated_state": 0,
            "replicated": [],  # {"state", "type", "reason"}: what stays whole, and why
            "loop_gathers": 0,
            "loop_reduce_scatters": 0,
        }

    # the state

    def split_state(self, graph: Graph) -> None:
        # a stack's optimizer state (its moments, of the stack's shape) is split where the
        # stack is, so the update meets blocks of one dimension: split on the layer
        # dimension instead (where it divides), every moment would be gathered whole
        layer_dims = _layer_dims(graph)
        tables = self.lookup_table_dims(graph)
        for arg in graph.io.state_inputs():
            value, attrs = graph.inputs[arg], graph.io.inputs[arg]
            if value.varying_axes or attrs.stacked or attrs.sharded:
                continue
            layer = layer_dims.get(value.shape)  # a stack's layers stay whole
            dim = tables.get(value.shape) if layer is None else None
            if dim is None:
                within = without(self._within_model(value.shape, attrs.model_dim), layer)
                dim = shard_dimension(within, self.replicas)
            if dim is None:
                but = " besides the layer dimension" if layer is not None else ""
                self.stats["replicated_state"] += 1
                self.stats["replicated"].append(
                    {
                        "state": value.name,
                        "type": format_type(value),
                        "reason": "no dividing dimension" + but,
                    }
                )
                if value.shape:  # a scalar (a step count) needs no word
                    self.remarks.append(
                        f"kept {_type(value)} replicated: no dimension{but} divides by "
                        f"{self.replicas} replicas"
                    )
                continue
            block = self.block_of(value, dim)
            block.name = value.name
            graph.inputs[arg] = block
            attrs.sharded = Split(dim, tuple(self.axes))
            self.stats["split_state"] += 1
            self.stats["split_state_bytes"] += value.nbytes
            self.hold_split(graph, value, block, dim, attrs.model_dim)

    def lookup_table_dims(self, graph: Graph) -> dict[tuple[int, ...], int]:
        """By shape, the dimension to split a table that only lookups read on: one each
        lookup takes whole, so it is looked up where it lies (`lookup_blocks`); its
        optimizer state, of its shape, lines up with it. None under a model axis."""
        if self.devices_per_replica > 1:
            return {}
        found: dict[tuple[int, ...], int] = {}
        users = graph.users()
        for arg in graph.io.state_inputs():
            value = graph.inputs[arg]
            dims = [] if value.varying_axes else table_dims(users, value, self.replicas)
            if dims:
                found.setdefault(value.shape, dims[0])
        return found

    def _within_model(self, shape: tuple[int, ...], model_dim: int | None) -> tuple[int, ...]:
        """`shape` as the replicas may split it: not on the dimension the model axis
        splits (counted as size 0). The replicas' blocks of that dimension would each be
        split over the model axis again, an order XLA's layout of the whole value over the
        model axis does not share, so every gather would move the value whole."""
        return shape if self.devices_per_replica == 1 else without(shape, model_dim)

    def hold_split(
        self,
        graph: Graph,
        value: Value,
        block: Value,
        dim: int,
        model_dim: int | None = None,
        defined_by: Node | None = None,
    ) -> None:
        """`graph` read `value`, which it now has as `block`: a loop over its layers or a
        checkpoint region takes the block (and gathers inside); a transpose runs on the
        block (a stack whose layer dimension is not its first: flax's `nn.scan` with
        `variable_axes` of 1); a deferred `all_gather` defines `value` for every other
        reader, after `defined_by`, the node that makes `block` (none: an input).
        `model_dim`: the dimension the model axis splits `value` on, which the gather
        records for the gradient's own blocks."""
        whole_readers = value in graph.outputs
        transposes, own_slices = [], []
        for node in graph.nodes:
            positions = [i for i, v in enumerate(node.inputs) if v is value]
            if not positions:
                continue
            if node.has(Trait.TRANSPOSE):
                transposes.append(node)
                continue
            if self.is_own_slice(node, dim):
                own_slices.append(node)
                continue
            inner_dim = _region_dim(node, positions, dim)
            if inner_dim is None:
                whole_readers = True
                continue
            region = node.regions[0]
            for i in positions:
                node.inputs[i] = block
                inner = region.inputs[i]
                region.inputs[i] = inner_block = self.block_of(inner, inner_dim)
                inner_model = None if model_dim is None else model_dim - (dim - inner_dim)
                self.hold_split(region, inner, inner_block, inner_dim, inner_model)
        if whole_readers:
            attrs = {"axes": self.axes, "dimension": dim, DEFERRED: True}
            if model_dim is not None:
                attrs["model_dim"] = model_dim
            at = 0 if defined_by is None else graph.nodes.index(defined_by) + 1
            graph.nodes.insert(at, self.node("all_gather", [block], [value], attrs))
        for node in transposes:
            self.transpose_block(graph, node, block, dim, model_dim)
        for node in own_slices:  # a pipeline's stage program, which gathers per layer
            graph.nodes.remove(node)
            graph.replace_uses(node.outputs[0], block)

    def is_own_slice(self, node: Node, dim: int) -> bool:
        """Whether `node` takes this replica's block of a value held split on `dim`."""
        attrs = node.attrs
        return (
            node.op == "replica_slice"
            and attrs["dimension"] == dim
            and list(attrs["axes"]) == self.axes
        )

    def transpose_block(
        self, graph: Graph, node: Node, block: Value, dim: int, model_dim: int | None
    ) -> None:
        """Run the transpose `node` of a held value on its `block`, and hold its result
        split where the permutation moves `dim`."""
        order = list(node.attrs["permutation"])
        whole = node.outputs[0]
        moved = self.block_of(whole, order.index(dim))
        on_block = Node(node.op, [block], [moved], dict(node.attrs), payload=node.payload,
                        created_by=self.created_by)  # fmt: skip
        graph.nodes[graph.nodes.index(node)] = on_block
        moved_model = None if model_dim is None else order.index(model_dim)
        self.hold_split(graph, whole, moved, order.index(dim), moved_model, on_block)

    # the loops

    def shard_regions(self, graph: Graph) -> None:
        """Innermost first, rewrite each scan body and checkpoint region on blocks: its
        gradient all-reduces become reduce-scatters, its parameters are gathered where
        read, and the blocks it returns come out of the loop stacked, defined for the
        enclosing graph by deferred all-gathers."""
        for node in list(graph.nodes):
            scan = node.has(Trait.COUNTED_LOOP)
            if not (scan or node.has(Trait.CALL_ONCE)):
                continue
            region = node.regions[0]
            self.shard_regions(region)
            if not any(n.attrs.get(DEFERRED) for n in region.nodes):
                continue  # holds nothing split: its reductions stay for hoist-all-reduces
            sharder = BlockSharder(
                self.axes, self.mesh_axes, self.created_by, lookups=self.devices_per_replica == 1
            )
            first = node.attrs["num_carry"] if scan else 0
            returned = sharder.rewrite_region(region, range(first, len(region.outputs)))
            self.stats["loop_gathers"] += sum(1 for n in region.nodes if n.op == "all_gather")
            self.stats["loop_reduce_scatters"] += sharder.stats["sharded_gradients"]
            self.remarks.extend(sharder.remarks)
            at = graph.nodes.index(node) + 1
            for index, dim in sorted(returned.items()):
                outer_dim = dim + 1 if scan else dim
                whole = node.outputs[index]
                node.outputs[index] = block = self.block_of(whole, outer_dim)
                attrs = {"axes": self.axes, "dimension": outer_dim, DEFERRED: True}
                graph.nodes.insert(at, self.node("all_gather", [block], [whole], attrs))

    # building blocks

    def block_of(self, full: Value, dim: int) -> Value:
        return block_value(full, dim, self.replicas, self.axes)

    def node(self, op: str, inputs: list[Value], outputs: list[Value], attrs: dict) -> Node:
        return Node(op, inputs, outputs, attrs, created_by=self.created_by)


def _layer_dims(graph: Graph) -> dict[tuple[int, ...], int]:
    """By shape, the layer dimension of each stack a loop slices (or a pipeline's stages
    hold): its first dimension, or, for a stack taken through a transpose, the one the
    transpose makes first."""
    producers = {out: node for node in graph.nodes for out in node.outputs}
    found: dict[tuple[int, ...], int] = {}
    for value, attrs in zip(graph.inputs, graph.io.inputs, strict=True):
        if attrs.stage_split:  # split over the stages on its layers
            found[value.shape] = 0
    for node in graph.nodes:
        for value in _stacks(node):
            found[value.shape] = 0
            made_by = producers.get(value)
            if made_by is not None and made_by.has(Trait.TRANSPOSE):
                found.setdefault(made_by.inputs[0].shape, made_by.attrs["permutation"][0])
    return found


def _stacks(node: Node) -> list[Value]:
    """The stacks of layers `node` reads a layer at a time: a scan's xs, or the stack a
    pipeline's stage program takes in blocks (its `replica_slice`)."""
    if node.has(Trait.COUNTED_LOOP):
        return _xs(node)
    return node.inputs[:1] if node.op == "replica_slice" else []


def _xs(scan: Node) -> list[Value]:
    """The values a scan slices per iteration (after its consts and carry)."""
    return scan.inputs[scan.attrs["num_consts"] + scan.attrs["num_carry"] :]


def _region_dim(node: Node, positions: list[int], dim: int) -> int | None:
    """The dimension a split value has inside `node`'s region, if the region can take its
    block at `positions`: a scan's xs drop the layer dimension (which is never split),
    a checkpoint's operands keep theirs. None where the region needs it whole."""
    if node.has(Trait.CALL_ONCE):
        return dim
    if node.has(Trait.COUNTED_LOOP) and dim > 0:
        first_xs = node.attrs["num_consts"] + node.attrs["num_carry"]
        if all(i >= first_xs for i in positions):
            return dim - 1
    return None


def _type(value: Value) -> str:
    return (f"{value.name} " if value.name else "") + format_type(value)
