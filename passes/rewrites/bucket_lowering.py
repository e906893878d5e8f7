"""How `combine-all-reduces` lowers one bucket: its members become one collective over a
flat buffer (reshape, concatenate; slice and reshape back after), placed where the last
member was. Block collectives (reduce-scatters, all-gathers) view each member as
[replicas, block size] first.

With a device tile (rows, lanes) (TPU: (8, 128)), a member whose last two dimensions are
whole tiles enters the flat buffer in the order its tiled layout keeps it in memory, tile
after tile ([..., R, L] as [..., R / rows, L / lanes, rows, lanes]), not in row-major
order: a sum does not care about the order, and XLA's TPU compiler then copies nothing
(the buffer's 1-D layout is whole tiles in a row) where a row-major buffer is a relayout
of every member after the reduction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from xla_strategies.passes.ir.graph import Graph, NewNodes, Node, Value


@dataclass
class Bucket:
    """Reductions combined into one collective, in schedule order."""

    members: list[Node] = field(default_factory=list)
    nbytes: int = 0
    tainted: set[Value] = field(default_factory=set)  # values computed from members' results


_KEPT_ATTRS = ("axes", "reduce_op", "origin", "root", "size")


def _label(node: Node) -> str:
    """What a bucket member was: its parameter, else its source line, else its shape."""
    shape = "x".join(map(str, node.inputs[0].shape)) or "scalar"
    return node.label or shape


def combine(
    graph: Graph,
    bucket: Bucket,
    index: int,
    created_by: str,
    own_operand_bytes: int = 0,
    tile: tuple[int, int] | None = None,
) -> None:
    """Replace the bucket's members by one all_reduce at the last member's position. Its
    first operand is a flat buffer of the members (reshape, concatenate; slice and reshape
    back after); with a `tile`, members in tile order where they are whole tiles, and zeros
    after them up to whole tiles. Members of at least `own_operand_bytes` (when not 0) are
    operands of their own instead, so the reduction is one tuple all-reduce that copies only
    small tensors."""
    members, first = bucket.members, bucket.members[0]
    dtype, axes = first.inputs[0].dtype, set(first.attrs["axes"])
    varying = first.inputs[0].varying_axes
    own = [m for m in members if own_operand_bytes and m.inputs[0].nbytes >= own_operand_bytes]
    packed = [m for m in members if m not in own]
    emit = NewNodes(created_by)
    operands, results = [m.inputs[0] for m in own], [m.outputs[0] for m in own]
    if len(packed) == 1:  # nothing to pack it with: an operand of its own
        operands, results = [packed[0].inputs[0], *operands], [packed[0].outputs[0], *results]
        packed = []
    flats = [_flat(emit, m.inputs[0], tile) for m in packed]
    if packed:
        size = sum(f.size for f in flats)
        pad = (-size) % math.prod(tile or (1,))
        zeros = [emit("constant", [], Value((pad,), dtype, frozenset()), value=0)] if pad else []
        total = size + pad
        buffer = emit("concatenate", [*flats, *zeros], Value((total,), dtype, varying), dimension=0)
        operands = [buffer, *operands]
        results = [Value((total,), dtype, frozenset(varying - axes)), *results]
    attrs = {k: first.attrs[k] for k in _KEPT_ATTRS if k in first.attrs}
    attrs.update(bucket=index, members=[_label(m) for m in members])
    emit.add(first.op, operands, results, attrs)
    offset = 0
    for member, flat in zip(packed, flats, strict=True):
        result = member.outputs[0]
        piece = result if len(result.shape) == 1 else result.like(shape=(flat.size,))
        emit("slice", [results[0]], piece, start=[offset], limit=[offset + flat.size])
        if piece is not result:
            _unflat(emit, piece, result, tile)
        offset += flat.size
    _replace_members(graph, bucket, emit.nodes)


def _tiles(shape: tuple[int, ...], tile: tuple[int, int] | None) -> tuple[int, ...] | None:
    """`shape` as [leading, row tiles, rows, lane tiles, lanes], where its last two
    dimensions are whole tiles in more than one column of tiles (one column of tiles is in
    row-major order already); None elsewhere."""
    if tile is None or len(shape) < 2:
        return None
    (rows, lanes), (height, width) = tile, shape[-2:]
    if height % rows or width % lanes or width == lanes:
        return None
    return (math.prod(shape[:-2]), height // rows, rows, width // lanes, lanes)


# swaps a tiled view's rows and lane tiles: [l, R, r, L, l'] <-> [l, R, L, r, l']; its own
# inverse
_TILE_ORDER = [0, 1, 3, 2, 4]


def _flat(emit: NewNodes, value: Value, tile: tuple[int, int] | None) -> Value:
    """`value` as one dimension: in tile order where it is whole tiles, else row-major."""
    if len(value.shape) == 1:
        return value
    flat = value.like(shape=(value.size,))
    tiled = _tiles(value.shape, tile)
    if tiled is None:
        return emit("reshape", [value], flat)
    view = emit("reshape", [value], value.like(shape=tiled))
    ordered = tuple(tiled[i] for i in _TILE_ORDER)
    moved = emit("transpose", [view], value.like(shape=ordered), permutation=_TILE_ORDER)
    return emit("reshape", [moved], flat)


def _unflat(emit: NewNodes, piece: Value, result: Value, tile: tuple[int, int] | None) -> None:
    """`_flat`'s inverse: the reduced `piece` as the member's `result`."""
    tiled = _tiles(result.shape, tile)
    if tiled is None:
        emit.add("reshape", [piece], [result])
        return
    ordered = tuple(tiled[i] for i in _TILE_ORDER)
    view = emit("reshape", [piece], result.like(shape=ordered))
    moved = emit("transpose", [view], result.like(shape=tiled), permutation=_TILE_ORDER)
    emit.add("reshape", [moved], [result])


def combine_blocks(
    graph: Graph,
    bucket: Bucket,
    index: int,
    created_by: str,
    mesh_axes: dict[str, int],
    tile: tuple[int, int] | None = None,
) -> None:
    """One reduce-scatter (or all-gather) for the bucket: each member as [replicas, its
    block size] (contiguous blocks make that a reshape), concatenated along dimension 1,
    one collective along dimension 0, and each member's columns sliced out again. With a
    `tile` (rows, lanes), each replica's block is padded to whole tiles and given as
    `rows` rows: the shape XLA's TPU compiler keeps as a reduce-scatter."""
    members, first = bucket.members, bucket.members[0]
    replicas = math.prod(mesh_axes[a] for a in first.attrs["axes"])
    scatter = first.op == "reduce_scatter"
    source, result = first.inputs[0], first.outputs[0]
    emit = NewNodes(created_by)
    rows_in, rows_out = (replicas, 1) if scatter else (1, replicas)
    views = [
        _rows(emit, m.inputs[0], m.attrs["dimension"], replicas)
        if scatter
        else emit("reshape", [m.inputs[0]], m.inputs[0].like(shape=(1, _block_size(m))))
        for m in members
    ]
    total = sum(v.shape[1] for v in views)
    rows, lanes = tile or (1, 1)
    pad = (-total) % (rows * lanes)
    if pad:  # zeros after the members, never read back
        zeros = source.like(shape=(rows_in, pad), varying_axes=frozenset())
        views = [*views, emit("constant", [], zeros, value=0)]
    buffer = emit("concatenate", views, source.like(shape=(rows_in, total + pad)), dimension=1)
    attrs = {k: first.attrs[k] for k in _KEPT_ATTRS if k in first.attrs}
    attrs.update(dimension=0, bucket=index, members=[_label(m) for m in members])
    if rows > 1:  # each replica's block as `rows` rows of the device's tile
        shape = (rows_in * rows, (total + pad) // rows)
        buffer = emit("reshape", [buffer], buffer.like(shape=shape))
    out = result.like(shape=(rows_out * rows, (total + pad) // rows))
    combined = emit(first.op, [buffer], out, **attrs)
    if rows > 1:
        combined = emit("reshape", [combined], out.like(shape=(rows_out, total + pad)))
    offset = 0
    for member, view in zip(members, views[: len(members)], strict=True):
        width = view.shape[1]
        piece = member.outputs[0].like(shape=(rows_out, width))
        emit("slice", [combined], piece, start=[0, offset], limit=[rows_out, offset + width])
        if scatter:
            emit.add("reshape", [piece], [member.outputs[0]])
        else:
            _unrows(emit, piece, member)
        offset += width
    _replace_members(graph, bucket, emit.nodes)


def _rows(emit: NewNodes, value: Value, dim: int, replicas: int) -> Value:
    """`value` as [replicas, block size], row r its block r along `dim`."""
    shape = value.shape
    split = (*shape[:dim], replicas, shape[dim] // replicas, *shape[dim + 1 :])
    flat = value.like(shape=(replicas, value.size // replicas))
    if all(size == 1 for size in shape[:dim]):  # block r is contiguous already
        return emit("reshape", [value], flat)
    grouped = emit("reshape", [value], value.like(shape=split))
    order = [dim, *range(dim), *range(dim + 1, len(split))]
    front = emit(
        "transpose", [grouped], value.like(shape=tuple(split[i] for i in order)), permutation=order
    )
    return emit("reshape", [front], flat)


def _unrows(emit: NewNodes, rows: Value, member: Node) -> None:
    """The gathered [replicas, block size] rows of `member` as its whole result."""
    dim, result, block = member.attrs["dimension"], member.outputs[0], member.inputs[0].shape
    if all(size == 1 for size in block[:dim]):
        emit.add("reshape", [rows], [result])
        return
    stacked = emit("reshape", [rows], result.like(shape=(rows.shape[0], *block)))
    order = [*range(1, dim + 1), 0, *range(dim + 1, len(block) + 1)]
    split = tuple(stacked.shape[i] for i in order)
    moved = emit("transpose", [stacked], result.like(shape=split), permutation=order)
    emit.add("reshape", [moved], [result])


def _block_size(node: Node) -> int:
    block = node.outputs[0] if node.op == "reduce_scatter" else node.inputs[0]
    return block.size


def _replace_members(graph: Graph, bucket: Bucket, new: list[Node]) -> None:
    """Put `new` where the bucket's last member was; nodes between the first and the last
    member that read a member's result move after it, keeping their order."""
    members = bucket.members
    start, end = graph.nodes.index(members[0]), graph.nodes.index(members[-1])
    between = [n for n in graph.nodes[start:end] if n not in members]
    dependent = [n for n in between if any(v in bucket.tainted for v in (*n.inputs, *n.outputs))]
    kept = [n for n in between if n not in dependent]
    graph.nodes[start : end + 1] = kept + new + dependent
