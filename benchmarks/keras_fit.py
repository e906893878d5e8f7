"""Keras `model.fit` steps per second: `keras.distribution.DataParallel` against
`xs.MirroredStrategy` on the same devices, with a communication-heavy model (many small
Dense layers, so many small gradients).

Each round fits one epoch with each, alternating; the first round of each is warm-up
(compilation) and is dropped. Reports the medians and their ratio, and writes
`benchmarks/results/keras_fit.json`. Run: `python -m benchmarks.keras_fit`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

RESULTS = Path(__file__).parent / "results"


def _model(layers: int, width: int) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    stack = [keras.Input((width,))]
    stack += [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
    model = keras.Sequential([*stack, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
    return model


def _epoch_seconds(model: Any, x: Any, y: Any, batch: int) -> float:
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    import jax
    import keras
    import numpy as np

    import xla_strategies as xs
    from xla_strategies.hardware.devices import emulate_cpu_devices

    emulate_cpu_devices(8)
    devices = jax.devices()
    rng = np.random.default_rng(0)
    rows = args.steps * args.global_batch
    x = rng.normal(size=(rows, args.width)).astype("float32")
    y = rng.normal(size=(rows, 1)).astype("float32")

    data_parallel = keras.distribution.DataParallel(devices=devices)
    with data_parallel.scope():
        theirs = _model(args.layers, args.width)
    strategy = xs.MirroredStrategy(devices)
    with strategy.scope():
        ours = _model(args.layers, args.width)

    times: dict[str, list[float]] = {"DataParallel": [], "MirroredStrategy": []}
    for _ in range(args.rounds + 1):
        with data_parallel.scope():
            times["DataParallel"].append(_epoch_seconds(theirs, x, y, args.global_batch))
        times["MirroredStrategy"].append(_epoch_seconds(ours, x, y, args.global_batch))
    steps_per_second = {
        name: args.steps / statistics.median(seconds[1:]) for name, seconds in times.items()
    }
    ratio = steps_per_second["MirroredStrategy"] / steps_per_second["DataParallel"]
    print(
        f"{args.layers} Dense({args.width}) layers + head, global batch {args.global_batch}, "
        f"{len(devices)} devices, {args.steps} steps per epoch, median of {args.rounds} epochs"
    )
    for name, rate in steps_per_second.items():
        print(f"  {name:<18} {rate:8.1f} steps/s")
    print(f"  MirroredStrategy / DataParallel: {ratio:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    record = {"args": vars(args), "steps_per_second": steps_per_second, "ratio": ratio}
    (RESULTS / "keras_fit.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
