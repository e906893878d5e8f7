"""Saves a small checkpoint (step 1), then starts a large asynchronous save (step 2) and
prints `STEP 2`, so the test can kill it in the middle of writing."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402

import xla_strategies as xs  # noqa: E402


def main() -> None:
    directory, megabytes = sys.argv[1], int(sys.argv[2])
    strategy = xs.OneDeviceStrategy()
    manager = xs.CheckpointManager(directory, strategy)
    small = strategy.replicate({"w": np.full((4,), 1.0, np.float32)})
    manager.save(1, small)
    manager.wait_until_finished()
    count = megabytes * 1024 * 1024 // 4 // 8
    big = strategy.replicate(
        {
            "w": np.full((4,), 2.0, np.float32),
            "blob": [np.random.default_rng(i).random(count, np.float32) for i in range(8)],
        }
    )
    manager.save(2, big)
    print("STEP 2", flush=True)
    time.sleep(60)  # killed before this ends


if __name__ == "__main__":
    main()
