"""MaxText's published TPU training rows beside our estimate of the same compiled program:
the rows a TPU generation's hardware model is fitted to (tokens/s per chip, measured).

Each recipe below is MaxText's own, setting for setting, from the commit or tag its
published row names (MaxText's `docs/reference/models/tiering.md`, tokens/s per chip and
MFU; the recipes in MaxText's `benchmarks/maxtext_*_model_configs.py` and the
`tpu-recipes` scripts that run them). Settings that only steer a run and not the program
(dataset path, profiler, tokenizer, metrics upload) are left out. The libtpu flags are the
recipe's flag sets as MaxText's `benchmarks/xla_flags_library.py` defines them, less the
ones libtpu 0.0.50 refuses to compile with on v5p and v6e (continuation fusion: "not
supported/recommended on platforms other than TPU v5e"); each row lists both.

Compile a recipe with MaxText's `train_compile` (`benchmarks/maxtext_aot.py`, in MaxText's
own environment), its HLO kept gzipped in `results/hlo/` beside a note of the compile
(libtpu version, flags, XLA's memory analysis per chip, seconds, peak host memory):

    python3.12 -m venv .venv-maxtext && .venv-maxtext/bin/pip install \\
        "maxtext[tpu]==0.2.5" "jax[tpu]==0.12.0.1" "jaxlib==0.12.0.1"
    python -m benchmarks.tpu_calibration_rows --compile llama3.1-8b-v6e-256
    python -m benchmarks.tpu_calibration_rows --compile llama2-70b-v5p-512 \\
        --memory-limit-gib 16 --timeout-min 40
    python -m benchmarks.tpu_calibration_rows --list          # every recipe's command

Then read every compiled recipe with the project's reader (`hlo_report`) and write
`results/tpu_calibration.json` and the table:

    python -m benchmarks.tpu_calibration_rows

Per row: our estimate (compute, communication, exposed, step) and its tokens/s per chip
(MaxText's count: per_device_batch_size x max_target_length tokens per chip per step)
against the published one; and the terms a fit needs: matmul flops by element type, the
matmul instructions' (flops, device-memory bytes, executions) and every other
instruction's bytes (the roofline's inputs), and communication by kind, with the seconds
XLA's schedule hides behind compute.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xla_strategies.hardware.compiled_report import collective_seconds, hlo_report
from xla_strategies.hardware.hlo import (
    OPERAND,
    computations,
    operand_text,
)
from xla_strategies.hardware.hlo_collectives import total_cycles
from xla_strategies.hardware.hlo_flops import declared_cost, instruction_flops, matmul_seconds
from xla_strategies.hardware.hlo_loops import executions
from xla_strategies.hardware.hlo_roofline import _DMA_DESTINATION, hbm_bytes
from xla_strategies.hardware.topology import Topology

ROOT = Path(__file__).resolve().parent
HLO_DIR = ROOT / "results" / "hlo"
RESULTS = ROOT / "results" / "tpu_calibration.json"
MAXTEXT_PYTHON = ".venv-maxtext/bin/python"

#: MaxText's benchmarks/xla_flags_library.py (its HEAD of 2026-08-22; the recipes' own
#: commits define these sets alike, but for an obfuscated chip-config flag in the
#: SparseCore set that MaxText's later runs remove).
SPARSECORE_BASE = (
    "--xla_tpu_use_tc_device_shape_on_sc=true --xla_sc_enable_instruction_fusion=false"
    " --xla_sc_disjoint_spmem=false --xla_sc_disable_megacore_partitioning=true"
)
FLAG_SETS: dict[str, str] = {
    "DENSE_VMEM_LIMIT_FLAG": "--xla_tpu_scoped_vmem_limit_kib=98304",
    "MOE_VMEM_LIMIT_FLAG": "--xla_tpu_scoped_vmem_limit_kib=81920",
    "CF_FOR_ALL_GATHER": (
        "--xla_tpu_enable_async_collective_fusion=true"
        " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
        " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
        " --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
    ),
    "DATA_PARALLEL_OVERLAP": (
        "--xla_tpu_enable_data_parallel_all_reduce_opt=true"
        " --xla_tpu_data_parallel_opt_different_sized_ops=true"
    ),
    "LAYOUT_FOR_ALL_REDUCE_SCATTER": (
        "--xla_tpu_use_minor_sharding_for_major_trivial_input=true"
        " --xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1"
        " --xla_tpu_assign_all_reduce_scatter_layout=true"
    ),
    "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE": (
        "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false"
        " --xla_tpu_enable_sparse_core_collective_offload_all_reduce=true"
        " --xla_tpu_enable_all_reduce_offload_tracing=true " + SPARSECORE_BASE
    ),
    "HOST_OFFLOAD_FLAGS": (
        "--xla_tpu_enable_all_experimental_scheduler_features=true"
        " --xla_tpu_enable_scheduler_memory_pressure_tracking=true"
        " --xla_tpu_host_transfer_overlap_limit=24"
        " --xla_tpu_aggressive_opt_barrier_removal=ENABLED"
        " --xla_lhs_prioritize_async_depth_over_stall=ENABLED"
        " --xla_tpu_enable_ag_backward_pipelining=true"
        " --xla_should_allow_loop_variant_parameter_in_chain=ENABLED"
        " --xla_should_add_loop_invariant_op_in_chain=ENABLED"
        " --xla_max_concurrent_host_send_recv=100"
        " --xla_tpu_scheduler_percent_shared_memory_limit=100"
        " --xla_latency_hiding_scheduler_rerun=2"
    ),
    # tpu-recipes training/v5p/Mixtral-8X7B-Maxtext/scripts/run_mixtral-8x7b.sh, verbatim
    "MIXTRAL_8X7B_V5P_SCRIPT": (
        "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
        " --xla_tpu_megacore_fusion_allow_ags=false --xla_enable_async_collective_permute=true"
        " --xla_tpu_enable_ag_backward_pipelining=true"
        " --xla_tpu_enable_data_parallel_all_reduce_opt=true"
        " --xla_tpu_data_parallel_opt_different_sized_ops=true"
        " --xla_tpu_enable_async_collective_fusion=true"
        " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
        " --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
        " --xla_tpu_scoped_vmem_limit_kib=81920"
    ),
}
#: Flags libtpu 0.0.50 refuses on v5p and v6e ("Continuation fusion for AllGather is
#: enabled on platform ghostlite ... Please disable it"): left out, and listed per row.
REFUSED = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
)

_OFFLOADED = {p: "offload" for p in ("decoder_layer_input", "query_proj", "key_proj")}
_SPLASH_2048 = {"sa_block_q": 2048, "sa_block_q_dkv": 2048, "sa_block_q_dq": 2048}
_SPLASH_FUSED = {
    **_SPLASH_2048,
    **{f"sa_block_{b}": 2048 for b in ("kv", "kv_compute", "kv_dkv", "kv_dkv_compute", "kv_dq")},
    "sa_use_fused_bwd_kernel": True,
}
_SYNTHETIC = {"use_iota_embed": True, "dataset_type": "synthetic", "enable_checkpointing": False}

_LLAMA2_70B_V5P = {
    "per_device_batch_size": 4, "max_target_length": 4096, "ici_fsdp_parallelism": -1,
    "remat_policy": "save_dot_except_mlpwi", "attention": "autoselected", **_SYNTHETIC,
}  # fmt: skip


@dataclass(frozen=True)
class Recipe:
    """One published row and the MaxText recipe that produced it."""

    name: str
    model: str  # MaxText's model_name
    topology: str  # MaxText's compile_topology, and ours; "2xv6e-256": two slices
    published_tokens_per_s: float  # per chip
    published_mfu: float  # percent
    source: str  # where the recipe and the published row are
    settings: dict[str, Any] = field(default_factory=dict)
    flag_sets: tuple[str, ...] = ()

    @property
    def tokens_per_chip(self) -> float:
        return float(self.settings["per_device_batch_size"]) * self.settings["max_target_length"]

    @property
    def flags(self) -> list[str]:
        return [f for s in self.flag_sets for f in FLAG_SETS[s].split()]

    @property
    def compiled_flags(self) -> list[str]:
        return [f for f in self.flags if f not in REFUSED]


# Smallest first: the order to compile them in on a small machine.
RECIPES = [
    Recipe(
        "llama3.1-8b-v6e-256", "llama3.1-8b", "v6e-256", 7207, 45.46,
        "tiering.md Trillium Gold; tpu-recipes training/trillium/Llama3.1-8B-MaxText/v6e-256 "
        "(MaxText tag tpu-recipes-v0.1.4, llama3_1_8b_8192; log: 4.546 s, 7207.336 tokens/s)",
        {"per_device_batch_size": 4, "max_target_length": 8192, "ici_fsdp_parallelism": -1,
         "remat_policy": "custom", **_OFFLOADED, "value_proj": "offload", "out_proj": "offload",
         "attention": "flash", **_SPLASH_FUSED, **_SYNTHETIC},
        ("DENSE_VMEM_LIMIT_FLAG", "LAYOUT_FOR_ALL_REDUCE_SCATTER", "DATA_PARALLEL_OVERLAP",
         "CF_FOR_ALL_GATHER", "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE", "HOST_OFFLOAD_FLAGS"),
    ),
    Recipe(
        "llama2-70b-v5p-512", "llama2-70b", "v5p-512", 692, 65.4,
        "tiering.md v5p Gold ('512 Chips': slice names count cores, as its Mixtral row's "
        "'256 Chips(8x4x4)'); MaxText 92e59fdf benchmarks/maxtext_v5p_model_configs.py#L156, "
        "llama2_70b_v5p_128",
        _LLAMA2_70B_V5P, ("DATA_PARALLEL_OVERLAP", "CF_FOR_ALL_GATHER"),
    ),
    Recipe(
        "mixtral-8x7b-v5p-256", "mixtral-8x7b", "v5p-256", 2909, 52.56,
        "tiering.md v5p Silver ('256 Chips(8x4x4)'); tpu-recipes "
        "training/v5p/Mixtral-8X7B-Maxtext/scripts/run_mixtral-8x7b.sh",
        {"per_device_batch_size": 36, "max_target_length": 4096, "dtype": "bfloat16",
         "weight_dtype": "bfloat16", "attention": "flash", "dataset_type": "synthetic",
         "enable_checkpointing": False},
        ("MIXTRAL_8X7B_V5P_SCRIPT",),
    ),
    Recipe(
        "llama2-70b-v6e-256", "llama2-70b", "v6e-256", 900, 43.8,
        "tiering.md Trillium Gold; tpu-recipes training/trillium/Llama2-70B-MaxText "
        "(MaxText tag tpu-recipes-v0.1.2, llama2_70b_4096_sc; log: 9.052 s, 905.021 tokens/s)",
        {"per_device_batch_size": 3, "max_target_length": 4096, "ici_fsdp_parallelism": 1,
         "ici_fsdp_transpose_parallelism": -1, "ici_tensor_parallelism": 1,
         "remat_policy": "qkv_proj_offloaded", "attention": "flash", "sa_block_q": 1024,
         "sa_block_q_dkv": 2048, "sa_block_q_dq": 2048, **_SYNTHETIC},
        ("DENSE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER",
         "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE"),
    ),
    Recipe(
        "llama3.1-70b-v6e-256", "llama3.1-70b", "v6e-256", 960, 50.33,
        "tiering.md Trillium Gold; MaxText 92e59fdf "
        "benchmarks/maxtext_trillium_model_configs.py#L959, llama3_1_70b_8192",
        {"per_device_batch_size": 5, "max_target_length": 8192, "ici_fsdp_parallelism": -1,
         "remat_policy": "custom", **_OFFLOADED, "value_proj": "offload", "attention": "flash",
         **_SPLASH_FUSED, **_SYNTHETIC},
        ("DENSE_VMEM_LIMIT_FLAG", "LAYOUT_FOR_ALL_REDUCE_SCATTER", "DATA_PARALLEL_OVERLAP",
         "CF_FOR_ALL_GATHER", "HOST_OFFLOAD_FLAGS"),
    ),
    Recipe(
        "mixtral-8x7b-v6e-256", "mixtral-8x7b", "v6e-256", 3899, 35.23,
        "tiering.md Trillium Silver; tpu-recipes training/trillium/Mixtral-8x7B-MaxText "
        "(MaxText tag tpu-recipes-v0.1.2, mixtral_8x7b_dropped; log: 13.484 s, 3645.203 tokens/s)",
        {"per_device_batch_size": 12, "max_target_length": 4096, "ici_fsdp_parallelism": -1,
         "remat_policy": "custom", **_OFFLOADED, "value_proj": "offload", "out_proj": "offload",
         "attention": "flash", **_SPLASH_2048, "megablox": False, "sparse_matmul": False,
         "capacity_factor": 1.25, **_SYNTHETIC},
        ("MOE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "DATA_PARALLEL_OVERLAP"),
    ),
    Recipe(
        "mixtral-8x22b-v6e-256", "mixtral-8x22b", "v6e-256", 1326, 36.2,
        "tiering.md Trillium Silver; tpu-recipes training/trillium/Mixtral-8x22B-MaxText "
        "(MaxText tag tpu-recipes-v0.1.2, mixtral_8x22b_dropped; log: 24.706 s, 1326.307 tokens/s)",
        {"per_device_batch_size": 8, "max_target_length": 4096, "ici_fsdp_parallelism": 64,
         "ici_expert_parallelism": 4, "remat_policy": "custom", **_OFFLOADED,
         "value_proj": "offload", "out_proj": "offload", "attention": "flash", **_SPLASH_2048,
         "megablox": False, "sparse_matmul": False, "capacity_factor": 1.25,
         "dtype": "bfloat16", "weight_dtype": "bfloat16", "allow_split_physical_axes": True,
         "custom_mesh": "hybrid_ring_64x4", **_SYNTHETIC},
        ("MOE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "DATA_PARALLEL_OVERLAP"),
    ),
    Recipe(
        "llama3.1-405b-2xv6e-256", "llama3.1-405b", "2xv6e-256", 123, 38.55,
        "tiering.md Trillium Silver ('256 Chips'; the recipe's dcn_fsdp_parallelism=2 is two "
        "v6e-256 slices); MaxText 5e6a7caf benchmarks/maxtext_trillium_model_configs.py#L723, "
        "llama3_1_405b_8192_fsdp_dcn",
        {"per_device_batch_size": 1, "max_target_length": 8192, "ici_fsdp_parallelism": 64,
         "ici_tensor_parallelism": 4, "dcn_fsdp_parallelism": 2,
         "allow_split_physical_axes": True, "custom_mesh": "hybrid_ring_64x4",
         "remat_policy": "custom", **_OFFLOADED, "value_proj": "offload", "out_proj": "offload",
         "attention": "flash", "sa_block_q": 1024, "sa_block_q_dkv": 2048, "sa_block_q_dq": 2048,
         **_SYNTHETIC},
        ("DENSE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "HOST_OFFLOAD_FLAGS"),
    ),
    Recipe(  # a check, not a second measurement: the slice the recipe's name gives
        "llama2-70b-v5p-128", "llama2-70b", "v5p-128", 692, 65.4,
        "the llama2-70b-v5p-512 row's published measurement, compiled for the slice its "
        "recipe's name gives (v5p-128, 64 chips): how much the slice size moves the estimate",
        _LLAMA2_70B_V5P, ("DATA_PARALLEL_OVERLAP", "CF_FOR_ALL_GATHER"),
    ),
]  # fmt: skip
BY_NAME = {r.name: r for r in RECIPES}


def hlo_path(recipe: Recipe) -> Path:
    return HLO_DIR / f"maxtext-{recipe.name}.hlo.txt.gz"


def note_path(recipe: Recipe) -> Path:
    return HLO_DIR / f"maxtext-{recipe.name}.compile.json"


def compile_command(recipe: Recipe, out: Path, python: str = MAXTEXT_PYTHON) -> list[str]:
    """MaxText's train_compile of `recipe` (through `benchmarks/maxtext_aot.py`), its HLO
    text written to `out`."""
    settings = [f"{k}={v}" for k, v in recipe.settings.items()]
    return [python, "benchmarks/maxtext_aot.py", str(out), "--model", recipe.model,
            "--topology", recipe.topology, *settings]  # fmt: skip


def compile_env(recipe: Recipe) -> dict[str, str]:
    """The recipe's libtpu flags (MaxText's runner exports them as LIBTPU_INIT_ARGS) and a
    compile on the host's CPU; placeholders for what libtpu asks of a machine with chips."""
    return {
        "LIBTPU_INIT_ARGS": " ".join(recipe.compiled_flags),
        "JAX_PLATFORMS": "cpu",
        "TPU_ACCELERATOR_TYPE": "v5litepod-4",
        "TPU_WORKER_HOSTNAMES": "localhost",
    }


