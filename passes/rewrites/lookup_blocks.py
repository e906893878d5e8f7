"""Blocks through a table lookup: an embedding table held split on its features is read
where it lies, and its gradient is summed where it lies, as MaxText lays out its token
embedding.

Read whole, a split table is gathered whole on every replica for each lookup (Llama-2-7B:
250 MiB of bf16 per chip), and its gradient is a whole table on every replica before its
reduce-scatter (500 MiB of f32). Split on a dimension each lookup takes whole (a
feature), the table needs neither:

- forward: every replica's token ids are gathered (a few MB), each replica looks them all
  up in its own columns, and an all-to-all sends each replica its own tokens' rows, every
  column;
- backward: the transpose. An all-to-all sends each replica every token's cotangent in its
  columns, and one local scatter-add of all of them into zeros is this replica's block of
  the summed gradient: no reduction is left.

Each is taken only where it moves less than it replaces: a lookup whose result is smaller
than the table, a gradient whose cotangent is smaller than the gradient.

    Before (8 replicas; %1 the table's block, %2 this replica's token ids):
      %3: f32[64,16] = all_gather(%1) {"axes": ["replica"], "dimension": 1, "deferred": true}
      %4: f32[2,7,16]{replica} = jax.gather(%3, %2) {"slice_sizes": [1, 16], ...}
      ...
      %9: f32[64,16]{replica} = jax.scatter-add(%8, %2, %7)
      %10: f32[64,16] = all_reduce(%9) {"axes": ["replica"], "origin": "autodiff", ...}
    After:
      %11: i32[16,7,1] = all_gather(%2) {"axes": ["replica"], "dimension": 0}
      %12: f32[16,7,2]{replica} = jax.gather(%1, %11) {"slice_sizes": [1, 2], ...}
      %4: f32[2,7,16]{replica} = all_to_all(%12) {"split_axis": 0, "concat_axis": 2, ...}
      ...
      %13: f32[16,7,2]{replica} = all_to_all(%7) {"split_axis": 2, "concat_axis": 0, ...}
      %14: f32[64,2]{replica} = jax.scatter-add(%15, %11, %13)  (%15: zeros, one block)
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from xla_strategies.passes.ir.graph import Node, Value
from xla_strategies.passes.ir.text import format_type
from xla_strategies.passes.ir.traits import Trait
from xla_strategies.passes.rewrites.blocks import BlockRewriter, divides


class LookupRewriter(BlockRewriter, Protocol):
    """What the lookup rules need of the rewriter (`block_sharder.BlockSharder`) besides
    its blocks: the graph's producers and readers, the replicas it splits over and those
    it sums across, the whole nodes it may drop, and the token ids it has gathered."""

    replicas: int
    across: list[str]
    producers: dict[Value, Node]
    users: dict[Value, list[Node]]
    sunk: set[Node]
    gathered_ids: dict[Value, Value]

    def emit(self, op: str, inputs: list[Value], out: Value, attrs: dict) -> None: ...
    def copy(self, node: Node, inputs: list[Value], outputs: list[Value]) -> Node: ...


def window_dims(node: Node) -> dict[int, int]:
    """For a gather or a scatter-add with one batch of indices: each operand dimension
    the op takes whole (a slice of its full size, at offset 0), mapped to the dimension
    of the result (gather) or of the updates (scatter-add) that holds it."""
    windows, inserted, indexed, batching, _ = node.attrs["dimension_numbers"]
    operand, indices = node.inputs[0], node.inputs[1]
    if batching or len(indices.shape) < 2:
        return {}
    kept = [d for d in range(len(operand.shape)) if d not in inserted]
    if node.has(Trait.LOOKUP):
        sizes = node.attrs["slice_sizes"]
        whole = {d for d in kept if sizes[d] == operand.shape[d]}
    else:
        updates = node.inputs[2]
        whole = {
            d for d, w in zip(kept, windows, strict=True) if updates.shape[w] == operand.shape[d]
        }
    return {d: w for d, w in zip(kept, windows, strict=True) if d in whole and d not in indexed}


def table_dims(users: dict[Value, list[Node]], value: Value, replicas: int) -> list[int]:
    """The dimensions a state `value` (whose readers `users` maps, as `Graph.users()`)
    could be held split on and still be looked up in place: those every gather reading
    it (through elementwise ops: a cast to bf16) takes whole and that divide by
    `replicas`. Empty unless gathers that pay in place (`_pays`) are its only readers
    besides elementwise ops (the update) and the step's outputs."""
    reached, dims = [value], None
    for current in reached:
        for node in users.get(current, []):
            if node.op == "pvary" or (
                node.has(Trait.ELEMENTWISE) and node.outputs[0].shape == value.shape
            ):
                reached.extend(o for o in node.outputs if o not in reached)
            elif (
                node.has(Trait.LOOKUP)
                and node.inputs[0] is current
                and _pays(node, node.outputs[0])
            ):
                found = set(window_dims(node))
                dims = found if dims is None else dims & found
            else:
                return []
    return [d for d in sorted(dims or ()) if divides(value.shape, d, replicas)]


