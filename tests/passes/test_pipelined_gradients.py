"""Pipelined gradients equal JAX's own: a loss whose layers are a scan over stacked
weights, differentiated with `jax.value_and_grad` as written, run as a schedule over a
stage axis, against `jax.value_and_grad` on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from xla_strategies.passes.bridge.layer_stack import NothingToPipeline
from xla_strategies.passes.bridge.microbatches import microbatched
from xla_strategies.passes.bridge.pipelined_gradients import StagePlan, pipelining_gradients

LAYERS, WIDTH, ROWS = 8, 16, 32


def _model():
    k = jax.random.split(jax.random.key(0), 5)
    params = {
        "embed": jax.random.normal(k[0], (WIDTH,)),
        "w": jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)) * 0.3,
        "b": jax.random.normal(k[2], (LAYERS, WIDTH)) * 0.1,
        "head": jax.random.normal(k[3], (WIDTH, 3)),
    }
    x = jax.random.normal(k[4], (ROWS, WIDTH))
    y = jnp.sin(x[:, :3])
    return params, x, y


def _loss(params, x, y):
    h = jnp.tanh(x * params["embed"])

    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"]), None

    h, _ = jax.lax.scan(layer, h, {"w": params["w"], "b": params["b"]})
    out = h @ params["head"]
    loss = jnp.mean((out - y) ** 2)
    return loss, {"loss": loss, "out": out}


def _pipelined(plan, params, x, y):
    """`jax.value_and_grad(_loss)` in a step traced on the plan's microbatches of the
    batch (x, y), as a compiled step with stages traces it."""
    mesh = Mesh(np.array(jax.devices()[: plan.stages]), ("stage",))
    leaves, tree = jax.tree.flatten(params)

    def step(*flat):
        p = jax.tree.unflatten(tree, flat[: len(leaves)])
        with pipelining_gradients(plan) as taken:
            (loss, aux), grads = jax.value_and_grad(_loss, has_aux=True)(p, *flat[len(leaves) :])
        assert taken.gradients == 1, "the gradient was not pipelined"
        return [loss, aux["loss"], aux["out"], *jax.tree.leaves(grads)]

    rows = [False] * len(leaves) + [True, True]
    with jax.set_mesh(mesh):
        loss, scalar, out, *grads = jax.jit(microbatched(step, rows, plan.microbatches))(
            *leaves, x, y
        )
    return (loss, {"loss": scalar, "out": out}), jax.tree.unflatten(tree, grads)


@pytest.mark.parametrize(
    "schedule, stages, microbatches, virtual",
    [
        ("gpipe", 2, 4, 1),
        ("1f1b", 2, 8, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b-paired", 4, 8, 1),
        ("interleaved-1f1b", 2, 4, 2),
        ("looped-bfs", 2, 4, 2),
        ("zero-bubble-h1", 4, 4, 1),
    ],
)
def test_each_schedule_gives_jax_gradients(schedule, stages, microbatches, virtual):
    params, x, y = _model()
    want = jax.value_and_grad(_loss, has_aux=True)(params, x, y)
    got = _pipelined(StagePlan(stages, microbatches, schedule, virtual), params, x, y)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


def test_a_stack_the_stages_do_not_divide_is_named():
    params, x, y = _model()
    with pytest.raises(NothingToPipeline, match=r"multiple of pipeline_stages.*lengths \[8\]"):
        _pipelined(StagePlan(2, 4, "interleaved-1f1b", 3), params, x, y)


def test_microbatches_that_do_not_divide_the_rows_are_named():
    params, x, y = _model()
    with pytest.raises(ValueError, match=r"microbatches=5 does not divide the \(32,\) rows"):
        _pipelined(StagePlan(2, 5, "gpipe"), params, x, y)
