"""A GPU node file's `[calibration]`, fitted to the steps `benchmarks.gpu_calibration`
measured on a real GPU, and the estimate checked against every measured step:

    python -m benchmarks.gpu_calibration_fit --node dgx-h200

Two fractions of the datasheet rates, each from its own evidence:

- **matmul_fraction** from the kernels: in each traced step, the matmul kernels' measured
  time (XLA's GEMM fusions, matched by name to their HLO instruction, and the library's
  cuBLAS and cuDNN kernels, which are the program's GEMM and convolution custom calls)
  against their flops at the datasheet peak. Transformer steps only: their matmuls are
  large enough to run at the rate a train step's matmuls reach.
- **memory_fraction** from the steps: with the matmul fraction fixed, the one memory
  fraction whose roofline (`roofline_terms`, the reader's per-instruction roofline at
  those fractions) is nearest every fitted step's measured time (the least largest
  relative error). The steps in `FITTED` are fitted; every other transformer step checks
  the fit; the error band is the largest error over both.

Steps the device does not bound are reported, not fitted: in a traced step, the GPU's busy
time (its kernels') against the step. A convolutional net at small batch leaves the GPU
idle most of the step while the host issues its kernels, which a roofline of the device
does not model. Writes `results/gpu_calibration_fit.json` and prints the table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.gpu_calibration import RESULTS
from benchmarks.tpu_calibration_rows import roofline_terms
from xla_strategies.hardware.hlo import computations
from xla_strategies.hardware.hlo_flops import instruction_flops, matmul_seconds
from xla_strategies.hardware.hlo_loops import executions
from xla_strategies.hardware.topology import Topology

HLO_ROOT = RESULTS.parent / "hlo"
FIT = RESULTS.parent / "gpu_calibration_fit.json"
#: the steps the memory fraction is fitted to; every other transformer step checks it
FITTED = ("gpt2-medium@8:ours", "bert-large@8:ours", "gpt2-medium@2:ours", "bert-large@32:ours")
#: workloads whose steps the device bounds (the fit's domain); the others are reported
TRANSFORMERS = ("gpt2-medium", "gpt2-medium-plain", "gpt2-medium-plain-cast", "bert-large")
_TRACED_STEPS = 3  # `benchmarks.gpu_calibration` profiles three steps


def estimate_s(terms: dict[str, Any], topology: Topology, matmul: float, memory: float) -> float:
    """The roofline of a step's `terms` (`roofline_terms` at `topology`'s datasheet rates)
    with the matmul peak and the memory bandwidth scaled by the two fractions."""
    peak, bandwidth = topology.peak_flops * matmul, topology.memory_bandwidth * memory
    return (
        sum(
            m["times"] * max(m["flops_at_bf16_peak"] / peak, m["hbm_bytes"] / bandwidth)
            for m in terms["matmul_instructions"]
        )
        + (terms["other_hbm_bytes"] + terms["async_copy_hbm_bytes"]) / bandwidth
    )


def fit_memory_fraction(
    rows: list[tuple[dict[str, Any], float]], topology: Topology, matmul: float
) -> float:
    """The memory fraction (to 0.005) whose estimates of `rows` ((terms, measured seconds))
    have the least largest relative error, the matmul fraction fixed at `matmul`."""
    grid = [round(0.2 + 0.005 * i, 3) for i in range(161)]  # 0.2 .. 1.0

    def worst(memory: float) -> float:
        return max(abs(math.log(estimate_s(t, topology, matmul, memory) / s)) for t, s in rows)

    return min(grid, key=worst)


def kernel_seconds(xplane: bytes) -> dict[str, float]:
    """Each GPU kernel's device seconds per step, by kernel name, from a profile of
    `_TRACED_STEPS` steps (`jax.profiler`'s serialized XSpace)."""
    from jax.profiler import ProfileData

    found: dict[str, float] = defaultdict(float)
    for plane in ProfileData.from_serialized_xspace(xplane).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                for event in line.events:
                    found[event.name] += event.duration_ns * 1e-9 / _TRACED_STEPS
    return dict(found)


def matmul_kernels(hlo_text: str, kernels: dict[str, float], topology: Topology) -> dict:
    """A traced step's matmul kernels: their flops at the datasheet peak (seconds) and their
    measured seconds. XLA names a kernel after its instruction (`fusion.3` runs as
    `fusion_3`); a library's kernels (cuBLAS, cuDNN) are named by the library, and are the
    program's custom calls."""
    comps, entry = computations(hlo_text)
    at_peak = {"xla": 0.0, "library": 0.0}
    measured = {"xla": 0.0, "library": 0.0}
    named = set()
    for name, times in executions(comps, entry).items():
        types = {op[0]: op[1] for op in comps.get(name, [])}
        for op in comps.get(name, []):
            named.add(op[0])
            seconds = matmul_seconds(instruction_flops(op, comps, types), topology) or 0.0
            if not seconds:
                continue
            where = "library" if op[2] == "custom-call" else "xla"
            at_peak[where] += times * seconds
            if where == "xla":
                measured["xla"] += kernels.get(op[0].replace(".", "_"), 0.0)
    measured["library"] = sum(
        seconds
        for kernel, seconds in kernels.items()
        if re.sub(r"_(\d+)$", r".\1", kernel) not in named and not kernel.startswith("mem")
    )
    return {"flops_at_peak_s": at_peak, "measured_s": measured}


def _runs(results: Path) -> dict[str, list[dict[str, Any]]]:
    """Every measured program, by key: one entry per run that measured it."""
    found: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in json.loads(results.read_text())["runs"]:
        for key, row in run["programs"].items():
            if "error" not in row:
                found[key].append({**row, "hlo_dir": run["hlo_dir"], "traced": run["traced"]})
    return found


def fit(node: str, results: Path, hlo_root: Path) -> dict[str, Any]:
    topology = Topology.from_name(node).at_datasheet_rates()
    steps, matmuls, busy = {}, [], {}
    for key, measured in _runs(results).items():
        last = measured[-1]
        text = gzip.open(hlo_root / last["hlo_dir"] / last["hlo"], "rt").read()
        seconds = sorted(r["median_ms"] / 1e3 for r in measured)
        steps[key] = {"terms": roofline_terms(text, topology), "measured_s": seconds}
        for run in (r for r in measured if r["traced"]):
            xplane = hlo_root / run["hlo_dir"] / run["hlo"].replace(".hlo.txt.gz", ".xplane.pb.gz")
            kernels = kernel_seconds(gzip.open(xplane).read())
            busy[key] = sum(kernels.values()) / (run["median_ms"] / 1e3)
            if key.split("@")[0] in TRANSFORMERS:
                matmuls.append(matmul_kernels(text, kernels, topology))
    at_peak = sum(sum(m["flops_at_peak_s"].values()) for m in matmuls)
    matmul = round(at_peak / sum(sum(m["measured_s"].values()) for m in matmuls), 3)
    median = {k: s["measured_s"][len(s["measured_s"]) // 2] for k, s in steps.items()}
    memory = fit_memory_fraction([(steps[k]["terms"], median[k]) for k in FITTED], topology, matmul)
    rows = {}
    for key, step in steps.items():
        estimate = estimate_s(step["terms"], topology, matmul, memory)
        rows[key] = {
            "role": "fitted" if key in FITTED else
            "checked" if key.split("@")[0] in TRANSFORMERS else "not in the band",
            "measured_ms": [round(1e3 * s, 2) for s in step["measured_s"]],
            "datasheet_estimate_ms": round(1e3 * estimate_s(step["terms"], topology, 1, 1), 2),
            "estimate_ms": round(1e3 * estimate, 2),
            "error": round(estimate / median[key] - 1, 4),
            "gpu_busy_share": round(busy[key], 3) if key in busy else None,
        }  # fmt: skip
    band = max(abs(r["error"]) for r in rows.values() if r["role"] != "not in the band")
    return {"node": node, "matmul_fraction": matmul, "memory_fraction": memory,
            "error_band": round(band, 3), "matmul_kernels": matmuls, "steps": rows}  # fmt: skip


def table(found: dict[str, Any]) -> str:
    lines = [
        "| step | role | measured ms | datasheet roofline ms | calibrated ms | error | GPU busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, row in found["steps"].items():
        busy = "-" if row["gpu_busy_share"] is None else f"{row['gpu_busy_share']:.0%}"
        measured = " / ".join(f"{m:.1f}" for m in row["measured_ms"])
        lines.append(
            f"| {key} | {row['role']} | {measured} | {row['datasheet_estimate_ms']:.1f} | "
            f"{row['estimate_ms']:.1f} | {row['error']:+.1%} | {busy} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--node", default="dgx-h200")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--hlo-root", default=str(HLO_ROOT))
    parser.add_argument("--out", default=str(FIT))
    args = parser.parse_args()
    found = fit(args.node, Path(args.results), Path(args.hlo_root))
    Path(args.out).write_text(json.dumps(found, indent=1) + "\n")
    print(
        f"{args.node}: matmul_fraction {found['matmul_fraction']}, memory_fraction "
        f"{found['memory_fraction']}, error band ±{found['error_band']:.1%}"
    )
    print(table(found))


if __name__ == "__main__":
    main()
