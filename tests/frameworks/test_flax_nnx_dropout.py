"""flax NNX Dropout under a strategy: each replica draws its own mask, from its stream's
key with the replica id folded in, and the stream advances as under `nnx.jit`. On one
replica a step draws exactly what `nnx.jit` draws."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import xla_strategies as xs
from tests.frameworks.reference import R, mean_of, replica_slices
from xla_strategies.core.layout import Layout


class MLP(nnx.Module):  # as flax's docs write a model with dropout
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(4, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.linear2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train_step(model, optimizer, x, y):  # the tutorial's in-place style
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def _objects():
    model = MLP(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _batches(n=2):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32))
        for _ in range(n)
    ]


def _params(model):
    return [np.asarray(v[...]) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def test_on_one_replica_the_masks_are_nnx_jits():
    expected, expected_optimizer = _objects()
    for x, y in _batches():
        nnx.jit(train_step)(expected, expected_optimizer, x, y)
    strategy = xs.OneDeviceStrategy()
    step = strategy.compile(train_step)
    model, optimizer = _objects()
    for x, y in strategy.experimental_distribute_dataset(_batches()):
        step(model, optimizer, x, y)
    for got, want in zip(_params(model), _params(expected), strict=True):
        np.testing.assert_array_equal(got, want)


def test_replicas_draw_their_own_masks_and_the_stream_advances_as_under_nnx_jit():
    strategy = xs.MirroredStrategy()
    step = strategy.compile(train_step)
    model, optimizer = _objects()
    key_before = jax.random.key_data(model.dropout.rngs.key[...])
    for x, y in strategy.experimental_distribute_dataset(_batches()):
        step(model, optimizer, x, y)
    assert int(model.dropout.rngs.count[...]) == 2  # one draw per step, as nnx.jit counts
    np.testing.assert_array_equal(jax.random.key_data(model.dropout.rngs.key[...]), key_before)

    # by hand, eagerly: replica r draws from the stream key folded with r, on its slice
    shared, shared_optimizer = _objects()
    for x, y in _batches():
        grads = []
        for r, (xr, yr) in enumerate(replica_slices((x, y))):
            replica = nnx.clone(shared)
            stream = replica.dropout.rngs
            stream.key[...] = jax.random.fold_in(stream.key[...], r)
            grads.append(nnx.grad(loss_fn)(replica, xr, yr))
        shared.dropout.rngs.count[...] += 1
        shared_optimizer.update(shared, mean_of(grads))
    for got, want in zip(_params(model), _params(shared), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_the_masks_differ_across_replicas():
    strategy = xs.MirroredStrategy()
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    kept = strategy.compile(lambda layer, x: layer(x) != 0)  # x is mirrored: one row each
    rows = np.asarray(kept(dropout, np.ones(64, np.float32)))
    assert rows.shape == (R, 64)
    assert len({row.tobytes() for row in rows}) == R
    assert 0.3 < rows.mean() < 0.7


@pytest.mark.parametrize("rngs_in", ["module", "split-state"])
def test_a_returned_stream_comes_back_mirrored(rngs_in):
    strategy = xs.MirroredStrategy()
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    key_before = jax.random.key_data(dropout.rngs.key[...])
    x = np.ones((R, 8), np.float32)
    if rngs_in == "module":
        _, returned = strategy.compile(lambda layer, x: (layer(x), layer))(dropout, x)
        stream = returned.rngs
    else:
        graphdef, state = nnx.split(dropout)

        def functional(state, x):
            layer = nnx.merge(graphdef, state)
            return layer(x), nnx.state(layer)

        _, state = strategy.compile(functional)(state, x)
        stream = nnx.merge(graphdef, state).rngs
    assert strategy.layout(stream.key[...]) is Layout.MIRRORED
    np.testing.assert_array_equal(jax.random.key_data(stream.key[...]), key_before)
    assert int(stream.count[...]) == 1
