"""shard-weight-updates: each replica updates only its block of the weights and their state.

Data parallelism reduces every gradient on every replica and then runs the whole optimizer
update N times. Xu et al. 2020 ("Automatic Cross-Replica Sharding of Weight Update in
Data-Parallel Training") shard that update instead (ZeRO-1/2 without user changes):

- a gradient's `all_reduce` becomes a `reduce_scatter` along a dimension that divides by
  the replica count: each replica receives the reduced block it owns;
- the update runs on blocks, forward from those reductions: elementwise ops take blocks
  (a mirrored operand of full shape is cut to this replica's block by `replica_slice`, which
  moves no data); a reduction over the sharded dimension (global-norm clipping's sum of
  squares) becomes a partial reduction plus one small `all_reduce`; broadcasts and
  reshapes that keep the sharded dimension follow it;
- an updated value that is the next value of a step input read only by the update (Adam's
  moments) stays sharded across steps: the input and output are marked `sharded=D{axes}`
  and live split across the devices, in their logical shape. Anything else a block
  reaches, the new parameters included, is gathered back (`all_gather`) where it is read
  whole. Blocks are numbered over the replica axes fast levels first, so a decomposed
  reduce-scatter crosses a slow level (DCN) last.

What cannot be proved elementwise is gathered first and run replicated, and a gradient with
no dimension that divides by the replica count keeps its all-reduce: a jax.Array cannot be
split unevenly, so padding such a tensor would change the logical shape of its state. The
dump's remarks list each of these with its reason.

    Before (8 replicas; %0 params, %1 Adam's first moment, both mirrored state):
      %3: f32[16,4] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", ...}
      %4: f32[16,4] = jax.mul(%1, %c)
      %5: f32[16,4] = jax.add(%4, %3)
      %6: f32[16,4] = jax.sub(%0, %5)
      return %6 state=%0, %5 state=%1
    After (%1 now arrives as this replica's block):
      func @step(%0: f32[16,4], %1: f32[2,4]{replica} sharded=0{replica}, ...)
      %3: f32[2,4]{replica} = reduce_scatter(%2) {"axes": ["replica"], "dimension": 0, ...}
      %4: f32[2,4]{replica} = jax.mul(%1, %c)
      %5: f32[2,4]{replica} = jax.add(%4, %3)
      %7: f32[2,4]{replica} = replica_slice(%0) {"axes": ["replica"], "dimension": 0}
      %8: f32[2,4]{replica} = jax.sub(%7, %5)
      %9: f32[16,4] = all_gather(%8) {"axes": ["replica"], "dimension": 0}
      return %9 state=%0, %5 state=%1 sharded=0{replica}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.blocks import (
    block_shape,
    shard_dimension,
    sinks_to_blocks,
    unit_reshape_dim,
)
from xla_strategies.passes.cost_model import fast_first, weight_update_estimates
from xla_strategies.passes.ir import Graph, Node, Origin, Split, Value
from xla_strategies.passes.ir_text import format_type
from xla_strategies.passes.traits import Trait, dimension_reduction

MODES = ("on", "auto")


@dataclass(frozen=True)
class ShardWeightUpdates(Pass):
    """Options:
    mode: ``on`` shards whenever it can; ``auto`` lets the cost model decide for the
        strategy's topology (off without one: on emulated CPU devices the collectives are
        synchronous copies and the update is cheap), and says what it decided in a remark.
    """

    name = "shard-weight-updates"
    mode: str = "on"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"shard-weight-updates: mode must be one of {MODES}, got {self.mode!r}"
            )

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        axes = _block_order(ctx)
        decision = _cost_model_decision(graph, ctx) if self.mode == "auto" else None
        if ctx.num_replicas == 1 or (decision is not None and not decision["on"]):
            ctx.stats[self.name] = {"sharded_gradients": 0, "sharded_state": 0}
            ctx.stats[self.name]["decision"] = decision
            return False
        sharder = _Sharder(axes, ctx.num_replicas, self.name)
        sharder.rewrite(graph)
        ctx.stats[self.name] = {**sharder.stats, "decision": decision}
        ctx.remarks.extend(f"{self.name}: {r}" for r in sharder.remarks)
        return sharder.stats["sharded_gradients"] > 0


def _block_order(ctx: PassContext) -> list[str]:
    """The replica axes in the order blocks are numbered over: fast levels first on a
    topology, so that decompose-all-reduces' reduce-scatter crosses a slow level (DCN)
    last, with 1/(fast replicas) of the data; the mesh's order otherwise."""
    if ctx.topology is None:
        return list(ctx.mesh_axes)
    return [a.name for a in fast_first(ctx.topology.axis_links(tuple(ctx.mesh_axes)))]


