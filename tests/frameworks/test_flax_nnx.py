"""flax NNX through its functional API (`nnx.split` / `nnx.merge`), as NNX's docs write
it: BatchNorm statistics, Dropout drawing from `nnx.Rngs`, and the optax update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

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


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 8, use_bias=False, rngs=rngs)  # BatchNorm follows
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.bn(self.linear(x)))))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train_step(graphdef, state, x, y):
    """NNX's functional training step: merge, `nnx.value_and_grad`, `Optimizer.update`,
    and the new state back out."""
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))


def _new_state():
    model = Model(nnx.Rngs(0, dropout=1))
    return nnx.split((model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)))


def test_nnx_split_merge_with_batchnorm_dropout_and_rngs():
    graphdef, state = _new_state()
    batches = regression_batches(3, rows=32, inputs=3, outputs=1)
    strategy = xs.MirroredStrategy()
    step = strategy.compile(train_step)
    ours = state
    for x, y in distribute(strategy, batches):
        loss, ours = step(graphdef, ours, x, y)
    model_state = ours[0]
    mean = model_state["bn"]["mean"].value
    assert mean.shape == (R, 8) and strategy.layout(mean) is Layout.STACKED
    count = model_state["dropout"]["rngs"]["count"].value
    assert strategy.layout(count) is Layout.MIRRORED and int(count) == 3
    assert jnp.issubdtype(model_state["dropout"]["rngs"]["key"].value.dtype, jax.dtypes.prng_key)
    assert loss.shape == (R,)

    # by hand: every replica merges the same state with its own statistics, on its slice,
    # and draws its dropout mask from the stream key folded with its replica id
    shared, stats = state, [None] * R
    for batch in batches:
        grads = []
        for r, (x, y) in enumerate(replica_slices(batch)):
            # a copy: an eager merge shares the state's variables, rng counts included
            model, optimizer = nnx.merge(graphdef, jax.tree.map(jnp.array, shared))
            if stats[r] is not None:
                nnx.update(model, stats[r])
            stream = model.dropout.rngs
            key = stream.key[...]
            stream.key[...] = jax.random.fold_in(key, r)
            grads.append(nnx.value_and_grad(loss_fn)(model, x, y)[1])
            stats[r] = nnx.state(model, nnx.BatchStat)
            stream.key[...] = key
            if r == 0:
                first = model, optimizer
        model, optimizer = first
        optimizer.update(model, mean_of(grads))
        shared = nnx.state((model, optimizer))
    assert_trees_close(
        nnx.state(nnx.merge(graphdef, ours)[0], nnx.Param),
        nnx.state(nnx.merge(graphdef, shared)[0], nnx.Param),
    )
    assert_trees_close(mean, np.stack([s["bn"]["mean"].value for s in stats]))
