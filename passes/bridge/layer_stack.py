"""A differentiated function split at its layer stack: what runs before the layers, the
layers' scan, and what follows them up to the loss.

A model whose layers are a scan over stacked weights (`jax.lax.scan`, flax's `nn.scan`,
NNX's scanned layers, MaxText's decoder) has one `scan` equation in its jaxpr whose length
is the layer count and whose scanned inputs are the weights. Pipelining splits that stack
over the stages; the equations before it (the embedding) and after it (the head and the
loss) stay whole. Nothing here changes how the user wrote the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from xla_strategies.passes.bridge import jax_compat
from xla_strategies.passes.bridge.boundary_stack import split_at_boundaries
from xla_strategies.passes.bridge.cast_reads import read_as
from xla_strategies.passes.bridge.jaxpr_eval import CALLS, evaluate
from xla_strategies.passes.bridge.output_reductions import reductions
from xla_strategies.passes.bridge.pipeline_boundary import boundary_p
from xla_strategies.passes.bridge.stack_parts import (
    LayerStack,
    NothingToPipeline,
    depending,
    function_of,
    head_parts,
    input_indices,
    reached_from,
)

__all__ = ["LayerStack", "NothingToPipeline", "split"]


# Collectives across the replicas, which the stage program (the differentiated function
# run one microbatch and one stage at a time) does not run
_COLLECTIVES = frozenset(
    {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_to_all", "ppermute",
     "reduce_scatter"}
)  # fmt: skip


def split(fun: Callable[..., Any], args: Sequence[Any], divisor: int) -> LayerStack:
    """`fun(*args)` (flat arrays in, flat arrays out) split at its `xs.pipeline_boundary`
    marks where it has any, else at its longest layer scan whose length `divisor` divides.
    Raises `NothingToPipeline` naming what it found instead."""
    closed = jax.make_jaxpr(fun)(*args)
    jaxpr, consts = jax_compat.jaxpr_parts(closed)
    jaxpr, consts = _inlined(jaxpr, consts, args)
    _refuse_collectives(jaxpr)
    # what the function reads from its closure becomes its first inputs
    jaxpr = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
    marks = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is boundary_p]
    reduced_by = reductions(jaxpr)
    if marks:
        return dataclasses.replace(
            split_at_boundaries(jaxpr, consts, marks, divisor), reductions=reduced_by
        )
    scans = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"]
    usable = [i for i in scans if _is_layer_stack(jaxpr.eqns[i], divisor)]
    if not usable:
        found = [int(jaxpr.eqns[i].params["length"]) for i in scans]
        raise NothingToPipeline(
            f"found no layer scan to split into {divisor} stage chunks: pipelining needs the "
            "layers as one scan over stacked weights (jax.lax.scan, flax nn.scan, NNX's "
            "scanned layers) whose length is a multiple of pipeline_stages x virtual_stages"
            + (f"; the scans found have lengths {found}" if found else "; there is none")
        )
    at = max(usable, key=lambda i: _xs_bytes(jaxpr.eqns[i]))
    return dataclasses.replace(_split_at(jaxpr, consts, at), reductions=reduced_by)


def _refuse_collectives(jaxpr: jex.Jaxpr) -> None:
    """Name a collective across the replicas in the differentiated function, which JAX
    would refuse deep in the stage program ("psum is a variant->invariant collective")."""
    for eqn in jax_compat.equations(jaxpr):
        if eqn.primitive.name in _COLLECTIVES:
            axes = eqn.params.get("axes", eqn.params.get("axis_name"))
            raise ValueError(
                f"the function differentiated over pipeline stages calls "
                f"{eqn.primitive.name} over {axes!r}: the stages run it one microbatch at a "
                "time, in a program that runs no collective across the replicas. Reduce "
                "after jax.grad instead (lax.pmean of the loss and gradients, as pmap code "
                "does), or leave it out: the strategy averages the gradients itself"
            )


def _is_layer_stack(eqn: jex.JaxprEqn, divisor: int) -> bool:
    params = eqn.params
    num_consts, num_carry = jax_compat.scan_counts(params)
    xs = eqn.invars[num_consts + num_carry :]
    return (
        not params["reverse"]
        and int(params["length"]) % divisor == 0
        and bool(xs)
        and any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in xs)
    )


def _xs_bytes(eqn: jex.JaxprEqn) -> int:
    num_consts, num_carry = jax_compat.scan_counts(eqn.params)
    return sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars[num_consts + num_carry :])


def _split_at(jaxpr: jex.Jaxpr, consts: Sequence[Any], at: int) -> LayerStack:
    scan = jaxpr.eqns[at]
    num_consts, num_carry = jax_compat.scan_counts(scan.params)
    used_after = {v for e in jaxpr.eqns[at + 1 :] for v in e.invars if isinstance(v, jex.Var)}
    used_after |= {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
    _refuse_per_layer_outputs(jaxpr, at, used_after)
    carry_out = scan.outvars[:num_carry]
    defined_before = set(jaxpr.invars) | set(jaxpr.constvars)
    defined_before |= {v for e in jaxpr.eqns[:at] for v in e.outvars}
    kept = [v for v in dict.fromkeys(used_after) if v in defined_before]
    scan_in = list(scan.invars)
    head = jaxpr.eqns[:at]
    before = function_of(jaxpr, head, jaxpr.invars, scan_in + kept)
    body = scan.params["jaxpr"]
    inner = jax_compat.jaxpr_parts(body)[0]
    after, apart, outputs_apart = head_parts(jaxpr, jaxpr.eqns[at + 1 :], carry_out, kept)

    def grouped(values: list) -> tuple[list, list, list, list]:
        """`before`'s outputs (or one flag per output) as (carry, consts, xs, kept)."""
        ins, rest = values[: len(scan_in)], values[len(scan_in) :]
        carry_end = num_consts + num_carry
        return ins[num_consts:carry_end], ins[:num_consts], ins[carry_end:], rest

    def split_before(*args: Any) -> tuple[list, list, list, list]:
        return grouped(before(*args))

    def layer(x: list, carry: list, scan_consts: list) -> list:
        inner, inner_consts = jax_compat.jaxpr_parts(body)
        return evaluate(inner, inner_consts, [*scan_consts, *carry, *x])[:num_carry]

    def depends(inputs: Sequence[bool]) -> tuple[list, list, list, list]:
        """Which of `before`'s outputs depend on the inputs flagged in `inputs`."""
        return grouped(depending(jaxpr, head, inputs, scan_in + kept))

    return LayerStack(
        split_before,
        layer,
        lambda c, k: after(*c, *k),
        int(scan.params["length"]),
        tuple(consts),
        depends,
        tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.outvars),
        input_indices(jaxpr, scan.invars[num_consts + num_carry :]),
        apart,
        outputs_apart,
        tuple(read_as(inner, v) for v in inner.invars[num_consts + num_carry :]),
        input_indices(jaxpr, kept),
    )


