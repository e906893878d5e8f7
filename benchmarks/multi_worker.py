"""Multi-worker benchmark: a flat all-reduce over all 8 replicas against the hierarchical
decomposition (reduce-scatter inside each process, all-reduce of the shard across processes,
all-gather inside), 2 processes x 4 emulated devices over gloo on loopback, side by side.

`--fit` fits the cost model's `cpu-gloo` profile (tpu_configs/cpu-gloo.toml) from the
measurements; the table then shows what the default pipeline chooses at each size, and
what the same pipeline chooses on a TPU and a GPU topology.
Run: `python -m benchmarks.multi_worker [--fit]`. Writes results/multi_worker.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tests.multiprocess import check, run_workers

RESULTS = Path(__file__).parent / "results"
SIZES = [1 << 20, 8 << 20, 32 << 20, 128 << 20]  # bytes per replica; 169 MB in total


def fit(results: dict[str, dict]) -> dict[str, float]:
    """The profile from the two curves. Flat over 8 gloo ranks: t = 6a + 1.75 n / b (a
    tree's latency, a ring's bandwidth). Hierarchical: reduce-scatter and all-gather inside a
    host at a fraction e of b, plus the shard's all-reduce across hosts:
    t = 6a_local + 2a + (1.5 / e + 0.25) n / b. Both levels share b: both are gloo on TCP."""
    n = np.array([int(k) for k in results], dtype=float)
    flat = np.array([r["flat"] for r in results.values()])
    hier = np.array([r["hierarchical"] for r in results.values()])
    slope_flat, intercept_flat = np.polyfit(n, flat, 1)
    slope_hier, intercept_hier = np.polyfit(n, hier, 1)
    bandwidth = 1.75 / slope_flat
    latency = max(intercept_flat / 6, 1e-6)
    efficiency = min(1.0, 1.5 / max(slope_hier * bandwidth - 0.25, 1e-9))
    local_latency = max((intercept_hier - 2 * latency) / 6, 1e-6)
    return {
        "bandwidth": bandwidth,
        "latency": latency,
        "local_latency": local_latency,
        "scatter_efficiency": efficiency,
    }


def write_profile(profile: dict[str, float]) -> None:
    """Rewrite the fitted numbers in tpu_configs/cpu-gloo.toml, keeping its header and sources."""
    path = Path(__file__).parents[1] / "tpu_configs" / "cpu-gloo.toml"
    text = path.read_text()
    head = text[: text.index("scatter_efficiency = ")]
    sources = text[text.index("[sources]") :]
    body = (
        f"scatter_efficiency = {profile['scatter_efficiency']:.3g}\n\n"
        "[local]\n"
        f"bandwidth_bytes_per_s_per_device = {profile['bandwidth']:.4g}\n"
        f"latency_s = {profile['local_latency']:.4g}\n\n"
        "[network]\n"
        f"bandwidth_bytes_per_s_per_device = {profile['bandwidth']:.4g}\n"
        f"latency_s = {profile['latency']:.4g}\n\n"
    )
    path.write_text(head + body + sources)


def choices_elsewhere(nbytes: int) -> dict[str, str]:
    from xla_strategies.hardware.topology import Topology
    from xla_strategies.passes.cost import model as cost_model

    return {
        name: cost_model.best_algorithm(
            "all_reduce", nbytes, Topology.from_name(name).axis_links()
        )[0]
        for name in ("2xv5p-512", "4xdgx-h100")
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fit", action="store_true", help="refit tpu_configs/cpu-gloo.toml")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = ",".join(str(s) for s in SIZES)
    workers = run_workers(["benchmarks/multi_worker_run.py", sizes, str(args.repeats)], timeout=900)
    check(workers)
    line = next(line for line in workers[0].lines if line.startswith("RESULT "))
    results = json.loads(line[len("RESULT ") :])
    summary = {"sizes": results}
    if args.fit:
        summary["fitted_profile"] = fit(results)
        write_profile(summary["fitted_profile"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "multi_worker.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"{'MB/replica':>10} {'flat s':>8} {'hier. s':>8} {'hier/flat':>9} {'chosen':>13} "
        f"{'chosen s':>9} {'vs best':>8}  on 2xv5p-512 / 4xdgx-h100"
    )
    for size, r in results.items():
        best = min(r["flat"], r["hierarchical"])
        elsewhere = choices_elsewhere(int(size))
        print(
            f"{int(size) / 2**20:>10.0f} {r['flat']:>8.3f} {r['hierarchical']:>8.3f} "
            f"{r['hierarchical'] / r['flat']:>9.2f} {r['chosen_algorithm']:>13} "
            f"{r['chosen']:>9.3f} "
            f"{r['chosen'] / best:>8.2f}  {elsewhere['2xv5p-512']} / {elsewhere['4xdgx-h100']}"
        )


if __name__ == "__main__":
    main()
