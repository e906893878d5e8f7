"""What a step's captured graph declares at its edges, and the mesh it is traced on.

- `capture_mesh`: with `compile(axis_name=...)`, one replica axis of the user's name over
  all the strategy's replicas (and the model axis, if any, as it is);
- `declare_interface`: per output its name, the state it updates (donated in place), the
  model dimension it keeps, whether it is declared mirrored or aggregated; per input its
  model dimension. The verifier checks these after capture and after every pass;
- `hold_split_over_stages`: a pipeline's stacked layer weights held split over the stages.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_strategies.core.layout import Layout
from xla_strategies.passes.bridge.layouts import mark_model_dims, replica_spec
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.step.arguments import Signature
from xla_strategies.step.outputs import Outputs
from xla_strategies.step.state import DeclaredState, declared_outputs, state_pairs

if TYPE_CHECKING:
    from xla_strategies.step.step_strategy import StepStrategy


def capture_mesh(
    strategy: StepStrategy, axis_name: str | None
) -> tuple[Mesh, dict[str, tuple[str, ...]]]:
    """The mesh a step is traced on, and how its axis names map to the strategy's."""
    mesh, replicas = strategy.mesh, strategy.replica_axes
    if axis_name is None or replicas == (axis_name,):
        return mesh, {}
    names = list(mesh.axis_names)
    others = [a for a in names if a not in replicas]  # the stage and model axes, or none
    order = [names.index(a) for a in (*replicas, *others)]
    devices = mesh.devices.transpose(order).reshape(
        strategy.num_replicas_in_sync, *[mesh.shape[a] for a in others]
    )
    return Mesh(devices, (axis_name, *others)), {axis_name: replicas}


def hold_split_over_stages(graph: Graph, arrays: Sequence[Any], stacked: Sequence[Any]) -> None:
    """Mark the inputs a pipeline's layer scan took as its stacked weights (`stacked`: the
    traced `arrays` themselves) held split over the stage axis between steps, each stage
    its layers, with the state of their shape (optimizer moments) and the outputs that are
    their next values. A layout only: the graph sees them whole."""
    taken = {id(value) for value in stacked}
    weights = [i for i, a in enumerate(arrays) if id(a) in taken]
    shapes = {(graph.inputs[i].shape, graph.inputs[i].dtype) for i in weights}
    io = graph.io
    state = {out.state_of for out in io.outputs if out.state_of is not None}
    for i, (value, attrs) in enumerate(zip(graph.inputs, io.inputs, strict=True)):
        mirrored = not value.varying_axes and not attrs.stacked and attrs.sharded is None
        like_weight = i in state and (value.shape, value.dtype) in shapes
        attrs.stage_split = mirrored and (i in weights or like_weight)
    for out in io.outputs:
        if out.state_of is not None and io.inputs[out.state_of].stage_split:
            out.stage_split = True


def traced_arguments(specs: Sequence[Any], mesh: Mesh) -> list[jax.ShapeDtypeStruct]:
    """The abstract arguments a step is traced with on `mesh`: per-replica ones split over
    its replica axes, mirrored ones whole."""
    split = replica_spec(mesh)
    return [
        jax.ShapeDtypeStruct(
            spec.shape,
            spec.dtype,
            sharding=NamedSharding(
                mesh, PartitionSpec() if spec.layout is Layout.MIRRORED else split
            ),
            weak_type=spec.weak_type,
        )
        for spec in specs
    ]


def declare_interface(
    graph: Graph,
    signature: Signature,
    outputs: Outputs,
    declared_state: DeclaredState,
    mirrored_outputs: Any,
    name: str,
) -> None:
    """Write what the step declares onto `graph`'s inputs and outputs."""
    io = graph.io
    for attrs, output_name in zip(io.outputs, outputs.names, strict=True):
        attrs.name = output_name  # known once the step has been traced
    for attrs, spec in zip(io.inputs, signature.arrays, strict=True):
        attrs.model_dim = spec.model_dim
    mark_model_dims(graph)
    state = state_pairs(declared_state, signature, outputs, graph)
    for out, arg in state.outputs.items():
        io.outputs[out].state_of = arg
        io.outputs[out].model_dim = io.inputs[arg].model_dim  # held as it came
    for arg in state.donated:
        io.inputs[arg].donated = True
    if state.unreturned:
        warnings.warn(
            f"{name}: donated {', '.join(state.unreturned)}, but no output has "
            "its structure, shapes and dtypes, so nothing can reuse its buffers and it "
            "is not donated",
            stacklevel=5,
        )
    if mirrored_outputs is not None:
        for index, op in declared_outputs(mirrored_outputs, outputs).items():
            io.outputs[index].mirrored = op is None
            io.outputs[index].aggregation = op
    in_place = io.outputs[len(io.outputs) - len(outputs.written) :]
    for attrs, leaf in zip(in_place, outputs.written, strict=True):
        attrs.mirrored = True  # in-place state: the same everywhere, or an error
        attrs.model_dim = getattr(signature.leaves[leaf], "model_dim", None)
