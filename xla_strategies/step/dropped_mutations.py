"""A step changes copies of its arguments: a change it makes in place, and does not
return, would be lost without a word. `jax.jit` drops such changes silently; here they are
an error that says what to do (NNX's stateful `train_step(model, optimizer, batch)`,
`params["w"] = ...` inside a step)."""

from __future__ import annotations

from typing import Any

import jax

from xla_strategies.core.errors import DroppedMutationError
from xla_strategies.core.trees import arg_path


def snapshot(args: tuple, kwargs: dict) -> tuple[list[tuple[Any, Any]], Any]:
    """Each leaf of the step's arguments with its path, and their structure, as traced."""
    return jax.tree_util.tree_flatten_with_path((args, kwargs))


def check_unchanged(
    name: str,
    before: tuple[list[tuple[Any, Any]], Any],
    args: tuple,
    kwargs: dict,
    result: Any,
    written_back: tuple[int, ...] = (),
) -> None:
    """Raise if an argument's leaves (or structure) changed during the step and the new
    values are neither among what the step returns nor written back (`written_back`:
    leaf positions, NNX variables; `in_place_state`)."""
    leaves, treedef = before
    now, now_treedef = jax.tree_util.tree_flatten((args, kwargs))
    returned = {id(leaf) for leaf in jax.tree_util.tree_leaves(result)}
    if now_treedef != treedef:
        changed = ["the structure of its arguments"]
    else:
        changed = [
            arg_path(path)
            for index, ((path, old), new) in enumerate(zip(leaves, now, strict=True))
            if new is not old and id(new) not in returned and index not in written_back
        ]
    if changed:
        shown = ", ".join(changed[:4]) + (
            f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        )
        raise DroppedMutationError(
            f"{name} changed {shown} in place and did not return it. A compiled step works on "
            "copies of its arguments, as jax.jit does, so the change would be lost. Return "
            "the changed objects and use what the step returns (flax NNX variables changed "
            "in place are written back, as nnx.jit does)"
        )
