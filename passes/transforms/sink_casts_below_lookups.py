"""sink-casts-below-lookups: a lookup of a cast value looks up the value, then casts what
it took.

A step's loss often reads a few elements of a large cast value: optax's
`softmax_cross_entropy_with_integer_labels` on `logits.astype(jnp.float32)` gathers each
label's logit from the f32 logits. XLA fuses a cast into the elementwise ops and reductions
that read it, but not into a gather, so the f32 logits are made whole for the gather alone
(Llama-2-7B, 2,048 tokens of a 32,000-word vocabulary: 250 MiB per chip). XLA's TPU
scheduler runs that gather when it likes, for a loss only the step's output reads at the
end of the step, so those 250 MiB stay alive through the backward pass, at its peak.

Casting after the lookup is exact: a gather only selects elements, and a cast acts on each
element alone. Only casts between floating types are moved, where a lookup's fill value
for indices out of range (NaN) casts to the fill value of the other type; and only where
the lookup takes fewer elements than the cast makes.

Where it pays, as measured by XLA's TPU compiler (Llama-2-7B, BERT-large, GPT-2 medium and
ResNet-50 on v5e-256 and the other table topologies): in steps whose parameters are held
split (`shard-parameters`) the peak is at the loss, and the rewrite took 0.16 to 1.53 GiB
per chip off it (Llama-2-7B on v5e-256 3.21 → 2.97 GiB, GPT-2 medium 3.29 → 1.76; no change
where the peak is in the layer loop: Llama-2-7B on v5p-512 and v6e-256); in steps whose
state is whole on every chip the peak is the update's, and the rewrite left XLA a worse
schedule (v5e-256: BERT-large 6.13 → 6.21 GiB, GPT-2 medium 7.77 → 7.88, ResNet-50 1.684
→ 1.690). `mode=auto` (the default) sinks the casts only in
the first; `mode=on` everywhere.

    Before:
      %5: f32[1,2048,32000] = jax.convert_element_type(%4) {"new_dtype": "float32"}
      %7: f32[1,2048,1] = jax.gather(%5, %6) {...}
    After:
      %8: bf16[1,2048,1] = jax.gather(%4, %6) {...}
      %7: f32[1,2048,1] = jax.convert_element_type(%8) {"new_dtype": "float32"}
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_strategies.passes.base import ModePass, PassContext
from xla_strategies.passes.ir.graph import Graph, Node
from xla_strategies.passes.ir.traits import Trait

# floating types whose out-of-range lookups fill with NaN, which casts to NaN
_FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})


@dataclass(frozen=True)
class SinkCastsBelowLookups(ModePass):
    """Options:
    mode: ``on`` sinks every such cast; ``auto`` only in a step whose state
        `shard-parameters` holds split (see the module's docstring).
    """

    name = "sink-casts-below-lookups"

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if self.mode == "auto" and not ctx.parameters_split:
            return self.stays_off(
                ctx,
                {"sunk": 0, "reason": "state whole"},
                "the step's state is whole on every chip, where its peak is the update's, not "
                "the loss's",
            )
        sunk = 0
        for region in graph.graphs():
            producers = region.producers()
            rewritten: list[Node] = []
            for node in region.nodes:
                cast = self._cast_read(node, producers)
                if cast is None:
                    rewritten.append(node)
                    continue
                rewritten.extend(self._sink(node, cast))
                sunk += 1
            region.nodes[:] = rewritten
        ctx.stats[self.name] = {"sunk": sunk}
        return sunk > 0

    @staticmethod
    def _cast_read(node: Node, producers: dict) -> Node | None:
        """The cast whose result the lookup `node` reads as its table, where moving the cast
        after the lookup is exact and casts fewer elements."""
        if not node.has(Trait.LOOKUP) or len(node.outputs) != 1:
            return None
        cast = producers.get(node.inputs[0])
        if cast is None or not cast.has(Trait.CAST) or len(cast.inputs) != 1:
            return None
        source, table = cast.inputs[0], cast.outputs[0]
        if source.dtype not in _FLOATING or table.dtype not in _FLOATING:
            return None
        return cast if node.outputs[0].size < table.size else None

    def _sink(self, lookup: Node, cast: Node) -> list[Node]:
        """The lookup on the cast's operand, then the cast of what it took."""
        taken = lookup.outputs[0].like(dtype=cast.inputs[0].dtype)
        return [
            Node(
                lookup.op,
                [cast.inputs[0], *lookup.inputs[1:]],
                [taken],
                dict(lookup.attrs),
                payload=lookup.payload,
                created_by=self.name,
            ),
            Node(
                cast.op,
                [taken],
                list(lookup.outputs),
                dict(cast.attrs),
                payload=cast.payload,
                created_by=self.name,
            ),
        ]
