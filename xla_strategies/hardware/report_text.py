"""A compiled report (`compiled_report.CompiledReport`) as a few lines for a terminal: what
`xla-strategies aot`, `report` and the dumps' `summary.txt` print."""

from __future__ import annotations

from xla_strategies.hardware.compiled_report import CompiledReport


def summary_text(report: CompiledReport, name: str) -> str:
    """The report as a few lines for a terminal."""
    lines = [f"step {name} on {report.topology or report.platform}", _memory_line(report)]
    across = [c for c in report.collectives if not (c.inside_replica or c.across_slices)]
    inside = [c for c in report.collectives if c.inside_replica]
    slices = [c for c in report.collectives if c.across_slices]
    lines.append(f"  collectives/step  {_by_kind(across)}")
    if slices:
        lines.append(f"  across slices     {_by_kind(slices)} (over DCN, the slices' runtime)")
    if inside:
        lines.append(f"  inside replicas   {_by_kind(inside)} (XLA's partitioner, model axis)")
    asynchronous = [c for c in report.collectives if c.asynchronous]
    if asynchronous:
        hidden = sum(1 for c in asynchronous if c.overlapped_ops)
        lines.append(
            f"  asynchronous      {len(asynchronous)} collective(s), {hidden} with compute "
            "scheduled between start and done"
        )
    est = report.estimate
    if est.get("step_s") is None and est.get("communication_s") is not None:
        lines.append(
            f"  communication     {est['communication_s'] * 1e3:.3f} ms (estimated: the "
            "topology's cost model per collective; the topology knows no peak flops)"
        )
    if est.get("step_s") is not None:
        share = est["exposed_s"] / est["step_s"] if est["step_s"] else 0.0
        ms = {k: (v or 0.0) * 1e3 for k, v in est.items()}
        bound = (
            "the HLO's roofline: matmul flops at peak "
            f"{ms['matmul_s']:.3f} ms, the rest device-memory bytes at its bandwidth"
            if ms["compute_s"] != ms["matmul_s"]
            else "HLO matmul flops at peak"
        )
        lines.append(
            f"  estimated step    {ms['step_s']:.3f} ms: compute {ms['compute_s']:.3f} ms "
            f"({bound}), communication {ms['communication_s']:.3f} ms, exposed "
            f"{ms['exposed_s']:.3f} ms ({share:.1%} of the step)"
        )
    if report.calibration and est.get("communication_s") is not None:
        lines.append(f"  estimate          {report.calibration}")
    if report.compiler:
        releases = ", ".join(f"{k} {v}" for k, v in report.compiler.items() if k != "options")
        options = len(report.compiler.get("options", {}))
        lines.append(f"  compiler          {releases}; {options} XLA option(s) given")
    if report.opaque_kernels:
        lines.append(
            f"  kernels           {report.opaque_kernels} call(s) per step of compiled kernels "
            "(Pallas) that declare no cost (`cost_estimate`), whose flops the HLO does not "
            "show: the compute estimate leaves them out"
        )
    if report.memory is not None:  # read from an executable, not from text
        lines.append(f"  compile time      {report.compile_seconds:.1f} s")
    return "\n".join(lines)


def _by_kind(collectives: list) -> str:
    kinds: dict[str, list[int]] = {}
    for c in collectives:
        count_bytes = kinds.setdefault(c.kind, [0, 0])
        count_bytes[0] += c.times
        count_bytes[1] += c.times * c.nbytes
    return ", ".join(f"{k} x{n} ({b:,} B)" for k, (n, b) in sorted(kinds.items())) or "none"


def _memory_line(report: CompiledReport) -> str:
    gib = 2**30
    memory = report.memory
    if memory is None:
        return (
            "  memory per chip   unknown (read from HLO text; XLA's memory analysis needs "
            "the executable)"
        )
    fits = {True: "fits", False: "DOES NOT FIT", None: "chip memory unknown"}[report.fits]
    hbm = f" of {report.hbm_bytes / gib:.2f} GiB HBM" if report.hbm_bytes else ""
    return (
        f"  memory per chip   {memory.total_bytes / gib:.3f} GiB{hbm} ({fits}): arguments "
        f"{memory.argument_bytes / gib:.3f}, temporaries {memory.temp_bytes / gib:.3f}, outputs "
        f"{memory.output_bytes / gib:.3f}, aliased {memory.alias_bytes / gib:.3f}"
    )
