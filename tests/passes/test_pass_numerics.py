"""Each optimisation pass alone, and the whole pipeline, give the numbers of the
unoptimised program on 8 emulated devices (float64, so only reassociation differs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import xla_strategies as xs
from tests import helpers
from xla_strategies.demo import models
from xla_strategies.hardware.hlo import count_hlo_collectives
from xla_strategies.passes import DEFAULT_PIPELINE
from xla_strategies.passes.cost.collective_stats import collective_summary

BASE = "insert-reductions"
PIPELINES = {
    "hoist": f"{BASE},hoist-all-reduces",
    "pipeline": f"{BASE},schedule-all-reduces{{force=pipeline}}",
    "reassociate": f"{BASE},reassociate-all-reduces",
    "combine": f"{BASE},combine-all-reduces{{threshold-bytes=4096}}",
    "default": DEFAULT_PIPELINE,
}


def _setup(model: str):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    if model == "mlp":
        graphdef, params = helpers.mlp(np.float64)
        return (
            models.mlp_train_step(graphdef, tx),
            params,
            tx,
            helpers.mlp_batches(3, dtype=np.float64),
        )
    graphdef, params, cfg = helpers.transformer(np.float64, layers=3)
    return models.lm_train_step(graphdef, tx), params, tx, helpers.lm_batches(3, cfg)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_each_pass_preserves_the_numbers(model):
    with jax.enable_x64(True):
        step, params, tx, batches = _setup(model)
        strategy = xs.MirroredStrategy()
        reference = helpers.train(strategy, step, params, tx, batches, pipeline=BASE)[-1]
        for name, spec in PIPELINES.items():
            result = helpers.train(strategy, step, params, tx, batches, pipeline=spec)[-1]
            assert helpers.max_relative_error(result, reference) < 1e-9, name


@jax.enable_x64(True)
def test_default_pipeline_leaves_one_reduction_per_step_on_the_transformer():
    """With a bucket large enough for every gradient, 38 reductions per step become one."""
    step, params, tx, batches = _setup("transformer")
    strategy = xs.MirroredStrategy()
    args = (params, tx.init(params), next(iter(strategy.experimental_distribute_dataset(batches))))
    one_bucket = DEFAULT_PIPELINE.replace(
        "combine-all-reduces", "combine-all-reduces{threshold-bytes=1073741824}"
    )
    compiled = strategy.compile(step, pipeline=one_bucket)
    executable = compiled.executable(*args)
    captured, optimised = executable.captured_text_stats, collective_summary(executable.graph)
    assert captured["all_reduce_count"] == 38  # 12 per layer x 3 layers inside the loop, + 2
    assert optimised["all_reduce_count"] == 1
    # one tied-embedding reduction is gone: the bytes drop by exactly the embedding's size
    embedding = params["embed"]["embedding"][...].nbytes
    assert captured["all_reduce_bytes"] - optimised["all_reduce_bytes"] == embedding
    assert count_hlo_collectives(compiled.lower(*args).compile().as_text())["all-reduce"] == 1


def test_hoisting_a_while_loop_accumulator_in_a_real_program():
    """Gradient accumulation over a dynamic number of micro-batches (a while loop)."""
    strategy = xs.MirroredStrategy()

    def step(w, x, count):
        def body(i, acc):
            return acc + jax.grad(lambda w: jnp.mean((x[:, i] @ w) ** 2))(w)

        total = lax.fori_loop(0, count, body, jnp.ones_like(w))  # a non-zero initial carry
        return w - 0.1 * total

    w = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
    data = np.random.default_rng(0).normal(size=(16, 3, 4)).astype(np.float32)
    x = next(iter(strategy.experimental_distribute_dataset([data])))
    count = np.int32(3)
    hoisted, plain = strategy.compile(step), strategy.compile(step, pipeline=BASE)
    graph = hoisted.graph(w, x, count, after="schedule-all-reduces")
    loop = next(n for n in graph.walk() if n.op == "jax.while")
    assert loop.regions[1].count_ops("all_reduce") == 0
    np.testing.assert_allclose(hoisted(w, x, count), plain(w, x, count), rtol=1e-6)
    expected = w - 0.1 * (1 + sum((2 / 32) * data[:, i].T @ (data[:, i] @ w) for i in range(3)))
    np.testing.assert_allclose(hoisted(w, x, count), expected, rtol=1e-5)


def test_a_reduction_that_feeds_the_next_iteration_stays_in_the_loop():
    """Inner SGD steps: each iteration needs the reduced gradient, so nothing moves."""
    strategy = xs.MirroredStrategy()

    def step(w, x):
        def body(w, _):
            return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w), None

        return lax.scan(body, w, length=3)[0]

    w = np.ones((4, 2), np.float32)
    x = next(iter(strategy.experimental_distribute_dataset([np.ones((16, 4), np.float32)])))
    compiled = strategy.compile(step)
    graph = compiled.graph(w, x, after="schedule-all-reduces")
    loop = next(n for n in graph.walk() if n.op == "jax.scan")
    assert loop.regions[0].count_ops("all_reduce") == 1
    reference = strategy.compile(step, pipeline=BASE)
    np.testing.assert_allclose(compiled(w, x), reference(w, x), rtol=1e-6)
