"""What a step's outputs are declared to be, and which arguments are state it hands back.

tf.distribute gives each variable a synchronization and an aggregation. Here the step's
outputs carry them: `compile(mirrored_outputs=...)` is a pytree prefix of the outputs whose
leaves say, per output,

- `True`: mirrored; an output that still varies across replicas is an error;
- a `ReduceOp` (or its name): aggregated, reduced across replicas inside the step by
  `insert-reductions` (tf.distribute's `VariableAggregation`), so it comes back mirrored;
- `False` or `None`: as the step computes it (a varying value comes back stacked, one row
  per replica: tf.distribute's `SyncOnRead`).
"""

from __future__ import annotations

from typing import Any

import jax

from xla_strategies.arguments import Layout, Outputs, Signature
from xla_strategies.passes.ir import Graph, Value
from xla_strategies.reduce_op import ReduceOp


def declared_outputs(prefix: Any, outputs: Outputs) -> dict[int, str | None]:
    """Traced output position -> None (declared mirrored) or the reduction (`"mean"`...)
    that makes it mirrored. Outputs left undeclared are absent."""
    full = jax.tree.unflatten(outputs.treedef, range(len(outputs.leaves)))
    try:
        marks = jax.tree.map(
            lambda mark, sub: [(mark, len(jax.tree.leaves(sub)))],
            prefix,
            full,
            is_leaf=lambda x: x is None,
        )
    except ValueError as exc:
        raise ValueError(
            f"mirrored_outputs must be a pytree prefix of the step's outputs "
            f"({outputs.treedef}): {exc}"
        ) from None
    flags: list[Any] = []
    for [(mark, count)] in jax.tree.leaves(marks, is_leaf=lambda x: isinstance(x, list)):
        flags.extend([mark] * count)
    declared: dict[int, str | None] = {}
    for position, leaf_index in enumerate(outputs.traced_indices()):
        mark = flags[leaf_index]
        if mark is None or mark is False:
            continue
        if mark is True:
            declared[position] = None
        else:
            where = f"mirrored_outputs for {outputs.names[position]}"
            declared[position] = ReduceOp.of(mark, where).value
    return declared


def state_outputs(signature: Signature, outputs: Outputs, graph: Graph) -> dict[int, int]:
    """Traced output position -> traced argument position, for the step's state: a
    positional argument that comes back at the same position of a tuple of outputs, or the
    first of several arguments returned alone, with the same structure, and each leaf with the same
    per-replica type and layout (mirrored stays mirrored, stacked comes back stacked),
    holding at least one non-scalar array (`params, opt_state, ... = step(params, ...)`,
    or flax's `state = train_step(state, batch)`). Anything else, e.g. an evaluation step's
    inputs or a batch, is not state."""
    traced_arg = {leaf: k for k, leaf in enumerate(signature.traced_indices())}
    traced_out = {leaf: k for k, leaf in enumerate(outputs.traced_indices())}
    args, kwargs = jax.tree.unflatten(signature.treedef, range(len(signature.leaves)))
    results = jax.tree.unflatten(outputs.treedef, range(len(outputs.leaves)))
    if not isinstance(results, tuple | list):
        # `f(x) -> x'` transforms x; a step updates its state from data
        if len(args) + len(kwargs) < 2:
            return {}
        results = (results,)  # one output: at position 0, like the first argument
    state: dict[int, int] = {}
    for arg, result in zip(args, results, strict=False):
        if jax.tree.structure(arg) != jax.tree.structure(result):
            continue
        pairs = [
            (traced_arg.get(a), traced_out.get(r))
            for a, r in zip(jax.tree.leaves(arg), jax.tree.leaves(result), strict=True)
        ]
        pairs = [(a, r) for a, r in pairs if a is not None or r is not None]
        if (
            pairs
            and all(
                a is not None and r is not None and _same_state(signature, graph, a, r)
                for a, r in pairs
            )
            and any(graph.inputs[a].shape for a, _ in pairs)
        ):
            state.update((r, a) for a, r in pairs)
    return state


def donated_state(graph: Graph) -> tuple[int, ...]:
    """The argument positions of the state the optimised graph still hands back in the
    layout it takes it (a pass that holds state sharded holds its next value sharded)."""
    return tuple(
        sorted(
            arg
            for out, arg in graph.state_outputs.items()
            if _same_type(graph.inputs[arg], graph.outputs[out])
            and graph.sharded_inputs.get(arg) == graph.sharded_outputs.get(out)
        )
    )


def _same_type(value: Value, result: Value) -> bool:
    return (value.shape, value.dtype) == (result.shape, result.dtype)


def _same_state(signature: Signature, graph: Graph, arg: int, out: int) -> bool:
    layout = signature.arrays[arg].layout
    value, result = graph.inputs[arg], graph.outputs[out]
    if not _same_type(value, result) or layout is Layout.SPLIT:
        return False
    return bool(result.varying_axes) == (layout is Layout.STACKED)
