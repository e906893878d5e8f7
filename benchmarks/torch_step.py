"""PyTorch training steps per second: torch_xla's own data parallelism (SPMD, the batch
sharded over a one-axis mesh) against `xla_strategies.torch` on `MirroredStrategy`, the
same `torch.nn.Module`, loss, `torch.optim.SGD` and batches, on 8 PJRT CPU devices.

torch_xla and JAX each load their own XLA runtime, so every measurement runs in a fresh
process of its own (`--worker`); the parent alternates them round by round and reports
the medians and their ratio (ours / torch_xla, higher is better). Each worker compiles,
warms up, then times `--steps` steps ending in a wait for the devices. Writes
`benchmarks/results/torch_step.json`. Run: `python -m benchmarks.torch_step`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DEVICES = 8


def _model():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):
        """The CIFAR-10 tutorial's network, widened, with BatchNorm."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 32, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(32)
            self.conv2 = nn.Conv2d(32, 64, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(64)
            self.pool = nn.MaxPool2d(2, 2)
            self.fc1 = nn.Linear(64 * 8 * 8, 256)
            self.fc2 = nn.Linear(256, 10)

        def forward(self, x):
            x = self.pool(F.relu(self.bn1(self.conv1(x))))
            x = self.pool(F.relu(self.bn2(self.conv2(x))))
            return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))

    torch.manual_seed(0)
    return Net()


def _batch(rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    images = rng.normal(size=(rows, 3, 32, 32)).astype(np.float32)
    return images, rng.integers(0, 10, rows).astype(np.int32)


def _loss(model, images, labels):
    import torch.nn.functional as F

    return F.cross_entropy(model(images), labels.long())


def _torch_xla(batch: int, steps: int, data_parallel: bool = True) -> float:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", str(DEVICES if data_parallel else 1))
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as spmd
    import torch_xla.runtime as xr

    if data_parallel:
        xr.use_spmd()
    device = torch_xla.device()
    model = _model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = (torch.from_numpy(a).to(device) for a in _batch(batch))
    if data_parallel:
        mesh = spmd.Mesh(np.arange(DEVICES), (DEVICES,), ("data",))
        spmd.mark_sharding(images, mesh, ("data", None, None, None))
        spmd.mark_sharding(labels, mesh, ("data",))

    def step() -> None:
        optimizer.zero_grad()
        _loss(model, images, labels).backward()
        optimizer.step()
        xm.mark_step()

    for _ in range(3):  # compile (the first two steps differ: momentum buffers appear)
        step()
    xm.wait_device_ops()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    xm.wait_device_ops()
    return steps / (time.perf_counter() - start)


def _xla_strategies(batch: int, steps: int) -> float:
    import jax
    import torch

    import xla_strategies as xs

    xs.emulate_cpu_devices(DEVICES)
    import xla_strategies.torch as xst

    strategy = xs.MirroredStrategy()
    model = _model()
    state = xst.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    @strategy.compile(donate_argnums=0)
    def train_step(state, images, labels):
        return xst.train_step(state, _loss, images, labels)

    images, labels = next(iter(strategy.experimental_distribute_dataset([_batch(batch)])))
    for _ in range(3):
        state, loss = train_step(state, images, labels)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, loss = train_step(state, images, labels)
    jax.block_until_ready((state, loss))
    return steps / (time.perf_counter() - start)


def _torch_xla_one_device(batch: int, steps: int) -> float:
    return _torch_xla(batch, steps, data_parallel=False)


# torch_xla on one device is not a peer (no data parallelism); it shows what torch_xla's
# SPMD partitioning costs on the emulated devices.
WORKERS = {
    "torch_xla": _torch_xla,
    "xla_strategies": _xla_strategies,
    "torch_xla_one_device": _torch_xla_one_device,
}


def _measure(worker: str, batch: int, steps: int) -> float:
    command = [sys.executable, "-m", "benchmarks.torch_step", "--worker", worker]
    command += ["--global-batch", str(batch), "--steps", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{worker} worker failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(WORKERS[args.worker](args.global_batch, args.steps))
        return

    from tqdm import tqdm

    rates: dict[str, list[float]] = {name: [] for name in WORKERS}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name in WORKERS:
            rates[name].append(_measure(name, args.global_batch, args.steps))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["xla_strategies"] / medians["torch_xla"]
    result = {
        "global_batch": args.global_batch,
        "devices": DEVICES,
        "steps_per_second": rates,
        "median_steps_per_second": medians,
        "ratio_ours_over_torch_xla": ratio,
        "goal": 1.5,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "torch_step.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, value in medians.items():
        print(f"{name:>20}: {value:7.2f} steps/s  (rounds: {rates[name]})")
    print(f"ratio ours / torch_xla: {ratio:.2f}x (goal 1.5x)")


if __name__ == "__main__":
    main()
