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

from dataclasses import dataclass
from typing import Any

import jax

from xla_strategies.core.layout import Layout
from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.core.state_types import is_state_type
from xla_strategies.passes.ir.graph import Graph, Value
from xla_strategies.step.arguments import Signature
from xla_strategies.step.outputs import Outputs


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


@dataclass(frozen=True)
class DeclaredState:
    """Which of a step's arguments are state, by position and by name: those named by
    `donate_argnums`/`donate_argnames` (donated to their new value), any argument of a
    state type a frontend knows (flax's and `xst`'s `TrainState`: kept, not donated), and
    any other argument the step hands back where it came from (kept)."""

    donate_argnums: frozenset[int] = frozenset()
    donate_argnames: frozenset[str] = frozenset()

    def of(self, position: int | str, value: Any) -> str:
        """`"donated"`, `"kept"` (state the caller keeps, paired with any free output of its
        structure) or `"returned"` (state only if an output at its own position, or the
        whole result, is its next value: `params, opt_state = step(params, opt_state, x)`)
        for argument `position` (an int, or a keyword argument's name) holding `value`."""
        if position in self.donate_argnums or position in self.donate_argnames:
            return "donated"
        return "kept" if is_state_type(value) else "returned"


@dataclass(frozen=True)
class StatePairs:
    """A step's state: traced output position -> traced argument position (its next
    value), the argument positions to donate, and the declared arguments no output returns."""

    outputs: dict[int, int]
    donated: frozenset[int]
    unreturned: list[str]


def state_pairs(
    declared: DeclaredState, signature: Signature, outputs: Outputs, graph: Graph
) -> StatePairs:
    """Pair each declared state argument with the output that is its next value: of the
    step's result or, when it is a tuple, list or dict, one of its items, with the same
    tree structure and each leaf the same per-replica type and layout (mirrored stays
    mirrored, stacked comes back stacked). A tuple's item at the argument's own position
    is preferred (`params, opt_state, loss = step(params, opt_state, batch)`), then the
    whole result (flax's `state = train_step(state, batch)`), then the first free item;
    each output is the next value of one argument at most."""
    traced_arg = {leaf: k for k, leaf in enumerate(signature.traced_indices())}
    traced_out = {leaf: k for k, leaf in enumerate(outputs.traced_indices())}
    args, kwargs = jax.tree.unflatten(signature.treedef, range(len(signature.leaves)))
    items = _items(jax.tree.unflatten(outputs.treedef, range(len(outputs.leaves))))
    declared_args = {  # arg: its structure, with leaf numbers
        position: (arg, declared.of(position, arg))
        for position, arg in [*enumerate(args), *kwargs.items()]
    }
    paired: dict[int, int] = {}
    donated: set[int] = set()
    # rounds, so that no argument takes the item another one finds at its own position
    for round_of in (lambda p: [p], lambda p: [None], lambda p: list(items)):
        for position, (arg, kind) in list(declared_args.items()):
            keys = round_of(position)
            if kind == "returned" and len(keys) > 1:
                continue  # undeclared: its own position or the whole result only
            for key in keys:
                if key not in items:
                    continue
                partial = kind != "donated"  # kept state may grow (a first torch step)
                found = _pair(arg, items[key], traced_arg, traced_out, signature, graph, partial)
                if found is not None:
                    del declared_args[position]
                    if key is None:  # the whole result is this state: no item is free
                        items.clear()
                    else:
                        del items[key]
                        items.pop(None, None)
                    paired.update((r, a) for a, r in found)
                    donated.update(a for a, _ in found if kind == "donated")
                    break
    unreturned = [  # an argument with no arrays (Keras' empty variable groups) has none to lose
        f"args[{p}]" if isinstance(p, int) else f"kwargs[{p!r}]"
        for p, (arg, kind) in declared_args.items()
        if kind == "donated" and any(leaf in traced_arg for leaf in jax.tree.leaves(arg))
    ]
    paired.update(_written_in_place(signature, outputs, graph, traced_arg))
    return StatePairs(paired, frozenset(donated), unreturned)


def _written_in_place(
    signature: Signature, outputs: Outputs, graph: Graph, traced_arg: dict[int, int]
) -> dict[int, int]:
    """Output -> argument for the NNX variables a step changed in place: state, which its
    caller keeps (their new values are written back into the caller's objects)."""
    first = len(graph.outputs) - len(outputs.written)
    pairs = {}
    for offset, leaf in enumerate(outputs.written):
        arg = traced_arg.get(leaf)
        if arg is not None and _same_state(signature, graph, arg, first + offset):
            pairs[first + offset] = arg
    return pairs


def _items(result: Any) -> dict[Any, Any]:
    """The candidates for a state argument's next value: None for the whole result, and
    each item of a tuple, list or dict result under its index or key."""
    items: dict[Any, Any] = {None: result}
    if isinstance(result, tuple | list):
        items.update(enumerate(result))
    elif isinstance(result, dict):
        items.update(result.items())
    return items


def _pair(
    arg: Any,
    out: Any,
    traced_arg: dict,
    traced_out: dict,
    signature: Signature,
    graph: Graph,
    partial: bool = False,
) -> list[tuple[int, int]] | None:
    """The (argument, output) traced positions if `out` has `arg`'s structure and types.
    With `partial`, an `out` of the same kind whose structure differs (a torch optimizer's
    state, made by its first step) pairs the leaves at the paths both have."""
    if jax.tree.structure(arg) != jax.tree.structure(out):
        if not partial or type(arg) is not type(out):
            return None
        pairs = _pair_by_path(arg, out, traced_arg, traced_out)
    else:
        pairs = [
            (traced_arg.get(a), traced_out.get(r))
            for a, r in zip(jax.tree.leaves(arg), jax.tree.leaves(out), strict=True)
        ]
    pairs = [(a, r) for a, r in pairs if a is not None or r is not None]
    if pairs and all(
        a is not None and r is not None and _same_state(signature, graph, a, r) for a, r in pairs
    ):
        return pairs
    return None


def _pair_by_path(arg: Any, out: Any, traced_arg: dict, traced_out: dict) -> list:
    """(argument, output) traced positions of the leaves at the same path in both."""
    outs = dict(jax.tree_util.tree_flatten_with_path(out)[0])
    return [
        (traced_arg.get(a), traced_out.get(outs[path]))
        for path, a in jax.tree_util.tree_flatten_with_path(arg)[0]
        if path in outs and traced_arg.get(a) is not None and traced_out.get(outs[path]) is not None
    ]


def donated_state(graph: Graph) -> tuple[int, ...]:
    """The donated argument positions whose next value the optimised graph still hands
    back in the layout it takes it (a pass that holds state sharded holds its next value
    sharded), so XLA can write it in place."""
    io = graph.io
    return tuple(
        sorted(
            arg
            for out, arg in io.state_pairs().items()
            if io.inputs[arg].donated
            and _same_type(graph.inputs[arg], graph.outputs[out])
            and io.inputs[arg].sharded == io.outputs[out].sharded
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
