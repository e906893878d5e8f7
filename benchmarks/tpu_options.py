"""XLA options for a TPU generation, measured with and without: one `tpu_aot` cell compiled
once per option set, every compile read by the same HLO text reader (`hlo_report`), memory
from the executable. The strategy's own generation options are left out
(`generation_compiler_options=False`), so each set is measured against XLA's defaults.

The sets are MaxText's recipe flags (`benchmarks/xla_flags_library.py` in its repository),
split where its groups mix several mechanisms. What wins goes in `tpu_configs/`.

    python -m benchmarks.tpu_options --model llama2-7b --topology v5e-256 --variant d \\
        --sets none cf-all-reduce [--hlo-dir DIR]

With `--sets none` alone it is the one-reader row of a cell (ours), as the README's
tables against MaxText quote it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.results_rows import merge_rows
from benchmarks.tpu_aot import TENSOR_PARALLEL, _our_step, compile_only_strategy
from benchmarks.tpu_models import WORKLOADS
from xla_strategies.hardware.compiled_report import Memory, hlo_report

RESULTS = Path(__file__).parent / "results" / "tpu_options.json"
# XLA's partitioner writes a matmul beside an all-gather or reduce-scatter over the model
# axis as a windowed einsum (a ring of collective-permutes); these turn it off
_NO_WINDOWED_EINSUM_AG = {"xla_tpu_enable_windowed_einsum_for_all_gather": False}
_NO_WINDOWED_EINSUM_RS = {"xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}
SETS: dict[str, dict[str, Any]] = {
    "none": {},
    # continuation fusion of all-gathers (v5e only: libtpu refuses it elsewhere)
    "cf-all-gather": {
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
        "xla_enable_async_all_gather": True,
    },
    # continuation fusion of all-reduces (v5e only)
    "cf-all-reduce": {
        "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
        "xla_enable_async_all_reduce": True,
    },
    # continuation fusion of reduce-scatters (v5e only)
    "cf-reduce-scatter": {
        "xla_enable_async_reduce_scatter_fusion": True,
        "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter": True,
    },
    "async-all-gather": {"xla_enable_async_all_gather": True},
    "async-all-reduce": {"xla_enable_async_all_reduce": True},
    "ag-backward-pipelining": {"xla_tpu_enable_ag_backward_pipelining": True},
    "async-all-to-all": {"xla_tpu_enable_async_all_to_all": True},
    # the overlap half of MaxText's CF_FOR_ALL_GATHER, without the fusion v5p refuses
    "overlap-collectives": {
        "xla_tpu_enable_async_collective_fusion": True,
        "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
        "xla_tpu_overlap_compute_collective_tc": True,
    },
    # the latency-hiding scheduler's settings of MaxText's HOST_OFFLOAD_FLAGS
    "scheduler": {
        "xla_tpu_enable_all_experimental_scheduler_features": True,
        "xla_tpu_enable_scheduler_memory_pressure_tracking": True,
        "xla_tpu_aggressive_opt_barrier_removal": "ENABLED",
        "xla_lhs_prioritize_async_depth_over_stall": "ENABLED",
        "xla_should_allow_loop_variant_parameter_in_chain": "ENABLED",
        "xla_should_add_loop_invariant_op_in_chain": "ENABLED",
        "xla_tpu_scheduler_percent_shared_memory_limit": 100,
        "xla_latency_hiding_scheduler_rerun": 2,
    },
    "data-parallel-overlap": {
        "xla_tpu_enable_data_parallel_all_reduce_opt": True,
        "xla_tpu_data_parallel_opt_different_sized_ops": True,
    },
    "no-windowed-einsum": _NO_WINDOWED_EINSUM_AG | _NO_WINDOWED_EINSUM_RS,
    "no-windowed-einsum-ag": _NO_WINDOWED_EINSUM_AG,
    "no-windowed-einsum-rs": _NO_WINDOWED_EINSUM_RS,
}


def measure(
    model: str, topology: str, variant: str, sets: list[str], hlo_dir: Path | None = None
) -> list[dict[str, Any]]:
    """One row per option set; each compiled program's HLO text in `hlo_dir` if given."""
    tensor_parallel = variant == "t"
    per_replica = TENSOR_PARALLEL if tensor_parallel else 1
    strategy = compile_only_strategy(topology, per_replica, tuned=False)
    workload = WORKLOADS[model](tp=True) if tensor_parallel else WORKLOADS[model]()
    step, args = _our_step(strategy, workload, variant)
    lowered = step.lower(*args)
    rows = []
    for name in tqdm(sets, desc="compile", unit="option set"):
        head = {"model": model, "topology": topology, "variant": variant, "set": name}
        try:
            compiled = lowered.compile(compiler_options=SETS[name] or None)
        except Exception as exc:  # libtpu refuses some options on some generations
            rows.append({**head, "error": " ".join(str(exc).split())[:300]})
            tqdm.write(f"{name}: {rows[-1]['error']}")
            continue
        report = hlo_report(compiled.as_text(), strategy.topology, per_replica)
        estimate = report.estimate
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            hlo = hlo_dir / f"{model}-{topology}-{variant}-{name}.hlo.txt"
            hlo.write_text(compiled.as_text())
        rows.append(
            {
                **head,
                "memory_gib": Memory.of(compiled.memory_analysis()).total_bytes / 2**30,
                "collective_gb": report.bytes_per_step() / 1e9,
                "synchronous_gb": report.bytes_per_step(synchronous_only=True) / 1e9,
                "step_ms": 1e3 * estimate["step_s"],
                "exposed_share": estimate["exposed_s"] / estimate["step_s"],
                "compile_s": compiled.compile_seconds,
            }
        )
        tqdm.write(json.dumps(rows[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, choices=list(WORKLOADS))
    parser.add_argument("--topology", required=True)
    parser.add_argument("--variant", default="a", help="a tpu_aot variant of ours: a, b, d, e or t")
    parser.add_argument("--sets", nargs="+", default=["none"], choices=list(SETS))
    parser.add_argument("--hlo-dir", type=Path, help="write each compiled HLO text here")
    args = parser.parse_args()
    rows = measure(args.model, args.topology, args.variant, args.sets, args.hlo_dir)
    merge_rows(RESULTS, rows, lambda r: (r["model"], r["topology"], r["variant"], r["set"]))


if __name__ == "__main__":
    main()