def _cost_model_decision(graph: Graph, ctx: PassContext) -> dict[str, Any]:
    """Whether sharding pays on the strategy's topology, with its estimates (the pass's
    stats; also printed as a remark): `on`, `reason` ("no topology" or "cost model"),
    and the gradient bytes and both estimated seconds when there is a topology."""
    where = f"{ShardWeightUpdates.name}{{mode=auto}}"
    if ctx.topology is None:
        ctx.remarks.append(
            f"{where}: off: no topology (emulated or unknown devices), whose collectives "
            "run as synchronous copies; compile(shard_weight_updates=True) turns it on"
        )
        return {"on": False, "reason": "no topology"}
    axes = list(ctx.mesh_axes)
    seeds = [n for n in graph.nodes if _is_gradient_reduction(n, axes)]
    gradient_bytes = sum(n.outputs[0].nbytes for n in seeds)
    links = ctx.topology.axis_links(tuple(axes))
    replicated, sharded = weight_update_estimates(
        gradient_bytes, _update_bytes(graph, seeds), links, ctx.topology.memory_bandwidth
    )
    on = sharded < replicated
    ctx.remarks.append(
        f"{where}: {'on' if on else 'off'}: {gradient_bytes} gradient bytes; estimated "
        f"{replicated * 1e3:.3f} ms replicated (all-reduce, whole update) against "
        f"{sharded * 1e3:.3f} ms sharded (reduce-scatter, 1/{ctx.num_replicas} of the "
        "update, all-gather)"
    )
    return {
        "on": on,
        "reason": "cost model",
        "gradient_bytes": gradient_bytes,
        "replicated_s": replicated,
        "sharded_s": sharded,
    }


def _update_bytes(graph: Graph, seeds: list[Node]) -> int:
    """Bytes the update reads and writes: the nodes reached from the gradients."""
    reached = {n.outputs[0] for n in seeds}
    total = 0
    for node in graph.nodes:
        if node not in seeds and any(v in reached for v in node.inputs):
            reached.update(node.outputs)
            total += sum(v.nbytes for v in node.inputs + node.outputs)
    return total


