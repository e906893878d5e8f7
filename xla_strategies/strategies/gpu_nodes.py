"""GPU nodes a strategy compiles for without their GPUs (`compile_only=True`): the topology
it was given, or the one `xla-strategies aot --topology` names, checked against the
strategy's shape (one node for MirroredStrategy, nodes for MultiWorkerMirroredStrategy)."""

from __future__ import annotations

from typing import Any

from xla_strategies.hardware.gpu_compile import compile_only_gpus
from xla_strategies.hardware.topology import Topology, aot_topology, hardware_config


def compile_only_nodes(
    strategy: str, topology: Topology | str | None, compile_only: bool, several: bool
) -> tuple[Topology | None, list[Any] | None]:
    """(topology, the GPUs XLA describes for it) when `strategy` compiles only, else
    (None, None). `several`: the strategy spans nodes ("2xdgx-h100"), else one node."""
    aot = aot_topology("gpu")
    if aot is not None and (aot.mesh_axes.get("host", 1) > 1) == several:
        topology, compile_only = aot, True
    if not compile_only:
        if topology is not None:
            raise ValueError(
                f"{strategy}(topology=...) names the GPU nodes to compile for without them: "
                "pass compile_only=True too (on GPUs the topology comes from the devices)"
            )
        return None, None
    if topology is None:
        example = "'2xdgx-h100'" if several else "'dgx-h100'"
        raise ValueError(f"{strategy}(compile_only=True) needs a topology, e.g. {example}")
    if isinstance(topology, str):
        topology = Topology.from_name(topology)
    if hardware_config(topology.hardware)["kind"] != "gpu":
        raise ValueError(
            f"{strategy}(compile_only=True): {topology.name} is not a GPU topology; "
            "compile for a TPU slice with TPUStrategy(topology, compile_only=True)"
        )
    nodes = topology.mesh_axes.get("host", 1)
    if several and nodes < 2:
        raise ValueError(
            f"{strategy}(compile_only=True): {topology.name} is one node; name several, "
            f"e.g. '2x{topology.hardware}', or use MirroredStrategy for one"
        )
    if not several and nodes > 1:
        raise ValueError(
            f"{strategy}(compile_only=True): {topology.name} is {nodes} nodes and "
            "MirroredStrategy runs on one; use MultiWorkerMirroredStrategy for several"
        )
    return topology, compile_only_gpus(topology)
