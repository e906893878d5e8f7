"""Exact GELU (`jax.nn.gelu(approximate=False)`, as flax's and torch's defaults write it)
runs on every strategy and equals the single-device run. On JAX 0.12 its `erf` evaluates a
`polynomial` primitive whose constant coefficients JAX's varying-axes check rejected."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests.frameworks.reference import (
    assert_trees_close,
    distribute,
    linen_regression_step,
    regression_batches,
)


class MLP(nn.Module):
    """A flax linen MLP with the exact GELU, as BERT-style models write it."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(features=16)(x)
        x = nn.gelu(x, approximate=False)
        return nn.Dense(features=2)(x)


def _setup():
    model = MLP()
    batches = regression_batches(steps=3, rows=16, inputs=4, outputs=2)
    params = model.init(jax.random.key(0), batches[0][0])["params"]
    tx = optax.sgd(0.1)
    return linen_regression_step(model, tx), params, tx, batches


@pytest.mark.parametrize("make_strategy", [xs.OneDeviceStrategy, xs.MirroredStrategy])
def test_exact_gelu_trains_as_on_one_device(make_strategy):
    train_step, params, tx, batches = _setup()
    expected, opt_state = params, tx.init(params)
    single = jax.jit(train_step)
    for batch in batches:
        expected, opt_state, _ = single(expected, opt_state, batch)

    strategy = make_strategy()
    step = strategy.compile(train_step)
    state = strategy.replicate((params, tx.init(params)))
    for batch in distribute(strategy, batches):
        *state, _ = step(*state, batch)
    assert_trees_close(jax.tree.map(np.asarray, state[0]), expected)


def test_exact_gelu_inside_the_step_keeps_its_meaning():
    """The erf itself, not only its gradient: each replica's activations come back."""
    strategy = xs.MirroredStrategy()
    x = np.linspace(-3, 3, 8 * 4, dtype=np.float32).reshape(8, 4)
    step = strategy.compile(lambda x: jax.nn.gelu(x, approximate=False))
    (batch,) = distribute(strategy, [x])
    got = np.asarray(step(batch)).reshape(8, 4)
    np.testing.assert_allclose(got, jax.nn.gelu(x, approximate=False), rtol=1e-6, atol=1e-7)
