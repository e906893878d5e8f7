"""An asynchronous save the disk refuses (RLIMIT_FSIZE: EFBIG, as a full disk gives
ENOSPC), then a second manager opened on the directory and a retry of the step, as a
training loop that catches the error would do. Prints what each stage gave as JSON lines,
then exits: the test bounds how long the exit takes.

The first manager retries, beside the second (which must be refused); with
`--close-first` the first is closed before the second opens, and the second retries.
`--race-clean-up` makes the retry's removal of the failed save's temporary directory fail
as it did when another process's clean-up removed it first (FileNotFoundError), then
retries once more."""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402

import xla_strategies as xs  # noqa: E402


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


@contextlib.contextmanager
def _clean_up_raced() -> Iterator[None]:
    """Orbax's removal of a leftover temporary directory fails as if another process had
    removed it first."""
    from orbax.checkpoint._src.path import async_path

    original = async_path.rmtree

    async def raced(path: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", str(path))

    async_path.rmtree = raced
    try:
        yield
    finally:
        async_path.rmtree = original


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--close-first", action="store_true")
    parser.add_argument("--race-clean-up", action="store_true")
    args = parser.parse_args()
    strategy = xs.OneDeviceStrategy()
    manager = xs.CheckpointManager(args.dir, strategy)
    small = {"w": np.arange(4, dtype=np.float32), "big": np.zeros(1 << 18, np.float32)}
    manager.save(1, small)
    manager.wait_until_finished()
    big = {"w": np.ones(4, np.float32), "big": np.random.default_rng(0).random(1 << 18, np.float32)}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
    try:
        manager.save(2, big)
        manager.wait_until_finished()
        report(stage="refused", error=None)
    except xs.CheckpointError as exc:
        report(stage="refused", error=str(exc).splitlines()[0])
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    if args.close_first:
        manager.close()
    try:
        opened = xs.CheckpointManager(args.dir, strategy)  # an evaluator, or a restart
        report(stage="second", error=None)
    except xs.CheckpointError as exc:
        opened = None
        report(stage="second", error=str(exc).splitlines()[0])
    second = opened if args.close_first else manager
    if args.race_clean_up:
        try:
            with _clean_up_raced():
                second.save(2, big)
                second.wait_until_finished()
            report(stage="raced", error=None)
        except xs.CheckpointError as exc:
            report(stage="raced", error=str(exc).splitlines()[0])
    second.save(2, big)
    second.wait_until_finished()
    restored = second.restore(target=big)
    report(
        stage="retried",
        latest=second.latest_step(),
        intact=bool(np.array_equal(np.asarray(restored["big"]), big["big"])),
    )
    print("EXITING", flush=True)  # no close(): the process must exit all the same


if __name__ == "__main__":
    main()
