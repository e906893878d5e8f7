"""optax's wrappers, as optax's docs use them: `MultiSteps` gradient accumulation,
`clip_by_global_norm` in a chain, and `inject_hyperparams`, each against one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests.frameworks.reference import assert_trees_close, distribute, regression_batches


def _loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


OPTIMIZERS = {
    "multi_steps": lambda: optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2),
    "clip_chain": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 4)
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_wrappers_equal_one_device(name):
    tx = OPTIMIZERS[name]()

    def step(params, opt_state, x, y):
        grads = jax.grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(4, 8)).astype(np.float32),
        "b1": np.zeros(8, np.float32),
        "w2": rng.normal(size=(8, 1)).astype(np.float32),
    }
    batches = regression_batches(4, rows=16, inputs=4, outputs=1, seed=1)
    strategy = xs.MirroredStrategy()
    compiled, reference = strategy.compile(step), jax.jit(step)
    ours = strategy.replicate((params, tx.init(params)))
    ref = (params, tx.init(params))
    for local, batch in zip(distribute(strategy, batches), batches, strict=True):
        ours = compiled(*ours, *local)
        ref = reference(*ref, *batch)
    assert_trees_close(ours, ref)
    assert not any(strategy.is_per_replica(a) for a in jax.tree.leaves(ours))  # all mirrored
