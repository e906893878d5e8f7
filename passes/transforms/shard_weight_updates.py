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

import math
from dataclasses import dataclass
from typing import Any

from xla_strategies.passes.base import ModePass, PassContext
from xla_strategies.passes.cost.decisions import runs_as_all_reduce, weight_update_estimates
from xla_strategies.passes.ir.graph import Graph, Node
from xla_strategies.passes.rewrites.block_axes import block_order
from xla_strategies.passes.rewrites.block_sharder import (
    DEFERRED,
    BlockSharder,
    is_gradient_reduction,
)
from xla_strategies.passes.rewrites.held_state import require_state, warn_if_nothing_held
from xla_strategies.passes.rewrites.regather_reads import regather_reads

# Gather a held parameter again for a later read where holding the first gathers would
# take more than this share of a chip's memory (the activations' and temporaries' room).
REGATHER_SHARE_OF_HBM = 0.1


@dataclass(frozen=True)
class ShardWeightUpdates(ModePass):
    """Options:
    mode: ``on`` shards whenever it can; ``auto`` lets the cost model decide for the
        strategy's topology (off without one: on emulated CPU devices the collectives are
        synchronous copies and the update is cheap, and on unknown hardware nothing can
        be estimated), and says what it decided in its stats and a remark.
    asked: whether the user turned the pass on (`shard_weight_updates=True`), so a step
        it would not change is an error or a warning to them; false where the compiler
        tries it as an alternative (`pipeline_choice`).
    """

    name = "shard-weight-updates"
    mode: str = "on"
    asked: bool = True

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if self.mode == "on" and self.asked:
            require_state(graph, ctx, self.name, "shard_weight_updates")
        axes = block_order(ctx)
        held_split = [n.attrs["axes"] for n in graph.nodes if n.attrs.get(DEFERRED)]
        if held_split:  # shard-parameters holds values split: only blocks can update them
            axes = held_split[0]  # and its blocks say which axes they are split over
            decision = {"on": True, "reason": "shard-parameters"}
        else:
            decision = _cost_model_decision(graph, ctx) if self.mode == "auto" else None
        if ctx.num_replicas == 1 or (decision is not None and not decision["on"]):
            ctx.stats[self.name] = {"sharded_gradients": 0, "sharded_state": 0}
            ctx.stats[self.name]["decision"] = decision
            return False
        # the cost model's choice leaves a tensor whole where a block is less than one tile
        small = _tile_elements(ctx) if decision and decision["reason"] == "cost model" else 0
        sharder = BlockSharder(
            axes, ctx.mesh_axes, self.name, min_elements=small, lookups=ctx.devices_per_replica == 1
        )
        sharder.rewrite(graph)
        if held_split:
            sharder.stats["regathered_reads"] = self._regather(graph, ctx)
        ctx.stats[self.name] = {**sharder.stats, "decision": decision}
        ctx.remarks.extend(f"{self.name}: {r}" for r in sharder.remarks)
        if self.mode == "on" and self.asked and not held_split:
            held = sharder.stats["sharded_state"] + sharder.stats["sharded_gradients"]
            warn_if_nothing_held(self.name, "shard_weight_updates", held, sharder.remarks)
        return sharder.stats["sharded_gradients"] > 0 or bool(held_split)

    def _regather(self, graph: Graph, ctx: PassContext) -> int:
        """Held parameters read again after other layers' gathers (an unscanned model's
        backward pass) are gathered again there, where keeping the first gathers alive
        would hold more than `REGATHER_SHARE_OF_HBM` of a chip (always, without a chip
        memory size): a second gather against the whole model's weights per chip."""
        hbm = ctx.topology.hbm_bytes if ctx.topology is not None else None
        limit = REGATHER_SHARE_OF_HBM * hbm if hbm else None
        copied = regather_reads(graph, self.name, limit)
        if copied:
            ctx.remarks.append(
                f"{self.name}: {copied} reads of held parameters after other layers' gathers "
                "gather again, rather than hold the first gathers across the step"
            )
        return copied


