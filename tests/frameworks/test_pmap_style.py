"""A step written for `jax.pmap(..., axis_name="batch")`, run unchanged under
`compile(axis_name="batch")` and compared with `jax.pmap` itself on the same devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import xla_strategies as xs
from tests.frameworks.reference import R, assert_trees_close

tx = optax.sgd(0.1, momentum=0.9)


def train_step(params, opt_state, batch):
    """The pmap idiom: local gradients, `pmean` over the named axis, metrics reduced too."""

    def loss_fn(params):
        logits = jnp.tanh(batch["x"] @ params["w"] + params["b"])
        return jnp.mean((logits - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = lax.pmean(grads, axis_name="batch")
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics = {
        "loss": lax.pmean(loss, axis_name="batch"),
        "examples": lax.psum(batch["x"].shape[0], axis_name="batch"),
    }
    return optax.apply_updates(params, updates), opt_state, metrics


def test_pmap_step_equals_pmap():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
    batches = [
        {
            "x": rng.normal(size=(16, 3)).astype(np.float32),
            "y": rng.normal(size=(16, 2)).astype(np.float32),
        }
        for _ in range(3)
    ]
    strategy = xs.MirroredStrategy()
    compiled = strategy.compile(train_step, axis_name="batch")
    pmapped = jax.pmap(train_step, axis_name="batch")
    ours = strategy.replicate((params, tx.init(params)))
    theirs = jax.tree.map(lambda a: np.stack([a] * R), (params, tx.init(params)))
    dataset = strategy.experimental_distribute_dataset(batches)
    for local, batch in zip(dataset, batches, strict=True):
        *ours, metrics = compiled(*ours, local)
        *theirs, their_metrics = pmapped(*theirs, jax.tree.map(_shard, batch))
    assert_trees_close(ours, jax.tree.map(lambda a: a[0], theirs))
    np.testing.assert_allclose(float(metrics["loss"]), their_metrics["loss"][0], rtol=1e-6)
    assert int(metrics["examples"]) == 16
    # the user's pmean of gradients costs nothing: autodiff already reduced them
    graph = compiled.graph(*ours, local, after="fold-invariant-reductions")
    reduced = [n for n in graph.walk() if n.op == "all_reduce"]
    assert [n.attrs["origin"] for n in reduced].count("user") == 1  # the loss metric


def _shard(a):
    return a.reshape(R, -1, *a.shape[1:])
