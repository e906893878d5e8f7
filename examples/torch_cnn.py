"""Train a PyTorch CNN with BatchNorm data-parallel on MirroredStrategy: the module, the
loss and the `torch.optim` optimizer are plain PyTorch, and `@strategy.compile` captures
the step through torchax.

python examples/torch_cnn.py --steps 30
xla-strategies dump --stop-after-compile -- python examples/torch_cnn.py
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import xla_strategies as xs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc = nn.Linear(32 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.fc(torch.flatten(x, 1))


def compute_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor):
    return F.cross_entropy(model(images), labels.long())


def dataset(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """16x16 images whose label is the brightest of four quadrants."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(rows, 3, 16, 16)).astype(np.float32)
    labels = rng.integers(0, 4, rows)
    for row, label in enumerate(labels):
        top, left = divmod(int(label), 2)
        images[row, :, top * 8 : top * 8 + 8, left * 8 : left * 8 + 8] += 1.0
    return images, labels.astype(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    xs.emulate_cpu_devices(8)
    import xla_strategies.torch as xst  # after the devices are set up

    strategy = xs.MirroredStrategy()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    state = xst.TrainState.create(model, optimizer)

    @strategy.compile(donate_argnums=0)
    def train_step(state, images, labels):
        return xst.train_step(state, compute_loss, images, labels)

    images, labels = dataset(args.batch_size * args.steps)
    batches = [
        (images[i : i + args.batch_size], labels[i : i + args.batch_size])
        for i in range(0, len(images), args.batch_size)
    ]
    print(f"{strategy}: a torch CNN with BatchNorm, global batch {args.batch_size}")
    for step, batch in enumerate(strategy.experimental_distribute_dataset(batches)):
        state, loss = train_step(state, *batch)
        scheduler.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {float(strategy.reduce('mean', loss, axis=None)):.3f}")

    model.load_state_dict(state.state_dict())  # the trained weights back in the module
    model.eval()
    test_images, test_labels = dataset(512, seed=1)
    with torch.no_grad():
        predicted = model(torch.from_numpy(test_images)).argmax(-1).numpy()
    accuracy = float((predicted == test_labels).mean())
    print(f"eager torch, trained weights: test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
