"""Input-pipeline benchmark: steps per second with and without device prefetch.

A producer does real host work per batch (random crops, flips and normalisation of
image-sized uint8 arrays with numpy), and a compiled step of similar duration consumes it
on 8 emulated devices. On a TPU host the CPU is free while the chips compute; to stand in
for that on a 2-core machine, XLA's compute gets one core: the main thread is pinned to
core 0 before JAX starts its thread pools (they inherit the affinity), with Eigen's
intra-op threading off, and the input pipeline's two background threads (host preparation,
device copies) are moved to core 1 as they start.

Run: `python -m benchmarks.input_pipeline` (or `make bench`). Writes results/input_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
XLA_CORE, INPUT_CORE = 0, 1


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < os.cpu_count():
        os.sched_setaffinity(0, {core})  # this thread only


def _pin_input_threads() -> None:
    """Move the input pipeline's background threads to the input core."""
    if not hasattr(os, "sched_setaffinity") or INPUT_CORE >= os.cpu_count():
        return
    for thread in threading.enumerate():
        if thread.name.startswith("xla_strategies-input") and thread.native_id is not None:
            os.sched_setaffinity(thread.native_id, {INPUT_CORE})


def augmented_batches(count: int, batch: int, size: int, seed: int = 0) -> Iterator[dict]:
    """Decode-like host work: crop a (size+8)^2 uint8 image to size^2 at a random offset,
    flip half, normalise to float32 with per-channel mean/std."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 255, size=(batch, size + 8, size + 8, 3), dtype=np.uint8)
    mean, std = np.array([123.7, 116.3, 103.5]), np.array([58.4, 57.1, 57.4])
    for _ in range(count):
        dy, dx = rng.integers(0, 9, size=2)
        images = raw[:, dy : dy + size, dx : dx + size].astype(np.float32)
        flip = rng.random(batch) < 0.5
        images[flip] = images[flip, :, ::-1]
        images = ((images - mean) / std).astype(np.float32)
        yield {"image": images, "label": rng.integers(0, 10, size=batch).astype(np.int32)}


def _time_per_item(iterable: Any, consume: Any) -> float:
    start, n = time.perf_counter(), 0
    for item in iterable:
        if n == 0:
            _pin_input_threads()  # they start with the first batch
        consume(item)
        n += 1
    return (time.perf_counter() - start) / n


def measure(batch: int, size: int, width: int, steps: int, rounds: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import xla_strategies as xs

    strategy = xs.MirroredStrategy()
    features = size * size * 3
    weights = strategy.replicate(
        {
            "w1": np.full((features, width), 1e-3, np.float32),
            "w2": np.full((width, width), 1e-3, np.float32),
        }
    )

    @strategy.compile
    def step(params: Any, data: dict) -> Any:
        h = jnp.tanh(data["image"].reshape(data["image"].shape[0], -1) @ params["w1"])
        for _ in range(4):
            h = jnp.tanh(h @ params["w2"])
        return jnp.sum(h, axis=1)

    fixed = next(iter(strategy.experimental_distribute_dataset(augmented_batches(1, batch, size))))
    jax.block_until_ready(step(weights, fixed))
    sample = next(augmented_batches(1, batch, size))
    batch_bytes = sum(a.nbytes for a in sample.values())

    def run(prefetch: bool) -> float:
        options = xs.InputOptions(prefetch_to_device=prefetch)
        dataset = strategy.experimental_distribute_dataset(
            augmented_batches(steps, batch, size), options
        )
        out = None

        def consume(b: Any) -> None:
            nonlocal out
            out = step(weights, b)

        per_step = _time_per_item(dataset, consume)
        jax.block_until_ready(out)
        return per_step

    samples: dict[str, list[float]] = {
        "compute": [],
        "input": [],
        "prefetch": [],
        "no_prefetch": [],
    }
    for _ in range(rounds):
        start = time.perf_counter()  # dispatched back to back, as the train loop does
        jax.block_until_ready([step(weights, fixed) for _ in range(steps)])
        samples["compute"].append((time.perf_counter() - start) / steps)
        samples["input"].append(
            _time_per_item(augmented_batches(steps, batch, size), lambda _: None)
        )
        samples["prefetch"].append(run(prefetch=True))
        samples["no_prefetch"].append(run(prefetch=False))
    ms = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
    bound = max(ms["compute"], ms["input"])
    options = xs.InputOptions()
    return {
        "setup": f"global batch {batch} images {size}x{size}x3 (float32 after augmentation), "
        f"step: 5 dense layers of width {width} over the flattened images, 8 replicas",
        "ms_per_step": ms,
        "prefetch_over_bound": ms["prefetch"] / bound,
        "no_prefetch_over_sum": ms["no_prefetch"] / (ms["compute"] + ms["input"]),
        "speedup": ms["no_prefetch"] / ms["prefetch"],
        "host_to_device_MB_per_s": batch_bytes / (ms["prefetch"] / 1e3) / 1e6,
        "batch_MB": batch_bytes / 1e6,
        "buffered_MB": (options.buffer_size + options.host_buffer_size) * batch_bytes / 1e6,
        "target_prefetch_over_bound": 1.15,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    _pin(XLA_CORE)  # before JAX creates its threads, which inherit this affinity
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    ).strip()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    result = measure(args.batch, args.size, args.width, args.steps, args.rounds)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "input_pipeline.json").write_text(json.dumps(result, indent=2) + "\n")
    ms = result["ms_per_step"]
    print(result["setup"])
    for key, label in (
        ("compute", "compute only (batch already on device)"),
        ("input", "input only (host augmentation)"),
        ("no_prefetch", "train loop, prefetch_to_device=False"),
        ("prefetch", "train loop, prefetch_to_device=True"),
    ):
        print(f"  {label:<42} {ms[key]:8.2f} ms/step")
    print(
        f"prefetch: {result['prefetch_over_bound']:.2f}x of max(compute, input) (target <= 1.15); "
        f"without: {result['no_prefetch_over_sum']:.2f}x of compute + input; "
        f"speed-up {result['speedup']:.2f}x"
    )
    print(
        f"host-to-device {result['host_to_device_MB_per_s']:.0f} MB/s; "
        f"buffers hold {result['buffered_MB']:.1f} MB ({result['batch_MB']:.1f} MB per batch)"
    )


if __name__ == "__main__":
    main()