def _cost_model_decision(graph: Graph, ctx: PassContext) -> dict[str, Any]:
    """Whether sharding pays on the strategy's topology, with its estimates (the pass's
    stats; also printed as a remark): `on`, `reason` ("synchronous collectives", "no
    topology" or "cost model"),
    and the gradient bytes and both estimated seconds when there is a topology; off on a
    strategy whose replicas span several devices ("model axis")."""
    where = f"{ShardWeightUpdates.name}{{mode=auto}}"
    if ctx.devices_per_replica > 1:
        # XLA's partitioner already splits the update over the model axis, and blocks over
        # the replicas would move the gradients twice (`bridge.partial_manual`)
        ctx.remarks.append(
            f"{where}: off: each replica spans {ctx.devices_per_replica} devices, over which "
            "XLA's partitioner splits the update; compile(shard_weight_updates=True) turns it on"
        )
        return {"on": False, "reason": "model axis"}
    if ctx.topology is None:
        reason, why = (
            (
                "synchronous collectives",
                "emulated devices, whose collectives are synchronous copies",
            )
            if ctx.synchronous_collectives
            else ("no topology", "unknown devices, so no cost model")
        )
        ctx.remarks.append(f"{where}: off: {why}; compile(shard_weight_updates=True) turns it on")
        return {"on": False, "reason": reason}
    axes = list(ctx.mesh_axes)
    seeds = [n for n in graph.nodes if is_gradient_reduction(n, axes)]
    gradient_bytes = sum(n.outputs[0].nbytes for n in seeds)
    links = ctx.topology.axis_links(tuple(axes))
    replicated, sharded = weight_update_estimates(
        gradient_bytes,
        _update_bytes(graph, seeds),
        links,
        ctx.topology.memory_bandwidth,
        _weight_bytes(graph, seeds),
        ctx.topology.reduce_scatter_over_axes_is_all_reduce,
        ctx.topology.hides_update_traffic,
    )
    on = sharded < replicated
    scatter = "reduce-scatter"
    if runs_as_all_reduce(
        "reduce_scatter", links, ctx.topology.reduce_scatter_over_axes_is_all_reduce
    ):
        scatter += " (the compiler's all-reduce and slice)"
    update = "whole update"
    if ctx.topology.hides_update_traffic:
        update += ", which the compiler hides behind the backward pass"
    ctx.remarks.append(
        f"{where}: {'on' if on else 'off'}: {gradient_bytes} gradient bytes; estimated "
        f"{replicated * 1e3:.3f} ms replicated (all-reduce, {update}) against "
        f"{sharded * 1e3:.3f} ms sharded ({scatter}, 1/{ctx.num_replicas} of the "
        "update, all-gather)"
    )
    return {
        "on": on,
        "reason": "cost model",
        "gradient_bytes": gradient_bytes,
        "replicated_s": replicated,
        "sharded_s": sharded,
    }


def _tile_elements(ctx: PassContext) -> int:
    """The elements of one tile per replica: fewer, and a block is mostly padding
    (`collective_block_tile`: XLA's TPU compiler pads each block to [16, 128])."""
    tile = ctx.topology.collective_block_tile if ctx.topology is not None else None
    return math.prod(tile) * ctx.num_replicas if tile else 0


def _weight_bytes(graph: Graph, seeds: list[Node]) -> int:
    """Bytes of the weights the gradients are of (what the sharded update gathers back):
    each gradient's parameter where capture named it, else the gradient's own bytes."""
    inputs = {v.name: v for v in graph.inputs if v.name}
    total = 0
    for seed in seeds:
        gradient = seed.outputs[0]
        weight = inputs.get(seed.attrs.get("param"))
        total += weight.nbytes if weight and weight.size == gradient.size else gradient.nbytes
    return total


def _update_bytes(graph: Graph, seeds: list[Node]) -> int:
    """Bytes the update reads and writes, as XLA fuses it: each value it reads from outside
    (gradients, parameters, optimizer state) once, and each value it leaves for the rest
    of the step once. The update is the nodes reached from the gradients' reductions that
    no reduction waits for: a reduction inside the backward pass (BatchNorm's statistics
    over the global batch) reaches the rest of the backward pass, which every replica runs
    whichever way the update goes."""
    backward, reductions = _feeding(graph, seeds), set(seeds)
    reached = {n.outputs[0] for n in seeds}
    update: set[Node] = set()
    for node in graph.nodes:
        if node not in reductions and any(v in reached for v in node.inputs):
            reached.update(node.outputs)
            if node not in backward:
                update.add(node)
    made = {v for n in update for v in n.outputs}
    read = {v for n in update for v in n.inputs if v not in made}
    used_after = {v for n in graph.nodes if n not in update for v in n.inputs}
    left = {v for v in made if v in used_after or v in graph.outputs}
    return sum(v.nbytes for v in read | left)


def _feeding(graph: Graph, seeds: list[Node]) -> set[Node]:
    """The nodes some reduction in `seeds` reads from, directly or not."""
    needed = {v for n in seeds for v in n.inputs}
    feeding: set[Node] = set()
    for node in reversed(graph.nodes):
        if any(v in needed for v in node.outputs):
            feeding.add(node)
            needed.update(node.inputs)
    return feeding
