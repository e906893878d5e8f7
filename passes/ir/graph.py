"""The graph IR the passes work on: a small SSA graph whose node order is the schedule.

A `Graph` has input values, a list of nodes and output values. A `Node` consumes values and
defines new ones; it may own nested regions (loop bodies, branches), each itself a `Graph`
that sees only its own inputs. Collectives and the few ops passes create are *known* ops;
everything else the capture finds is a *foreign* node (`jax.<primitive>`) that passes treat
as opaque, reading only the shapes and dtypes of its values.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xla_strategies.passes.ir.traits import Trait, traits_of

REDUCE_OPS = ("sum", "mean", "max", "min")


class Origin(enum.StrEnum):
    """Who put a collective (or a gradient's scale) into the program: the `origin`
    attribute of the IR, as its text form spells it."""

    AUTODIFF = "autodiff"  # a mirrored value's gradient completed by JAX's autodiff
    USER = "user"  # written in the step (lax.psum, a replica context's all_reduce)
    GRADIENT = "gradient"  # the scale a gradient gets from the strategy's MEAN or SUM
    AGGREGATION = "aggregation"  # an output declared aggregated (mirrored_outputs)
    WEIGHT_UPDATE = "weight-update"  # a sharded update's partial sums


FOREIGN_PREFIX = "jax."

_DTYPE_SHORT = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint64": "u64",
    "uint32": "u32",
    "uint16": "u16",
    "uint8": "u8",
    "bool": "bool",
    "complex64": "c64",
    "complex128": "c128",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}
_DTYPE_LONG = {v: k for k, v in _DTYPE_SHORT.items()}


def itemsize(dtype: str) -> int:
    """Bytes per element, also for the ml_dtypes types numpy does not know by name."""
    bits = re.search(r"(\d+)", short_dtype(dtype))
    return 1 if bits is None else max(1, int(bits.group(1)) // 8)


def short_dtype(dtype: Any) -> str:
    """`float32` -> `f32`, the spelling used in the text form."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return _DTYPE_SHORT.get(name, name)


def long_dtype(short: str) -> str:
    """`f32` -> `float32`."""
    return _DTYPE_LONG.get(short, short)


@dataclass(eq=False)
class Value:
    """An SSA value: one array of the per-replica program.

    Attributes:
        shape: the per-replica shape.
        dtype: numpy dtype name, e.g. ``"float32"``.
        varying_axes: mesh axes over which replicas may hold different data; empty means
            the value is identical on every replica (mirrored).
        name: an optional human name (the pytree path of a step input or output).
    """

    shape: tuple[int, ...]
    dtype: str
    varying_axes: frozenset[str] = frozenset()
    name: str | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)

    def like(self, **changes: Any) -> Value:
        """A fresh value of the same type, with `changes` applied."""
        fields = dict(shape=self.shape, dtype=self.dtype, varying_axes=self.varying_axes)
        fields.update(changes)
        return Value(**fields)

    def __repr__(self) -> str:
        axes = "{" + ",".join(sorted(self.varying_axes)) + "}" if self.varying_axes else ""
        return f"Value({short_dtype(self.dtype)}{list(self.shape)}{axes})"


@dataclass(eq=False)
class Node:
    """One operation. `payload` holds what only the JAX layer understands (a jaxpr equation
    for foreign nodes, an array for large constants); it never appears in the text form.
    `created_by` names the pass that made the node, for dumps and debugging. `call`: the
    nested `jax.jit` call of the user's program the node was imported from, which the
    lowering may call again (`bridge.called_functions.CallSite`); never in the text."""

    op: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    regions: list[Graph] = field(default_factory=list)
    payload: Any = None
    created_by: str | None = None
    call: Any = None

    @property
    def is_foreign(self) -> bool:
        return self.op.startswith(FOREIGN_PREFIX)

    @property
    def traits(self) -> frozenset[Trait]:
        """What passes may know about this op (`passes/ir/traits.py`)."""
        return traits_of(self.op)

    def has(self, trait: Trait) -> bool:
        return trait in traits_of(self.op)

    @property
    def is_collective(self) -> bool:
        return self.has(Trait.COLLECTIVE)

    @property
    def is_loop(self) -> bool:
        """Whether the node runs its region more than once: a counted or a while loop."""
        return self.has(Trait.COUNTED_LOOP) or self.has(Trait.WHILE_LOOP)

    @property
    def whole_bytes(self) -> int:
        """Bytes of the whole tensors a collective moves, which the cost model takes: the
        larger of its operands and results (an all-gather's result, not its block)."""
        return max(sum(v.nbytes for v in self.inputs), sum(v.nbytes for v in self.outputs))

    @property
    def primitive(self) -> str:
        """The JAX primitive name of a foreign node (``jax.scan`` -> ``scan``)."""
        return self.op[len(FOREIGN_PREFIX) :] if self.is_foreign else self.op

    @property
    def label(self) -> str | None:
        """What a collective reduces, for dumps: its parameter's pytree path (a gradient),
        the output it aggregates, or the user's source line."""
        a = self.attrs
        return a.get("param") or a.get("output") or a.get("source")

    def __repr__(self) -> str:
        return f"Node({self.op}, {len(self.inputs)} in, {len(self.outputs)} out)"