def shell_line(recipe: Recipe) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in compile_env(recipe).items())
    out = f"benchmarks/results/hlo/maxtext-{recipe.name}.hlo.txt"
    return f"{env} {shlex.join(compile_command(recipe, Path(out)))}"


def run_compile(recipe: Recipe, python: str, memory_gib: float, timeout_min: float) -> dict:
    """Compile `recipe` with MaxText, keep its HLO gzipped and a note of the compile."""
    HLO_DIR.mkdir(parents=True, exist_ok=True)
    text = hlo_path(recipe).with_suffix("")  # .hlo.txt
    log = HLO_DIR / f"maxtext-{recipe.name}.log"
    limit = int(memory_gib * 2**30)

    def limited() -> None:  # the child's address space, so it fails rather than swaps
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.monotonic()
    with log.open("w") as out:
        try:
            code = subprocess.run(
                compile_command(recipe, text, python),
                env={**os.environ, **compile_env(recipe)},
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=limited,
                timeout=timeout_min * 60, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.monotonic() - start
    output = log.read_text(errors="replace")
    versions = subprocess.run(
        [python, "-c", "import importlib.metadata as m; "
         "print(*(m.version(p) for p in ('libtpu', 'jax', 'maxtext')))"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    note = {
        "recipe": recipe.name,
        "command": shell_line(recipe),
        "versions": dict(zip(("libtpu", "jax", "maxtext"), versions, strict=False)),
        "compile_seconds": round(seconds, 1),
        "peak_host_rss_gib": round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2
        ),
        "memory_limit_gib": memory_gib,
        "timeout_min": timeout_min,
        "memory": memory_stats(output),
        "status": "ok" if code == 0 and text.exists() else _failure(code, output, timeout_min),
    }
    if text.exists():
        with text.open("rb") as src, gzip.open(hlo_path(recipe), "wb") as dst:
            dst.write(src.read())
        text.unlink()
    note_path(recipe).write_text(json.dumps(note, indent=1) + "\n")
    return note


def _failure(code: int | None, output: str, timeout_min: float) -> str:
    if code is None:
        return f"timeout: not compiled in {timeout_min:g} min"
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith(" ")]
    errors = [ln for ln in lines if re.search(r"Error|error:|RESOURCE_EXHAUSTED|Killed", ln)]
    return f"failed (exit {code}): {(errors or lines or [''])[-1][:400]}"


_STAT = re.compile(r"(\w+_size_in_bytes)=(\d+)")


def memory_stats(output: str) -> dict[str, int]:
    """XLA's memory analysis per chip, as MaxText's train_compile prints it."""
    line = next((ln for ln in output.splitlines() if ln.startswith("Memory analysis:")), "")
    return {k: int(v) for k, v in _STAT.findall(line)}


def device_gib(stats: dict[str, int]) -> float | None:
    """Per-chip bytes (XLA's out-of-memory sum) in GiB."""
    if not stats:
        return None
    held = (
        stats["argument_size_in_bytes"] + stats["output_size_in_bytes"]
        - stats["alias_size_in_bytes"] + stats["temp_size_in_bytes"]
        + stats["generated_code_size_in_bytes"]
    )  # fmt: skip
    return round(held / 2**30, 3)


#: Asynchronous transfers between device memory and the host's (memory space 5: MaxText's
#: offloaded activations, `remat_policy=custom` with `...=offload`).
_HOST_TRANSFERS = ("dynamic-update-slice-start", "dynamic-slice-start", "copy-start")
_SPLASH = re.compile(r"splash_m[hq]a_(fwd|dkv|dq)")
_GROUPED = re.compile(r"^t?gmm\b")  # megablox' grouped matmuls (MoE experts) and transposes
_CONSTRAINED = re.compile(r"operand_layout_constraints=\{(.*?)\}, \w+=")
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]+)\]")
#: Splash attention's matmuls per kernel (each 2 x B x H x S x S x D flops, half of them
#: under a causal mask): forward QK' and PV; dq: QK', dO V', dS K; dkv: QK', dO V', P'dO,
#: dS'Q, and dS K as well when fused (three results).
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def roofline_terms(text: str, topology: Topology) -> dict[str, Any]:
    """The roofline's inputs: each matmul instruction's (flops, device-memory bytes,
    executions per step), grouped where equal; every other instruction's bytes in sum; the
    asynchronous copies' bytes apart, and the host transfers' (which the roofline counts
    as device-memory traffic in line); and the compiled kernels whose flops the HLO does
    not show, by name, with their flops estimated from their shapes (`_kernel_flops`)."""
    comps, entry = computations(text)
    matmuls: Counter[tuple[float, int]] = Counter()
    calls: Counter[str] = Counter()
    kernel_flops: Counter[str] = Counter()
    other = dma = host = 0.0
    for name, times in executions(comps, entry).items():
        ops = comps.get(name, [])
        types = {op[0]: op[1] for op in ops}
        for op in ops:
            nbytes = hbm_bytes(op, comps, types)
            if op[2] in _HOST_TRANSFERS and "S(5)" in op[1]:
                host += times * nbytes
                continue
            if op[2] in _DMA_DESTINATION:
                dma += times * nbytes
                continue
            if (
                declared_cost(op[2], op[3]) is None
                and 'custom_call_target="tpu_custom_call"' in op[3]
            ):
                kernel = re.sub(r"\.\d+$", "", op[0])
                calls[kernel] += times
                kernel_flops[kernel] += times * _kernel_flops(op, types)
            seconds = matmul_seconds(instruction_flops(op, comps, types), topology) or 0.0
            if seconds:
                matmuls[(seconds, nbytes)] += times
            else:
                other += times * nbytes
    peak = topology.peak_flops or 0.0
    return {
        "matmul_instructions": [
            {"flops_at_bf16_peak": s * peak, "hbm_bytes": b, "times": n}
            for (s, b), n in sorted(matmuls.items(), key=lambda kv: -kv[0][0] * kv[1])
        ],
        "matmul_hbm_bytes": sum(b * n for (_, b), n in matmuls.items()),
        "other_hbm_bytes": other,
        "async_copy_hbm_bytes": dma,
        "host_transfer_bytes": host,
        "hbm_bytes": sum(b * n for (_, b), n in matmuls.items()) + other + dma + host,
        "opaque_kernels": {k: {"calls": n, "flops": kernel_flops[k]} for k, n in calls.items()},
        "opaque_kernel_flops": sum(kernel_flops.values()),
    }


