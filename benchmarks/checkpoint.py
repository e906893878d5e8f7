"""Checkpoint benchmark: save/restore of a 1 GiB state against numpy, and what an
asynchronous save costs the training steps that run while it writes.

1. Save and restore time of a 1 GiB state (16 float32 arrays of 64 MiB, random so that
   compression cannot shrink them) with `xs.CheckpointManager`, as ratios to
   `numpy.save`/`numpy.load` of the same bytes, in both cases to completion (saved files
   flushed with fsync, so neither side is timed into the page cache alone). Both orbax
   layouts are timed: ours by default (one file per array), and OCDBT with zstd. Variants
   alternate, medians of `--repeats`.
2. Asynchronous-save overhead: an MLP trained with Adam (0.77 GB of parameters and optimizer
   state). Steps are timed with no save in flight and while a save of the whole state
   writes in the background; `save()` itself blocks for the device-to-host copy, which is
   reported as a share of one step.

Run: `python -m benchmarks.checkpoint` (or `make bench`). Writes results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def save_restore(workdir: Path, gib: float, repeats: int) -> dict[str, Any]:
    import jax

    import xla_strategies as xs

    strategy = xs.OneDeviceStrategy()
    count = int(gib * 2**30) // 4 // 16
    host = {f"a{i:02d}": np.random.default_rng(i).random(count, np.float32) for i in range(16)}
    state = strategy.replicate(host)
    target = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), host)
    formats = {"": {}, " (ocdbt+zstd)": {"ocdbt": True, "compression": True}}
    names = ["numpy save", "numpy load"]
    names += [f"{op}{suffix}" for suffix in formats for op in ("save", "restore")]
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shutil.rmtree(workdir, ignore_errors=True)
        plain = workdir / "numpy"
        plain.mkdir(parents=True)
        start = time.perf_counter()
        for name, array in host.items():
            np.save(plain / f"{name}.npy", array)
        _fsync_tree(plain)
        times["numpy save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = {name: np.load(plain / f"{name}.npy") for name in host}
        times["numpy load"].append(time.perf_counter() - start)
        del loaded

        for suffix, options in formats.items():
            directory = workdir / f"orbax{len(options)}"
            with xs.CheckpointManager(directory, strategy, **options) as manager:
                start = time.perf_counter()
                manager.save(repeat, state, force=True)
                manager.wait_until_finished()
                _fsync_tree(directory)
                times[f"save{suffix}"].append(time.perf_counter() - start)
                start = time.perf_counter()
                restored = manager.restore(repeat, target=target)
                jax.block_until_ready(restored)
                times[f"restore{suffix}"].append(time.perf_counter() - start)
                del restored
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        f"{op}{suffix} / numpy.{'save' if op == 'save' else 'load'}": medians[f"{op}{suffix}"]
        / medians[f"numpy {'save' if op == 'save' else 'load'}"]
        for suffix in formats
        for op in ("save", "restore")
    }
    return {"gib": gib, "seconds": medians, "ratios": ratios}


def async_overhead(workdir: Path, steps: int, rounds: int) -> dict[str, Any]:
    import jax
    import optax
    from flax import nnx

    import xla_strategies as xs
    from xla_strategies.demo import models

    strategy = xs.OneDeviceStrategy()
    model = models.MLP((2048, 4096, 4096, 4096, 4096, 2048), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-4)
    step = strategy.compile(models.mlp_train_step(graphdef, tx), donate_argnums=(0, 1))
    state = [strategy.replicate(params), strategy.replicate(tx.init(params))]
    rng = np.random.default_rng(0)
    batch = strategy.replicate(
        {
            "x": rng.normal(size=(32, 2048)).astype(np.float32),
            "y": rng.integers(0, 2048, size=32).astype(np.int32),
        }
    )
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

    def run_steps(count: int) -> list[float]:
        nonlocal state
        times = []
        for _ in range(count):
            start = time.perf_counter()
            *state, loss = step(*state, batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        return times

    run_steps(3)  # compile and warm up
    quiet, during, blocking, writes = [], [], [], []
    with xs.CheckpointManager(workdir / "async", strategy, max_to_keep=1) as manager:
        for n in range(rounds):
            quiet += run_steps(steps)
            start = time.perf_counter()
            manager.save(n, {"params": state[0], "opt": state[1]}, force=True)
            blocking.append(time.perf_counter() - start)
            during += run_steps(steps)
            manager.wait_until_finished()
            writes.append(time.perf_counter() - start)
    step_time = statistics.median(quiet)
    return {
        "state_gb": state_bytes / 1e9,
        "step_ms": step_time * 1e3,
        "step_during_save_ms": statistics.median(during) * 1e3,
        "overhead": statistics.median(during) / step_time - 1,
        "save_call_blocks_ms": statistics.median(blocking) * 1e3,
        "save_call_in_steps": statistics.median(blocking) / step_time,
        "whole_save_s": statistics.median(writes),
    }


def print_tables(result: dict[str, Any]) -> None:
    sr = result["save_restore"]
    print(f"\n{sr['gib']:g} GiB state, medians (s)")
    for name, seconds in sr["seconds"].items():
        print(f"  {name:<24} {seconds:8.3f}")
    for name, ratio in sr["ratios"].items():
        print(f"  {name:<36} {ratio:5.2f}x")
    ao = result["async"]
    print(f"\nasynchronous save of a {ao['state_gb']:.2f} GB training state")
    print(f"  step, no save in flight    {ao['step_ms']:8.1f} ms")
    print(f"  step, save in flight       {ao['step_during_save_ms']:8.1f} ms")
    print(f"  overhead while writing     {ao['overhead']:+8.1%}  (target < 10%)")
    print(f"  save() blocks for          {ao['save_call_blocks_ms']:8.1f} ms", end="")
    print(f" ({ao['save_call_in_steps']:.2f} steps)")
    print(f"  whole save                 {ao['whole_save_s']:8.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        result = {
            "save_restore": save_restore(Path(tmp) / "sr", args.gib, args.repeats),
            "async": async_overhead(Path(tmp), args.steps, args.rounds),
        }
    print_tables(result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
