"""combine-all-reduces: bucket independent reductions into flat buffers.

Hundreds of small gradient reductions each pay a collective's latency. This pass groups
reductions with equal (axes, reduce_op, dtype) into buckets of up to `threshold_bytes`, in
schedule order (readiness order: backward order for gradients, so an early bucket can
overlap the rest of the backward pass), and lowers each bucket as one flat buffer:
flatten, concatenate, one all_reduce, slice and reshape back. A flat buffer was measured
faster than XLA's tuple-shaped combined all-reduce on CPU. A reduction joins a bucket only
if no member's result is read before it, which also keeps dependent reductions apart.
CentralStorageStrategy's `reduce_to_one` and `broadcast` are bucketed the same way, each
kind (and root) apart, and so are weight-update sharding's `reduce_scatter`s and
`all_gather`s: each member is viewed as [replicas, block size], the views are
concatenated along the second dimension, and one collective over the first moves every
member's block. A block is contiguous when every dimension before the split one is 1, and
the view is a reshape; otherwise (a scanned layer stack [L, d, d] split on d) the split
dimension is transposed to the front first, a local copy. Where the topology says so
(`bucket_layer_collectives = false`: TPU v5e, v5p, v6e), the gathers and reduce-scatters
inside a layer loop (parameter sharding's, per layer) stay one per weight: XLA's compiler
runs each weight's gather beside the matmul before its use on v5e, which a bucket would
delay, and on every TPU copies each weight out of a gathered bucket into its tiled layout.

    Before (8 replicas):
      %2: f32[2,4]{replica} = reduce_scatter(%0) {"axes": ["replica"], "dimension": 0}
      %3: f32[1,3]{replica} = reduce_scatter(%1) {"axes": ["replica"], "dimension": 0}
    After:
      %4: f32[8,8]{replica} = reshape(%0)
      %5: f32[8,3]{replica} = reshape(%1)
      %6: f32[8,11]{replica} = concatenate(%4, %5) {"dimension": 1}
      %7: f32[1,11]{replica} = reduce_scatter(%6) {"axes": ["replica"], "dimension": 0}
      %8: f32[1,8]{replica} = slice(%7) {"limit": [1, 8], "start": [0, 0]}
      %2: f32[2,4]{replica} = reshape(%8)
      ...

    Before:
      %2: f32[4,3] = all_reduce(%0) {"axes": ["replica"], "reduce_op": "mean"}
      %3: f32[5] = all_reduce(%1) {"axes": ["replica"], "reduce_op": "mean"}
    After:
      %2: f32[12]{replica} = reshape(%0)
      %3: f32[17]{replica} = concatenate(%2, %1) {"dimension": 0}
      %4: f32[17] = all_reduce(%3) {"axes": ["replica"], "reduce_op": "mean"}
      %5: f32[12] = slice(%4) {"limit": [12], "start": [0]}
      %6: f32[4,3] = reshape(%5)
      %7: f32[5] = slice(%4) {"limit": [17], "start": [12]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xla_strategies.passes.base import Pass, PassContext
from xla_strategies.passes.cost.decisions import bucket_bytes
from xla_strategies.passes.cost.model import SLOW_LEVELS
from xla_strategies.passes.ir.graph import Graph, Node
from xla_strategies.passes.ir.traits import Trait
from xla_strategies.passes.rewrites.bucket_lowering import Bucket, combine, combine_blocks
from xla_strategies.passes.rewrites.regather_reads import PARAMETER_GATHER

# Without a topology (CPU, plain MirroredStrategy): chosen from the sweep in
# benchmarks/README.md ("Bucket threshold sweep").
DEFAULT_THRESHOLD_BYTES = 64 * 1024
# With synchronous collectives (emulated CPU devices), a bucket's members of this size or
# more are operands of their own (one tuple all-reduce) rather than copied into the flat
# buffer: on CPU, copying large
# tensors in and out cost more than reducing them (2.5-3.9x XLA's tuple all-reduce from
# 1 MiB buckets up, benchmarks/README.md), while many small operands cost more than copying
# them. Inside a TPU slice every member is its own operand
# (`Topology.tuple_all_reduce_buckets`: its tiled layouts make the flat buffer a copy in
# and out). Elsewhere buckets stay flat: across TPU slices flat measured better (Llama-2-7B
# FSDP on 2xv5p-512: 4.07 against 4.09 GiB, 445.2 against 455.9 ms), in the device's tile
# order and padded to whole tiles (`Topology.flat_buffer_tile`, bucket_lowering), and
# decompose-all-reduces splits a flat buffer across GPU nodes.
OWN_OPERAND_BYTES = DEFAULT_THRESHOLD_BYTES
# With a topology, the first bucket of each kind holds at most 1/16 of the threshold.
FIRST_BUCKET_FRACTION = 16


@dataclass(frozen=True)
class CombineAllReduces(Pass):
    """Options:
    threshold_bytes: the most bytes per bucket; 0 (default) lets the topology's cost
        model choose (the smallest bucket whose latency is under 2% of its transfer), or
        DEFAULT_THRESHOLD_BYTES when the strategy has no topology.
    first_bucket_bytes: a smaller cap for the first bucket of each kind, so the first
        reduction can start early, behind the backward compute still to come (DDP's
        first bucket); 0 (default) takes 1/16 of the threshold with a topology (DDP's
        1 MiB against 25 MiB), and the threshold without one (its collectives are
        synchronous: nothing overlaps them).
    num_packs: instead of a threshold, split each kind's reductions into this many
        buckets of about equal bytes, in schedule order (tf.distribute's
        `NcclAllReduce(num_packs=k)`; a tensor is never split, so a bucket may run over
        its share, and fewer buckets result when there are fewer tensors); 0: off.
    """

    name = "combine-all-reduces"
    threshold_bytes: int = 0
    first_bucket_bytes: int = 0
    num_packs: int = 0

    def __post_init__(self) -> None:
        if self.threshold_bytes < 0 or self.first_bucket_bytes < 0 or self.num_packs < 0:
            raise ValueError(
                "combine-all-reduces: threshold-bytes, first-bucket-bytes and num-packs must "
                f"not be negative, got {self.threshold_bytes}, {self.first_bucket_bytes} and "
                f"{self.num_packs}"
            )
        if self.num_packs and (self.threshold_bytes or self.first_bucket_bytes):
            raise ValueError(
                "combine-all-reduces: num-packs sizes the buckets itself; drop threshold-bytes "
                "and first-bucket-bytes"
            )

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        sizes: list[int] = []
        if math.prod(ctx.mesh_axes.values()) == 1:
            ctx.stats[self.name] = {"buckets": 0, "bucket_bytes": []}
            return False  # one replica: reductions are free, and copies into buckets are not
        threshold = self.threshold_bytes or _threshold_for(ctx)
        first = self.first_bucket_bytes or (
            0 if ctx.topology is None else max(1, threshold // FIRST_BUCKET_FRACTION)
        )
        # With a model axis, a member's layout over it is XLA's: a flat buffer (reshape,
        # concatenate) would move every member whole over the model axis to build it.
        # All-reduces are bucketed as tuples (each member an operand of its own), and block
        # collectives are left apart.
        spans = ctx.devices_per_replica > 1
        kinds = (
            COMBINABLE if not spans else tuple(k for k in COMBINABLE if k not in BLOCK_COLLECTIVES)
        )
        apart = not spans and _leaves_layer_collectives(ctx)
        topology = ctx.topology  # none: unknown hardware, whose blocks need no tiles
        block_tile = topology.collective_block_tile if topology is not None else None
        flat_tile = topology.flat_buffer_tile if topology is not None else None
        unbucketed = _layer_loop_regions(graph) if apart else set()
        left_apart = 0
        for region in graph.graphs():
            if id(region) in unbucketed:
                left_apart += sum(1 for n in region.nodes if n.op in BLOCK_COLLECTIVES)
                kinds_here = tuple(k for k in kinds if k not in BLOCK_COLLECTIVES)
            else:
                kinds_here = kinds
            if apart and not unbucketed:
                # unscanned layers' weights, gathered where read: apart, as in a loop. Where
                # the layers are a loop, the few gathers outside it (embedding, head) stay
                # bucketed: apart, XLA's TPU compiler sank a tied embedding's gather into
                # the layer loop, 24 gathers a step for one (GPT-2 medium on v5e-256: 16
                # GB of collectives a step and 16 % longer, against 2 GB)
                kinds_here = _without_parameter_gathers(region, kinds_here)
            # Packs are fixed before any bucket is made: combining removes their members.
            packs = _pack_of(region, self.num_packs, kinds_here) if self.num_packs else {}
            # One bucket at a time, then look again: combining moves nodes.
            while bucket := self._next_bucket(region, threshold, first, packs, kinds_here):
                op = bucket.members[0].op
                if op in BLOCK_COLLECTIVES:
                    mesh = ctx.mesh_axes
                    combine_blocks(region, bucket, len(sizes), self.name, mesh, block_tile)
                else:
                    own_bytes = _own_bytes(ctx, bucket.members[0], spans)
                    combine(region, bucket, len(sizes), self.name, own_bytes, flat_tile)
                sizes.append(bucket.nbytes)
        ctx.stats[self.name] = {"buckets": len(sizes), "bucket_bytes": sizes}
        if left_apart:
            ctx.stats[self.name]["layer_collectives_apart"] = left_apart
            ctx.remarks.append(
                f"{self.name}: {left_apart} all-gathers and reduce-scatters in layer loops "
                f"left apart: XLA's compiler for {ctx.topology.hardware} overlaps each "
                "weight's own collective with the compute beside it "
                "(tpu_configs: bucket_layer_collectives = false)"
            )
        return bool(sizes)

    def _next_bucket(
        self,
        graph: Graph,
        threshold: int,
        first: int,
        packs: dict[Node, int],
        kinds: tuple[str, ...] = (),
    ) -> Bucket | None:
        buckets = self._buckets(graph, threshold, first, packs, kinds)
        return next((b for b in buckets if len(b.members) > 1), None)

    def _buckets(
        self,
        graph: Graph,
        threshold: int,
        first_limit: int,
        packs: dict[Node, int],
        kinds: tuple[str, ...] = (),
    ) -> list[Bucket]:
        """Greedy buckets in schedule order (by `packs`, when given). A reduction whose
        operand is computed from a member's result closes that bucket: the two cannot be
        one collective."""
        open_buckets: dict[tuple, Bucket] = {}
        done: list[Bucket] = []
        started = {_key(n) for n in graph.nodes if _is_combined(n)}
        for node in graph.nodes:
            tainting = [
                b for b in open_buckets.values() if any(v in b.tainted for v in node.inputs)
            ]
            for bucket in tainting:
                bucket.tainted.update(node.outputs)
            if not _combinable(node, kinds):
                continue
            key, size = _key(node), node.whole_bytes
            limit = first_limit if first_limit and key not in started else threshold
            bucket = open_buckets.get(key)
            full = (
                packs[node] != packs[bucket.members[-1]]
                if packs and bucket is not None
                else bucket is not None and bucket.nbytes + size > limit
            )
            if bucket is None or bucket in tainting or full:
                if bucket is not None:
                    done.append(bucket)
                    started.add(key)
                bucket = open_buckets[key] = Bucket()
            bucket.members.append(node)
            bucket.nbytes += size
            bucket.tainted.update(node.outputs)
        return done + list(open_buckets.values())


# Collectives whose members can share one flat buffer; `_key` keeps the kinds apart.
BLOCK_COLLECTIVES = ("reduce_scatter", "all_gather")
COMBINABLE = ("all_reduce", "reduce_to_one", "broadcast", *BLOCK_COLLECTIVES)


def _combinable(node: Node, kinds: tuple[str, ...] = ()) -> bool:
    kinds = kinds or COMBINABLE
    return (
        node.op in kinds
        and len(node.inputs) == 1
        and not _is_combined(node)
        and not node.attrs.get("stage_split")  # a bucket would gather it across the stages
    )


def _pack_of(graph: Graph, num_packs: int, kinds: tuple[str, ...] = ()) -> dict[Node, int]:
    """Each combinable reduction's pack, 0 .. num_packs - 1: the share of its kind's bytes
    (in schedule order) in which the middle of its own bytes falls."""
    members = [n for n in graph.nodes if _combinable(n, kinds)]
    totals: dict[tuple, int] = {}
    for node in members:
        totals[_key(node)] = totals.get(_key(node), 0) + node.whole_bytes
    offsets: dict[tuple, int] = {}
    packs: dict[Node, int] = {}
    for node in members:
        key, size = _key(node), node.whole_bytes
        middle = offsets.get(key, 0) + size / 2
        packs[node] = min(num_packs - 1, int(num_packs * middle / max(totals[key], 1)))
        offsets[key] = offsets.get(key, 0) + size
    return packs


def _own_bytes(ctx: PassContext, member: Node, spans: bool) -> int:
    """The bytes from which a bucket's member is an operand of its own rather than copied
    into the flat buffer: every member with a model axis, or on a TPU slice
    (`tuple_all_reduce_buckets`: its tiled layouts make the flat buffer a copy in and out;
    an emulated slice keeps the real one's buckets); large ones on emulated CPU devices;
    none elsewhere, nor across TPU slices (flat, as measured there)."""
    topology = ctx.topology
    if spans:
        return 1
    if topology is not None and topology.tuple_all_reduce_buckets:
        links = topology.axis_links(tuple(member.attrs["axes"]))
        return 0 if any(link.level in SLOW_LEVELS for link in links) else 1
    if topology is None and ctx.synchronous_collectives and member.op == "all_reduce":
        return OWN_OPERAND_BYTES
    return 0


def _leaves_layer_collectives(ctx: PassContext) -> bool:
    return ctx.topology is not None and not ctx.topology.bucket_layer_collectives


def _without_parameter_gathers(graph: Graph, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """`kinds`, less the gathers, where `graph` gathers held parameters outside a loop
    (`regather_reads.PARAMETER_GATHER`); its other gathers are the updated blocks of
    weight-update sharding, few and small beside them."""
    if any(n.attrs.get(PARAMETER_GATHER) for n in graph.nodes):
        return tuple(k for k in kinds if k != "all_gather")
    return kinds


def _layer_loop_regions(graph: Graph) -> set[int]:
    """The ids of every region a counted loop (a layer loop) runs, nested ones included."""
    return {
        id(inner)
        for node in graph.walk()
        if node.has(Trait.COUNTED_LOOP)
        for inner in node.regions[0].graphs()
    }


def _threshold_for(ctx: PassContext) -> int:
    if ctx.topology is None:
        return DEFAULT_THRESHOLD_BYTES
    return bucket_bytes(ctx.topology.axis_links(tuple(ctx.mesh_axes)))


def _key(node: Node) -> tuple:
    source, attrs = node.inputs[0], node.attrs
    return (
        node.op,
        tuple(attrs["axes"]),
        attrs.get("reduce_op"),
        attrs.get("root"),
        source.dtype,
        source.varying_axes,
    )


def _is_combined(node: Node) -> bool:
    return node.op in COMBINABLE and "bucket" in node.attrs
