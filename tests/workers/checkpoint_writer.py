"""A process that writes or reads one checkpoint directory, for the tests of two processes
on one directory and of kills during a save, a `max_to_keep` deletion or an overwrite.

Every leaf of step n holds `n + tag` (`--tag 0.25` for one writer, `0.75` for another), so
a step that mixes writers, or mixes steps, shows in its values. Modes:

- `write`: save steps 1..`--steps`, printing `STEP n` after each; `REFUSED <error>` and
  exit status 3 when the directory is refused.
- `overwrite`: save steps 1..3, then step 3 again with `overwrite=True`, over and over,
  printing `STEP n` after each save.
- `read`: a read-only manager restores the latest step for `--seconds`, printing `READ n`
  for each consistent restore and `BAD <what>` for anything else.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))

import numpy as np  # noqa: E402

import xla_strategies as xs  # noqa: E402

REFUSED_STATUS = 3


def state(value: float, leaves: int, size: int) -> dict[str, np.ndarray]:
    """The state every step saves: `leaves` arrays of `size` floats, all `value`."""
    return {f"l{i:03d}": np.full(size, value, np.float32) for i in range(leaves)}


def tag_of(step: int, restored: dict) -> float | None:
    """The writer's tag of a restored step, or None when its leaves disagree."""
    values = {float(np.asarray(v).min()) for v in restored.values()}
    values |= {float(np.asarray(v).max()) for v in restored.values()}
    return values.pop() - step if len(values) == 1 else None


def write(args: argparse.Namespace, overwrite: bool) -> None:
    strategy = xs.OneDeviceStrategy()
    try:
        manager = xs.CheckpointManager(
            args.dir, strategy, max_to_keep=args.max_to_keep, async_save=args.async_save
        )
    except xs.CheckpointError as exc:
        print(f"REFUSED {exc}".splitlines()[0], flush=True)
        sys.exit(REFUSED_STATUS)
    steps = [1, 2, 3] + [3] * args.steps if overwrite else range(1, args.steps + 1)
    for n, step in enumerate(steps):
        value = step + args.tag + (0 if n < 3 or not overwrite else n * 1000)
        try:
            manager.save(step, state(value, args.leaves, args.size), overwrite=overwrite)
            manager.wait_until_finished()
        except xs.CheckpointError as exc:
            print(f"REFUSED {exc}".splitlines()[0], flush=True)
            sys.exit(REFUSED_STATUS)
        print(f"STEP {n + 1}", flush=True)
        if args.hold_until and n == 1:  # the lock held after step 2 until another is done
            _wait_for(Path(args.hold_until))
        time.sleep(args.pause)
    manager.close()
    print("DONE", flush=True)


def _wait_for(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def read(args: argparse.Namespace) -> None:
    strategy = xs.OneDeviceStrategy()
    target = state(0.0, args.leaves, args.size)
    deadline = time.monotonic() + args.seconds
    with xs.CheckpointManager(args.dir, strategy, read_only=True) as manager:
        while time.monotonic() < deadline:
            step = manager.latest_step()
            if step is None:
                time.sleep(0.01)
                continue
            try:
                restored = manager.restore(target=target)
            except xs.CheckpointError as exc:
                print(f"BAD {exc}".splitlines()[0], flush=True)
                continue
            tag = tag_of(int(restored["l000"][0]), restored)
            print("READ" if tag is not None else "BAD mixed values", flush=True)
    print("DONE", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("write", "overwrite", "read"))
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tag", type=float, default=0.25)
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--max-to-keep", type=int, default=100)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--hold-until", help="after step 2, wait until this file exists")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    if args.mode == "read":
        read(args)
    else:
        write(args, overwrite=args.mode == "overwrite")


if __name__ == "__main__":
    main()