class NewNodes:
    """The nodes a rewrite makes, in order, each marked with the pass that made it. Called
    as `emit(op, inputs, out, **attrs)`, it adds a node of one result and returns that
    result; `add` adds a node of any number of results."""

    def __init__(self, created_by: str) -> None:
        self.created_by = created_by
        self.nodes: list[Node] = []

    def __call__(self, op: str, inputs: list[Value], out: Value, **attrs: Any) -> Value:
        self.add(op, inputs, [out], attrs)
        return out

    def add(
        self, op: str, inputs: list[Value], outputs: list[Value], attrs: dict | None = None
    ) -> Node:
        node = Node(op, list(inputs), list(outputs), dict(attrs or {}), created_by=self.created_by)
        self.nodes.append(node)
        return node


# The attribute of an all_gather whose result is a value held split: gathered only where
# something reads it whole (shard-parameters defers its gathers so; the importer marks a
# pipeline's gathers of its own blocks so)
DEFERRED = "deferred"


@dataclass(frozen=True)
class Split:
    """How a mirrored value is held across the replicas: dimension `dim` cut into one block
    per position over `axes`, numbered in this order (the order tiled collectives and
    `replica_slice` use), so block i of the value is on the replicas whose index over
    `axes` is i. Replicas that differ only along the other axes (other slices) hold the
    same block."""

    dim: int
    axes: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.dim}{{{','.join(self.axes)}}}"


@dataclass
class InputAttrs:
    """What the step's interface says of one input (MLIR's argument attributes).

    `stacked`: it holds one value per replica (stacked on a leading replica axis outside
    the step), not a split batch. `donated`: its buffer may be reused (declared with
    `donate_argnums`; only state). `sharded`: a mirrored value held split across the
    replicas between steps, whose type in the graph is the per-replica block. `model_dim`:
    the dimension a mirrored value is split on over the model axis (a replica spanning
    several devices), left to XLA's partitioner; the graph sees the value whole.
    `stage_split`: a stacked layer weight a pipeline splits over the stage axis (dim 0)
    between steps, each stage holding its layers; the graph sees it whole."""

    stacked: bool = False
    donated: bool = False
    sharded: Split | None = None
    model_dim: int | None = None
    stage_split: bool = False


@dataclass
class OutputAttrs:
    """What the step's interface says of one output (MLIR's result attributes).

    `name`: its pytree path. `state_of`: the input it is the next value of (a step's
    state: `params, opt_state = ...`). `sharded`: held split between steps, like the input.
    `mirrored`: declared mirrored, so a pass must reject it if it still varies.
    `aggregation`: declared aggregated by this reduction (`sum`, `mean`, `max`, `min`),
    which makes it mirrored. `rooted`: only the root replica holds it correctly
    (reduce-to-one-device); the runtime keeps the root's copy. `model_dim`, `stage_split`:
    as the input's."""

    name: str | None = None
    state_of: int | None = None
    sharded: Split | None = None
    mirrored: bool = False
    aggregation: str | None = None
    rooted: bool = False
    model_dim: int | None = None
    stage_split: bool = False


@dataclass
class Interface:
    """A program's interface: the attributes of each input and output, position by
    position. Only the program's graph has one; a region's inputs and outputs are its
    parent op's business."""

    inputs: list[InputAttrs]
    outputs: list[OutputAttrs]

    @classmethod
    def plain(cls, inputs: int, outputs: int) -> Interface:
        return cls([InputAttrs() for _ in range(inputs)], [OutputAttrs() for _ in range(outputs)])

    def state_pairs(self) -> dict[int, int]:
        """Output position -> the input position it is the next value of."""
        return {i: a.state_of for i, a in enumerate(self.outputs) if a.state_of is not None}

    def state_inputs(self) -> list[int]:
        """The state inputs' positions, in order."""
        return sorted(set(self.state_pairs().values()))


@dataclass(eq=False)
class Graph:
    """A program (or a region of one): its inputs, nodes in schedule order and outputs,
    and, for the program, its `Interface`."""

    inputs: list[Value]
    nodes: list[Node]
    outputs: list[Value]
    name: str = "main"
    interface: Interface | None = None

    @property
    def io(self) -> Interface:
        """The program's interface (a region has none)."""
        if self.interface is None:
            raise ValueError(f"@{self.name} is a region or has no interface")
        return self.interface

    def output_name(self, index: int) -> str:
        """The pytree path of output `index`, or a positional fallback."""
        name = self.interface.outputs[index].name if self.interface else None
        return name or f"output #{index}"

    def walk(self) -> Iterator[Node]:
        """Every node, nested regions included, in schedule order (pre-order)."""
        for node in self.nodes:
            yield node
            for region in node.regions:
                yield from region.walk()

    def graphs(self) -> list[Graph]:
        """This graph and every region nested in it, outermost first."""
        found = [self]
        for node in self.walk():
            found.extend(node.regions)
        return found

    def users(self) -> dict[Value, list[Node]]:
        """Map each value to the nodes of this graph (not nested regions) that read it."""
        result: dict[Value, list[Node]] = {}
        for node in self.nodes:
            for value in node.inputs:
                result.setdefault(value, []).append(node)
        return result

    def producers(self) -> dict[Value, Node]:
        """Map each value defined by a node of this graph to that node."""
        return {out: node for node in self.nodes for out in node.outputs}

    def replace_uses(self, old: Value, new: Value) -> None:
        """Make every reader of `old` in this graph (and its outputs) read `new` instead."""
        for node in self.nodes:
            node.inputs = [new if v is old else v for v in node.inputs]
        self.outputs = [new if v is old else v for v in self.outputs]

    def count_ops(self, op: str) -> int:
        return sum(1 for node in self.walk() if node.op == op)
