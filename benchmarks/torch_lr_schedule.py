"""A torch step under `OneCycleLR`, which changes SGD's learning rate and momentum every
step: the step time and the programs compiled with the hyperparameters traced (what
`xla_strategies.torch` does) against compiled in (what it did before: `TRACED` emptied
for the run), side by side in one process, alternating, on 8 emulated CPU devices.

Writes `benchmarks/results/torch_lr_schedule.json`.
Run: `python -m benchmarks.torch_lr_schedule [--steps 30] [--rounds 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import xla_strategies as xs  # noqa: E402
import xla_strategies.torch as xst  # noqa: E402
from xla_strategies.torch import traced_hyperparameters  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WARMUP = 5  # steps left out of the median: the first compiles, the optimizer makes its state


class Net(nn.Module):
    """A small CNN with BatchNorm, as torch's CIFAR-10 tutorial writes one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.bn(self.conv(x))), 1))


def loss_fn(model, images, labels):
    return F.cross_entropy(model(images), labels.long())


def run(steps: int, traced: bool) -> dict[str, float]:
    saved = dict(traced_hyperparameters.TRACED)
    if not traced:
        traced_hyperparameters.TRACED.clear()
    try:
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.2, total_steps=steps + 1)
        strategy = xs.MirroredStrategy()
        state = xst.TrainState.create(model, optimizer)
        step = strategy.compile(lambda state, *batch: xst.train_step(state, loss_fn, *batch))
        rng = np.random.default_rng(0)
        batches = [
            (rng.normal(size=(32, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 32))
            for _ in range(steps)
        ]
        times = []
        for batch in strategy.experimental_distribute_dataset(batches):
            start = time.perf_counter()
            state, loss = step(state, *batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
            scheduler.step()
        return {"step_ms": 1e3 * statistics.median(times[WARMUP:]), "programs": step.cache_size}
    finally:
        traced_hyperparameters.TRACED.clear()
        traced_hyperparameters.TRACED.update(saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than {WARMUP}, got {args.steps}")
    rounds = {"traced": [], "compiled_in": []}
    for _ in range(args.rounds):
        for name in rounds:
            rounds[name].append(run(args.steps, traced=name == "traced"))
            print(name, rounds[name][-1], flush=True)
    summary = {
        name: {
            "step_ms_median": statistics.median(r["step_ms"] for r in runs),
            "programs": runs[0]["programs"],
        }
        for name, runs in rounds.items()
    }
    summary["speedup"] = (
        summary["compiled_in"]["step_ms_median"] / summary["traced"]["step_ms_median"]
    )
    summary["steps"] = args.steps
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "torch_lr_schedule.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
