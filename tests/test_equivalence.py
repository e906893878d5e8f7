"""MirroredStrategy on 8 replicas (global batch split) against OneDeviceStrategy (whole
batch): the same parameters after every one of 20 steps.

Tolerances are relative, with an absolute floor far below the parameters' scale (about 0.1)
for entries that pass near zero, where any relative measure blows up: float32 rtol 1e-5 /
atol 1e-7, float64 rtol 1e-9 / atol 1e-12.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from xla_strategies.demo import models

STEPS = 20


def _compare(make_step, params, tx, batches, rtol, atol, **options):
    one = helpers.train(xs.OneDeviceStrategy(), make_step, params, tx, batches, **options)
    mirrored = helpers.train(xs.MirroredStrategy(), make_step, params, tx, batches, **options)
    assert len(one) == len(mirrored) == STEPS
    for step, (a, b) in enumerate(zip(mirrored, one, strict=True)):
        jax.tree.map(
            lambda x, y, s=step: np.testing.assert_allclose(
                x, y, rtol=rtol, atol=atol, err_msg=f"after step {s + 1}"
            ),
            a,
            b,
        )
    # the parameters moved: the comparison is not of two untouched copies
    assert helpers.max_relative_error(one[-1], jax.tree.map(np.asarray, params)) > 1e-3


def _setup(model: str, dtype):
    """(step, params, optimizer, batches): SGD in float32, clip + adamw in float64."""
    tx = (
        optax.sgd(0.1)
        if dtype == np.float32
        else optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    )
    if model == "mlp":
        graphdef, params = helpers.mlp(dtype)
        return (
            models.mlp_train_step(graphdef, tx),
            params,
            tx,
            helpers.mlp_batches(STEPS, dtype=dtype),
        )
    graphdef, params, cfg = helpers.transformer(dtype)
    return models.lm_train_step(graphdef, tx), params, tx, helpers.lm_batches(STEPS, cfg)


TOLERANCES = {np.float32: {"rtol": 1e-5, "atol": 1e-7}, np.float64: {"rtol": 1e-9, "atol": 1e-12}}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["sgd-f32", "adamw-f64"])
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_mirrored_matches_one_device(model, dtype):
    with jax.enable_x64(dtype == np.float64):
        _compare(*_setup(model, dtype), **TOLERANCES[dtype])


def test_sum_reduction_matches_hand_scaled_reference():
    """gradient_reduction=SUM is tf.distribute's custom-loop convention: the user scales
    the loss by 1/global_batch. OneDevice on the whole batch, with the plain mean loss,
    is the reference."""
    graphdef, params = helpers.mlp()
    tx = optax.sgd(0.1)
    batches = helpers.mlp_batches(STEPS)
    global_batch = batches[0]["x"].shape[0]

    def scaled_step(params, opt_state, batch):
        def loss_fn(p):
            logits = nnx_merge(graphdef, p)(batch["x"])
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return per_example.sum() / global_batch

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, 0.0

    from flax.nnx import merge as nnx_merge

    reference = helpers.train(
        xs.OneDeviceStrategy(), models.mlp_train_step(graphdef, tx), params, tx, batches
    )
    summed = helpers.train(
        xs.MirroredStrategy(), scaled_step, params, tx, batches, gradient_reduction=xs.ReduceOp.SUM
    )
    meaned = helpers.train(xs.MirroredStrategy(), scaled_step, params, tx, batches)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
        summed[-1],
        reference[-1],
    )
    # with the default MEAN the same scaled loss takes steps 8x too small: it must differ
    assert helpers.max_relative_error(meaned[-1], reference[-1]) > 1e-3


@pytest.mark.parametrize("strategy_cls", [xs.OneDeviceStrategy, xs.MirroredStrategy])
def test_loss_goes_down(strategy_cls):
    graphdef, params, cfg = helpers.transformer()
    tx = optax.adam(3e-3)
    strategy = strategy_cls()
    step = strategy.compile(models.lm_train_step(graphdef, tx))
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    batch = next(iter(strategy.experimental_distribute_dataset(helpers.lm_batches(1, cfg))))
    losses = []
    for _ in range(10):
        *state, per_example = step(*state, batch)
        losses.append(float(strategy.reduce(xs.ReduceOp.MEAN, per_example, axis=0)))
    assert losses[-1] < 0.8 * losses[0]
