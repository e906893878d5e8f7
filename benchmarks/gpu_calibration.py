"""The GPU step estimate against measured steps: on a real GPU, `--measure` times train
steps and keeps each one's compiled HLO (and with `--trace` a profile); anywhere,
`benchmarks.gpu_calibration_fit` reads those programs with the project's reader and fits
the node file's `[calibration]` to the measured times.

    # on one GPU (JAX with its CUDA plugin, flax, optax):
    python -m benchmarks.gpu_calibration --measure --trace --out run.json \\
        --hlo-dir results/hlo/gpu-h200-1
    # here, from the runs kept in results/gpu_calibration.json:
    python -m benchmarks.gpu_calibration_fit --node dgx-h200

Each `--measure` writes one run; `results/gpu_calibration.json` keeps the runs the fit
reads (`{"runs": [...]}`), their HLO under `results/hlo/<run's hlo_dir>/`.

`--measure` runs each program of `PROGRAMS` in a process of its own (so its device memory
peak is its own): three warm-up steps, then the median of ten, the step's peak device
memory (`memory_stats()["peak_bytes_in_use"]`) beside XLA's memory analysis, and the
compiled HLO gzipped. It also measures the chip's two ceilings: a large bf16 matmul's
flops and a device-to-device copy's bytes a second. Results are written after every
program, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "gpu_calibration.json"
HLO_DIR = Path(__file__).parent / "results" / "hlo" / "gpu"

#: (workload of `benchmarks.tpu_models.WORKLOADS`, sequences or images per step, program):
#: "ours" is `MirroredStrategy().compile`, "jit" plain `jax.jit`. In the order they run.
PROGRAMS = (
    ("gpt2-medium", 8, "ours"),
    ("gpt2-medium-plain", 8, "ours"),
    ("gpt2-medium-plain", 8, "jit"),
    ("bert-large", 8, "ours"),
    ("resnet50", 32, "ours"),
    ("resnet50", 128, "ours"),
    ("gpt2-medium", 2, "ours"),
    ("gpt2-medium", 8, "jit"),
    ("bert-large", 32, "ours"),
    ("gpt2-medium-plain-cast", 8, "ours"),
    ("bert-large", 8, "jit"),
    ("resnet50", 64, "ours"),
)


def program_key(workload: str, batch: int, program: str) -> str:
    return f"{workload}@{batch}:{program}"


def median_ms(run: Any, steps: int, warmup: int = 3) -> dict[str, float]:
    """`run()`'s median wall time over `steps` calls after `warmup` (it blocks until its
    result is ready), and the spread of the timed calls."""
    seconds = []
    for i in range(warmup + steps):
        started = time.perf_counter()
        run()
        if i >= warmup:
            seconds.append(time.perf_counter() - started)
    return {
        "median_ms": 1e3 * statistics.median(seconds),
        "min_ms": 1e3 * min(seconds),
        "max_ms": 1e3 * max(seconds),
    }


def measure_program(
    workload_key: str, batch: int, program: str, hlo_dir: Path, trace: bool = False
) -> dict:
    """One train step on this process's first device: timed, its memory, its HLO kept, and
    (`trace`) a profile of three more steps, each kernel's time (`xplane.pb`, gzipped)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import xla_strategies as xs
    from benchmarks.tpu_models import WORKLOADS, trained_params

    workload, tx = WORKLOADS[workload_key](), optax.adamw(1e-4)
    rng = np.random.default_rng(0)
    data = {
        key: rng.normal(size=s.shape).astype(s.dtype)
        if jnp.issubdtype(s.dtype, jnp.floating)
        else rng.integers(0, 1000, size=s.shape).astype(s.dtype)  # valid ids and labels
        for key, s in workload.batch(batch).items()
    }
    variables = jax.jit(workload.init)()
    opt_state = jax.jit(tx.init)(trained_params(variables))
    if program == "ours":
        strategy = xs.MirroredStrategy()
        step = strategy.compile(workload.step(tx, "batch"), axis_name="batch",
                                donate_argnums=(0, 1))  # fmt: skip
        state = [strategy.replicate(variables), strategy.replicate(opt_state)]
        batch_args = next(iter(strategy.experimental_distribute_dataset([data])))
    else:
        step = jax.jit(workload.step(tx, None), donate_argnums=(0, 1))
        state = [variables, opt_state]
        batch_args = jax.device_put(data)
    del variables, opt_state

    def run() -> None:
        state[0], state[1], loss = step(state[0], state[1], batch_args)
        jax.block_until_ready(loss)

    started = time.perf_counter()
    run()  # compiles (kept in the compilation cache for the text below)
    first_ms = 1e3 * (time.perf_counter() - started)
    timed = median_ms(run, steps=10)
    compiled = step.lower(*state, batch_args).compile()
    text = compiled.as_text()
    name = program_key(workload_key, batch, program).replace(":", "_").replace("@", "_")
    hlo_dir.mkdir(parents=True, exist_ok=True)
    if trace:
        traced = hlo_dir / "trace" / name
        with jax.profiler.trace(str(traced)):
            for _ in range(3):
                run()
        (xplane,) = traced.rglob("*.xplane.pb")
        with gzip.open(hlo_dir / f"{name}.xplane.pb.gz", "wb") as f:
            f.write(xplane.read_bytes())
    with gzip.open(hlo_dir / f"{name}.hlo.txt.gz", "wt") as f:
        f.write(text)
    memory = compiled.memory_analysis()
    stats = jax.devices()[0].memory_stats() or {}
    return {
        **timed,
        "first_call_ms": first_ms,
        "hlo": f"{name}.hlo.txt.gz",
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "xla_temp_bytes": memory.temp_size_in_bytes,
        "xla_argument_bytes": memory.argument_size_in_bytes,
        "xla_output_bytes": memory.output_size_in_bytes,
        "xla_alias_bytes": memory.alias_size_in_bytes,
    }