def _kernel_flops(op: tuple[str, str, str, str], types: dict[str, str]) -> float:
    """A compiled kernel's matmul flops, from its shapes: a grouped matmul's (each row of
    its [M, K] left operand times one group's [K, N]: 2 M K N, N its result's last
    dimension, for `gmm` and its transpose `tgmm` alike); a splash attention kernel's under
    a causal mask (`_splash_flops`); 0 for any other kernel."""
    if _GROUPED.match(op[0]):
        constrained = _CONSTRAINED.search(op[3])
        shapes = _SHAPE.findall(constrained.group(1)) if constrained else []
        result = _SHAPE.search(op[1])
        if len(shapes) < 2 or not result:
            return 0.0
        rows, depth = map(int, shapes[-2].split(","))
        return 2.0 * rows * depth * int(result.group(1).split(",")[-1])
    return _splash_flops(op, types)


def _splash_flops(op: tuple[str, str, str, str], types: dict[str, str]) -> float:
    """A splash attention kernel's matmul flops under a causal mask, from its query's
    shape [B, H, S, D] (self-attention: keys as long as queries); 0 for other kernels."""
    kind = _SPLASH.search(op[0])
    operands = OPERAND.findall(operand_text(op[3]))
    query = next((o for o in operands if o.endswith("q_ref")), None)
    shape = re.search(r"\[(\d+),(\d+),(\d+),(\d+)\]", types.get(query or "", ""))
    if not (kind and shape):
        return 0.0
    b, h, s, d = map(int, shape.groups())
    fused = kind.group(1) == "dkv" and op[1].count("[") >= 3  # dq computed too
    matmuls = _SPLASH_MATMULS[kind.group(1)] + fused
    return matmuls * 2 * b * h * s * s * d / 2


