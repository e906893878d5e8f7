"""`Executable`: one compiled program of a step, for one input signature, with what its
build recorded for the dumps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import NamedSharding

from xla_strategies.passes.ir.graph import Graph
from xla_strategies.step.arguments import Outputs


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
