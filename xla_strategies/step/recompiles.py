"""Saying when a step keeps compiling: a static value (a Python number in a static
argument, a torch optimizer setting that a scheduler changes) that differs on every
call compiles a new program each time, which runs, but slowly; `jax.jit` is as silent."""

from __future__ import annotations

import warnings

import jax

from xla_strategies.core.trees import arg_path
from xla_strategies.step.arguments import ArraySpec, Signature

#: After this many programs for one step, a warning names what keeps changing.
RECOMPILES_WARNED_AFTER = 8


def warn_if_recompiling(name: str, compiled: int, previous: Signature, new: Signature) -> None:
    """Warn once, when step `name` has compiled `compiled` programs, naming what
    differs between the last two signatures."""
    if compiled != RECOMPILES_WARNED_AFTER:
        return
    warnings.warn(
        f"{name} has compiled {compiled} programs: {_difference(previous, new)} changes "
        "between calls, and every new value compiles again. Pass a value that changes as an "
        "array (a torch optimizer setting: docs/pytorch.md lists the optimizers "
        "whose scheduled learning rate compiles once)",
        stacklevel=4,
    )


def _difference(old: Signature, new: Signature) -> str:
    if old.treedef != new.treedef:
        return "the arguments' structure or a value kept in it (a torch optimizer's settings)"
    indices = jax.tree.unflatten(new.treedef, range(len(new.leaves)))
    paths = [arg_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(indices)[0]]
    changed = [
        path
        for path, a, b in zip(paths, old.leaves, new.leaves, strict=True)
        if a != b and not (isinstance(a, ArraySpec) and isinstance(b, ArraySpec))
    ]
    shapes = [p for p, a, b in zip(paths, old.leaves, new.leaves, strict=True) if a != b]
    return f"the static value {', '.join(changed)}" if changed else f"the shape of {shapes[0]}"
