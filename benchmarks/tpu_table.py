"""The TPU and GPU ahead-of-time tables (`benchmarks.tpu_aot`, `benchmarks.gpu_aot`): a
recorded cell as a line of progress and as rows of `benchmarks/README.md`'s tables."""

from __future__ import annotations

import math
from typing import Any


def row_text(r: dict[str, Any]) -> str:
    head = f"{r['model'] + ' ':<14}{r['topology']:<11}{r['program']:<9}"  # a long name apart
    if "error" in r:
        return head + f"does not fit: {r['error']}"
    return head + (
        f"{r['memory_gib']:>8.2f} GiB {'fits' if r['fits'] else 'OOM':<5}"
        f"{r['collectives']:>6} coll {r['collective_bytes'] / 2**20:>10,.1f} MiB"
        f"{r['step_ms']:>10.2f} ms  exposed {r['exposed_share']:>6.1%}"
        f"{r['compile_s']:>8.1f} s"
    )


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table for benchmarks/README.md."""
    lines = [
        "| model | topology | program | GiB/chip | fits | collectives/step | MiB/step "
        "| synchronous MiB/step | step ms | exposed | MFU | HLO compute ms | HLO matmul ms "
        "| our compute ms | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['topology']} | {r['program']} | - | no | - | - | - | - "
                "| - | - | - | - | - | - |"
            )
            continue
        ours_ms = r.get("our_compute_ms", math.nan)
        matmul = r.get("matmul_ms", r["compute_ms"])  # rows read before the roofline
        waited = r.get("synchronous_bytes")  # rows before 2026-11-26 have none
        # a step with kernels whose flops the HLO does not show: its compute and step leave
        # them out, so its MFU (the model's flops over that step) reads too high
        without_kernels = " †" if r.get("opaque_kernels") else ""
        model = r.get("model_ms")  # rows recorded before 2026-11-27 have none
        mfu = "-" if model is None else f"{model / r['step_ms']:.1%}{without_kernels}"
        lines.append(
            f"| {r['model']} | {r['topology']} | {r['program']} | {r['memory_gib']:.2f} "
            f"| {'yes' if r['fits'] else 'no'} | {r['collectives']} "
            f"| {r['collective_bytes'] / 2**20:,.0f} "
            f"| {'-' if waited is None else f'{waited / 2**20:,.0f}'} "
            f"| {r['step_ms']:.2f}{without_kernels} "
            f"| {r['exposed_share']:.1%} | {mfu} "
            f"| {r['compute_ms']:.2f} | {matmul:.2f} "
            f"| {'-' if math.isnan(ours_ms) else f'{ours_ms:.2f}'} | {r['compile_s']:.0f} |"
        )
    if any(r.get("opaque_kernels") for r in rows):
        lines.append(
            "\n† leaves out the compute of kernels (Pallas) whose flops the HLO does not "
            "show: a step too short, so an MFU too high"
        )
    return "\n".join(lines + estimates(rows))


def estimates(rows: list[dict[str, Any]]) -> list[str]:
    """Per topology, what its rows' step estimate was fitted to and the compiler release
    that compiled them: the lines under a table."""
    seen: dict[str, set[str]] = {}
    for r in rows:
        if "error" not in r:
            said = r.get("calibration") or "recorded before calibration: the datasheet's rates"
            compiler = r.get("compiled_by") or f"libtpu {r.get('libtpu', '-')}"
            seen.setdefault(r["topology"], set()).add(f"{said}; {compiler}")
    lines = [f"- {topology}: {' / '.join(sorted(said))}" for topology, said in seen.items()]
    return ["", "Step estimates, per topology:", *lines] if lines else []