def _refuse_per_layer_outputs(jaxpr: jex.Jaxpr, at: int, used_after: set) -> None:
    """Refuse per-layer outputs of the layer scan at `at` (its ys) the stages cannot run,
    named for what they are: read by the loss, or returned state computed from the
    activations (BatchNorm's statistics). State the layers update apart from their
    activations (a flax NNX `Dropout`'s RNG count in each layer) is computed outside the
    stages (`stack_parts.head_parts`), where no output the activations reach reads it."""
    scan = jaxpr.eqns[at]
    num_consts, num_carry = jax_compat.scan_counts(scan.params)
    ys = scan.outvars[num_carry:]
    used = [v in used_after for v in ys]
    if not any(used):
        return
    after = jaxpr.eqns[at + 1 :]
    from_ys = reached_from({v for v, u in zip(ys, used, strict=True) if u}, after)
    if jaxpr.outvars[0] in from_ys:
        raise NothingToPipeline(
            "the loss reads per-layer outputs of the layer scan (its ys: a loss each layer "
            "adds, a mixture of experts' balancing loss); pipelining splits a scan that only "
            "carries its activations"
        )
    body = jax_compat.jaxpr_parts(scan.params["jaxpr"])[0]
    carried = [num_consts <= k < num_consts + num_carry for k in range(len(body.invars))]
    from_activations = depending(body, body.eqns, carried, body.outvars[num_carry:])
    from_layers = reached_from(set(scan.outvars[:num_carry]), after)
    mixed = any(v in from_ys and v in from_layers for v in jaxpr.outvars)
    if mixed or any(u and a for u, a in zip(used, from_activations, strict=True)):
        raise NothingToPipeline(
            "each layer returns state computed from its activations (BatchNorm's running "
            "statistics, a metric per layer), which the step returns; pipeline stages run "
            "layers that return only their activations"
        )


def _inlined(
    jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any]
) -> tuple[jex.Jaxpr, list]:
    """`jaxpr` traced again with its nested calls (`jit`) run inline, so a scan a model
    wraps in a `jit` is found at the top level."""
    if not any(e.primitive.name in CALLS for e in jaxpr.eqns):
        return jaxpr, list(consts)
    return jax_compat.jaxpr_parts(jax.make_jaxpr(lambda *a: evaluate(jaxpr, consts, a))(*args))
