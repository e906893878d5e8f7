"""What every pass is: a frozen dataclass with a kebab-case `name` and a `run` method."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from xla_strategies.passes.ir.graph import Graph

if TYPE_CHECKING:
    from xla_strategies.passes.cost.topology_like import TopologyLike


@dataclass
class PassContext:
    """What passes may read besides the graph.

    Attributes:
        mesh_axes: mesh axis name -> size, in mesh order.
        topology: the strategy's topology, when it is known (used by the cost model).
        synchronous_collectives: whether collectives run as synchronous copies that
            nothing overlaps (emulated devices sharing one host's cores). Without a
            topology and without this, the hardware is simply unknown.
        devices_per_replica: the devices one replica spans (the model axis's size, which
            `mesh_axes` leaves out: passes only ever reduce over replica axes).
        parameters_split: set by `shard-parameters`: the step holds its parameters split
            between steps and gathers them where used. Later passes and the strategy's
            choice of XLA options read it.
        stats: diagnostics for the dump, keyed by pass name: counters, timings and the
            decisions passes took. Nothing decides by reading it; a fact a later pass
            needs is a typed field above.
        remarks: human-readable notes passes leave for the dump (why a rewrite did not fire).
        platform: the platform of the devices the program is compiled for (`tpu`, `gpu`,
            `cpu`: a `jax.Device`'s).
    """

    mesh_axes: Mapping[str, int]
    topology: TopologyLike | None = None
    synchronous_collectives: bool = False
    devices_per_replica: int = 1
    parameters_split: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    remarks: list[str] = field(default_factory=list)
    platform: str = "cpu"

    @property
    def num_replicas(self) -> int:
        total = 1
        for size in self.mesh_axes.values():
            total *= size
        return total


#: The values of an `on|auto` pass's `mode` option.
MODES = ("on", "auto")


@dataclass(frozen=True)
class Pass:
    """Base of all passes. Subclasses are `@dataclass(frozen=True)`; fields are options.

    `run(graph, ctx)` rewrites `graph` in place and returns whether it changed anything.
    `written_options` names the options a spec string wrote (even at their default): a
    field, so copies (`dataclasses.replace`) keep it; it is not an option itself.
    """

    name: ClassVar[str] = ""
    written_options: frozenset[str] | None = field(
        default=None, kw_only=True, compare=False, repr=False
    )

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        raise NotImplementedError

    @classmethod
    def option_fields(cls) -> list[dataclasses.Field]:
        """The dataclass fields that are options."""
        return [f for f in dataclasses.fields(cls) if f.name != "written_options"]

    @classmethod
    def option_names(cls) -> dict[str, str]:
        """Spec-string option name (kebab-case) -> dataclass field name."""
        return {f.name.replace("_", "-"): f.name for f in cls.option_fields()}

    def set_options(self) -> frozenset[str]:
        """The options this pass was given, as field names: those a spec string wrote
        (even at their default), else those that differ from their defaults."""
        if self.written_options is not None:
            return self.written_options
        return frozenset(f.name for f in self.option_fields() if getattr(self, f.name) != f.default)

    def spec(self) -> str:
        """This pass as it is written in a pipeline spec, options included."""
        options = [
            f"{f.name.replace('_', '-')}={_format_option(getattr(self, f.name))}"
            for f in self.option_fields()
            if getattr(self, f.name) != f.default
        ]
        return f"{self.name}{{{' '.join(options)}}}" if options else self.name


@dataclass(frozen=True)
class ModePass(Pass):
    """A pass with one option, `mode`: one of `MODES` (``on``: always; ``auto``: where the
    pass decides it pays). A subclass with another default declares `mode` again."""

    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"{self.name}: mode must be one of {MODES}, got {self.mode!r}")

    def stays_off(self, ctx: PassContext, stats: dict[str, Any], why: str) -> bool:
        """What the pass does where `mode=auto` keeps it off: records its `stats` and a
        remark saying `why` and how to turn it on, and returns False (nothing changed),
        for `run` to return."""
        ctx.stats[self.name] = stats
        ctx.remarks.append(f"{self.name}{{mode=auto}}: off: {why}; mode=on turns it on")
        return False


class Instrument:
    """Hooks around each pass of a pipeline (`PassPipeline.instruments`): a timer, the IR
    dumper and printer, the collective ledger. All methods are optional."""

    def before_pipeline(self, graph: Graph, ctx: PassContext) -> None: ...

    def after_pass(
        self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool, seconds: float
    ) -> None: ...


def _format_option(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
