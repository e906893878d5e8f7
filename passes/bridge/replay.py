"""Replaying a foreign node: its captured JAX equation bound again, in its captured
context moved to the mesh being lowered to, with the user's source line kept for XLA's
metadata and a re-typed result's shape passed where the op table says."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding

from xla_strategies.passes.ir.graph import Node
from xla_strategies.passes.ir.traits import result_shape_param


class LoweringError(RuntimeError):
    """The graph cannot be turned into a JAX program."""


def bind_foreign(node: Node, args: list[Any]) -> list[Any]:
    if node.payload is None:
        raise LoweringError(
            f"cannot lower foreign node {node.op}: it has no captured JAX equation "
            "(graphs parsed from text can be optimised and printed, not run)"
        )
    eqn = node.payload
    with _user_source(eqn), equation_context(eqn.ctx) as params:
        bound = _resized(node, params(eqn.params))
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(bound))
    return list(out) if eqn.primitive.multiple_results else [out]


def _resized(node: Node, params: dict) -> dict:
    """A pass may give a foreign node other shapes than it was captured with (one replica's
    block of an elementwise update); the parameter the op table declares names its result's
    shape then gets the node's, and a gather's slice sizes its attributes'."""
    if "slice_sizes" in params and tuple(node.attrs["slice_sizes"]) != params["slice_sizes"]:
        # a gather run on a block takes the block's size of a dimension it took whole
        params = {**params, "slice_sizes": tuple(node.attrs["slice_sizes"])}
    name = result_shape_param(node.op)
    if name is None or tuple(params[name]) == node.outputs[0].shape:
        return params
    return {**params, name: node.outputs[0].shape}


def _user_source(eqn: Any) -> Any:
    """The user's source line and name stack for what `eqn` lowers to, as
    `jax.core.eval_jaxpr` keeps them, so XLA's HLO metadata names the user's code."""
    from jax._src import source_info_util

    info = eqn.source_info
    name_stack = source_info_util.current_name_stack() + info.name_stack
    return source_info_util.user_context(info.traceback, name_stack=name_stack)


@contextlib.contextmanager
def equation_context(ctx: Any) -> Iterator[Callable[[dict], dict]]:
    """The captured equation's context, moved to the mesh being lowered to, and a function
    that moves its parameters' shardings there too. A step compiled with `axis_name=` was
    traced on a mesh of that name, and its equations remember it. Inside the fully manual
    `shard_map` body a sharding's spec names no mesh axis, so only its mesh changes."""
    from jax._src import mesh as mesh_lib

    current = mesh_lib.get_abstract_mesh()
    if ctx.cur_abstract_mesh == current:
        with ctx.manager:
            yield lambda params: params
        return

    def move(params: dict) -> dict:
        return {
            k: NamedSharding(current, v.spec)
            if isinstance(v, NamedSharding) and _abstract(v.mesh) == ctx.cur_abstract_mesh
            else _on_current_mesh(v)
            for k, v in params.items()
        }

    # the captured context, then the current mesh over it (JaxprEqnContext's constructor
    # takes other fields in each JAX release, so no moved copy of it is built)
    with ctx.manager, jax.sharding.use_abstract_mesh(current):
        yield move


def _abstract(mesh: Any) -> Any:
    """A sharding's mesh as a trace's context names it: a library handed the step's mesh
    (`ReplicaContext.mesh`) builds its shardings on the concrete one."""
    return mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh


def _on_current_mesh(value: Any) -> Any:
    """A parameter that is an abstract value (a Pallas call's `out_avals`), or a tuple of
    them, retyped on the mesh being lowered to: the captured one names the trace's mesh
    and its varying axes, and under `check_vma=False` the types are ours."""
    if type(value) is tuple:  # not a named tuple of other parameters
        return tuple(_on_current_mesh(v) for v in value)
    if type(value) is not jax.core.ShapedArray:
        return value
    return jax.core.ShapedArray(
        value.shape, value.dtype, value.weak_type, memory_space=value.memory_space
    )


def recompute_inputs(args: list[Any], prevent_cse: Any) -> list[Any]:
    """The inputs of a differentiated remat region (the backward pass's recomputation) as
    JAX lowers them: those `prevent_cse` flags (one bool, or one per input) through an
    optimization barrier, so XLA does not merge the recomputation with the forward pass
    or move it where its inputs are first ready (`ad_checkpoint._remat_lowering`)."""
    if isinstance(prevent_cse, list | tuple):
        # operands a pass gave the region after the captured ones (a gather moved out of
        # it, `prefetch_all_gathers`) go through the barrier too
        flags = [*prevent_cse, *[True] * (len(args) - len(prevent_cse))][: len(args)]
    else:
        flags = [prevent_cse] * len(args)
    held = [a for a, f in zip(args, flags, strict=True) if f]
    if not held:
        return list(args)
    barred = iter(jax.lax.optimization_barrier(tuple(held)))
    return [next(barred) if f else a for a, f in zip(args, flags, strict=True)]
