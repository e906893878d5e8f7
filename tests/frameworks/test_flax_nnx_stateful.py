"""flax NNX's stateful style, as its MNIST tutorial writes the step: `train_step(model,
optimizer, metrics, batch)` changes its arguments in place and returns nothing. A compiled
step works on copies of its arguments, so those changes cannot reach the caller: that is an
error that says what to return, never a step that silently trains nothing. The same step
returning its objects trains like `nnx.jit`."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import xla_strategies as xs


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(4, 16, rngs=rngs)
        self.linear2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


def _objects():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return model, optimizer


def _batch():
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(16, 4)).astype(np.float32),
        "y": rng.integers(0, 3, size=16).astype(np.int32),
    }


def test_the_tutorials_in_place_step_is_an_error_not_a_silent_no_op():
    strategy = xs.MirroredStrategy()

    @strategy.compile
    def train_step(model, optimizer, metrics, batch):  # as the tutorial writes it
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])
        optimizer.update(model, grads)

    model, optimizer = _objects()
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    kernel = np.asarray(model.linear1.kernel.value).copy()
    batch = next(iter(strategy.experimental_distribute_dataset([_batch()])))
    with pytest.raises(xs.errors.DroppedMutationError, match=r"train_step changed args\[0\]"):
        train_step(model, optimizer, metrics, batch)
    np.testing.assert_array_equal(np.asarray(model.linear1.kernel.value), kernel)


def test_the_same_step_returning_its_objects_trains_like_nnx_jit():
    @nnx.jit
    def reference_step(model, optimizer, batch):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss

    expected, expected_optimizer = _objects()
    for _ in range(3):
        reference_step(expected, expected_optimizer, _batch())

    strategy = xs.MirroredStrategy()

    @strategy.compile
    def train_step(model, optimizer, batch):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return model, optimizer, loss

    model, optimizer = _objects()
    batch = next(iter(strategy.experimental_distribute_dataset([_batch()])))
    for _ in range(3):
        model, optimizer, _ = train_step(model, optimizer, batch)
    assert int(optimizer.step.value) == 3
    for got, want in zip(
        nnx.state(model, nnx.Param).flat_state(),
        nnx.state(expected, nnx.Param).flat_state(),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(got[1].value), np.asarray(want[1].value), rtol=2e-5, atol=1e-6
        )
