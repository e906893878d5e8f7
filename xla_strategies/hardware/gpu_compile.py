"""XLA's GPU compiler on a machine without GPUs: the devices it describes for a GPU
topology, so a step lowers and compiles for real GPU nodes, as libtpu does for TPU slices.

`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` takes
the GPU's target config (`tpu_configs/<hardware>.target_config.txtpb`, with its source) and
a topology string, slices x hosts per slice x GPUs per host: `"1x2x8"` is two 8-GPU nodes.
The CUDA plugin comes with `pip install 'xla-strategies[gpu]'`; it registers only where its
CUDA version check passes or is skipped, which `accelerator_plugins` arranges on machines
without a GPU.
"""

from __future__ import annotations

import importlib.util
from importlib import resources
from typing import Any

from xla_strategies.hardware.topology import Topology, hardware_config

#: JAX's CUDA plugins (the `[gpu]` extra installs the CUDA 12 one)
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def target_config(hardware: str) -> str:
    """The text of `tpu_configs/<hardware>.target_config.txtpb`."""
    path = resources.files("xla_strategies.tpu_configs") / f"{hardware}.target_config.txtpb"
    if not path.is_file():
        raise ValueError(
            f"no GPU target config for {hardware!r}: XLA's GPU compiler needs "
            f"tpu_configs/{hardware}.target_config.txtpb to compile for it without the GPU"
        )
    return path.read_text()


def compile_only_gpus(topology: Topology) -> list[Any]:
    """The GPUs XLA's GPU compiler describes for `topology` (`"dgx-h100"`, `"2xdgx-h100"`),
    node by node: their `process_index` is the node."""
    config = hardware_config(topology.hardware)
    if config["kind"] != "gpu":
        raise ValueError(
            f"{topology.name} is not a GPU topology (its hardware is {config['kind']})"
        )
    if all(_find_spec(plugin) is None for plugin in CUDA_PLUGINS):
        raise ImportError(
            f"compiling for {topology.name} without its GPUs needs XLA's GPU compiler, which "
            "JAX's CUDA plugin provides: pip install 'xla-strategies[gpu]'"
        )
    from jax.experimental import topologies

    nodes = topology.mesh_axes.get("host", 1)
    shape = f"1x{nodes}x{config['gpus_per_host']}"
    try:
        description = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(topology.hardware), topology=shape
        )
    except NotImplementedError as exc:
        raise RuntimeError(
            f"JAX's CUDA plugin is installed but not registered, so XLA's GPU compiler cannot "
            f"compile for {topology.name}. On a machine without a GPU it registers only when "
            "its CUDA check is skipped: import xla_strategies before JAX starts its backends, "
            "or set JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) before starting"
        ) from exc
    return sorted(description.devices, key=lambda d: (d.process_index, d.id))


def _find_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
