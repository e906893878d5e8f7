"""Preemption-handler benchmark: what `PreemptionCheckpointHandler.run` adds to a step.

With several processes the handler agrees after every step whether any worker was
signalled: one 4-byte all-gather over the cluster. This times an MLP train step (Adam,
2 processes x 4 emulated CPU devices over gloo on loopback) called directly and through the
handler, in alternating blocks; medians of the per-step block means.

Run: `python -m benchmarks.preemption` (or `make bench`). Writes results/preemption.json.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tests.multiprocess import check, run_workers

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    argv = ["benchmarks/preemption_run.py", str(args.blocks), str(args.steps)]
    workers = run_workers(argv, timeout=600)
    check(workers)
    line = re.search(r"^RESULT (.*)$", workers[0].output, re.MULTILINE)
    result = json.loads(line.group(1))
    result["overhead_ms"] = result["handler"] - result["direct"]
    result["ratio"] = result["handler"] / result["direct"]
    print(f"step, called directly       {result['direct']:7.2f} ms")
    print(f"step, through handler.run   {result['handler']:7.2f} ms")
    print(f"added per step              {result['overhead_ms']:+7.2f} ms ({result['ratio']:.2f}x)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "preemption.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
