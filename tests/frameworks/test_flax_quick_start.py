"""flax's "Quick start", as its docs write it: a linen CNN, a `TrainState` with
`optax.sgd(learning_rate, momentum)`, and a `train_step(state, batch)` that returns the new
state alone. Handed to the strategy in place of `jax.jit`, the `TrainState` it returns is
the state it takes: its momentum is held split across the replicas under weight-update
sharding, and, as under `jax.jit`, it is donated only when `donate_argnums` says so."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import xla_strategies as xs
from tests.frameworks.reference import assert_trees_close, distribute


class CNN(nn.Module):
    """A simple CNN model."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


def create_train_state(module, rng, learning_rate, momentum):
    """Creates an initial `TrainState`."""
    params = module.init(rng, jnp.ones([1, 28, 28, 1]))["params"]
    tx = optax.sgd(learning_rate, momentum)
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)


def train_step(state, batch):
    """Train for a single step."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=batch["label"]
        ).mean()
        return loss

    grad_fn = jax.grad(loss_fn)
    grads = grad_fn(state.params)
    state = state.apply_gradients(grads=grads)
    return state


def _train(**options):
    """The quick start's three steps under jax.jit and under a MirroredStrategy compiled
    with `options`: (ours, jax.jit's, every state our step took, the strategy)."""
    rng = np.random.default_rng(0)
    batches = [
        {
            "image": rng.normal(size=(16, 28, 28, 1)).astype(np.float32),
            "label": rng.integers(0, 10, size=16),
        }
        for _ in range(3)
    ]
    cnn = CNN()
    expected = create_train_state(cnn, jax.random.key(0), 0.01, 0.9)
    jitted = jax.jit(train_step)
    for batch in batches:
        expected = jitted(expected, batch)

    strategy = xs.MirroredStrategy()
    step = strategy.compile(train_step, **options)
    state = create_train_state(cnn, jax.random.key(0), 0.01, 0.9)
    previous = []
    for batch in distribute(strategy, batches):
        previous.append(state)
        state = step(state, batch)
    assert int(state.step) == int(expected.step) == 3
    assert_trees_close(state.params, expected.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.opt_state, expected.opt_state, rtol=1e-5, atol=1e-6)
    # nothing was declared donated: every state a step took is still there, as under jax.jit
    assert not any(p.params["Dense_0"]["kernel"].is_deleted() for p in previous)
    return state, strategy


def _unsplit(tree, strategy) -> list[str]:
    """The paths of `tree`'s non-scalar leaves not held split across the replicas."""
    return [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if leaf.ndim and not strategy.is_held_sharded(leaf)
    ]


def test_the_quick_start_train_step_shards_its_momentum_and_equals_jax_jit():
    state, strategy = _train(shard_weight_updates=True)
    # every momentum leaf with a dimension that divides by 8 is held split: not the 10 biases
    assert _unsplit(state.opt_state, strategy) == ["[0].trace['Dense_1']['bias']"]
    assert len([leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim]) == 8


def test_parameter_sharding_holds_the_train_state_split_and_equals_jax_jit():
    """A TrainState is the step's state without any declaration: with
    `shard_parameters=True` its parameters are held split too."""
    state, strategy = _train(shard_parameters=True)
    assert _unsplit(state.params, strategy) == ["['Dense_1']['bias']"]
    assert _unsplit(state.opt_state, strategy) == ["[0].trace['Dense_1']['bias']"]