class _Sharder:
    """One walk over the top-level graph in schedule order. A logical (mirrored) value
    whose update is sharded is represented by its block in `blocks`; the original `Value`
    object is defined again, by an `all_gather`, only if something reads it whole."""

    def __init__(self, axes: list[str], replicas: int, created_by: str) -> None:
        self.axes, self.replicas, self.created_by = axes, replicas, created_by
        self.varying = frozenset(axes)
        self.blocks: dict[Value, tuple[Value, int]] = {}
        self.gathered: set[Value] = set()
        self.slices: dict[tuple[Value, int], Value] = {}
        self.nodes: list[Node] = []
        self.producers: dict[Value, Node] = {}
        self.sunk: set[Node] = set()  # whole nodes redone on blocks; dropped if unread
        self.remarks: list[str] = []
        self.stats: dict[str, int] = {
            "sharded_gradients": 0,
            "replicated_gradients": 0,
            "gathered_for_ops": 0,
            "sharded_state": 0,
            "sharded_state_bytes": 0,
        }

    def rewrite(self, graph: Graph) -> None:
        for node in graph.nodes:
            if _is_gradient_reduction(node, self.axes):
                self.scatter(node)
            elif not any(v in self.blocks for v in node.inputs) or not self.shard(node):
                self.read_whole(node)
                self.producers.update((out, node) for out in node.outputs)
        graph.nodes = self.nodes  # the same list: finishing the outputs edits it
        self.drop_unread(graph)
        self.finish_outputs(graph)

    # the reductions

    def scatter(self, node: Node) -> None:
        full = node.outputs[0]
        dim = shard_dimension(full.shape, self.replicas)
        if dim is None:
            self.stats["replicated_gradients"] += 1
            self.remarks.append(
                f"kept the all-reduce of {node.label or 'a gradient'} {_type(full)}: no "
                f"dimension divides by {self.replicas} replicas, and a jax.Array cannot be "
                "split unevenly, so its update stays replicated"
            )
            self.nodes.append(node)
            return
        block = self.block_of(full, dim)
        # the block order of every collective and slice of the update, whatever the
        # reduction's own axis order was
        attrs = {**node.attrs, "axes": self.axes, "dimension": dim}
        attrs.pop("reduce_op")
        self.emit("reduce_scatter", node.inputs, block, attrs)
        self.blocks[full] = (block, dim)
        self.stats["sharded_gradients"] += 1

    # the update on blocks

    def shard(self, node: Node) -> bool:
        """Rewrite `node` to work on blocks; False if no rule proves that right."""
        if node.has(Trait.ELEMENTWISE):
            return self.elementwise(node)
        if len(node.inputs) != 1 or len(node.outputs) != 1:
            return False
        block, dim = self.blocks[node.inputs[0]]
        out = node.outputs[0]
        if node.has(Trait.DIMENSION_REDUCTION):
            return self.reduction(node, block, dim)
        if node.has(Trait.BROADCAST_IN_DIM):
            new_dim = node.attrs["broadcast_dimensions"][dim]
            if out.shape[new_dim] != node.inputs[0].shape[dim]:
                return False
            return self.follow(node, [block], new_dim)
        if node.has(Trait.RESHAPE):
            new_dim = unit_reshape_dim(node.inputs[0].shape, out.shape, dim)
            return new_dim is not None and self.follow(node, [block], new_dim)
        return False

    def elementwise(self, node: Node) -> bool:
        dims = {self.blocks[v][1] for v in node.inputs if v in self.blocks}
        logical = next(v.shape for v in node.inputs if v in self.blocks)
        if len(dims) != 1 or any(o.shape != logical for o in node.outputs):
            return False
        dim = dims.pop()
        operands = []
        for value in node.inputs:
            if value in self.blocks:
                operands.append(self.blocks[value][0])
            elif value.shape == ():  # a scalar broadcasts to any block
                operands.append(value)
            elif value.shape == logical and not value.varying_axes:
                operands.append(self.slice(value, dim))
            else:
                return False
        return self.follow(node, operands, dim)

    def reduction(self, node: Node, block: Value, dim: int) -> bool:
        reduced = node.attrs["axes"]
        out = node.outputs[0]
        if dim not in reduced:
            return self.follow(node, [block], dim - sum(1 for a in reduced if a < dim))
        # each replica reduces its block; one small all-reduce combines the partial results
        partial = out.like(varying_axes=out.varying_axes | self.varying)
        self.nodes.append(self.copy(node, [block], [partial]))
        attrs = {"axes": self.axes, "reduce_op": dimension_reduction(node.op)}
        self.emit("all_reduce", [partial], out, {**attrs, "origin": Origin.WEIGHT_UPDATE})
        return True

    def follow(self, node: Node, operands: list[Value], dim: int) -> bool:
        """Emit `node` on blocks; its results are blocks split on `dim`."""
        blocks = [self.block_of(out, dim) for out in node.outputs]
        self.nodes.append(self.copy(node, operands, blocks))
        for out, block in zip(node.outputs, blocks, strict=True):
            self.blocks[out] = (block, dim)
        return True

    def read_whole(self, node: Node) -> None:
        """`node` as it was, reading every sharded operand whole (gathered once)."""
        sharded = [v for v in node.inputs if v in self.blocks and v not in self.gathered]
        if sharded:
            self.stats["gathered_for_ops"] += 1
            self.remarks.append(
                f"gathered {', '.join(_type(v) for v in sharded)} for {node.op}: no rule "
                "proves it elementwise along the sharded dimension, so it runs replicated"
            )
        for value in sharded:
            self.gather(value)
        self.nodes.append(node)

    # the program's outputs

    def finish_outputs(self, graph: Graph) -> None:
        """State read only by the update comes back sharded, as it is taken next step;
        every other output that is still a block is gathered."""
        users = graph.users()
        for index, value in enumerate(graph.outputs):
            if value not in self.blocks:
                continue
            block, dim = self.blocks[value]
            arg = graph.state_outputs.get(index)
            if arg is not None and self.hold_sharded(graph, arg, dim, users):
                graph.outputs[index] = block
                graph.sharded_outputs[index] = Split(dim, tuple(self.axes))
                self.stats["sharded_state"] += 1
                self.stats["sharded_state_bytes"] += value.nbytes
            elif value not in self.gathered:
                self.gather(value, graph.output_name(index))

    def hold_sharded(self, graph: Graph, arg: int, dim: int, users: dict) -> bool:
        """Take input `arg` as this replica's block if all that reads it is its slice on
        `dim`; that slice's result becomes the input."""
        value, split = graph.inputs[arg], Split(dim, tuple(self.axes))
        if arg in graph.sharded_inputs:
            return graph.sharded_inputs[arg] == split
        readers = users.get(value, [])
        block = self.slices.get((value, dim))
        if (
            block is None
            or len(readers) != 1
            or value in graph.outputs
            or value.varying_axes
            or arg in graph.stacked_inputs
        ):
            return False
        self.nodes.remove(readers[0])
        block.name = value.name
        graph.inputs[arg] = block
        graph.sharded_inputs[arg] = split
        return True

    # building blocks

    def block_of(self, full: Value, dim: int) -> Value:
        shape = block_shape(full.shape, dim, self.replicas)
        return full.like(shape=shape, varying_axes=full.varying_axes | self.varying)

    def slice(self, value: Value, dim: int) -> Value:
        """This replica's block of a whole mirrored value. An elementwise producer (Adam's
        `b1 * mu` before it meets the gradient) is redone on blocks of its operands, so
        state is read only through its block and can be held sharded."""
        key = (value, dim)
        if key in self.slices:
            return self.slices[key]
        producer = self.producers.get(value)
        block = self.block_of(value, dim)
        if producer is not None and sinks_to_blocks(producer, value):
            # scalars broadcast to any block; the rest have the value's shape
            operands = [
                self.slice(x, dim) if x.shape == value.shape else x for x in producer.inputs
            ]
            self.nodes.append(self.copy(producer, operands, [block]))
            self.sunk.add(producer)
        else:
            self.emit("replica_slice", [value], block, {"axes": self.axes, "dimension": dim})
        self.slices[key] = block
        return block

    def drop_unread(self, graph: Graph) -> None:
        """Drop the whole nodes that were redone on blocks and that nothing reads now."""
        while True:
            read = {v for n in self.nodes for v in n.inputs} | set(graph.outputs)
            dead = [n for n in self.sunk if n in self.nodes and not read & set(n.outputs)]
            if not dead:
                return
            for node in dead:
                self.nodes.remove(node)

    def gather(self, value: Value, output: str | None = None) -> None:
        """Define `value` again, whole, from its block (`output`: the step output it is)."""
        block, dim = self.blocks[value]
        attrs = {"axes": self.axes, "dimension": dim} | ({"output": output} if output else {})
        self.emit("all_gather", [block], value, attrs)
        self.gathered.add(value)

    def emit(self, op: str, inputs: list[Value], out: Value, attrs: dict) -> None:
        self.nodes.append(Node(op, list(inputs), [out], attrs, created_by=self.created_by))

    def copy(self, node: Node, inputs: list[Value], outputs: list[Value]) -> Node:
        return Node(
            node.op,
            inputs,
            outputs,
            dict(node.attrs),
            payload=node.payload,
            created_by=self.created_by,
        )


def _is_gradient_reduction(node: Node, axes: list[str]) -> bool:
    """A complete gradient: autodiff's sum of one tensor over every replica axis."""
    a = node.attrs
    return (
        node.op == "all_reduce"
        and a.get("origin") == Origin.AUTODIFF
        and a.get("reduce_op") == "sum"
        and sorted(a.get("axes", ())) == sorted(axes)
        and len(node.inputs) == 1
        and not node.outputs[0].varying_axes
        and "bucket" not in a
    )


def _type(value: Value) -> str:
    return (f"{value.name} " if value.name else "") + format_type(value)
