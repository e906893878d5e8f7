"""flax NNX's stateful style, as its MNIST tutorial writes the step: `train_step(model,
optimizer, metrics, batch)` changes its arguments in place and returns nothing. As under
`nnx.jit`, the changed variables are written back to the caller's objects, the metrics
covering the global batch; a change to anything that is not an NNX variable is an error,
never a step that silently changes nothing."""

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


def tutorial_train_step(model, optimizer, metrics, batch):  # as the tutorial writes it
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    optimizer.update(model, grads)


def _metrics():
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


def _batches(n=3):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(16, 4)).astype(np.float32),
            "y": rng.integers(0, 3, size=16).astype(np.int32),
        }
        for _ in range(n)
    ]


def _assert_same_params(got, want):
    flat = [nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (got, want)]
    for (_, g), (_, w) in zip(*flat, strict=True):
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(w[...]), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("make_strategy", [xs.OneDeviceStrategy, xs.MirroredStrategy])
def test_the_tutorials_in_place_step_trains_like_nnx_jit(make_strategy):
    expected, expected_optimizer = _objects()
    expected_metrics = _metrics()
    reference = nnx.jit(tutorial_train_step)
    for batch in _batches():
        reference(expected, expected_optimizer, expected_metrics, batch)

    strategy = make_strategy()
    train_step = strategy.compile(tutorial_train_step)
    model, optimizer = _objects()
    metrics = _metrics()
    for batch in strategy.experimental_distribute_dataset(_batches()):
        assert train_step(model, optimizer, metrics, batch) is None
    assert int(optimizer.step[...]) == 3
    _assert_same_params(model, expected)
    got, want = metrics.compute(), expected_metrics.compute()
    assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)  # global batch
    assert float(got["accuracy"]) == float(want["accuracy"])
    # a scalar loss is one update per step, as under nnx.jit; accuracy counts every row
    assert int(metrics.loss.count[...]) == int(expected_metrics.loss.count[...]) == 3
    assert int(metrics.accuracy.count[...]) == int(expected_metrics.accuracy.count[...]) == 48
    metrics.reset()
    assert int(metrics.loss.count[...]) == 0


def test_batch_statistics_changed_in_place_are_averaged_over_replicas():
    class Normalized(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
            self.linear = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.linear(self.norm(x))

    def step(model, optimizer, batch):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)

    batch = _batches(1)[0]
    model = Normalized(nnx.Rngs(0))
    strategy = xs.MirroredStrategy()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    strategy.compile(step)(
        model, optimizer, next(iter(strategy.experimental_distribute_dataset([batch])))
    )
    # per replica: 0.5 * 0 + 0.5 * its rows' mean; their mean is half the global mean
    np.testing.assert_allclose(
        np.asarray(model.norm.mean[...]), 0.5 * batch["x"].mean(0), rtol=1e-5, atol=1e-6
    )
    per_replica_vars = batch["x"].reshape(8, 2, 4).var(1)
    np.testing.assert_allclose(
        np.asarray(model.norm.var[...]), 0.5 + 0.5 * per_replica_vars.mean(0), rtol=1e-5
    )


def test_a_change_in_place_to_anything_else_is_an_error():
    strategy = xs.MirroredStrategy()

    @strategy.compile
    def step(params, batch):
        params["w"] = params["w"] - 0.1 * batch["x"].mean()

    params = {"w": np.ones(3, np.float32)}
    batch = next(iter(strategy.experimental_distribute_dataset(_batches(1))))
    with pytest.raises(xs.errors.DroppedMutationError, match=r"step changed args\[0\]\['w'\]"):
        step(params, batch)
    np.testing.assert_array_equal(params["w"], 1.0)


def test_a_parameter_that_differs_across_replicas_is_named():
    strategy = xs.MirroredStrategy()

    @strategy.compile
    def step(model, batch):
        model.linear1.bias[...] = model.linear1.bias[...] + batch["x"].mean()  # per replica

    model, _ = _objects()
    batch = next(iter(strategy.experimental_distribute_dataset(_batches(1))))
    with pytest.raises(xs.MirroredOutputError, match=r"linear1.*bias.*in place"):
        step(model, batch)


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
    assert int(optimizer.step[...]) == 3
    _assert_same_params(model, expected)