def read_row(recipe: Recipe) -> dict[str, Any]:
    """One recipe's row: the compile's note, and our reading of its HLO."""
    note = json.loads(note_path(recipe).read_text()) if note_path(recipe).exists() else {}
    calibrated = Topology.from_name(recipe.topology)
    topology = calibrated.at_datasheet_rates()
    published_step = recipe.tokens_per_chip / recipe.published_tokens_per_s
    row: dict[str, Any] = {
        "recipe": recipe.name,
        "model": recipe.model,
        "topology": recipe.topology,
        "settings": recipe.settings,
        "xla_flag_sets": list(recipe.flag_sets),
        "libtpu_flags": recipe.compiled_flags,
        "libtpu_flags_left_out": [f for f in recipe.flags if f in REFUSED],
        "source": recipe.source,
        "published_tokens_per_s_per_chip": recipe.published_tokens_per_s,
        "published_mfu_percent": recipe.published_mfu,
        "published_step_s": published_step,
        # MaxText's model flops per chip and step (MFU x peak x step; attention halved)
        "published_model_flops_per_chip": recipe.published_mfu
        / 100
        * (topology.peak_flops or 0.0)
        * published_step,
        "status": note.get("status", "not compiled"),
        "versions": note.get("versions"),
        "compile_seconds": note.get("compile_seconds"),
        "peak_host_rss_gib": note.get("peak_host_rss_gib"),
        "memory_per_chip_gib": device_gib(note.get("memory", {})),
        "hbm_per_chip_gib": round((topology.hbm_bytes or 0) / 2**30, 3),
        "memory_analysis": note.get("memory"),
    }
    if not hlo_path(recipe).exists():
        return row
    with gzip.open(hlo_path(recipe), "rt") as f:
        text = f.read()
    report = hlo_report(text, topology)
    roofline = roofline_terms(text, topology)
    ours = recipe.tokens_per_chip / report.estimate["step_s"]
    fitted = hlo_report(text, calibrated)
    fitted_ours = recipe.tokens_per_chip / fitted.estimate["step_s"]
    row.update(
        # at the datasheet's rates: what a fit starts from
        estimate=dict(report.estimate),
        tokens_per_s_per_chip=ours,
        ratio=ours / recipe.published_tokens_per_s,
        # at the rates the hardware file's [calibration] gives, as the library reports
        calibration=fitted.calibration,
        calibrated_estimate=dict(fitted.estimate),
        calibrated_tokens_per_s_per_chip=fitted_ours,
        calibrated_ratio=fitted_ours / recipe.published_tokens_per_s,
        flops_by_dtype=report.flops_by_dtype,
        opaque_kernel_calls=report.opaque_kernels,
        communication_by_kind=_communication(report, topology, text),
        roofline=roofline,
        # the compiled kernels' flops at the bf16 peak: compute the estimate leaves out
        kernel_s_at_peak=roofline["opaque_kernel_flops"] / (topology.peak_flops or 1),
    )
    return row


