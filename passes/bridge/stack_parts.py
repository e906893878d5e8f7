"""What a differentiated function split at its layers is (`LayerStack`), shared by the
two ways of finding the layers: one scan over stacked weights (`layer_stack`), or the
equations between `xs.pipeline_boundary` marks (`boundary_stack`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jex

from xla_strategies.passes.bridge.jaxpr_eval import evaluate


class NothingToPipeline(ValueError):
    """The function has no layer stack the stages can split."""


@dataclass(frozen=True)
class LayerStack:
    """`fun` as `before`, its `length` alike layers, and `after`.

    Each function of the function's inputs takes them as `[*closed_over, *args]`: the
    values it reads from its closure first, explicitly (a batch read from the closure is
    one of them). `before(*inputs) -> (carry, consts, xs, kept)`: flat lists;
    `layer(x, carry, consts)` runs one layer on its `x` (its weights: a row of `xs`);
    `after(carry, kept) -> outputs` (the loss first)."""

    before: Callable[..., tuple[list, list, list, list]]
    layer: Callable[[list, list, list], list]
    after: Callable[[list, list], list]
    length: int
    closed_over: tuple[Any, ...]  # values the function reads from its closure: inputs first
    depends: Callable[[Sequence[bool]], tuple[list, list, list, list]]
    outputs: tuple[jax.ShapeDtypeStruct, ...]  # the function's (the loss first)
    xs_inputs: tuple[int | None, ...]  # per scanned input, the input it is, if one
    #: per scanned input, the narrower float type a layer reads it as, if it only ever
    #: reads it as one (`cast_reads.read_as`); empty: none known
    xs_read_as: tuple[Any, ...] = ()
    #: per value the head reads from before the layers (`kept`), the input it is, if one
    kept_inputs: tuple[int | None, ...] = ()
    #: per output of the function (the loss first), the input it is, if one: flax NNX's
    #: gradients return the model's state so, beside the loss
    outputs_inputs: tuple[int | None, ...] = ()


#: equations whose output is their input's value, laid out another way (flax's own
#: constraint on an annotated parameter, where it is read)
_SAME_VALUE = ("sharding_constraint",)


def input_indices(jaxpr: jex.Jaxpr, values: Sequence[Any]) -> tuple[int | None, ...]:
    """Per value of `values`, the input of `jaxpr` it is, if one: itself, or through a
    sharding constraint."""
    same_as = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name in _SAME_VALUE}

    def index(v: Any) -> int | None:
        while v not in jaxpr.invars and v in same_as:
            v = same_as[v]
        return jaxpr.invars.index(v) if v in jaxpr.invars else None

    return tuple(index(v) for v in values)


def function_of(jaxpr: jex.Jaxpr, eqns: list, invars: list, outvars: list) -> Callable[..., list]:
    """The equations `eqns` of `jaxpr` (which has no constants) as a function of `invars`
    returning `outvars`."""
    inputs = [v for v in invars if isinstance(v, jex.Var)]
    part = jaxpr.replace(invars=inputs, outvars=outvars, eqns=eqns)
    return lambda *args: evaluate(part, (), args)


def depending(jaxpr: jex.Jaxpr, eqns: list, inputs: Sequence[bool], values: list) -> list[bool]:
    """Which of `values` (computed by `eqns` from `jaxpr`'s inputs) depend on the inputs
    flagged in `inputs`."""
    flagged = {v for v, f in zip(jaxpr.invars, inputs, strict=True) if f}
    for eqn in eqns:
        if any(isinstance(v, jex.Var) and v in flagged for v in eqn.invars):
            flagged.update(eqn.outvars)
    return [isinstance(v, jex.Var) and v in flagged for v in values]
