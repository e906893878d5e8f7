"""scatter-adds-as-selects: a scatter-add that adds one element to each row of its operand
becomes a compare and a select, which XLA fuses into what reads it.

A step's loss reads each label's logit (optax's `softmax_cross_entropy_with_integer_labels`,
`jnp.take_along_axis`); autodiff's transpose of that lookup is a scatter-add of one
cotangent per token into zeros of the logits' shape, added to the softmax's gradient. XLA
fuses neither a scatter nor its zeros: it makes the f32 gradient of the logits whole
(Llama-2-7B, 2,048 tokens of a 32,000-word vocabulary: 250 MiB per chip), and on TPU v6e,
which runs the scatter on its SparseCores, once more in the flat layout they take, beside
the bf16 logits and the gathered output layer, at the step's peak.

Where every row of the operand (every position of its other dimensions) gets exactly one
index, the scatter-add is `where(iota == index, operand + update, operand)` along the
indexed dimension: elementwise, so XLA fuses it with the softmax's gradient and the cast
to bf16 into the matmuls that read it. Exact: each element gets the one addition the
scatter gives it, or none; an index out of range (dropped by the scatter) matches no
position. Scatters that clip their indices, write windows, or may add twice to a row
(an embedding table's gradient: many tokens, one row each) stay.

Where it pays is measured per TPU generation (`scatter_adds_as_selects` in
`tpu_configs/`): with `reduce-scatters-before-loops`, Llama-2-7B under parameter sharding
on v5e-256 takes 2.69 GiB per chip either way and 833.00 against 835.52 ms estimated, but
with splash attention 2.80 against 2.67 GiB, so v5e leaves it off; on v5p-512 it made the
step larger (3.16 → 3.77 GiB), and Llama-2-70B's smaller there (both passes: 14.21 →
13.88 GiB), so one v5p slice leaves it off too. On v6e and across v5p slices it runs;
`mode=on` is the user's elsewhere.

    Before:
      %20: f32[1,2048,32000] = jax.scatter-add(%19, %12, %18) {"dimension_numbers": [[0],
          [2], [2], [1], [0]], "mode": "FILL_OR_DROP", ...}
    After:
      %20: f32[1,2048,32000] = one_hot_add(%19, %12, %18) {"dimension": 2,
          "index_dims": [1, -1], "update_dims": [0, 1, -1]}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xla_strategies.passes.base import ModePass, PassContext
from xla_strategies.passes.ir.graph import Graph, Node
from xla_strategies.passes.ir.traits import Trait

# scatter modes under which an index out of range adds nothing (a promise of none is kept)
_DROPPING_MODES = frozenset({"FILL_OR_DROP", "PROMISE_IN_BOUNDS"})


@dataclass(frozen=True)
class ScatterAddsAsSelects(ModePass):
    """Options:
    mode: ``on`` rewrites every such scatter-add; ``auto`` only in a step whose state
        `shard-parameters` holds split, on a topology whose hardware file says it pays
        (`scatter_adds_as_selects`: TPU v6e, v5p across slices).
    """

    name = "scatter-adds-as-selects"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if self.mode == "auto" and not _pays(ctx):
            return self.stays_off(
                ctx,
                {"rewritten": 0, "reason": "not measured to pay here"},
                "runs under parameter sharding on a topology whose hardware file says it pays "
                "(scatter_adds_as_selects)",
            )
        rewritten = 0
        for region in graph.graphs():
            for position, node in enumerate(region.nodes):
                attrs = one_hot_attrs(node)
                if attrs is None:
                    continue
                region.nodes[position] = Node(
                    "one_hot_add",
                    list(node.inputs),
                    list(node.outputs),
                    attrs,
                    created_by=self.name,
                )
                rewritten += 1
        ctx.stats[self.name] = {"rewritten": rewritten}
        return rewritten > 0


def _pays(ctx: PassContext) -> bool:
    """Measured to pay: under parameter sharding, on TPU v6e and v5p across slices."""
    return (
        ctx.parameters_split and ctx.topology is not None and ctx.topology.scatter_adds_as_selects
    )


def one_hot_attrs(node: Node) -> dict[str, Any] | None:
    """`one_hot_add`'s attributes for the scatter-add `node`, if every position of its
    operand's other dimensions gets exactly one index of one element:

    - dimension: the operand dimension the index picks in;
    - index_dims: the operand dimension of each indices dimension but the index vector's
      (-1: a dimension of size 1 that names none);
    - update_dims: the operand dimension of each update dimension (-1 likewise)."""
    if not node.has(Trait.SCATTER_ADD) or len(node.inputs) != 3 or len(node.outputs) != 1:
        return None
    if node.attrs.get("mode") not in _DROPPING_MODES or node.attrs.get("update_consts"):
        return None
    numbers = node.attrs.get("dimension_numbers")
    if numbers is None or len(numbers) != 5:
        return None
    window, inserted, to_operand, operand_batching, indices_batching = numbers
    operand, indices, updates = node.inputs
    if len(to_operand) != 1 or list(inserted) != list(to_operand) or indices.shape[-1:] != (1,):
        return None
    dimension = to_operand[0]
    index_dims = []
    for axis, size in enumerate(indices.shape[:-1]):
        if axis in indices_batching:
            index_dims.append(operand_batching[list(indices_batching).index(axis)])
        elif size == 1:
            index_dims.append(-1)
        else:  # several indices along it may pick in the same row
            return None
    window_operand_dims = [
        d for d in range(len(operand.shape)) if d not in inserted and d not in operand_batching
    ]
    if len(window_operand_dims) != len(window):
        return None
    if len(updates.shape) != len(window) + len(index_dims):
        return None
    update_dims: list[int] = []
    scatter_dims = iter(index_dims)
    for axis, size in enumerate(updates.shape):
        if axis in window:
            dim = window_operand_dims[list(window).index(axis)]
            if size != operand.shape[dim]:  # a window smaller than the operand's dimension
                return None
            update_dims.append(dim)
        else:
            update_dims.append(next(scatter_dims))
    return {"dimension": dimension, "index_dims": index_dims, "update_dims": update_dims}