def _communication(report: Any, topology: Topology, text: str) -> dict[str, dict[str, float]]:
    """Per collective kind: count and bytes per step, the cost model's seconds, and the
    seconds XLA's schedule hides behind compute (the estimate's own rule)."""
    cycles = total_cycles(text)
    compute = report.estimate["compute_s"] or 0.0
    kinds: dict[str, dict[str, float]] = defaultdict(
        lambda: {"count": 0, "bytes": 0, "seconds": 0.0, "hidden_s": 0.0, "exposed_s": 0.0}
    )
    for c in report.collectives:
        seconds = collective_seconds(c, topology)
        hidden = compute * c.overlapped_cycles / cycles if c.asynchronous and cycles else 0.0
        kind = kinds[c.kind + (" (dcn)" if c.across_slices else "")]
        kind["count"] += c.times
        kind["bytes"] += c.times * c.nbytes
        kind["seconds"] += c.times * seconds
        kind["hidden_s"] += c.times * min(seconds, hidden)
        kind["exposed_s"] += c.times * max(0.0, seconds - hidden)
    return dict(kinds)


def _rate(tokens: float | None) -> str:
    return "-" if tokens is None else f"{tokens:,.0f}"


def _share(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| recipe | topology | published tok/s/chip | ours tok/s/chip | ours/published "
        "| calibrated tok/s/chip | calibrated/published "
        "| compute ms | matmul ms | kernels ms | comm ms | exposed ms | step ms "
        "| published step ms "
        "| GiB/chip (HBM) | status |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        e = r.get("estimate", {})
        ours, ratio = r.get("tokens_per_s_per_chip"), r.get("ratio")
        kernels = r.get("kernel_s_at_peak")
        lines.append(
            f"| {r['recipe']} | {r['topology']} | {r['published_tokens_per_s_per_chip']:,.0f} "
            f"| {_rate(ours)} "
            f"| {_share(ratio)} "
            f"| {_rate(r.get('calibrated_tokens_per_s_per_chip'))} "
            f"| {_share(r.get('calibrated_ratio'))} "
            f"| {_ms(e.get('compute_s'))} | {_ms(e.get('matmul_s'))} | {_ms(kernels)} "
            f"| {_ms(e.get('communication_s'))} | {_ms(e.get('exposed_s'))} "
            f"| {_ms(e.get('step_s'))} | {_ms(r['published_step_s'])} "
            f"| {r['memory_per_chip_gib'] or '-'} ({r['hbm_per_chip_gib']:.0f}) "
            f"| {r['status'][:60]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", metavar="RECIPE", choices=sorted(BY_NAME))
    parser.add_argument("--list", action="store_true", help="print each recipe's command")
    parser.add_argument("--python", default=MAXTEXT_PYTHON, help="MaxText's environment")
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--timeout-min", type=float, default=40.0)
    args = parser.parse_args()
    if args.list:
        for recipe in RECIPES:
            print(f"# {recipe.name}\n{shell_line(recipe)}\n")
        return
    if args.compile:
        note = run_compile(
            BY_NAME[args.compile], args.python, args.memory_limit_gib, args.timeout_min
        )
        print(json.dumps(note, indent=1))
        sys.exit(0 if note["status"] == "ok" else 1)
    rows = [read_row(r) for r in RECIPES]
    RESULTS.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
