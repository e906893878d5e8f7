"""A differentiated function split at its `xs.pipeline_boundary` marks: a model whose
layers are not a scan (a Python loop over blocks, each with its own weights) as the
layer stack pipelining splits over the stages.

The equations between two consecutive boundaries are one layer. Every layer must be the
same operations on values of the same types (the template is the first); what a layer
reads from outside is then, position by position, either the same value in every layer
(a mask, a shared table: the scan's constants) or one value per layer (its weights:
stacked into the scan's `xs`). The equations before the first boundary run on every
stage (the embedding); those after the last on the last stage (the head and the loss).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from xla_strategies.passes.bridge.jaxpr_eval import evaluate
from xla_strategies.passes.bridge.stack_parts import (
    LayerStack,
    NothingToPipeline,
    depending,
    function_of,
    head_parts,
    input_indices,
)


def split_at_boundaries(
    jaxpr: jex.Jaxpr, consts: Sequence[Any], marks: list[int], divisor: int
) -> LayerStack:
    """`jaxpr` (no constants: its closure is its first inputs) split at the boundary
    equations at `marks` into layers, a multiple of `divisor` of them."""
    eqns = jaxpr.eqns
    segments = _layers(eqns, marks, divisor)
    layers, template = len(segments), segments[0]
    defined_before = set(jaxpr.invars) | {v for e in eqns[: marks[0]] for v in e.outvars}
    outside = _outside_reads(segments, defined_before)
    shared = [all(v is values[0] for v in values) for values in outside]
    head = eqns[marks[-1] + 1 :]
    carry_out = list(eqns[marks[-1]].outvars)
    kept = _read_by_the_head(jaxpr, marks, defined_before)
    carry_in = list(eqns[marks[0]].invars)
    consts_in = [values[0] for values, s in zip(outside, shared, strict=True) if s]
    rows_in = [values for values, s in zip(outside, shared, strict=True) if not s]
    flat_rows = [v for values in rows_in for v in values]
    before_part = function_of(
        jaxpr, eqns[: marks[0]], jaxpr.invars, [*carry_in, *consts_in, *flat_rows, *kept]
    )

    def group(values: list, stack: Any) -> tuple[list, list, list, list]:
        at = len(carry_in) + len(consts_in)
        rows = values[at : at + len(flat_rows)]
        xs = [stack(rows[j * layers : (j + 1) * layers]) for j in range(len(rows_in))]
        return (
            values[: len(carry_in)],
            values[len(carry_in) : at],
            xs,
            values[at + len(flat_rows) :],
        )

    def before(*args: Any) -> tuple[list, list, list, list]:
        return group(before_part(*args), jnp.stack)

    body = jaxpr.replace(
        invars=[
            *[v for v, s in zip(template.reads, shared, strict=True) if s],
            *template.carry_in,
            *[v for v, s in zip(template.reads, shared, strict=True) if not s],
        ],
        outvars=template.carry_out,
        eqns=template.eqns,
    )

    def layer(x: list, carry: list, layer_consts: list) -> list:
        return evaluate(body, (), [*layer_consts, *carry, *x])

    after, apart, outputs_apart = head_parts(jaxpr, head, carry_out, kept)

    def depends(inputs: Sequence[bool]) -> tuple[list, list, list, list]:
        flags = depending(
            jaxpr, eqns[: marks[0]], inputs, [*carry_in, *consts_in, *flat_rows, *kept]
        )
        return group(flags, any)

    return LayerStack(
        before,
        layer,
        lambda c, k: after(*c, *k),
        layers,
        tuple(consts),
        depends,
        tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.outvars),
        (None,) * len(rows_in),  # stacked here: no input is a stack
        apart,
        outputs_apart,
        kept_inputs=input_indices(jaxpr, kept),
    )


def _layers(eqns: list, marks: list[int], divisor: int) -> list[_Segment]:
    """The layers between the marks, each checked alike the first."""
    layers = len(marks) - 1
    if layers < 1 or layers % divisor:
        raise NothingToPipeline(
            f"{len(marks)} xs.pipeline_boundary marks enclose {layers} layers; pipelining "
            f"needs a multiple of pipeline_stages x virtual_stages = {divisor}: mark the "
            "input of each layer and the input of the head"
        )
    leaves = sorted({len(eqns[m].invars) for m in marks})
    if len(leaves) > 1:
        raise NothingToPipeline(
            f"the xs.pipeline_boundary marks are given {leaves} arrays: every mark must be "
            "given the same activations (the value a layer passes to the next)"
        )
    segments = [_Segment(eqns, marks[k], marks[k + 1]) for k in range(layers)]
    for k, segment in enumerate(segments[1:], start=1):
        segments[0].match(segment, k)
    return segments


def _outside_reads(segments: list[_Segment], defined_before: set) -> list[list]:
    """Per position of the first layer's reads, every layer's value there: each defined
    before the first mark."""
    outside = [[s.reads[j] for s in segments] for j in range(len(segments[0].reads))]
    if not all(v in defined_before for values in outside for v in values):
        raise NothingToPipeline(
            "a layer between xs.pipeline_boundary marks reads a value another layer "
            "computes: layers may pass on only the value given to the boundary"
        )
    return outside


def _read_by_the_head(jaxpr: jex.Jaxpr, marks: list[int], defined_before: set) -> list:
    """What the equations after the last mark (and the outputs) read from before the
    first, besides the last mark's value; a value a layer computed is refused."""
    eqns = jaxpr.eqns
    inside = {v for e in eqns[marks[0] : marks[-1]] for v in e.outvars}
    read = [v for e in eqns[marks[-1] + 1 :] for v in e.invars if isinstance(v, jex.Var)]
    read += [v for v in jaxpr.outvars if isinstance(v, jex.Var)]
    if any(v in inside for v in read):
        raise NothingToPipeline(
            "what follows the last xs.pipeline_boundary reads a value a layer computed: "
            "the head may read only what the last boundary is given"
        )
    return [v for v in dict.fromkeys(read) if v in defined_before]


