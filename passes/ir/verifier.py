"""IR verifier: run after every pass, so a broken rewrite fails where it happened.

Checks SSA (every use is defined earlier in the same region, nothing is defined twice),
regions (isolated from above, arity matching their op), collective axes (known to the mesh)
and the shapes and dtypes of the known ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from xla_strategies.passes.ir.graph import REDUCE_OPS, Graph, Node, Origin, Value
from xla_strategies.passes.ir.text import format_type
from xla_strategies.passes.ir.traits import REGION_TRAITS, Trait, is_declared

_ORIGINS = frozenset(o.value for o in Origin)


class VerificationError(ValueError):
    """The graph breaks an IR invariant; the message lists every problem found."""


def verify(graph: Graph, mesh_axes: Mapping[str, int] | None = None) -> None:
    """Raise `VerificationError` if `graph` is malformed.

    Args:
        graph: the graph to check.
        mesh_axes: axis name -> size; when given, collectives must name only these axes.
    """
    problems: list[str] = []
    _verify_region(graph, mesh_axes, problems, defined_anywhere=set())
    problems.extend(_check_interface(graph))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise VerificationError(f"graph @{graph.name} is malformed:\n  {shown}{more}")


def _verify_region(
    graph: Graph, mesh_axes: Mapping[str, int] | None, problems: list[str], defined_anywhere: set
) -> None:
    in_scope: set[int] = set()

    def define(value: Value, where: str) -> None:
        if id(value) in defined_anywhere:
            problems.append(f"{where}: defines a value that is already defined")
        defined_anywhere.add(id(value))
        in_scope.add(id(value))

    for index, value in enumerate(graph.inputs):
        define(value, f"@{graph.name} input {index}")
    for position, node in enumerate(graph.nodes):
        where = f"@{graph.name} node {position} ({node.op})"
        for index, value in enumerate(node.inputs):
            if id(value) not in in_scope:
                problems.append(f"{where}: operand {index} is used before it is defined")
        for region in node.regions:
            _verify_region(region, mesh_axes, problems, defined_anywhere)
        for value in node.outputs:
            define(value, where)
        problems.extend(f"{where}: {p}" for p in _check_node(node, mesh_axes))
    for index, value in enumerate(graph.outputs):
        if id(value) not in in_scope:
            problems.append(f"@{graph.name} output {index} is not defined in this region")


def _check_interface(graph: Graph) -> list[str]:
    """The program's interface has one attribute set per input and output, state pairs
    name real inputs, only state is donated, a value held split is split on one of its
    dimensions, and regions have no interface (their parent op gives their meaning)."""
    problems = [
        f"@{region.name} is a region but has an interface"
        for region in graph.graphs()[1:]
        if region.interface is not None
    ]
    io = graph.interface
    if io is None:
        return problems
    where = f"@{graph.name}"
    if len(io.inputs) != len(graph.inputs) or len(io.outputs) != len(graph.outputs):
        return [
            *problems,
            f"{where} interface has {len(io.inputs)} inputs and {len(io.outputs)} outputs, "
            f"the graph {len(graph.inputs)} and {len(graph.outputs)}",
        ]
    state = io.state_pairs()
    missing = sorted(arg for arg in state.values() if not 0 <= arg < len(graph.inputs))
    if missing:
        problems.append(f"{where} outputs are the state of inputs {missing} it does not have")
    donated = {i for i, a in enumerate(io.inputs) if a.donated}
    if donated - set(state.values()):
        problems.append(
            f"{where} donates inputs {sorted(donated - set(state.values()))}, which are not state"
        )
    for kind, values, attrs in (
        ("input", graph.inputs, io.inputs),
        ("output", graph.outputs, io.outputs),
    ):
        for index, (value, a) in enumerate(zip(values, attrs, strict=True)):
            if a.sharded is not None and a.sharded.dim >= len(value.shape):
                problems.append(
                    f"{where} {kind} {index} is held split on dimension {a.sharded.dim} of "
                    f"{format_type(value)}"
                )
    both = [i for i, a in enumerate(io.outputs) if a.mirrored and a.aggregation]
    if both:
        problems.append(f"{where} outputs {both} are declared both mirrored and aggregated")
    return problems


def _check_node(node: Node, mesh_axes: Mapping[str, int] | None) -> list[str]:
    problems: list[str] = []
    if node.is_collective:
        axes = node.attrs.get("axes")
        if not axes:
            return ["collective without an 'axes' attribute"]
        unknown = [a for a in axes if mesh_axes is not None and a not in mesh_axes]
        if unknown:
            known = ", ".join(mesh_axes or ()) or "none"
            return [f"collective over unknown mesh axis {unknown} (mesh axes: {known})"]
    origin = node.attrs.get("origin")
    if origin is not None and origin not in _ORIGINS:
        problems.append(f"unknown origin {origin!r} (one of {sorted(_ORIGINS)})")
    if not node.is_foreign and not is_declared(node.op):
        problems.append(f"unknown op {node.op!r}: not one of the IR's ops nor a foreign jax.* op")
    if node.regions or node.traits & REGION_TRAITS:
        message = _check_regions(node)
        if message:
            problems.append(message)
    check = None if node.is_foreign else _SHAPE_RULES.get(node.op)
    if check is not None:
        message = check(node, mesh_axes or {})
        if message:
            problems.append(message)
    return problems


def _types(values: list[Value]) -> str:
    return ", ".join(format_type(v) for v in values)


def _unary(node: Node) -> str | None:
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        return f"expects one operand and one result, has {len(node.inputs)} and {len(node.outputs)}"
    return None


def _check_all_reduce(node: Node, mesh: Mapping[str, int]) -> str | None:
    if node.attrs.get("reduce_op") not in REDUCE_OPS:
        return f"reduce_op must be one of {REDUCE_OPS}, got {node.attrs.get('reduce_op')!r}"
    if len(node.inputs) != len(node.outputs):
        return "needs as many results as operands"
    for src, dst in zip(node.inputs, node.outputs, strict=True):
        if (src.shape, src.dtype) != (dst.shape, dst.dtype):
            return f"result type {format_type(dst)} differs from operand {format_type(src)}"
        if dst.varying_axes != src.varying_axes - set(node.attrs["axes"]):
            return f"result should vary over {sorted(src.varying_axes - set(node.attrs['axes']))}"
    return None


def _group_size(node: Node, mesh: Mapping[str, int]) -> int | None:
    sizes = [mesh.get(a) for a in node.attrs["axes"]]
    return None if None in sizes else math.prod(sizes)


def _check_resize(node: Node, mesh: Mapping[str, int], grow: bool) -> str | None:
    problem = _unary(node)
    size = _group_size(node, mesh)
    if problem or size is None:
        return problem
    dim = node.attrs.get("dimension", 0)
    src, dst = node.inputs[0].shape, node.outputs[0].shape
    want = list(src)
    if grow:
        want[dim] *= size
    elif want[dim] % size:
        return f"dimension {dim} of {format_type(node.inputs[0])} does not divide by {size}"
    else:
        want[dim] //= size
    return None if tuple(want) == dst else f"result shape {dst} should be {tuple(want)}"


def _check_concatenate(node: Node, mesh: Mapping[str, int]) -> str | None:
    dim = node.attrs.get("dimension", 0)
    total = sum(v.shape[dim] for v in node.inputs)
    out = node.outputs[0].shape
    return (
        None
        if out[dim] == total
        else f"result dimension {dim} is {out[dim]}, operands sum to {total}"
    )


def _check_same_size(node: Node, mesh: Mapping[str, int]) -> str | None:
    problem = _unary(node)
    if problem:
        return problem
    if node.inputs[0].size != node.outputs[0].size:
        return f"changes the element count: {_types(node.inputs)} -> {_types(node.outputs)}"
    return None


def _check_elementwise(node: Node, mesh: Mapping[str, int]) -> str | None:
    shapes = {v.shape for v in node.inputs + node.outputs}
    dtypes = {v.dtype for v in node.inputs + node.outputs}
    if len(shapes) > 1 or len(dtypes) > 1:
        return f"operands and result differ: {_types(node.inputs)} -> {_types(node.outputs)}"
    return None


def _check_slice(node: Node, mesh: Mapping[str, int]) -> str | None:
    start, limit = node.attrs.get("start", []), node.attrs.get("limit", [])
    want = tuple(b - a for a, b in zip(start, limit, strict=False))
    got = node.outputs[0].shape
    return None if want == got else f"result shape {got} does not match limit - start = {want}"


def _check_transpose(node: Node, mesh: Mapping[str, int]) -> str | None:
    problem = _unary(node)
    if problem:
        return problem
    perm, src = node.attrs.get("permutation", []), node.inputs[0].shape
    if sorted(perm) != list(range(len(src))):
        return f"permutation {perm} is not one of {len(src)} dimensions"
    want = tuple(src[p] for p in perm)
    got = node.outputs[0].shape
    return None if want == got else f"result shape {got} should be {want}"


def _check_one_hot_add(node: Node, mesh: Mapping[str, int]) -> str | None:
    if len(node.inputs) != 3 or len(node.outputs) != 1:
        return f"expects operand, indices and updates, and one result; has {len(node.inputs)}"
    return _result_like_operand_0(node)


def _check_after(node: Node, mesh: Mapping[str, int]) -> str | None:
    if len(node.inputs) < 1 or len(node.outputs) != 1:
        return "expects a value, what it waits for (if anything), and one result"
    return _result_like_operand_0(node)


def _result_like_operand_0(node: Node) -> str | None:
    operand, result = node.inputs[0], node.outputs[0]
    if (operand.shape, operand.dtype) != (result.shape, result.dtype):
        return f"result differs from operand 0: {_types([operand])} -> {_types([result])}"
    return None


_SHAPE_RULES: dict[str, Callable[[Node, Mapping[str, int]], str | None]] = {
    "all_reduce": _check_all_reduce,
    "reduce_to_one": _check_all_reduce,
    "broadcast": _check_elementwise,
    "reduce_scatter": lambda n, m: _check_resize(n, m, grow=False),
    "all_gather": lambda n, m: _check_resize(n, m, grow=True),
    "replica_slice": lambda n, m: _check_resize(n, m, grow=False),
    "concatenate": _check_concatenate,
    "reshape": _check_same_size,
    "convert": _check_same_size,
    "pvary": _check_same_size,
    "pinvariant": _check_same_size,
    "add": _check_elementwise,
    "scale": _check_elementwise,
    "slice": _check_slice,
    "transpose": _check_transpose,
    "one_hot_add": _check_one_hot_add,
    "after": _check_after,
}


def _region_arity(node: Node) -> list[tuple[int, int]]:
    """(inputs, outputs) each region of `node` must have, from the node's own attributes."""
    n_in, n_out, attrs = len(node.inputs), len(node.outputs), node.attrs
    if node.has(Trait.COUNTED_LOOP) or node.has(Trait.CALL_ONCE):
        return [(n_in, n_out)]
    if node.has(Trait.BRANCHES):
        return [(n_in - 1, n_out)] * len(node.regions)
    if node.has(Trait.WHILE_LOOP):
        carry = n_in - attrs.get("cond_nconsts", 0) - attrs.get("body_nconsts", 0)
        return [
            (attrs.get("cond_nconsts", 0) + carry, 1),
            (attrs.get("body_nconsts", 0) + carry, carry),
        ]
    return [(len(r.inputs), len(r.outputs)) for r in node.regions]


def _check_regions(node: Node) -> str | None:
    want = _region_arity(node)
    if len(want) != len(node.regions) or (node.has(Trait.BRANCHES) and not node.regions):
        return f"has {len(node.regions)} regions, expected {max(len(want), 1)}"
    for index, (region, (n_in, n_out)) in enumerate(zip(node.regions, want, strict=True)):
        if (len(region.inputs), len(region.outputs)) != (n_in, n_out):
            return (
                f"region {index} takes {len(region.inputs)} and returns {len(region.outputs)} "
                f"values, expected {n_in} and {n_out}"
            )
    return None
