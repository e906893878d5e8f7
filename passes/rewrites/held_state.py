"""What passes that hold state split between steps ask of the step: state to hold."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from xla_strategies.passes.base import PassContext
from xla_strategies.passes.ir.graph import Graph


def require_state(graph: Graph, ctx: PassContext, pass_name: str, option: str) -> None:
    """Raise when a pass the user turned on (`option=True`) would find no state to hold
    split: it would compile and silently change nothing."""
    if ctx.num_replicas > 1 and graph.io is not None and not graph.io.state_inputs():
        raise ValueError(
            f"{option}=True ({pass_name}) holds state split across the replicas between "
            "steps, but this step hands back no state: return each state argument in the "
            "position it came from (params, opt_state = step(params, opt_state, batch)), "
            "declare it with donate_argnums, or change flax NNX objects in place"
        )


def warn_if_nothing_held(pass_name: str, option: str, held: int, remarks: Sequence[str]) -> None:
    """Warn when a pass the user turned on found state but split none of it (no dimension
    divides by the replicas): the option compiled and changed nothing."""
    if held == 0:
        why = "; ".join(remarks[:2]) or "nothing to split"
        warnings.warn(
            f"{option}=True ({pass_name}) split no state across the replicas: {why}",
            stacklevel=2,
        )