class _Segment:
    """The equations between the boundary at `start` and the next one at `end`: what they
    read from outside (`reads`, in order of first reading) besides the boundary's value."""

    def __init__(self, eqns: list, start: int, end: int) -> None:
        self.eqns = eqns[start + 1 : end]
        self.carry_in = list(eqns[start].outvars)
        self.carry_out = list(eqns[end].invars)
        made = set(self.carry_in) | {v for e in self.eqns for v in e.outvars}
        operands = [v for e in self.eqns for v in e.invars] + self.carry_out
        self.reads = [
            v for v in dict.fromkeys(o for o in operands if isinstance(o, jex.Var))
            if v not in made
        ]  # fmt: skip

    def match(self, other: _Segment, index: int) -> None:
        """Raise unless `other` runs the same operations as this one, wired alike, on
        values of the same types (each of its reads where this one has its own)."""
        alike = len(self.eqns) == len(other.eqns) and len(self.reads) == len(other.reads)
        alike = alike and [_type(v) for v in self.reads] == [_type(v) for v in other.reads]
        ours = dict(zip(other.carry_in, self.carry_in, strict=True))
        ours.update(zip(other.reads, self.reads, strict=False))
        for a, b in zip(self.eqns, other.eqns, strict=False):
            alike = alike and _signature(a) == _signature(b) and _wired(a.invars, b.invars, ours)
            ours.update(zip(b.outvars, a.outvars, strict=True))
        if not (alike and _wired(self.carry_out, other.carry_out, ours)):
            raise NothingToPipeline(
                f"the layers between xs.pipeline_boundary marks differ: layer {index} does "
                "not run the operations layer 0 runs, on values of the same shapes; a stage "
                "runs its layers as one stack of alike layers"
            )


def _wired(mine: list, theirs: list, ours: dict) -> bool:
    """Whether operands `theirs` are `mine` under the map of their values to ours."""
    return all(
        isinstance(t, jex.Literal) or ours.get(t) is m for m, t in zip(mine, theirs, strict=True)
    )


def _signature(eqn: jex.JaxprEqn) -> tuple:
    # a parameter that is a function made per call (custom_vjp's `out_trees`) prints its
    # address: the same function for alike layers
    params = sorted((k, _ADDRESS.sub("", str(v))) for k, v in eqn.params.items())
    literals = [str(v.val) if isinstance(v, jex.Literal) else None for v in eqn.invars]
    return (eqn.primitive.name, tuple(params), tuple(map(_type, eqn.invars)), tuple(literals),
            tuple(map(_type, eqn.outvars)))  # fmt: skip


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _type(v: Any) -> tuple:
    return (tuple(v.aval.shape), str(v.aval.dtype))
