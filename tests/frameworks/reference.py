"""References computed without the library: per-replica slices of a global batch, and a
data-parallel step done by hand on one device (each replica's gradient, then their mean)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import xla_strategies as xs

R = 8  # replicas: the suite runs on 8 emulated CPU devices
TOL = {"rtol": 2e-5, "atol": 2e-6}


def replica_slices(batch: Any, replicas: int = R) -> list[Any]:
    """What each replica sees of a global batch: equal consecutive slices of dim 0."""
    return [
        jax.tree.map(
            lambda a, r=r: a[r * (len(a) // replicas) : (r + 1) * (len(a) // replicas)], batch
        )
        for r in range(replicas)
    ]


def mean_of(trees: list[Any]) -> Any:
    """The MEAN gradient reduction, computed on the host."""
    return jax.tree.map(lambda *xs_: np.mean(np.stack(xs_), axis=0), *trees)


def regression_batches(
    steps: int, rows: int, inputs: int, outputs: int, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`steps` global batches `(x, y)` of `rows` random float32 examples."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(rows, inputs)).astype(np.float32),
            rng.normal(size=(rows, outputs)).astype(np.float32),
        )
        for _ in range(steps)
    ]


def linen_regression_step(model: Any, tx: Any) -> Any:
    """The train step flax's docs write for a linen model: mean squared error on `(x, y)`,
    an optax update: step(params, opt_state, batch) -> (params, opt_state, loss)."""
    import jax.numpy as jnp
    import optax

    def train_step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def distribute(strategy: xs.Strategy, batches: list[Any]) -> list[Any]:
    return list(strategy.experimental_distribute_dataset(batches))


def assert_trees_close(actual: Any, expected: Any, **tol: float) -> None:
    tol = {**TOL, **tol}
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tol),
        actual,
        expected,
    )
