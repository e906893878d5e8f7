"""Predicted gradient-sync time per step on TPU pods and GPU clusters, from the cost model.

For each model's gradient set and each topology:

- per-tensor ring: one flat ring all-reduce per tensor through every chip;
- XLA-style combining: tensors combined into 30 MiB buckets (XLA's GPU combiner default),
  each bucket one flat collective of the runtime (tree latency, slowest-axis bandwidth);
- ours: buckets sized by the cost model (`combine-all-reduces` with a topology), each
  decomposed as `decompose-all-reduces` chooses;
- bound: one all-reduce of every byte at the bandwidth/latency bound.

An overlap table gives, per cell, the exposed communication (gradient-sync time no
backward compute hides) with the reductions hoisted after the backward pass (`ours`, all
exposed) and pipelined (each layer's reduction starting when its backward is done,
`decisions.pipelined_exposure`, as `schedule-all-reduces` estimates it), the estimated
step (compute at `MFU` of the chip's bf16 peak, plus the exposed communication) and the
exposed share of it, under the per-chip workloads in `WORKLOADS`.

A further table (`shard-weight-updates`) compares, for BERT-large and Llama-2-7B on v5e-256
and v5p-1024, the replicated update (our all-reduce buckets, then AdamW over every weight on
every chip) with the sharded one (the same buckets as reduce-scatters, AdamW over each
chip's block, all-gathers of the new weights), and the optimizer state each chip holds.

Nothing here runs collectives: these are the model's numbers, validated against published
measurements in tests/passes/test_cost_model_validation.py.
Run: `python -m benchmarks.pod_collectives` (or `make bench`). Writes results/pod_collectives.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.gradient_shapes import bert, gpt2, llama2_7b, resnet50

RESULTS = Path(__file__).parent / "results"
XLA_COMBINE_BYTES = 30 * 1024 * 1024
MODELS = {
    "ResNet-50": (resnet50, 4),
    "BERT-large": (lambda: bert(1024, 24), 4),
    "GPT-2 medium": (lambda: gpt2(1024, 24), 4),
    "Llama-2-7B": (llama2_7b, 2),  # bf16
}
TOPOLOGIES = ["v4-1024", "v5e-256", "v5p-1024", "v6e-256", "2xv5p-512", "4xdgx-h100"]
# Per chip and step: layers, tokens (images for ResNet-50), and forward flops per token
# (2 per parameter for a transformer; 4.1 GFLOP per 224x224 image for ResNet-50, whose
# 16 bottleneck blocks count as its layers). Backward flops are twice the forward's.
WORKLOADS = {
    "ResNet-50": {"layers": 16, "items": 32, "forward_flops": 4.1e9},
    "BERT-large": {"layers": 24, "items": 8 * 512, "forward_flops": None},
    "GPT-2 medium": {"layers": 24, "items": 8 * 1024, "forward_flops": None},
    "Llama-2-7B": {"layers": 32, "items": 4096, "forward_flops": None},
}
MFU = 0.5  # the fraction of the bf16 peak the compute reaches
EXPOSED_GOAL = 0.05  # of the step, for GPT-2 medium and Llama-2-7B on v5e-256
SHARDED_CELLS = [(m, t) for m in ("BERT-large", "Llama-2-7B") for t in ("v5e-256", "v5p-1024")]
# AdamW reads the weight, its gradient and both moments, and writes the weight and moments.
ADAMW_TOUCHES = 7
ADAM_STATE_COPIES = 2


def buckets(sizes: list[int], threshold: int) -> list[int]:
    """Greedy buckets in order (backward order is the reverse; the sums are the same)."""
    out, current = [], 0
    for size in sizes:
        if current and current + size > threshold:
            out.append(current)
            current = 0
        current += size
    return out + ([current] if current else [])


def sync_times(sizes: list[int], topology: str) -> dict[str, Any]:
    from xla_strategies.hardware.topology import Topology
    from xla_strategies.passes.cost import decisions
    from xla_strategies.passes.cost import model as cost_model

    links = Topology.from_name(topology).axis_links()
    total = sum(sizes)
    ours_threshold = decisions.bucket_bytes(links)
    ours = buckets(sizes, ours_threshold)
    chosen = [cost_model.best_algorithm("all_reduce", b, links)[0] for b in ours]
    bound = cost_model.lower_bound("all_reduce", total, links)
    bandwidth_part = bound - 2 * math.ceil(math.log2(math.prod(a.size for a in links))) * min(
        a.latency for a in links
    )
    return {
        "per_tensor_ring": sum(cost_model.flat_ring_time("all_reduce", s, links) for s in sizes),
        "xla_combining": sum(
            cost_model.flat_time("all_reduce", b, links) for b in buckets(sizes, XLA_COMBINE_BYTES)
        ),
        "ours": sum(cost_model.collective_time("all_reduce", b, links) for b in ours),
        "bound": bound,
        "bandwidth_dominated": bandwidth_part > 0.5 * bound,
        "our_bucket_bytes": ours_threshold,
        "our_buckets": len(ours),
        "algorithms": sorted(set(chosen)),
    }


def layer_bytes(sizes: list[int], layers: int) -> tuple[list[int], int]:
    """(bytes of each repeated layer's gradients, bytes of the rest: embeddings, heads),
    finding the run of `layers` identical blocks; a model without one (ResNet-50) is cut
    into `layers` consecutive groups of tensors."""
    n = len(sizes)
    for start in range(n):
        block = (n - start) // layers
        while block > 0:
            run = sizes[start : start + block * layers]
            if all(run[i * block : (i + 1) * block] == run[:block] for i in range(layers)):
                rest = sum(sizes) - sum(run)
                return [sum(run[:block])] * layers, rest
            block -= 1
    groups = [sizes[i * n // layers : (i + 1) * n // layers] for i in range(layers)]
    return [sum(g) for g in groups], 0


def overlap(model: str, sizes: list[int], topology: str, hoisted: float) -> dict[str, Any]:
    """Exposed communication hoisted and pipelined, and the estimated step, for `model`."""
    from xla_strategies.hardware.topology import Topology
    from xla_strategies.passes.cost import decisions
    from xla_strategies.passes.cost import model as cost_model

    top = Topology.from_name(topology)
    links, work = top.axis_links(), WORKLOADS[model]
    params = sum(sizes) / MODELS[model][1]
    per_item = work["forward_flops"] or 2 * params
    compute = 3 * per_item * work["items"] / (top.peak_flops * MFU)  # forward + backward
    per_layer, rest = layer_bytes(sizes, work["layers"])
    backward = 2 / 3 * compute / work["layers"]

    def reduce(nbytes: float) -> float:
        return cost_model.collective_time("all_reduce", nbytes, links)

    # each layer's gradients are ready when its backward ends; the embeddings' last
    ready = [(per_layer[0], backward)]
    pipelined = decisions.pipelined_exposure(ready, backward, work["layers"], reduce)
    pipelined += reduce(rest) if rest else 0.0
    exposed = min(hoisted, pipelined)
    return {
        "compute_s": compute,
        "exposed_hoisted_s": hoisted,
        "exposed_pipelined_s": pipelined,
        "choice": "pipeline" if pipelined < hoisted else "hoist",
        "step_s": compute + exposed,
        "exposed_fraction": exposed / (compute + exposed),
    }


def sharded_update(shapes: list[tuple[int, ...]], itemsize: int, topology: str) -> dict:
    """Replicated against sharded weight update (shard-weight-updates) on `topology`:
    collective and AdamW time per step and the optimizer state per chip. A tensor with no
    dimension that divides by the chip count keeps a replicated update, as the pass does."""
    from xla_strategies.hardware.topology import Topology
    from xla_strategies.passes.cost import decisions
    from xla_strategies.passes.cost import model as cost_model
    from xla_strategies.passes.rewrites.blocks import shard_dimension

    top = Topology.from_name(topology)
    links, chips = top.axis_links(), top.num_devices
    sizes = [math.prod(s) * itemsize for s in shapes]
    split = [shard_dimension(s, chips) is not None for s in shapes]
    bucket = decisions.bucket_bytes(links)
    sharded_bytes = [b for b, ok in zip(sizes, split, strict=True) if ok]
    kept_bytes = [b for b, ok in zip(sizes, split, strict=True) if not ok]

    def time(op: str, tensors: list[int]) -> float:
        return sum(cost_model.collective_time(op, b, links) for b in buckets(tensors, bucket))

    rate = top.memory_bandwidth or decisions.UPDATE_BYTES_PER_S
    update = ADAMW_TOUCHES * sum(sizes) / rate
    kept_update = ADAMW_TOUCHES * sum(kept_bytes) / rate
    state = ADAM_STATE_COPIES * 4 * sum(math.prod(s) for s in shapes)  # float32 moments
    kept_state = (
        ADAM_STATE_COPIES
        * 4
        * sum(math.prod(s) for s, ok in zip(shapes, split, strict=True) if not ok)
    )
    replicated = time("all_reduce", sizes) + update
    sharded = (
        time("reduce_scatter", sharded_bytes)
        + time("all_gather", sharded_bytes)
        + time("all_reduce", kept_bytes)
        + (update - kept_update) / chips
        + kept_update
    )
    return {
        "replicated_s": replicated,
        "sharded_s": sharded,
        "update_replicated_s": update,
        "opt_state_bytes_replicated": state,
        "opt_state_bytes_sharded": (state - kept_state) / chips + kept_state,
        "tensors_kept_replicated": len(kept_bytes),
        "memory_bandwidth": rate,
    }


def measure() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for model, (shapes, itemsize) in MODELS.items():
        sizes = [math.prod(s) * itemsize for s in shapes()]
        results[model] = {
            "tensors": len(sizes),
            "bytes": sum(sizes),
            "topologies": {t: sync_times(sizes, t) for t in TOPOLOGIES},
        }
        for topology, cell in results[model]["topologies"].items():
            cell["overlap"] = overlap(model, sizes, topology, cell["ours"])
    for model, topology in SHARDED_CELLS:
        shapes, itemsize = MODELS[model]
        cell = results[model]["topologies"][topology]
        cell["shard_weight_updates"] = sharded_update(shapes(), itemsize, topology)
    return results


def print_table(results: dict[str, Any]) -> None:
    columns = ("per-tensor", "XLA comb.", "ours", "bound")
    print("predicted gradient sync per step, ms")
    print(f"{'model':<13}{'topology':<12}" + "".join(f"{c:>11}" for c in columns) + "  ours/bound")
    for model, r in results.items():
        for topology, t in r["topologies"].items():
            times = (t["per_tensor_ring"], t["xla_combining"], t["ours"], t["bound"])
            flag = "" if t["bandwidth_dominated"] else " (latency-bound)"
            print(
                f"{model:<13}{topology:<12}"
                + "".join(f"{x * 1e3:>11.2f}" for x in times)
                + f"  {t['ours'] / t['bound']:>10.2f}  {t['our_buckets']} x "
                f"{t['our_bucket_bytes'] >> 20} MiB, {'/'.join(t['algorithms'])}{flag}"
            )


def print_overlap_table(results: dict[str, Any]) -> None:
    print(f"\noverlap: exposed communication per step (ms), compute at {MFU:.0%} of bf16 peak")
    print(
        f"{'model':<13}{'topology':<12}{'bound':>8}{'ours':>8}{'hoisted':>9}{'pipelined':>10}"
        f"{'choice':>10}{'step':>9}{'exposed':>9}"
    )
    for model, r in results.items():
        for topology, t in r["topologies"].items():
            o = t["overlap"]
            print(
                f"{model:<13}{topology:<12}{t['bound'] * 1e3:>8.2f}{t['ours'] * 1e3:>8.2f}"
                f"{o['exposed_hoisted_s'] * 1e3:>9.2f}{o['exposed_pipelined_s'] * 1e3:>10.2f}"
                f"{o['choice']:>10}{o['step_s'] * 1e3:>9.1f}{o['exposed_fraction']:>9.1%}"
            )


def print_sharded_table(results: dict[str, Any]) -> None:
    print("\nshard-weight-updates: gradient sync + AdamW per step (ms), optimizer state per chip")
    print(
        f"{'model':<13}{'topology':<12}{'replicated':>11}{'sharded':>9}{'speedup':>9}"
        f"{'state MB/chip':>15}{'sharded':>9}{'kept':>6}"
    )
    for model, topology in SHARDED_CELLS:
        c = results[model]["topologies"][topology]["shard_weight_updates"]
        print(
            f"{model:<13}{topology:<12}{c['replicated_s'] * 1e3:>11.2f}"
            f"{c['sharded_s'] * 1e3:>9.2f}{c['replicated_s'] / c['sharded_s']:>9.2f}"
            f"{c['opt_state_bytes_replicated'] / 1e6:>15.1f}"
            f"{c['opt_state_bytes_sharded'] / 1e6:>9.1f}{c['tensors_kept_replicated']:>6}"
        )


def main() -> None:
    results = measure()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pod_collectives.json").write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print_overlap_table(results)
    print_sharded_table(results)


if __name__ == "__main__":
    main()
