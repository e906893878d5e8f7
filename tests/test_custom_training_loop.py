"""tf.distribute's custom training loop, as its guide writes it: a loss scaled by the global
batch, `strategy.run(train_step, args=(dist_inputs,))`, and the per-replica losses summed
with `strategy.reduce(SUM, ..., axis=None)`. Its gradients are sums over the replicas, which
`set_compile_defaults(gradient_reduction=SUM)` asks for; every way of compiling a step reads
that default."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import xla_strategies as xs
from tests.helpers import max_relative_error

GLOBAL_BATCH = 32
STEPS = 3


def _batches():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 1)).astype(np.float32)
    out = []
    for _ in range(STEPS):
        x = rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32)
        out.append({"x": x, "y": (x @ w)[:, 0] + rng.normal(size=GLOBAL_BATCH).astype(np.float32)})
    return out


def _custom_loop(strategy, reduction=None):
    """The guide's loop; returns the parameters and the summed loss of each step."""
    if reduction is not None:
        strategy.set_compile_defaults(gradient_reduction=reduction)
    tx = optax.sgd(0.1)  # SGD: a gradient of the wrong scale shows (Adam would hide it)
    init = {"w": np.zeros((6, 1), np.float32), "b": np.zeros((1,), np.float32)}
    with strategy.scope():
        state = {"params": strategy.replicate(init), "opt": strategy.replicate(tx.init(init))}

    def train_step(state, inputs):
        def compute_loss(params):
            per_example = ((inputs["x"] @ params["w"] + params["b"])[:, 0] - inputs["y"]) ** 2
            return jnp.sum(per_example) / GLOBAL_BATCH  # tf.nn.compute_average_loss

        loss, grads = jax.value_and_grad(compute_loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    losses = []
    for dist_inputs in strategy.experimental_distribute_dataset(_batches()):
        state, per_replica_losses = strategy.run(train_step, args=(state, dist_inputs))
        losses.append(float(strategy.reduce(xs.ReduceOp.SUM, per_replica_losses, axis=None)))
    return jax.tree.map(np.asarray, state["params"]), losses


def test_run_reads_the_compile_defaults_like_compile():
    want, want_losses = _custom_loop(xs.OneDeviceStrategy())
    got, got_losses = _custom_loop(xs.MirroredStrategy(), xs.ReduceOp.SUM)
    assert max_relative_error(got, want) < 1e-5
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)


def test_run_compiles_again_when_the_defaults_change():
    strategy = xs.MirroredStrategy()
    mean, _ = _custom_loop(strategy)  # MEAN: each gradient 1/8 of the summed one
    summed, _ = _custom_loop(strategy, xs.ReduceOp.SUM)
    want, _ = _custom_loop(xs.OneDeviceStrategy())
    assert max_relative_error(summed, want) < 1e-5
    assert max_relative_error(mean, want) > 0.1
