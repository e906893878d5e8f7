"""A `torch.optim.lr_scheduler` stepped every step, as torch's docs write it: the new
learning rate reaches the compiled step, which compiles once where torch's optimizer reads
the rate as a tensor (`traced_hyperparameters.py`), against eager torch's data-parallel
training (tests/torch_models/models.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import xla_strategies as xs
import xla_strategies.torch as xst
from tests.frameworks.reference import TOL
from tests.torch_models.models import classification_loss, eager_data_parallel, image_batches
from xla_strategies.torch.traced_hyperparameters import TRACED

optim, S = torch.optim, torch.optim.lr_scheduler
STEPS = 4

# name: (optimizer, scheduler)
CASES = {
    "sgd-steplr": (lambda m: optim.SGD(m.parameters(), lr=0.1), lambda o: S.StepLR(o, 1, 0.5)),
    "sgd-momentum-lambdalr": (
        lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda o: S.LambdaLR(o, lambda step: 1 / (1 + step)),
    ),
    # OneCycleLR also cycles Adam's betas[0] every step
    "adam-onecycle": (
        lambda m: optim.Adam(m.parameters(), lr=1e-3),
        lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS),
    ),
    "adamw-cosine": (
        lambda m: optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
        lambda o: S.CosineAnnealingLR(o, T_max=STEPS),
    ),
    "nadam-exponential": (
        lambda m: optim.NAdam(m.parameters(), lr=1e-2),
        lambda o: S.ExponentialLR(o, 0.5),
    ),
    "radam-exponential": (
        lambda m: optim.RAdam(m.parameters(), lr=1e-2),
        lambda o: S.ExponentialLR(o, 0.5),
    ),
    # OneCycleLR cycles SGD's momentum too
    "sgd-momentum-onecycle": (
        lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        lambda o: S.OneCycleLR(o, max_lr=0.2, total_steps=STEPS),
    ),
    "rmsprop-onecycle": (
        lambda m: optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5),
        lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS),
    ),
    "adagrad-steplr": (
        lambda m: optim.Adagrad(m.parameters(), lr=1e-2, lr_decay=0.1),
        lambda o: S.StepLR(o, 1, 0.5),
    ),
    "adadelta-steplr": (
        lambda m: optim.Adadelta(m.parameters(), lr=1.0),
        lambda o: S.StepLR(o, 1, 0.5),
    ),
}


# RMSprop's update of a weight whose gradient is near 0 is about lr * sign(gradient), so in
# float32 the order in which gradients are summed (per replica, then across replicas, as
# against eager torch's one backward pass) decides a few weights' steps, and that order is
# the CPU's. In float64 the sums agree to far below the tolerance: it runs there.
FLOAT64 = {"rmsprop-onecycle"}


@pytest.mark.parametrize("case", CASES)
def test_a_scheduled_learning_rate_matches_eager_torch(case):
    if case not in FLOAT64:
        _check_schedule(case, np.float32)
        return
    with jax.enable_x64(True):
        _check_schedule(case, np.float64)


def _check_schedule(case: str, dtype: type) -> None:
    make_optimizer, make_scheduler = CASES[case]
    torch.manual_seed(0)
    model = torch.nn.Sequential(  # a classifier as torch's tutorials build one
        torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    ).to(torch.float64 if dtype == np.float64 else torch.float32)
    batches = [(x.astype(dtype), y) for x, y in image_batches(STEPS)]
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    strategy = xs.MirroredStrategy()
    state = xst.TrainState.create(model, optimizer)

    @strategy.compile
    def train_step(state, *batch):
        return xst.train_step(state, classification_loss, *batch)

    programs = []
    for batch in strategy.experimental_distribute_dataset(batches):
        state, _ = train_step(state, *batch)
        scheduler.step()
        programs.append(train_step.cache_size)

    reference, _, _ = eager_data_parallel(
        model, make_optimizer, classification_loss, batches, make_scheduler=make_scheduler
    )
    # a torch optimizer makes its state in its first step (a new structure: one more
    # program); after that, every new rate runs the same program
    assert programs[1:] == [programs[1]] * (STEPS - 1) and programs[1] <= 2, programs
    for name, param in reference.named_parameters():
        assert np.asarray(state.params[name]).dtype == dtype, name
        np.testing.assert_allclose(
            np.asarray(state.params[name]), param.detach().numpy(), **TOL, err_msg=name
        )


def test_every_traced_optimizer_is_tested():
    tested = {type(make(torch.nn.Linear(1, 1))) for make, _ in CASES.values()}
    assert tested == set(TRACED)
