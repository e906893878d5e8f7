"""What the compiled step reads of its strategy, beyond `StrategyLike`: the hardware it
compiles for, the pipeline it runs, and where it puts arrays. The `Strategy` base
implements it; the step never imports that class. A strategy declares its changes to the
default pipeline here too (`PipelineChanges`, `Setting`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
from jax.sharding import Mesh, NamedSharding

from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.core.strategy_like import StrategyLike
from xla_strategies.hardware.topology import Topology
from xla_strategies.passes.base import Pass
from xla_strategies.passes.pipeline import PassPipeline


@dataclass(frozen=True)
class PipelineChanges:
    """What a strategy changes in the default pipeline: passes it adds (in place of a pass
    of the same name, else where `PASS_ORDER` puts them) and passes it leaves out."""

    add: tuple[Pass, ...] = ()
    leave_out: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Setting:
    """Options a user-facing setting (`source`, named in conflicts) gives every
    `pass_class` pass of a pipeline, wherever the pipeline came from."""

    pass_class: type[Pass]
    source: str
    options: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class StepStrategy(StrategyLike, Protocol):
    """A strategy as its compiled steps see it."""

    pipeline_label: ClassVar[str]
    shards_weight_updates: ClassVar[bool]
    completes_steps: ClassVar[bool]

    @property
    def topology(self) -> Topology | None: ...
    @property
    def sharded_mesh(self) -> Mesh: ...
    @property
    def devices_share_host_cores(self) -> bool: ...
    @property
    def replica_axes(self) -> tuple[str, ...]: ...

    def model_dim(self, array: Any) -> int | None: ...
    def compiler_options(self, gathers_parameters: bool = False) -> dict[str, Any]: ...
    def split_sharding(self) -> NamedSharding: ...
    def place(self, array: Any, sharding: jax.sharding.Sharding) -> Any: ...
    def root_copy(self, array: jax.Array) -> jax.Array: ...
    def pipeline_changes(self) -> PipelineChanges: ...
    def pipeline_settings(self) -> tuple[Setting, ...]: ...
    def pipeline(
        self, gradient_reduction: ReduceOp | None = None, spec: str | PassPipeline | None = None
    ) -> PassPipeline: ...
    def compile(
        self, fn: Callable[..., Any] | None = None, options: Any = None, **keywords: Any
    ) -> Any: ...
    def plan(self, step: Callable[..., Any], *args: Any, budget: float | None = None) -> Any: ...
    def with_logical_devices_per_replica(self, k: int) -> Any: ...
