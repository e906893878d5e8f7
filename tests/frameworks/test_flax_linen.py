"""flax linen, written as flax's own docs write it: a TrainState with batch_stats, BatchNorm
with and without `axis_name`, Dropout with an rng, and a scanned, rematerialised LM with a
tied embedding."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import xla_strategies as xs
from tests import helpers
from tests.frameworks.reference import R, assert_trees_close, distribute, mean_of, replica_slices
from xla_strategies.core.layout import Layout


class TrainState(train_state.TrainState):
    batch_stats: Any
    key: jax.Array


class CNN(nn.Module):
    """The flax BatchNorm guide's model, made small."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(features=4, kernel_size=(3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(rate=0.25, deterministic=not train)(x)
        return nn.Dense(features=3)(x)


def _loss_fn(state, params, batch_stats, batch, dropout_key):
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": batch_stats},
        batch["image"],
        train=True,
        rngs={"dropout": dropout_key},
        mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, updates["batch_stats"]


def train_step(state, batch):
    """The guide's step; the dropout key is folded with the replica id (the per-replica
    RNG idiom), so each replica drops different units, as under pmap."""
    replica = xs.get_replica_context().replica_id_in_sync_group
    dropout_key = jax.random.fold_in(jax.random.fold_in(state.key, state.step), replica)
    (loss, batch_stats), grads = jax.value_and_grad(
        lambda p: _loss_fn(state, p, state.batch_stats, batch, dropout_key), has_aux=True
    )(state.params)
    state = state.apply_gradients(grads=grads)
    return state.replace(batch_stats=batch_stats), loss


def _setup():
    model = CNN()
    rng = np.random.default_rng(0)
    batches = [
        {
            "image": rng.normal(size=(16, 6, 6, 2)).astype(np.float32),
            "label": rng.integers(0, 3, size=16).astype(np.int32),
        }
        for _ in range(3)
    ]
    variables = model.init(jax.random.key(0), batches[0]["image"], train=False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        key=jax.random.key(1),
        tx=optax.adam(1e-2),
    )
    return state, batches


def _reference_step(ref, stats_per_replica, batch):
    """One data-parallel step by hand: each replica's gradient and statistics on its own
    slice, with its own dropout key, then the mean gradient."""
    grads, new_stats = [], []
    for r, (stats, part) in enumerate(zip(stats_per_replica, replica_slices(batch), strict=True)):
        key = jax.random.fold_in(jax.random.fold_in(ref.key, ref.step), r)
        loss_fn = functools.partial(_loss_fn, ref, batch_stats=stats, batch=part, dropout_key=key)
        (_, aux), grad = jax.value_and_grad(loss_fn, has_aux=True)(ref.params)
        grads.append(grad)
        new_stats.append(aux)
    return ref.apply_gradients(grads=mean_of(grads)), new_stats


def test_batchnorm_without_axis_name_keeps_per_replica_statistics():
    strategy = xs.MirroredStrategy()
    state, batches = _setup()
    step = strategy.compile(train_step)
    for batch in distribute(strategy, batches):
        state, loss = step(state, batch)
    stats = state.batch_stats["BatchNorm_0"]["mean"]
    assert stats.shape == (R, 4) and strategy.layout(stats) is Layout.STACKED

    # each replica ran BatchNorm on its own slice, with its own statistics
    ref, _ = _setup()
    stats_per_replica = [ref.batch_stats] * R
    for batch in batches:
        ref, stats_per_replica = _reference_step(ref, stats_per_replica, batch)
    assert_trees_close(state.params, ref.params)
    assert_trees_close(state.batch_stats, jax.tree.map(lambda *s: np.stack(s), *stats_per_replica))
    assert int(state.step) == 3 and loss.shape == (R,)


class _NoDropoutCNN(CNN):
    """Dropout off: one device cannot draw the masks of 8 replicas."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(features=4, kernel_size=(3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
        x = nn.relu(x)
        return nn.Dense(features=3)(x.reshape((x.shape[0], -1)))


def _bn_step(model):
    def step(state, batch):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state.batch_stats},
                batch["image"],
                train=True,
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            return loss.mean(), updates["batch_stats"]

        (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads).replace(batch_stats=stats)

    return step


def test_batchnorm_with_axis_name_equals_one_device_on_the_global_batch():
    """BatchNorm(axis_name="batch") under compile(axis_name="batch") normalises over the
    global batch, so it equals one device without an axis name on the whole batch."""
    strategy = xs.MirroredStrategy()
    state, batches = _setup()
    compiled = strategy.compile(_bn_step(_NoDropoutCNN(axis_name="batch")), axis_name="batch")
    reference = jax.jit(_bn_step(_NoDropoutCNN()))
    ours, ref = state, state
    for local, batch in zip(distribute(strategy, batches), batches, strict=True):
        ours = compiled(ours, local)
        ref = reference(ref, batch)
    assert strategy.layout(ours.batch_stats["BatchNorm_0"]["mean"]) is Layout.MIRRORED
    assert_trees_close(ours.params, ref.params)
    assert_trees_close(ours.batch_stats, ref.batch_stats)


def test_scanned_remat_lm_with_tied_embedding_equals_one_device():
    model = helpers.ScannedLM()
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 11, size=(16, 6)).astype(np.int32) for _ in range(3)]
    params = model.init(jax.random.key(0), batches[0][:, :-1])["params"]
    tx = optax.adamw(1e-2)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    strategy = xs.MirroredStrategy()
    compiled = strategy.compile(step)
    reference = jax.jit(step)
    ours = strategy.replicate((params, tx.init(params)))
    ref = (params, tx.init(params))
    for local, tokens in zip(distribute(strategy, batches), batches, strict=True):
        *ours, _ = compiled(*ours, local)
        *ref, ref_loss = reference(*ref, tokens)
    assert_trees_close(ours[0], ref[0])
    graph = compiled.graph(*ours, local, after="combine-all-reduces")
    assert graph.count_ops("all_reduce") == 1  # the scanned layers' reductions left the loop
    assert jnp.isfinite(ref_loss)