def shard_lookup(sharder: LookupRewriter, node: Node) -> bool:
    """Run the gather `node` on its table's block, where the block's split dimension is
    one the gather takes whole and each replica looks up its own tokens."""
    table, indices = node.inputs[0], node.inputs[1]
    if table not in sharder.blocks or indices in sharder.blocks:
        return False
    block, dim = sharder.blocks[table]
    out_dim = _in_place(sharder, node, dim)
    if out_dim is None:
        return False
    out, replicas = node.outputs[0], sharder.replicas
    batch = _first_not_in(len(out.shape), node.attrs["dimension_numbers"][0])
    every_id = all_ids(sharder, indices, replicas)
    looked_up = out.like(
        shape=_exchanged(out.shape, grown=batch, split=out_dim, parts=replicas),
        varying_axes=out.varying_axes | frozenset(sharder.axes),
    )
    local = sharder.copy(node, [block, every_id], [looked_up])
    sizes = node.attrs["slice_sizes"]  # the dimension taken whole: the block's size now
    local.attrs["slice_sizes"] = [block.shape[d] if d == dim else s for d, s in enumerate(sizes)]
    sharder.nodes.append(local)
    _all_to_all(sharder, looked_up, out, split=batch, concat=out_dim)
    sharder.stats["lookups_in_place"] += 1
    return True


def type_for_lookups(sharder: LookupRewriter, node: Node) -> bool:
    """The `pvary` that types a table's block for the replicas' lookups, when every
    reader is a lookup that runs on the block: its result is the block, typed."""
    block, dim = sharder.blocks[node.inputs[0]]
    readers = sharder.users.get(node.outputs[0], [])
    if not readers or any(_in_place(sharder, r, dim) is None for r in readers):
        return False
    typed = sharder.block_of(node.outputs[0], dim)
    sharder.nodes.append(sharder.copy(node, [block], [typed]))
    sharder.blocks[node.outputs[0]] = (typed, dim)
    return True


def _in_place(sharder: LookupRewriter, node: Node, dim: int) -> int | None:
    """The result dimension of gather `node` that its table's block split on `dim`
    gives, if it may run on the block (`_pays`), with token ids that differ across every
    replica it is split over."""
    if not node.has(Trait.LOOKUP) or len(node.inputs) != 2 or node.inputs[1] in sharder.blocks:
        return None
    if not _pays(node, node.outputs[0]) or not _varies_over(node.inputs[1], sharder.axes):
        return None
    return window_dims(node).get(dim)


def _pays(node: Node, moved: Value) -> bool:
    """Whether a lookup or its transpose `node` is worth running where the table lies:
    its token ids differ across replicas (a position table's `arange` does not), and what
    the all-to-all moves (`moved`) is smaller than the table. The concatenated ids of
    every replica are neither sorted nor unique, whatever the op promised of its own."""
    table, indices = node.inputs[0], node.inputs[1]
    promised = node.attrs.get("indices_are_sorted") or node.attrs.get("unique_indices")
    return bool(indices.varying_axes) and moved.nbytes < table.nbytes and not promised


