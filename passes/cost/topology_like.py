"""`TopologyLike`: what the passes and the cost model read of a topology.

`xla_strategies.hardware.topology.Topology` is the one implementation; the passes sit
below it and type it by this Protocol, so they never import it and never probe it with
`getattr`. A pass without a topology (`PassContext.topology is None`: unknown hardware)
takes each field's "unknown" meaning, said where it reads it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from xla_strategies.passes.cost.model import AxisLink


@runtime_checkable
class TopologyLike(Protocol):
    """A topology's links and rates, and the compiler facts measured on its hardware
    (each documented on `Topology`)."""

    name: str
    hardware: str
    axes: tuple[AxisLink, ...]
    memory_bandwidth: float | None
    peak_flops: float | None
    hbm_bytes: int | None
    collective_block_tile: tuple[int, int] | None
    reduce_scatter_over_axes_is_all_reduce: bool
    loop_all_gathers_asynchronous: bool
    bucket_layer_collectives: bool
    tuple_all_reduce_buckets: bool
    flat_buffer_tile: tuple[int, int] | None
    hides_update_traffic: bool
    scatter_adds_as_selects: bool
    reduce_scatters_before_loops: bool

    @property
    def mesh_axes(self) -> dict[str, int]: ...
    @property
    def devices_per_replica(self) -> int: ...

    def axis_links(self, axes: tuple[str, ...] | None = None) -> list[AxisLink]: ...
    def collective_time(
        self, op: str, nbytes: float, axes: tuple[str, ...] | None = None, algorithm: str = "best"
    ) -> float: ...
    def lower_bound(self, op: str, nbytes: float, axes: tuple[str, ...] | None = None) -> float: ...
