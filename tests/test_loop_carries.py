"""Gradient accumulation over micro-batches in a loop, as users write it: the updated
parameters are the same on every replica and come back mirrored, whatever else the loop's
carry holds (a loss that differs per replica), so the next step still reduces gradients and
the run matches `OneDeviceStrategy`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests.helpers import max_relative_error
from xla_strategies.core.layout import Layout

MICRO = 4  # micro-batches per step


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))[:, 0]


MODEL = MLP()
TX = optax.sgd(0.1)  # a gradient that is not reduced, or reduced twice, shows


def _loss(params, x, y):
    return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)


def _micro_batch(batch, i):
    rows = batch["x"].shape[0] // MICRO
    return (
        jax.lax.dynamic_slice_in_dim(batch["x"], i * rows, rows),
        jax.lax.dynamic_slice_in_dim(batch["y"], i * rows, rows),
    )


def _fori(params, batch, traced_trips):
    def body(i, carry):
        loss_sum, grad_sum = carry
        loss, grads = jax.value_and_grad(_loss)(params, *_micro_batch(batch, i))
        return loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)

    trips = batch["trips"][0] if traced_trips else MICRO
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.lax.fori_loop(0, trips, body, (0.0, zeros))


def _grads_only(params, batch, traced_trips):
    def body(i, grad_sum):
        grads = jax.grad(_loss)(params, *_micro_batch(batch, i))
        return jax.tree.map(jnp.add, grad_sum, grads)

    grads = jax.lax.fori_loop(0, MICRO, body, jax.tree.map(jnp.zeros_like, params))
    return jnp.zeros(()), grads


def _scan(params, batch, traced_trips):
    def body(carry, i):
        loss_sum, grad_sum = carry
        loss, grads = jax.value_and_grad(_loss)(params, *_micro_batch(batch, i))
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss_sum, grads), _ = jax.lax.scan(body, (0.0, zeros), jnp.arange(MICRO))
    return loss_sum, grads


def _while(params, batch, traced_trips):
    def body(carry):
        i, loss_sum, grad_sum = carry
        loss, grads = jax.value_and_grad(_loss)(params, *_micro_batch(batch, i))
        return i + 1, loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)

    zeros = jax.tree.map(jnp.zeros_like, params)
    _, loss_sum, grads = jax.lax.while_loop(lambda c: c[0] < MICRO, body, (0, 0.0, zeros))
    return loss_sum, grads


def _train(strategy, accumulate, traced_trips, **options):
    params = MODEL.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    with strategy.scope():
        state = strategy.replicate(params), strategy.replicate(TX.init(params))

    @strategy.compile(**options)
    def step(params, opt_state, batch):
        loss_sum, grads = accumulate(params, batch, traced_trips)
        grads = jax.tree.map(lambda g: g / MICRO, grads)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_sum / MICRO

    rng = np.random.default_rng(1)
    batches = [
        {
            "x": rng.normal(size=(64, 4)).astype(np.float32),
            "y": rng.normal(size=64).astype(np.float32),
            "trips": np.full(64, MICRO, np.int32),
        }
        for _ in range(3)
    ]
    for batch in strategy.experimental_distribute_dataset(batches):
        *state, _ = step(*state, batch)
    return state[0]


@pytest.mark.parametrize(
    "accumulate, traced_trips",
    [(_fori, False), (_fori, True), (_grads_only, False), (_scan, False), (_while, False)],
    ids=["fori", "fori-traced-trips", "fori-grads-only", "scan", "while"],
)
def test_accumulated_gradients_update_mirrored_parameters(accumulate, traced_trips):
    want = _train(xs.OneDeviceStrategy(), accumulate, traced_trips)
    strategy = xs.MirroredStrategy()
    got = _train(strategy, accumulate, traced_trips)
    for leaf in jax.tree.leaves(got):
        assert strategy.layout(leaf) is Layout.MIRRORED, leaf.shape
    assert max_relative_error(jax.tree.map(np.asarray, got), want) < 1e-4


def test_declaring_the_accumulated_update_mirrored_is_not_refused():
    strategy = xs.MirroredStrategy()
    got = _train(strategy, _fori, False, mirrored_outputs=(True, True, False))
    want = _train(xs.OneDeviceStrategy(), _fori, False)
    assert max_relative_error(jax.tree.map(np.asarray, got), want) < 1e-4
