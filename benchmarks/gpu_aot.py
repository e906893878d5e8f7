"""What XLA's GPU compiler says of real training steps on DGX H100 nodes, compiled on this
machine without a GPU (`MirroredStrategy(topology="dgx-h100", compile_only=True)`,
`MultiWorkerMirroredStrategy(topology="2xdgx-h100", compile_only=True)`; the `[gpu]`
extra's CUDA plugin). The same train steps and summaries as `benchmarks.tpu_aot`:

- (a) ours with the default pipeline; (f) the same without the decomposition of reductions
  across nodes (`decompose-all-reduces`, which MultiWorkerMirroredStrategy adds); (h) the
  same without weight-update sharding (`shard_weight_updates=False`);
- (d) ours with `shard_parameters=True`; (g) the same without the decomposition;
- (c) plain `jax.jit` with `NamedSharding`s on the same GPUs (data parallel, or FSDP
  shardings where that does not fit).

Compute is the HLO roofline (`hardware/hlo_roofline.py`, as on TPU: each instruction's
matmul flops at the GPU's peaks or its device-memory bytes at the memory's bandwidth,
whichever is longer; XLA's GPU executables report no flops); communication is the cost
model's, per collective XLA kept. The GPU rates are fitted to steps measured on one H200
(`tpu_configs/dgx-h200.toml`, `benchmarks.gpu_calibration_fit`): matmuls and memory within
±16 % of measured transformer steps; the links are the datasheet's, never measured.

    python -m benchmarks.gpu_aot                 # every cell below
    python -m benchmarks.gpu_aot --table         # the recorded table, no compiles
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU here: the CUDA plugin only compiles

from benchmarks.tpu_aot import compute_check, measure_cells, record  # noqa: E402
from benchmarks.tpu_table import markdown  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gpu_aot.json"
CELLS = [
    ("gpt2-medium", "dgx-h100", "a"),
    ("gpt2-medium", "dgx-h100", "h"),
    ("gpt2-medium", "dgx-h100", "c"),
    ("gpt2-medium", "2xdgx-h100", "a"),
    ("gpt2-medium", "2xdgx-h100", "f"),
    ("gpt2-medium", "2xdgx-h100", "c"),
    ("llama2-7b", "dgx-h100", "d"),
    ("llama2-7b", "dgx-h100", "c"),
    ("llama2-7b", "2xdgx-h100", "d"),
    ("llama2-7b", "2xdgx-h100", "g"),
    ("llama2-7b", "2xdgx-h100", "c"),
    # models others wrote (`make bench-corpus`)
    ("gpt2-medium-plain", "dgx-h100", "a"),
    ("gpt2-medium-plain", "dgx-h100", "c"),
    ("hf-gpt2-medium", "dgx-h100", "a"),
    ("hf-gpt2-medium", "dgx-h100", "c"),
    ("gpt2-medium-plain", "2xdgx-h100", "a"),
    ("gpt2-medium-plain", "2xdgx-h100", "c"),
    ("hf-gpt2-medium", "2xdgx-h100", "a"),
    ("hf-gpt2-medium", "2xdgx-h100", "c"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", help="only these models' cells")
    parser.add_argument("--table", action="store_true", help="print the recorded table")
    parser.add_argument(
        "--compute-check",
        action="store_true",
        help="only refill the cost model's compute estimate of the recorded cells of ours",
    )
    args = parser.parse_args()
    if args.compute_check:
        compute_check(RESULTS, args.models)
        return
    if args.table:
        print(markdown(json.loads(RESULTS.read_text())["rows"]))
        return
    cells = [c for c in CELLS if not args.models or c[0] in args.models]
    record(measure_cells(cells), RESULTS)


if __name__ == "__main__":
    main()
