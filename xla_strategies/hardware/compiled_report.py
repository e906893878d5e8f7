"""What XLA's compiled program says about a step: memory per chip, the collectives it kept
(`hlo_collectives`: with their bytes, replica groups and XLA's algorithm), and the compute
it scheduled behind each asynchronous one.

The numbers come from the executable (`memory_analysis()`, its scheduled HLO text), not
from our cost model. Where an estimate is needed, it is labelled: communication time from
the topology's cost model, compute time from the HLO's own instructions as a roofline
(`hlo_roofline`: each one's matmul flops at the chip's peak or its device-memory bytes at
the memory's bandwidth, every loop body once per trip), and the share of that compute XLA
scheduled behind each asynchronous collective from XLA's own per-op cycle estimates. One reader for
every program: a step compiled here and any HLO text (a peer's dump) are read alike.
`cost_analysis()` is not used: it counts a loop body once, and scaling it per trip by XLA's
cycle estimates gave BERT-large 23.7 ms of compute on v5e-256 where its matmuls take 54.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from xla_strategies.core.layout import MODEL_AXIS, STAGE_AXIS
from xla_strategies.hardware.calibration import Calibration, uncalibrated
from xla_strategies.hardware.hlo import HloReadError
from xla_strategies.hardware.hlo_collectives import Collective, collectives, total_cycles
from xla_strategies.hardware.hlo_flops import hlo_flops, matmul_seconds, opaque_kernel_calls
from xla_strategies.hardware.hlo_roofline import (
    overlapped_seconds,
    roofline_seconds,
    roofline_step,
)
from xla_strategies.passes.cost import model as cost_model

if TYPE_CHECKING:
    from xla_strategies.hardware.topology import Topology


@dataclass(frozen=True)
class Memory:
    """Per-chip bytes from XLA's memory analysis."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int

    @property
    def total_bytes(self) -> int:
        """What the chip holds at the program's peak: arguments, outputs not aliased to
        them, temporaries and the program itself (XLA's own out-of-memory sum)."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.generated_code_bytes
        )

    @classmethod
    def of(cls, stats: Any) -> Memory:
        return cls(
            stats.argument_size_in_bytes,
            stats.output_size_in_bytes,
            stats.temp_size_in_bytes,
            stats.alias_size_in_bytes,
            stats.generated_code_size_in_bytes,
        )


@dataclass
class CompiledReport:
    """A compiled step, as XLA compiled it for the strategy's devices."""

    platform: str
    topology: str | None
    hbm_bytes: int | None
    memory: Memory | None  # None: read from HLO text alone, without the executable
    flops: float | None  # the HLO's matmul flops per step
    collectives: list[Collective]
    compile_seconds: float
    estimate: dict[str, float | None] = field(default_factory=dict)
    #: the HLO's matmul flops by element type (each type has its own peak)
    flops_by_dtype: dict[str, float] | None = None
    #: calls per step of compiled kernels (Pallas) whose flops the HLO does not show: the
    #: compute estimate leaves them out
    opaque_kernels: int = 0
    #: what the estimate was fitted to and its error band, or that it is uncalibrated
    calibration: str = ""
    #: the compiler that compiled it: JAX's, jaxlib's and libtpu's releases, and the XLA
    #: options given to the compile (baked into the executable)
    compiler: dict[str, Any] = field(default_factory=dict)

    def bytes_per_step(self, synchronous_only: bool = False) -> int:
        """The bytes the collectives move per step (loop bodies once per trip); only
        those XLA left synchronous, nothing scheduled beside them, with
        `synchronous_only`."""
        return sum(
            c.times * c.nbytes
            for c in self.collectives
            if not (synchronous_only and c.asynchronous)
        )

    @property
    def fits(self) -> bool | None:
        if self.hbm_bytes is None or self.memory is None:
            return None
        return self.memory.total_bytes <= self.hbm_bytes

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.memory is not None:
            data["memory"]["total_bytes"] = self.memory.total_bytes
        data["fits"] = self.fits
        return data


