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
    #: per output of the function (the loss first), whether the layers do not reach it:
    #: the model state flax NNX's gradients return beside the loss, a dropout stream's
    #: advanced count. `after` returns the others; `outputs_apart(*inputs)` these, in order
    apart: tuple[bool, ...]
    outputs_apart: Callable[..., list]
    #: per scanned input, the narrower float type a layer reads it as, if it only ever
    #: reads it as one (`cast_reads.read_as`); empty: none known
    xs_read_as: tuple[Any, ...] = ()
    #: per value the head reads from before the layers (`kept`), the input it is, if one
    kept_inputs: tuple[int | None, ...] = ()
    #: per output, the reduction of its rows that made it (`output_reductions`); empty:
    #: none known
    reductions: tuple[str | None, ...] = ()

    @property
    def staged_aux(self) -> list[jax.ShapeDtypeStruct]:
        """The auxiliary outputs the layers reach, which `after` returns after the loss."""
        return [o for o, a in zip(self.outputs[1:], self.apart[1:], strict=True) if not a]


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
    flagged = reached_from({v for v, f in zip(jaxpr.invars, inputs, strict=True) if f}, eqns)
    return [isinstance(v, jex.Var) and v in flagged for v in values]


def head_parts(
    jaxpr: jex.Jaxpr, head: list, carry_out: list, kept: list
) -> tuple[Callable[..., list], tuple[bool, ...], Callable[..., list]]:
    """What follows the layers (the equations `head`, reading the layers' output
    `carry_out` and the values `kept` from before them), split in two: `after(*carry_out,
    *kept)`, the outputs of `jaxpr` the layers' activations reach (the loss first,
    always); which outputs they do not reach (`apart`); and a function of `jaxpr`'s inputs
    computing those alone: `jaxpr` without what they do not need (JAX's own dead-code
    elimination, which keeps of the layer scan only what per-layer state they read, an RNG
    count). The stage program runs only the first."""
    reached = reached_from(set(carry_out), head)
    apart = tuple(
        k > 0 and not (isinstance(v, jex.Var) and v in reached) for k, v in enumerate(jaxpr.outvars)
    )
    with_layers = [v for v, a in zip(jaxpr.outvars, apart, strict=True) if not a]
    after = function_of(jaxpr, _needed(head, with_layers), [*carry_out, *kept], with_layers)
    from jax._src.interpreters import partial_eval as pe

    alone, used = pe.dce_jaxpr(jaxpr, list(apart))

    def outputs_apart(*inputs: Any) -> list:
        return evaluate(alone, (), [x for x, u in zip(inputs, used, strict=True) if u])

    return after, apart, outputs_apart


def reached_from(start: set, eqns: list) -> set:
    """`start` and every value `eqns` compute from it."""
    reached = set(start)
    for eqn in eqns:
        if any(isinstance(v, jex.Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return reached


def _needed(eqns: list, values: list) -> list:
    """The equations of `eqns` that `values` need, in order."""
    wanted = {v for v in values if isinstance(v, jex.Var)}
    kept = []
    for eqn in reversed(eqns):
        if any(v in wanted for v in eqn.outvars):
            kept.append(eqn)
            wanted.update(v for v in eqn.invars if isinstance(v, jex.Var))
    return kept[::-1]
