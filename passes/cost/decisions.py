"""What the passes ask the cost model (`model.py`) before they rewrite: how large a
bucket to make, how much of a loop's pipelined reductions no compute hides, and whether
a gradient's update pays to be sharded across the replicas."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from xla_strategies.passes.cost.model import AxisLink, collective_time, flat_time, ordered_time


def bucket_bytes(axes: Sequence[AxisLink], overhead: float = 0.02, cap: int = 1 << 30) -> int:
    """The smallest power-of-two bucket whose latency is at most `overhead` of its
    bandwidth time under the best algorithm: larger buckets gain little, smaller ones pay
    latency per bucket."""
    latency = collective_time("all_reduce", 1.0, axes)  # a byte costs only latency
    size = 1 << 16
    while size < cap and latency > overhead * (collective_time("all_reduce", size, axes) - latency):
        size <<= 1
    return size


def pipelined_exposure(
    ready: Sequence[tuple[float, float]],
    iteration_s: float,
    trips: int,
    reduce_time: Callable[[float], float],
) -> float:
    """Seconds of a loop's reductions that no compute hides when each runs as soon as its
    operand is ready: `ready` holds (bytes, seconds into the iteration) per reduction, the
    loop runs `trips` iterations of `iteration_s`, and reductions run one after another on
    the network; what runs past the loop's last compute is exposed."""
    network = 0.0
    for trip in range(trips):
        for nbytes, at in ready:
            network = max(trip * iteration_s + at, network) + reduce_time(nbytes)
    return max(0.0, network - trips * iteration_s)


#: Device memory bandwidth the elementwise optimizer update is bound by, where the
#: hardware file gives none (a rough rate, as the timeline's roofline uses).
UPDATE_BYTES_PER_S = 1e11


def runs_as_all_reduce(
    op: str, axes: Sequence[AxisLink], reduce_scatter_is_all_reduce: bool
) -> bool:
    """Whether the compiler runs a flat `op` over `axes` as an all-reduce: a reduce-scatter
    over several axes of more than one device, on a compiler that does so (TPU)."""
    return (
        op == "reduce_scatter"
        and reduce_scatter_is_all_reduce
        and sum(1 for a in axes if a.size > 1) > 1
    )


def block_collective_estimates(
    op: str, nbytes: float, axes: Sequence[AxisLink], reduce_scatter_is_all_reduce: bool = False
) -> dict[str, float]:
    """A reduce-scatter's or all-gather's seconds over several axes by the two algorithms
    `decompose-all-reduces` chooses between: `flat` (the runtime's own; where the compiler
    runs a reduce-scatter over several axes as an all-reduce and a slice, an all-reduce's
    price) and `ordered` (one axis at a time, in the order given)."""
    flat_op = "all_reduce" if runs_as_all_reduce(op, axes, reduce_scatter_is_all_reduce) else op
    return {
        "flat": flat_time(flat_op, nbytes, axes),
        "ordered": ordered_time(op, nbytes, axes),
    }


def weight_update_estimates(
    gradient_bytes: float,
    update_bytes: float,
    axes: Sequence[AxisLink],
    memory_bandwidth: float | None = None,
    weight_bytes: float | None = None,
    reduce_scatter_is_all_reduce: bool = False,
    update_hidden: bool = False,
) -> tuple[float, float]:
    """(replicated, sharded) seconds for reducing the gradients and updating the weights:
    an all-reduce and the whole update (`update_bytes` read and written at
    `memory_bandwidth`) on every replica, against a reduce-scatter, 1/p of the update and
    an all-gather of the new weights (Xu et al. 2020), `weight_bytes` of them (f32 weights
    of bf16 gradients: twice the gradients' bytes; default: the gradients' bytes). The
    reduce-scatter and the all-gather cost what `decompose-all-reduces` will make of them
    (`block_collective_estimates`, the cheaper algorithm): on TPU, where a flat
    reduce-scatter over several torus axes runs as an all-reduce
    (`reduce_scatter_is_all_reduce`), the flat one costs an all-reduce. Where the compiler
    hides the replicated update's memory traffic behind the backward pass
    (`update_hidden`), the update costs neither way: only the collectives differ."""
    p = math.prod(a.size for a in axes)
    update = 0.0 if update_hidden else update_bytes / (memory_bandwidth or UPDATE_BYTES_PER_S)
    replicated = collective_time("all_reduce", gradient_bytes, axes) + update
    gathered = gradient_bytes if weight_bytes is None else weight_bytes
    scatter = block_collective_estimates(
        "reduce_scatter", gradient_bytes, axes, reduce_scatter_is_all_reduce
    )
    sharded = (
        min(scatter.values())
        + update / p
        + min(block_collective_estimates("all_gather", gathered, axes).values())
    )
    return replicated, sharded