def ceilings(n: int = 8192, elements: int = 1 << 30) -> dict[str, float]:
    """The chip's matmul and memory ceilings as JAX reaches them: an `n`^3 bf16 matmul (on
    random data) and an f32 array of `elements` (4 GiB) read and written."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 2)
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
    matmul = jax.jit(lambda x, y: x @ y)
    found = median_ms(lambda: matmul(a, b).block_until_ready(), steps=20)
    x = jax.random.normal(keys[0], (elements,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)
    moved = median_ms(lambda: copy(x).block_until_ready(), steps=20)
    return {
        "bf16_matmul_flops_per_s": 2 * n**3 / (found["median_ms"] / 1e3),
        "copy_bytes_per_s": 2 * 4 * elements / (moved["median_ms"] / 1e3),
    }


def _one(args: argparse.Namespace) -> None:
    """The child process: one program, its findings printed as one JSON line."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(Path(args.hlo_dir) / "cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    workload, batch, program = args.one
    found = measure_program(workload, int(batch), program, Path(args.hlo_dir), args.trace)
    print("RESULT " + json.dumps(found))


def measure(args: argparse.Namespace) -> None:
    """Every program in a process of its own, until `--deadline-s` would be passed."""
    import jax

    device = jax.devices()[0]
    found: dict[str, Any] = {
        "hlo_dir": Path(args.hlo_dir).name,  # where the fit finds the programs, under hlo/
        "traced": args.trace,
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "ceilings": ceilings(),
        "programs": {},
    }
    out = Path(args.out)
    out.write_text(json.dumps(found, indent=1) + "\n")
    started = time.monotonic()
    for workload, batch, program in PROGRAMS:
        key = program_key(workload, batch, program)
        if args.programs and key not in args.programs:
            continue
        left = args.deadline_s - (time.monotonic() - started)
        if left < 30:
            found["programs"][key] = {"error": "not run: the deadline came first"}
            continue
        command = [sys.executable, "-m", "benchmarks.gpu_calibration", "--one",
                   workload, str(batch), program, "--hlo-dir", args.hlo_dir,
                   *(["--trace"] if args.trace else [])]  # fmt: skip
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=left)
            lines = [x for x in child.stdout.splitlines() if x.startswith("RESULT ")]
            result = (
                json.loads(lines[-1][len("RESULT ") :])
                if lines
                else {"error": child.stderr[-3000:]}
            )
        except subprocess.TimeoutExpired:
            result = {"error": f"timed out after {left:.0f} s"}
        found["programs"][key] = result
        print(key, json.dumps(result), flush=True)
        out.write_text(json.dumps(found, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--measure", action="store_true", help="time the programs (a GPU)")
    parser.add_argument("--one", nargs=3, metavar=("WORKLOAD", "BATCH", "PROGRAM"))
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--hlo-dir", default=str(HLO_DIR))
    parser.add_argument("--deadline-s", type=float, default=1e9)
    parser.add_argument("--programs", nargs="+", help="of PROGRAMS' keys (all by default)")
    parser.add_argument("--trace", action="store_true", help="also profile 3 steps")
    args = parser.parse_args()
    if args.one:
        _one(args)
    elif args.measure:
        measure(args)
    else:
        parser.error("--measure or --one")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