def compiled_report(
    compiled: Any, strategy: Any, options: Mapping[str, Any] | None = None
) -> CompiledReport:
    """Read a step compiled for `strategy`'s devices: what `hlo_report` reads from its HLO
    text (the one reader every program is measured by), its memory from the executable,
    and the compiler's releases with the XLA `options` it was given."""
    text = compiled.as_text()
    per_replica = getattr(strategy, "logical_devices_per_replica", 1)
    report = hlo_report(text, strategy.topology, per_replica)
    report.platform = strategy.devices[0].platform
    report.memory = Memory.of(compiled.memory_analysis())
    report.compile_seconds = float(getattr(compiled, "compile_seconds", 0.0))
    report.compiler = compiler_versions(options)
    return report


def compiler_versions(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The releases that compile here (libtpu's where installed) and the XLA `options` a
    compile was given, as a report records them."""
    from importlib import metadata

    found: dict[str, Any] = {}
    for package in ("jax", "jaxlib", "libtpu", "libtpu-nightly"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    found["options"] = {k: options[k] for k in sorted(options or {})}
    return found


def hlo_report(
    hlo_text: str, topology: Topology | None, devices_per_replica: int = 1
) -> CompiledReport:
    """Read a program from its compiled HLO text alone (ours, `jax.jit`'s, MaxText's dump):
    its collectives and their communication on `topology`, and its compute from the HLO's
    instructions (`hlo_roofline`; its matmul flops, `hlo_flops`, apart), every loop body
    once per trip, with the kernel calls whose flops the text does not show counted apart.
    Memory needs the executable, so it is None."""
    by_dtype = dict(hlo_flops(hlo_text))
    report = CompiledReport(
        platform=topology.hardware if topology else "unknown",
        topology=topology.name if topology else None,
        hbm_bytes=topology.hbm_bytes if topology else None,
        memory=None,
        flops=sum(by_dtype.values()),
        collectives=collectives(hlo_text, devices_per_replica),
        compile_seconds=0.0,
        flops_by_dtype=by_dtype,
        opaque_kernels=opaque_kernel_calls(hlo_text),
    )
    compute = roofline_seconds(hlo_text, topology)
    report.estimate = step_estimate(report, topology, total_cycles(hlo_text), compute, hlo_text)
    report.calibration = calibration_label(topology)
    return report


def calibration_label(topology: Topology | None) -> str:
    """What an estimate on `topology` was fitted to, or that it is uncalibrated."""
    if topology is None:
        return "no topology: communication and the step are not estimated"
    calibration = topology.calibration
    return calibration.describe() if calibration else uncalibrated(topology.hardware)


def step_estimate(
    report: CompiledReport,
    topology: Topology | None,
    cycles: int,
    compute: float | None = None,
    hlo_text: str | None = None,
) -> dict[str, float | None]:
    """Seconds per step: compute by the HLO's roofline (`compute`, `hlo_roofline`: each
    instruction's matmul flops at peak or its device-memory bytes at the memory's
    bandwidth, whichever is longer), or where the topology knows no memory bandwidth the
    matmul flops at each element type's peak alone (`matmul_s`, always given; it counts
    what remat computes again, so it is not the model's flops of MFU); communication from
    the topology's cost model per collective XLA kept; exposed communication from XLA's
    schedule (an asynchronous collective hides behind the compute scheduled between its
    start and done: its share of the step's compute by XLA's cycle estimates, or where the
    program has none, as XLA:GPU's, that compute's roofline seconds read from `hlo_text`).
    None where the topology does not know a rate.

    With the program's `hlo_text`, a conditional (a pipeline's tick) adds the branch whose
    compute and exposed communication together are the longest: every stage runs one
    branch a tick and the tick waits for the slowest. Without it, every branch's
    collectives are counted (`Collective.times`: a bound)."""
    matmul = matmul_seconds(report.flops_by_dtype or {}, topology)
    compute = matmul if compute is None else compute
    if topology is None:
        return {
            "compute_s": compute,
            "matmul_s": matmul,
            "communication_s": None,
            "exposed_s": None,
            "step_s": None,
        }
    # the share of the compute beside an asynchronous collective that measured steps hide
    hides = (topology.calibration or Calibration()).hidden_fraction
    overlapped: dict[tuple[str, str], float] = {}
    if not cycles and hlo_text is not None and compute is not None:
        overlapped = overlapped_seconds(hlo_text, report.collectives, topology)
    per_run: dict[str, Counter[str]] = {}  # each computation's collectives, one run of it
    communication = exposed = 0.0
    for c in report.collectives:
        seconds = collective_seconds(c, topology)
        hidden = 0.0
        if c.asynchronous and compute is not None and cycles:
            hidden = compute * c.overlapped_cycles / cycles * hides
        elif c.asynchronous:
            hidden = overlapped.get((c.computation, c.name), 0.0) * hides
        run = per_run.setdefault(c.computation, Counter())
        run["communication"] += seconds
        run["exposed"] += max(0.0, seconds - hidden)
        communication += c.times * seconds
        exposed += c.times * max(0.0, seconds - hidden)
    if hlo_text is not None and compute is not None:
        taken, totals = roofline_step(
            hlo_text,
            topology,
            beside=lambda name: per_run.get(name, Counter()),
            rank=lambda c: c["serial"] + c["exposed"],
        )
        if taken is not None:
            compute, communication = taken, totals["communication"]
            exposed = totals["exposed"]
    step = None if compute is None else compute + exposed
    return {
        "compute_s": compute,
        "matmul_s": matmul,
        "communication_s": communication,
        "exposed_s": exposed,
        "step_s": step,
    }


_COST_OP = {
    "all-reduce": "all_reduce",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
}


def collective_seconds(c: Collective, topology: Topology) -> float:
    """The cost model's time for `c` over the fastest axes that hold its group: the model
    axis for a collective inside a replica, the replica axes for the others (and then the
    model axis, for a group of every device of several replicas: MaxText's tensor-parallel
    programs have them), and the slices' DCN for a collective across them."""
    op = _COST_OP.get(c.kind, "all_gather")  # a permute: one pass of the bytes
    whole = c.nbytes * (c.group_size if c.kind == "reduce-scatter" else 1)
    if c.across_slices:
        return _dcn_seconds(c, topology, op, whole)
    if c.group_size <= 1:
        return 0.0
    axes, size = [], 1
    model = [a for a in topology.axes if a.name == MODEL_AXIS]
    # slowest first: the stage axis sits where the mesh puts it, but is cut from the slices
    replicas = sorted(
        (a for a in topology.axes if a.name != MODEL_AXIS), key=lambda a: a.name != STAGE_AXIS
    )
    links = model if c.inside_replica else model + replicas  # the model axis taken last
    for link in reversed(links):  # fastest (ICI minor) first
        if size >= c.group_size:
            break
        axes.append(link.name)
        size *= link.size
    if size < c.group_size:  # priced on fewer devices than it spans, it would look cheap
        held = "its model axis holds" if c.inside_replica else "it has"
        raise HloReadError(
            f"{c.name}: a group of {c.group_size} devices, but {held} {size}: read this "
            f"program with the topology it was compiled for, not {topology.name}"
        )
    # XLA's own algorithm for the group: the cost model's `flat` (on a TPU slice, its
    # multi-dimensional torus algorithm), not the best of the algorithms passes choose from
    return topology.collective_time(op, whole, tuple(axes), algorithm="flat")


def _dcn_seconds(c: Collective, topology: Topology, op: str, whole: int) -> float:
    """A cross-slice collective over DCN, among as many slices as its group holds."""
    if "dcn" not in topology.mesh_axes:
        raise HloReadError(
            f"{c.name} is a collective across {c.group_size} slices, but {topology.name} is "
            "one slice: read this program with its multislice topology (e.g. 2xv5p-512)"
        )
    (link,) = topology.axis_links(("dcn",))
    among = dataclasses.replace(link, size=c.group_size)
    return cost_model.collective_time(op, whole, [among], algorithm="flat")
