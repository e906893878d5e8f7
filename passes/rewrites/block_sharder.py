"""Rewrites a graph to work on one replica's block of mirrored values, forward from the
gradient reductions that can deliver blocks: the engine of weight-update sharding
(`shard_weight_updates.py`) and of parameter sharding (`shard_parameters.py`).

A logical (mirrored) value the rewrite has split is represented by its block in
`BlockSharder.blocks`; the original `Value` object is defined again, by an `all_gather`,
only if something reads it whole. Besides the gradient reductions, a block enters through
a *deferred* `all_gather` (attribute `"deferred": true`): a pass that holds a value split
(a parameter, a loop's stacked gradient blocks) defines the logical value by one, and the
sharder gathers it only where it is read whole, after any elementwise ops it can run on the
block first (a cast to bf16 is run on the block, so the gather moves half the bytes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from xla_strategies.passes.ir.graph import Graph, Node, Origin, Split, Value
from xla_strategies.passes.ir.text import format_type
from xla_strategies.passes.ir.traits import Trait, dimension_reduction, result_shape_param
from xla_strategies.passes.rewrites.blocks import (
    DEFERRED,
    block_value,
    divides,
    held_dims_by_shape,
    shard_dimension,
    sinks_to_blocks,
    unit_reshape_dim,
)
from xla_strategies.passes.rewrites.branch_blocks import shard_branches
from xla_strategies.passes.rewrites.lookup_blocks import (
    scatter_lookup_gradient,
    shard_lookup,
    type_for_lookups,
)


class BlockSharder:
    """One walk over a graph (not its regions) in schedule order."""

    def __init__(
        self,
        axes: list[str],
        mesh_axes: Mapping[str, int],
        created_by: str,
        min_elements: int = 0,
        lookups: bool = True,
    ) -> None:
        """`axes`: the replica axes blocks are numbered over; a value is replicated across
        the other axes of `mesh_axes`, whose gradient sums run on the blocks. A gradient of
        fewer than `min_elements` keeps its all-reduce. `lookups`: tables are looked up,
        and their gradients summed, where their blocks lie (`lookup_blocks`)."""
        self.axes, self.mesh_axes, self.created_by = axes, mesh_axes, created_by
        self.min_elements, self.lookups = min_elements, lookups
        self.replicas = math.prod(mesh_axes[a] for a in axes)
        self.all_axes = list(mesh_axes)
        self.across = [a for a in mesh_axes if a not in axes and mesh_axes[a] > 1]
        self.varying = frozenset(axes)
        self.blocks: dict[Value, tuple[Value, int]] = {}
        self.gathered: set[Value] = set()
        self.deferred: set[Value] = set()  # held split by a pass: gathered where read whole
        self.slices: dict[tuple[Value, int], Value] = {}
        self.model_dims: dict[tuple[int, ...], int] = {}
        # a held value's own model-axis dimension (its deferred gather's), which the shape
        # cannot tell where two parameters of one shape are split differently
        self.held_model_dims: dict[Value, int] = {}
        self.nodes: list[Node] = []
        self.producers: dict[Value, Node] = {}
        self.users: dict[Value, list[Node]] = {}
        self.held_dims: dict[tuple[int, ...], int] = {}
        self.gathered_ids: dict[Value, Value] = {}  # token ids every replica looks up
        self.sunk: set[Node] = set()  # whole nodes redone on blocks; dropped if unread
        self.remarks: list[str] = []
        self.stats: dict[str, Any] = {
            "sharded_gradients": 0,
            "replicated_gradients": 0,
            "gathered_for_ops": 0,
            "sharded_state": 0,
            "sharded_state_bytes": 0,
            # tables looked up, and gradients summed, where their blocks lie
            "lookups_in_place": 0,
            "lookup_gradients": 0,
            # the decisions the remarks word: what stayed whole, and why
            "replicated": [],  # {"gradient", "type", "reason"}
            "gathered": [],  # {"op", "types", "reason"}
        }

    def rewrite(self, graph: Graph) -> None:
        """The program: its state outputs come back as blocks where the next step can take
        them so (`hold_sharded`); every other output that is still a block is gathered."""
        self.walk(graph)
        self.drop_unread(graph)
        self.finish_outputs(graph)

    def rewrite_region(self, graph: Graph, returnable: range) -> dict[int, int]:
        """A region (loop body, checkpoint): its outputs at positions in `returnable` that
        are blocks are returned as blocks; returns their positions and split dimensions.
        The rest are gathered."""
        self.walk(graph)
        returned: dict[int, int] = {}
        for index, value in enumerate(graph.outputs):
            if value not in self.blocks:
                continue
            if index in returnable and graph.outputs.count(value) == 1:
                block, returned[index] = self.blocks[value]
                graph.outputs[index] = block
            elif value not in self.gathered:
                self.gather(value)
        self.drop_unread(graph)
        return returned

    def walk(self, graph: Graph) -> None:
        self.model_dims = held_dims_by_shape(graph, "model_dim")
        self.held_dims = held_dims_by_shape(graph, "dimension")
        self.users = graph.users()
        for node in graph.nodes:
            if is_gradient_reduction(node, self.all_axes):
                self.scatter(node)
            elif node.op == "all_gather" and node.attrs.get(DEFERRED):
                self.blocks[node.outputs[0]] = (node.inputs[0], node.attrs["dimension"])
                self.deferred.add(node.outputs[0])
                if "model_dim" in node.attrs:
                    self.held_model_dims[node.outputs[0]] = node.attrs["model_dim"]
            elif not any(v in self.blocks for v in node.inputs) or not self.shard(node):
                self.read_whole(node)
                self.producers.update((out, node) for out in node.outputs)
        graph.nodes = self.nodes  # the same list: finishing the outputs edits it

    # the reductions

    def scatter(self, node: Node) -> None:
        full = node.outputs[0]
        shape = full.shape
        model_dim = node.attrs.get("model_dim", self.model_dims.get(shape))
        if model_dim is not None:  # XLA's partitioner splits the gradient there
            shape = (*shape[:model_dim], 0, *shape[model_dim + 1 :])
        held = self.held_dims.get(full.shape)  # where the parameter's blocks lie
        dim = held if divides(shape, held, self.replicas) else shard_dimension(shape, self.replicas)
        small = full.size < self.min_elements
        if dim is None or small:
            reason = "smaller than a tile per replica" if small else "no dividing dimension"
            why = (
                f"fewer than {self.min_elements} elements: each replica's block would be "
                "padded to a whole tile of the collective"
                if small
                else f"no dimension divides by {self.replicas} replicas, and a jax.Array "
                "cannot be split unevenly"
            )
            self.stats["replicated_gradients"] += 1
            self.stats["replicated"].append(
                {"gradient": node.label, "type": _type(full), "reason": reason}
            )
            self.remarks.append(
                f"kept the all-reduce of {node.label or 'a gradient'} {_type(full)}: {why}, "
                "so its update stays replicated"
            )
            self.nodes.append(node)
            return
        if self.lookups and scatter_lookup_gradient(self, node, held):
            return
        block = self.block_of(full, dim)
        # the block order of every collective and slice of the update, whatever the
        # reduction's own axis order was
        attrs = {**node.attrs, "axes": self.axes, "dimension": dim}
        attrs.pop("reduce_op")
        if model_dim is not None:  # the lowering keeps the blocks split there
            attrs["model_dim"] = model_dim
            self.held_model_dims[full] = model_dim  # the update's gather, through its ops
        if self.across:  # the sum over the other axes (slices), on the blocks
            partial = block.like(varying_axes=block.varying_axes | frozenset(self.across))
            self.emit("reduce_scatter", node.inputs, partial, attrs)
            across = {**node.attrs, "axes": self.across, "reduce_op": "sum"}
            self.emit("all_reduce", [partial], block, across)
        else:
            self.emit("reduce_scatter", node.inputs, block, attrs)
        self.blocks[full] = (block, dim)
        self.stats["sharded_gradients"] += 1

    # the update on blocks

    def shard(self, node: Node) -> bool:
        """Rewrite `node` to work on blocks; False if no rule proves that right."""
        if node.has(Trait.ELEMENTWISE):
            return self.elementwise(node)
        if node.has(Trait.BRANCHES):
            return shard_branches(self, node)
        if node.has(Trait.LOOKUP):
            return self.lookups and shard_lookup(self, node)
        if node.op == "pvary" and self.lookups:
            return type_for_lookups(self, node)
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
        if node.has(Trait.TRANSPOSE):  # a stack's gradient back in its parameter's layout
            return self.follow(node, [block], list(node.attrs["permutation"]).index(dim))
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
        held = {self.held_model_dims[v] for v in node.inputs if v in self.held_model_dims}
        if len(held) == 1:  # a held value's cast or sharding constraint: split as it is
            self.held_model_dims.update(dict.fromkeys(node.outputs, held.pop()))
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
        if all(v in self.deferred for v in node.inputs if v in self.blocks):
            self.deferred.update(node.outputs)  # a held-split value's cast, still deferred
        return True

    def read_whole(self, node: Node) -> None:
        """`node` as it was, reading every sharded operand whole (gathered once)."""
        sharded = [v for v in node.inputs if v in self.blocks and v not in self.gathered]
        unplanned = [v for v in sharded if v not in self.deferred]
        if unplanned:
            self.stats["gathered_for_ops"] += 1
            self.stats["gathered"].append(
                {
                    "op": node.op,
                    "types": [_type(v) for v in unplanned],
                    "reason": "not elementwise along the split dimension",
                }
            )
            self.remarks.append(
                f"gathered {', '.join(_type(v) for v in unplanned)} for {node.op}: no rule "
                "proves it elementwise along the sharded dimension, so it runs replicated"
            )
        for value in sharded:
            self.gather(value)
        self.nodes.append(node)

    # the program's outputs

    def finish_outputs(self, graph: Graph) -> None:
        """State read only by the update comes back sharded, as it is taken next step;
        every other output that is still a block is gathered."""
        users, io = graph.users(), graph.io
        for index, value in enumerate(graph.outputs):
            arg = io.outputs[index].state_of
            taken_split = io.inputs[arg].sharded if arg is not None else None
            if value not in self.blocks and taken_split and not value.varying_axes:
                # state taken split whose next value is computed whole (running statistics):
                # returned as its block (a local slice), so the next step takes it as is
                graph.outputs[index] = self.slice(value, taken_split.dim)
                io.outputs[index].sharded = taken_split
                continue
            if value not in self.blocks:
                continue
            block, dim = self.blocks[value]
            if arg is not None and self.hold_sharded(graph, arg, dim, users):
                graph.outputs[index] = block
                io.outputs[index].sharded = Split(dim, tuple(self.axes))
                self.stats["sharded_state"] += 1
                self.stats["sharded_state_bytes"] += value.nbytes
            elif value not in self.gathered:
                self.gather(value, graph.output_name(index))

    def hold_sharded(self, graph: Graph, arg: int, dim: int, users: dict) -> bool:
        """Take input `arg` as this replica's block if all that reads it is its slice on
        `dim`; that slice's result becomes the input."""
        value, split = graph.inputs[arg], Split(dim, tuple(self.axes))
        attrs = graph.io.inputs[arg]
        if attrs.sharded:
            return attrs.sharded == split
        readers = users.get(value, [])
        block = self.slices.get((value, dim))
        if (
            block is None
            or len(readers) != 1
            or value in graph.outputs
            or value.varying_axes
            or attrs.stacked
        ):
            return False
        self.nodes.remove(readers[0])
        block.name = value.name
        graph.inputs[arg] = block
        attrs.sharded = split
        return True

    # building blocks

    def block_of(self, full: Value, dim: int) -> Value:
        return block_value(full, dim, self.replicas, self.axes)

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
        model_dim = self.held_model_dims.get(value, self.model_dims.get(value.shape))
        if model_dim is not None:
            attrs["model_dim"] = model_dim
        self.emit("all_gather", [block], value, attrs)
        self.gathered.add(value)

    def emit(self, op: str, inputs: list[Value], out: Value, attrs: dict) -> None:
        self.nodes.append(Node(op, list(inputs), [out], attrs, created_by=self.created_by))

    def copy(self, node: Node, inputs: list[Value], outputs: list[Value]) -> Node:
        """`node` on other operands and results; an attribute naming the result's shape
        (a broadcast's) names the new one, as the lowering will give it."""
        attrs = dict(node.attrs)
        if (shape := result_shape_param(node.op)) in attrs:
            attrs[shape] = list(outputs[0].shape)
        return Node(
            node.op, inputs, outputs, attrs, payload=node.payload, created_by=self.created_by
        )


def is_gradient_reduction(node: Node, axes: list[str]) -> bool:
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
