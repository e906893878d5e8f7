"""haiku's `transform_with_state` with BatchNorm, as haiku's docs write it."""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import xla_strategies as xs
from tests.frameworks.reference import (
    R,
    assert_trees_close,
    distribute,
    mean_of,
    regression_batches,
    replica_slices,
)
from xla_strategies.core.layout import Layout


def forward(x, is_training):
    x = hk.Linear(8, with_bias=False)(x)  # BatchNorm follows: a bias would do nothing
    x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(x, is_training)
    return hk.Linear(1)(jax.nn.relu(x))


model = hk.transform_with_state(forward)
tx = optax.sgd(0.05, momentum=0.9)


def loss_fn(params, state, x, y):
    out, state = model.apply(params, state, None, x, is_training=True)
    return jnp.mean((out - y) ** 2), state


def train_step(params, state, opt_state, x, y):
    (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, loss


def test_transform_with_state_batchnorm():
    batches = regression_batches(3, rows=32, inputs=5, outputs=1)
    params, state = model.init(jax.random.key(0), batches[0][0], is_training=True)
    strategy = xs.MirroredStrategy()
    step = strategy.compile(train_step)
    ours = (params, state, tx.init(params))
    for x, y in distribute(strategy, batches):
        *ours, _ = step(*ours, x, y)
    new_params, new_state, _ = ours
    average = new_state["batch_norm/~/mean_ema"]["average"]
    assert average.shape == (R, 1, 8) and strategy.layout(average) is Layout.STACKED
    counter = new_state["batch_norm/~/mean_ema"]["counter"]
    assert strategy.layout(counter) is Layout.MIRRORED and int(counter) == 3

    ref_params, states, ref_opt = params, [state] * R, tx.init(params)
    for batch in batches:
        grads = []
        for r, (x, y) in enumerate(replica_slices(batch)):
            fn = functools.partial(loss_fn, state=states[r], x=x, y=y)
            (_, states[r]), grad = jax.value_and_grad(fn, has_aux=True)(ref_params)
            grads.append(grad)
        updates, ref_opt = tx.update(mean_of(grads), ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    assert_trees_close(new_params, ref_params)
    assert_trees_close(new_state, jax.tree.map(lambda *s: np.stack(s), *states))


def test_an_lstm_unrolled_from_a_zero_state_equals_jax_jit():
    """haiku's docs unroll an LSTM from `initial_state`: zeros, the same on every replica,
    which the first step makes this replica's own. pmap code never had to say so."""

    def forward(x):
        core = hk.LSTM(8)
        out, _ = hk.dynamic_unroll(core, x, core.initial_state(x.shape[0]), time_major=False)
        return hk.Linear(1)(out[:, -1])

    net = hk.without_apply_rng(hk.transform(forward))
    tx = optax.sgd(0.1)
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.normal(size=(16, 5, 3)).astype(np.float32),
            rng.normal(size=(16, 1)).astype(np.float32),
        )
        for _ in range(3)
    ]
    params = net.init(jax.random.key(0), batches[0][0])

    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jnp.mean((net.apply(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    strategy = xs.MirroredStrategy()
    compiled = strategy.compile(step, donate_argnums=(0, 1))
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    for batch in strategy.experimental_distribute_dataset(batches):
        state = compiled(*state, *batch)
    expected = params, tx.init(params)
    for x, y in batches:
        expected = jax.jit(step)(*expected, x, y)
    assert_trees_close(state[0], expected[0])