def scatter_lookup_gradient(sharder: LookupRewriter, reduction: Node, prefer: int | None) -> bool:
    """Sum the gradient `reduction` completes as this replica's block, when it sums
    scatter-adds into zeros of tokens every replica looks up: one all-to-all of the
    cotangents and a local scatter-add (`prefer`: the dimension the parameter is held
    split on)."""
    full = reduction.outputs[0]
    scatter = sharder.producers.get(reduction.inputs[0])
    if scatter is None or not scatter.has(Trait.SCATTER_ADD) or len(scatter.inputs) != 3:
        return False
    zeros, indices, updates = scatter.inputs
    if (
        len(sharder.users.get(reduction.inputs[0], [])) != 1
        or not _varies_over(indices, sharder.axes)
        or not _pays(scatter, updates)
    ):
        return False
    replicas = sharder.replicas
    windows = {d: w for d, w in window_dims(scatter).items() if divides(full.shape, d, replicas)}
    if not windows or (zero := _zeros_source(sharder, zeros)) is None:
        return False
    dim = prefer if prefer in windows else min(windows)
    batch = _first_not_in(len(updates.shape), scatter.attrs["dimension_numbers"][0])
    sent = updates.like(
        shape=_exchanged(updates.shape, grown=batch, split=windows[dim], parts=replicas),
        varying_axes=updates.varying_axes | frozenset(sharder.axes),
    )
    _all_to_all(sharder, updates, sent, split=windows[dim], concat=batch)
    zero_block = sharder.slice(zero, dim)
    if zeros is not zero:  # the captured pvary to the replicas' type, on the block
        typed = sharder.block_of(zeros, dim)
        sharder.nodes.append(sharder.copy(sharder.producers[zeros], [zero_block], [typed]))
        zero_block = typed
    block = sharder.block_of(full, dim)
    # across slices, the local sum is partial until the blocks are summed over them
    summed = (
        block.like(varying_axes=block.varying_axes | frozenset(sharder.across))
        if sharder.across
        else block
    )
    every_id = all_ids(sharder, indices, replicas)
    sharder.nodes.append(sharder.copy(scatter, [zero_block, every_id, sent], [summed]))
    if sharder.across:  # the replicas in other slices hold other tokens: sum the blocks
        attrs = {**reduction.attrs, "axes": sharder.across, "reduce_op": "sum"}
        sharder.emit("all_reduce", [summed], block, attrs)
    sharder.sunk.add(scatter)  # the whole scatter-add, dropped once nothing reads it
    sharder.blocks[full] = (block, dim)
    sharder.stats["sharded_gradients"] += 1
    sharder.stats["lookup_gradients"] += 1
    sharder.remarks.append(
        f"summed the gradient of {reduction.attrs.get('param') or 'a lookup table'} where it "
        f"lies: an all-to-all of the cotangents {_type(updates)} and a local scatter-add into "
        f"each replica's block of dimension {dim}, instead of a whole gradient's reduce-scatter"
    )
    return True


def all_ids(sharder: LookupRewriter, indices: Value, replicas: int) -> Value:
    """Every replica's `indices`, concatenated in block order. They are gathered once per
    step without the index vector's unit dimension, and given it back at each use: TPU
    tiles pad a trailing dimension of 1 to 128, so the s32[524288, 1] ids of 256 chips
    would hold 256 MiB from the lookup to its gradient (Llama-2-70B on v5p-512)."""
    unit = indices.shape[-1] == 1
    cache = sharder.gathered_ids
    if indices not in cache:
        flat = indices.like(shape=indices.shape[:-1]) if unit else indices
        if unit:
            sharder.emit("reshape", [indices], flat, {})
        every = flat.like(
            shape=(flat.shape[0] * replicas, *flat.shape[1:]),
            varying_axes=flat.varying_axes - frozenset(sharder.axes),
        )
        sharder.emit("all_gather", [flat], every, {"axes": sharder.axes, "dimension": 0})
        cache[indices] = every
    if not unit:
        return cache[indices]
    every = cache[indices].like(shape=(*cache[indices].shape, 1))
    sharder.emit("reshape", [cache[indices]], every, {})
    return every


def _all_to_all(sharder: LookupRewriter, x: Value, out: Value, split: int, concat: int) -> None:
    attrs = {"axes": sharder.axes, "split_axis": split, "concat_axis": concat}
    sharder.emit("all_to_all", [x], out, attrs)


def _zeros_source(sharder: LookupRewriter, value: Value) -> Value | None:
    """The replica-invariant value of zeros `value` is (through a pvary), or None."""
    producer = sharder.producers.get(value)
    if producer is not None and producer.op == "pvary":
        value = producer.inputs[0]
        producer = sharder.producers.get(value)
    if value.varying_axes or producer is None:
        return None
    if producer.has(Trait.BROADCAST_IN_DIM):
        producer = sharder.producers.get(producer.inputs[0])
    if producer is None or producer.op != "constant":
        return None
    constant = producer.payload if producer.payload is not None else producer.attrs["value"]
    if isinstance(constant, str):  # elided in text, and no captured value
        return None
    return value if not np.any(np.asarray(constant)) else None


def _varies_over(value: Value, axes: list[str]) -> bool:
    return set(axes) <= value.varying_axes


def _first_not_in(rank: int, dims: list[int]) -> int:
    return next(d for d in range(rank) if d not in dims)


def _exchanged(shape: tuple[int, ...], grown: int, split: int, parts: int) -> tuple[int, ...]:
    """`shape` with dimension `grown` `parts` times longer and `split` cut into `parts`."""
    sizes = list(shape)
    sizes[grown], sizes[split] = sizes[grown] * parts, sizes[split] // parts
    return tuple(sizes)


def _type(value: Value) -> str:
    return (f"{value.name} " if value.name else "") + format_type(value)
