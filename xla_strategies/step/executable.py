"""`Executable`: one compiled program of a step, for one input signature, with what its
build recorded for the dumps."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding

from xla_strategies.core.trees import copy_to
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.step.outputs import Outputs

if TYPE_CHECKING:
    from xla_strategies.step.step_strategy import StepStrategy


@dataclass
class Executable:
    """One compiled program of a step, for one input signature."""

    graph: Graph
    run: Callable[..., tuple[jax.Array, ...]]
    outputs: Outputs
    donated: tuple[int, ...]
    # per traced argument: where a mirrored one is put before the call (replicated, or split
    # when a pass holds it sharded); None for per-replica arguments, placed already
    placements: tuple[NamedSharding | None, ...]
    captured_text_stats: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    # what the passes recorded (`PassContext.stats`: their decisions and counts, by pass
    # name) and their remarks (what they left undone, and why), as the dump prints them
    pass_stats: dict[str, Any] = field(default_factory=dict)
    remarks: list[str] = field(default_factory=list)

    @functools.cached_property
    def rooted(self) -> tuple[bool, ...]:
        """Per output, whether only the root replica's copy is right (read once: every
        call of the step asks)."""
        return tuple(a.rooted for a in self.graph.io.outputs)

    def place(self, flat: list[Any], strategy: StepStrategy) -> list[Any]:
        """The traced arguments `flat` as this program takes them: mirrored leaves put
        where it reads them (replicated, or split across the replicas for state a pass
        holds sharded); a donated buffer that is also passed elsewhere (the same array as
        two pieces of state, say) copied: XLA cannot donate a buffer that another
        argument still reads. `strategy` places a leaf (`place`)."""
        placed = [
            leaf if sharding is None else _put(leaf, sharding, strategy)
            for leaf, sharding in zip(flat, self.placements, strict=True)
        ]
        if self.donated:
            uses = Counter(id(leaf) for leaf in placed)
            for index in self.donated:
                if uses[id(placed[index])] > 1 and isinstance(placed[index], jax.Array):
                    uses[id(placed[index])] -= 1
                    placed[index] = copy_to(placed[index], placed[index].sharding)
        return placed


def _put(leaf: Any, sharding: NamedSharding, strategy: StepStrategy) -> Any:
    if isinstance(leaf, jax.Array) and (
        leaf.sharding == sharding or leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    ):  # equality first: it is the common case, and far cheaper
        return leaf
    return strategy.place(leaf, sharding)  # a copy where the program reads it, or abstract
