"""Saves step 1, then makes the OS refuse large writes (RLIMIT_FSIZE: the write fails with
EFBIG, as a full disk fails one with ENOSPC) and saves step 2. Prints the error, then the
latest step and whether step 1 restores intact, as JSON."""

from __future__ import annotations

import json
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402

import xla_strategies as xs  # noqa: E402


def main() -> None:
    directory = sys.argv[1]
    strategy = xs.OneDeviceStrategy()
    manager = xs.CheckpointManager(directory, strategy)
    small = {"w": np.arange(4, dtype=np.float32)}
    manager.save(1, strategy.replicate(small))
    manager.wait_until_finished()
    big = {"w": np.zeros(4, np.float32), "big": np.random.default_rng(0).random(1 << 20)}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
    error = None
    try:
        manager.save(2, strategy.replicate(big))
        manager.wait_until_finished()
    except xs.CheckpointError as exc:
        error = str(exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    restored = manager.restore(target=small)
    print(
        json.dumps(
            {
                "error": error,
                "latest": manager.latest_step(),
                "intact": bool(np.array_equal(np.asarray(restored["w"]), small["w"])),
            }
        )
    )
    manager.close()


if __name__ == "__main__":
    main()
