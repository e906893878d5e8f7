"""PyTorch's Quickstart tutorial as its docs write it (FashionMNIST-shaped random data, so
nothing is downloaded): a `DataLoader`, the `NeuralNetwork` module, `nn.CrossEntropyLoss`,
`torch.optim.SGD` and its `train(dataloader, model, loss_fn, optimizer)` loop, with the
step handed to the strategy. Compared with the tutorial's own eager loop."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import xla_strategies as xs
import xla_strategies.torch as xst


class NeuralNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits


def test_quickstart_with_a_dataloader_matches_the_tutorials_eager_loop():
    generator = torch.Generator().manual_seed(0)
    training_data = TensorDataset(
        torch.rand(640, 1, 28, 28, generator=generator),
        torch.randint(0, 10, (640,), generator=generator),
    )
    train_dataloader = DataLoader(training_data, batch_size=64)
    torch.manual_seed(0)
    model = NeuralNetwork()
    eager = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    strategy = xs.MirroredStrategy()
    state = xst.TrainState.create(model, optimizer)

    @strategy.compile
    def train_step(state, X, y):
        return xst.train_step(state, lambda model, X, y: loss_fn(model(X), y), X, y)

    # the DataLoader yields torch tensors; the input pipeline reads them as arrays
    for X, y in strategy.experimental_distribute_dataset(train_dataloader):
        state, loss = train_step(state, X, y)
    assert train_step.cache_size == 1

    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=1e-3)
    eager.train()
    for X, y in train_dataloader:  # the tutorial's train()
        pred = eager(X)
        loss = loss_fn(pred, y)
        loss.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad()

    model.load_state_dict(state.state_dict())
    for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
        np.testing.assert_allclose(
            got.detach().numpy(), want.detach().numpy(), rtol=1e-4, atol=5e-6, err_msg=name
        )


def test_torch_tensors_passed_to_a_step_are_arrays_not_static_values():
    """Passed straight to the step (no input pipeline), torch tensors are traced like numpy
    arrays: new values reuse the program instead of being baked in as constants."""
    strategy = xs.MirroredStrategy()

    @strategy.compile
    def double(x):
        return x * 2

    for value in (1.0, 2.0):
        out = double(torch.full((4,), value))
        np.testing.assert_array_equal(np.asarray(out), np.full((4,), 2 * value, np.float32))
    assert double.cache_size == 1
