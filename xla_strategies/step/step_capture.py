"""Capturing a compiled step: the user's per-replica function traced, on the strategy's
capture mesh and in its replica context, into the graph the passes run on.

What the trace sees: the step's arguments rebuilt from flat arrays, one replica's view of
each (a batch's rows, a stacked value's row), `xs.get_replica_context()` (its mesh the
capture mesh, replica axes manual), per-replica random streams, and state the step writes
in place collected as outputs; with pipeline stages, its microbatches and the pipelined
gradients. After it: the step's declared interface on the graph.
"""

from __future__ import annotations

from typing import Any

from xla_strategies.core.context import ReplicaContext, replica_scope
from xla_strategies.core.layout import Layout, replica_axes
from xla_strategies.passes.bridge.capture import capture
from xla_strategies.passes.bridge.pipelined_gradients import pipelining_gradients
from xla_strategies.passes.bridge.remat_policy import given_remat_policy, warn_if_none_given
from xla_strategies.passes.bridge.step_mesh import replica_view
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.step import in_place_state, replica_rng_streams
from xla_strategies.step.arguments import Signature, argument_paths
from xla_strategies.step.dropped_mutations import check_unchanged, snapshot
from xla_strategies.step.outputs import Outputs
from xla_strategies.step.stage_plan import check_pipelined, on_microbatches
from xla_strategies.step.step_interface import (
    capture_mesh,
    declare_interface,
    hold_split_over_stages,
    traced_arguments,
)


def capture_step(compiled: Any, signature: Signature) -> tuple[Graph, Outputs]:
    """The graph of `compiled`'s function (a `CompiledStep`, which imports this module)
    for arguments of `signature`, and how its flat outputs map back to the function's."""
    strategy = compiled.strategy
    mesh, rename = capture_mesh(strategy, compiled.axis_name)
    specs = signature.arrays
    flat_args = traced_arguments(specs, mesh)
    context = ReplicaContext(
        replica_axes(mesh.axis_names), strategy.num_replicas_in_sync, replica_view(mesh)
    )
    outputs = Outputs()

    traced: list[Any] = []

    def step(*arrays: Any) -> list[Any]:
        traced[:] = arrays
        args, kwargs = signature.rebuild(arrays)
        before = snapshot(args, kwargs)
        with replica_scope(strategy, context):
            with (
                replica_rng_streams.drawn_per_replica(args, kwargs, context) as restore,
                in_place_state.scalar_metric_updates() as scalar_updated,
            ):
                result = compiled.fn(*args, **kwargs)
                restore(result)
            written = in_place_state.collect(before, args, kwargs, result, context, scalar_updated)
        check_unchanged(compiled.name, before, args, kwargs, result, written.indices)
        return outputs.split(result, written)

    with (
        pipelining_gradients(compiled.stage_plan) as pipelined,
        given_remat_policy(compiled.options.remat_policy) as remat_blocks,
    ):
        graph = capture(
            on_microbatches(step, compiled.stage_plan, specs, compiled.gradient_reduction),
            flat_args,
            mesh,
            [spec.layout is not Layout.MIRRORED for spec in specs],
            stacked=[spec.layout is Layout.STACKED for spec in specs],
            rename=rename,
            input_names=argument_paths(signature),
            name=compiled.name,
        )
    check_pipelined(compiled.stage_plan, pipelined, compiled.name)
    warn_if_none_given(compiled.options.remat_policy, *remat_blocks(), compiled.name)
    declare_interface(
        graph, signature, outputs, compiled.declared_state, compiled.mirrored_outputs, compiled.name
    )
    hold_split_over_stages(graph, traced, pipelined.stacked)
    return graph, outputs
