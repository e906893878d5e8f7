"""Op traits: what passes, the verifier and the walkers may know about an op.

Passes never match op names of a frontend. Each op's traits are declared once: the IR's own
ops below, a frontend's ops where that frontend maps its primitives to IR ops
(`passes/bridge/ops.py` for JAX). MLIR's op traits are the model.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Trait(enum.Enum):
    COLLECTIVE = "collective"  # communicates across replicas over its `axes`
    REDUCES = "reduces"  # a collective that combines replicas' values (`reduce_op`)
    ELEMENTWISE = "elementwise"
    LINEAR = "linear"  # unary, linear, per replica: commutes with a cross-replica sum
    SCALING = "scaling"  # binary, linear in one operand when the other is replica-invariant
    DIVIDING = "dividing"  # like SCALING for the dividend only, and not for integers
    ADDING = "adding"  # the sum of its operands
    COUNTED_LOOP = "counted-loop"  # one region run `length` times: consts, carries, xs
    WHILE_LOOP = "while-loop"  # regions (condition, body) run an unknown number of times
    CALL_ONCE = "call-once"  # one region run once on the operands (rematerialisation)
    BRANCHES = "branches"  # operand 0 picks one of the regions, run on the rest
    CONTRACTION = "contraction"  # a matmul: costs 2 x output x contracted size flops
    # a convolution of operand 0 by the kernel, operand 1 (XLA's, with its attributes:
    # `dimension_numbers` as (operand, kernel, output) specs of (batch or output feature,
    # feature, spatial...), `window_strides`, `padding`, `lhs_dilation`, `rhs_dilation`):
    # each output element sums the kernel's input features over its window's taps
    CONVOLUTION = "convolution"
    SIDE_EFFECT = "side-effect"
    # reduces its operand over the dimensions in its `axes` attribute, combining elements
    # as `dimension_reduction(op)` says (sum, max, min)
    DIMENSION_REDUCTION = "dimension-reduction"
    # places its operand's dimensions at `broadcast_dimensions` of a result of `shape`
    BROADCAST_IN_DIM = "broadcast-in-dim"
    RESHAPE = "reshape"  # the same elements in row-major order, in its result's shape
    TRANSPOSE = "transpose"  # its operand's dimensions in the order of its `permutation`
    # a collective whose result every replica of its axes (`axes` or `axis_name`) holds
    # alike, whatever its type says (an all-gather)
    GATHERS = "gathers"
    # XLA's gather: slices of operand 0 (a table) at the indices of operand 1, as its
    # `dimension_numbers` (offset, collapsed, start index map, batching dims) and
    # `slice_sizes` say; the index vector is the indices' last dimension
    LOOKUP = "lookup"
    # XLA's scatter with addition: operand 2's windows added into operand 0 at the indices
    # of operand 1, as its `dimension_numbers` (update windows, inserted, scatter dims to
    # operand dims, batching dims) say; a lookup's transpose
    SCATTER_ADD = "scatter-add"
    # elementwise, unary: each element of its result is its operand's element in the type
    # its result has (a dtype conversion)
    CAST = "cast"


_TRAITS: dict[str, frozenset[Trait]] = {}
_COMBINERS: dict[str, str] = {}


def declare(op: str, *traits: Trait) -> None:
    """Declare `op`'s traits; an op is declared once."""
    if op in _TRAITS and _TRAITS[op] != frozenset(traits):
        raise ValueError(f"op {op!r} is already declared with other traits")
    _TRAITS[op] = frozenset(traits)


def declare_all(ops: Iterable[str], *traits: Trait) -> None:
    for op in ops:
        declare(op, *traits)


def traits_of(op: str) -> frozenset[Trait]:
    """The declared traits of `op`; none for an op nobody declared (opaque)."""
    return _TRAITS.get(op, frozenset())


def declare_dimension_reduction(op: str, combiner: str, *traits: Trait) -> None:
    """Declare `op` a reduction over dimensions that combines elements with `combiner`
    (`sum`, `max` or `min`), so a pass can finish a partial one with that all-reduce."""
    declare(op, Trait.DIMENSION_REDUCTION, *traits)
    _COMBINERS[op] = combiner


def dimension_reduction(op: str) -> str:
    """How a DIMENSION_REDUCTION op combines elements: `sum`, `max` or `min`."""
    return _COMBINERS[op]


_RESULT_SHAPE_PARAMS: dict[str, str] = {}


def declare_result_shape_param(op: str, param: str) -> None:
    """Declare that `op`'s frontend parameter `param` names its result's shape, so a pass
    may re-type the result (run the op on one replica's block) and the lowering passes the
    node's shape there."""
    _RESULT_SHAPE_PARAMS[op] = param


def result_shape_param(op: str) -> str | None:
    """The frontend parameter that names `op`'s result shape, if it has one."""
    return _RESULT_SHAPE_PARAMS.get(op)


def is_declared(op: str) -> bool:
    return op in _TRAITS


#: Traits of an op that holds nested regions (a loop, a call, branches).
REGION_TRAITS = frozenset({Trait.COUNTED_LOOP, Trait.WHILE_LOOP, Trait.CALL_ONCE, Trait.BRANCHES})

# The IR's own ops.
declare_all(("all_reduce", "reduce_to_one"), Trait.COLLECTIVE, Trait.REDUCES)
declare("reduce_scatter", Trait.COLLECTIVE, Trait.REDUCES)
declare("all_gather", Trait.COLLECTIVE, Trait.GATHERS)
declare_all(("all_to_all", "collective_permute", "broadcast"), Trait.COLLECTIVE)
declare("reshape", Trait.LINEAR, Trait.RESHAPE)
declare("transpose", Trait.LINEAR, Trait.TRANSPOSE)
declare("scale", Trait.LINEAR, Trait.ELEMENTWISE)
declare("add", Trait.ADDING, Trait.ELEMENTWISE)
declare("convert", Trait.ELEMENTWISE)
declare_all(("concatenate", "slice", "constant", "pvary", "axis_index"))
# a varying-typed value proven the same on every replica, typed invariant: pvary's inverse
declare("pinvariant")
# this replica's block of a mirrored value along `dimension`: all_gather's inverse, no traffic
declare("replica_slice")
# operand 0 plus operand 2 where `dimension` equals operand 1 (a scatter-add of one element
# per row, as a compare and a select); `index_dims` / `update_dims` place operands 1 and 2
declare("one_hot_add")
# operand 0, once the other operands are made: an order XLA's scheduler must keep. Alone,
# operand 0 made whole where it is made: XLA fuses nothing across it
declare("after")
