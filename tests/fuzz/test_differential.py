"""Differential fuzzing: random step programs, compiled with every pipeline and strategy,
must give OneDeviceStrategy's numbers on the global batch.

Programs are drawn by hypothesis: a pytree of parameters; matmuls and elementwise ops; a
`scan` over stacked layers; a `cond`; a `while` loop; a weight tied to the output layer;
user collectives (a `pmean`ed loss, `pmean`ed gradients as pmap code writes them, a
`pmean`ed statistic); mirrored and per-replica outputs. Each is compiled under
`axis_name="batch"` with the default pipeline, each pass alone, TPUStrategy's
decompositions and CentralStorageStrategy's reduce-to-one-device.

`make test` runs a short, derandomized profile; `make fuzz` runs 500 random examples
(`XLA_STRATEGIES_FUZZ=long`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import xla_strategies as xs

R = 8
ROWS = 2 * R
settings.register_profile(
    "short",
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("XLA_STRATEGIES_FUZZ", "short"))

ACTIVATIONS = {"tanh": jnp.tanh, "sin": jnp.sin, "relu": jax.nn.relu}
USER_COLLECTIVES = ("none", "pmean_loss", "pmean_grads", "pmean_stat")


@dataclass(frozen=True)
class Program:
    width: int
    layers: int  # 0: no scan
    activation: str
    cond: bool
    loop: bool
    tied: bool
    collective: str
    seed: int

    def params(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        d = self.width
        params = {
            "w0": (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32),
            "b": (0.1 * rng.normal(size=d)).astype(np.float32),
        }
        if self.layers:
            params["ws"] = (rng.normal(size=(self.layers, d, d)) / np.sqrt(d)).astype(np.float32)
        return params

    def batch(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed + 1)
        x = rng.normal(size=(ROWS, self.width)).astype(np.float32)
        return x, rng.normal(size=(ROWS, self.width)).astype(np.float32)

    def loss(self, params, x, y):
        act = ACTIVATIONS[self.activation]
        h = x
        if self.layers:
            h, _ = lax.scan(lambda h, w: (act(h @ w), None), h, params["ws"])
        h = act(h @ params["w0"] + params["b"])
        if self.cond:  # the predicate is the same on every replica
            h = lax.cond(jnp.sum(params["b"]) > 0, lambda h: 2 * h, lambda h: h - 1, h)
        if self.loop:
            h = lax.fori_loop(0, 2, lambda i, h: act(h @ params["w0"]), h)
        out = h @ params["w0"].T if self.tied else h
        loss = jnp.mean((out - y) ** 2)
        return lax.pmean(loss, "batch") if self.collective == "pmean_loss" else loss

    def step(self, params, x, y):
        loss, grads = jax.value_and_grad(self.loss)(params, x, y)
        if self.collective == "pmean_grads":
            grads = lax.pmean(grads, "batch")
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        stat = lax.pmean(jnp.mean(x, axis=0), "batch") if self.collective == "pmean_stat" else 0.0
        return new, loss, stat


programs = st.builds(
    Program,
    width=st.integers(2, 4),
    layers=st.integers(0, 2),
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    cond=st.booleans(),
    loop=st.booleans(),
    tied=st.booleans(),
    collective=st.sampled_from(USER_COLLECTIVES),
    seed=st.integers(0, 2**16),
)

PASSES = (
    "fold-invariant-reductions",
    "hoist-all-reduces",
    "schedule-all-reduces{force=pipeline}",
    "reassociate-all-reduces",
    "shard-weight-updates",
    "combine-all-reduces",
)
PIPELINES = {
    "default": lambda: (xs.MirroredStrategy(), None),
    **{
        name: functools.partial(lambda n: (xs.MirroredStrategy(), f"insert-reductions,{n}"), name)
        for name in PASSES
    },
    "tpu-decomposed": lambda: (xs.TPUStrategy("v5e-8", emulate=True), None),
    "central-storage": lambda: (xs.CentralStorageStrategy(), None),
}


@functools.cache
def _strategy(name: str):
    return PIPELINES[name]()


def _reference(program: Program):
    """One device on the global batch, and on each replica's slice for the local loss."""
    one = xs.OneDeviceStrategy()
    step = one.compile(program.step, axis_name="batch")
    params, (x, y) = program.params(), program.batch()
    new, loss, stat = step(params, x, y)
    k = ROWS // R
    local = [
        float(step(params, x[r * k : (r + 1) * k], y[r * k : (r + 1) * k])[1]) for r in range(R)
    ]
    return new, float(loss), stat, np.array(local)


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
@given(program=programs)
def test_every_pipeline_gives_one_device_numbers(pipeline, program):
    strategy, spec = _strategy(pipeline)
    step = strategy.compile(program.step, axis_name="batch", pipeline=spec)
    x, y = next(iter(strategy.experimental_distribute_dataset([program.batch()])))
    new, loss, stat = step(strategy.replicate(program.params()), x, y)
    ref_new, ref_loss, ref_stat, ref_local = _reference(program)
    tol = {"rtol": 2e-4, "atol": 2e-5}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, **tol), new, ref_new)
    if program.collective == "pmean_loss":  # mirrored: the global loss
        np.testing.assert_allclose(float(loss), ref_loss, **tol)
    else:  # per replica: each replica's own loss
        np.testing.assert_allclose(np.asarray(loss), ref_local, **tol)
    np.testing.assert_allclose(np.asarray(stat), np.asarray(ref_stat), **tol)
