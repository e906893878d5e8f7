"""Capture of real programs into the IR: autodiff vs user collectives, regions, inlining."""

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
from xla_strategies.passes import parse, print_graph, verify


def _graph(strategy, fn, *args):
    return strategy.compile(fn).graph(*args)


def _origins(graph):
    return sorted(n.attrs["origin"] for n in graph.walk() if n.op == "all_reduce")


def test_mlp_has_one_autodiff_reduction_per_parameter():
    strategy = xs.MirroredStrategy()
    graphdef, params = helpers.mlp()
    tx = optax.sgd(0.1)
    batch = next(iter(strategy.experimental_distribute_dataset(helpers.mlp_batches(1))))
    graph = _graph(strategy, models.mlp_train_step(graphdef, tx), params, tx.init(params), batch)
    assert _origins(graph) == ["autodiff"] * len(jax.tree.leaves(params))
    assert graph.count_ops("pvary") > 0
    # gelu is a custom_jvp function: inlined, not kept as an opaque call
    assert not any(n.op.startswith("jax.custom") or n.op == "jax.jit" for n in graph.walk())
    assert graph.inputs[0].name.startswith("args[0]")
    assert graph.io.outputs[-1].name == "output[2]"
    verify(graph, {"replica": 8})
    assert print_graph(parse(print_graph(graph))) == print_graph(graph)


def test_transformer_keeps_scan_and_remat_as_regions():
    strategy = xs.MirroredStrategy()
    graphdef, params, cfg = helpers.transformer()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    batch = next(iter(strategy.experimental_distribute_dataset(helpers.lm_batches(1, cfg))))
    graph = _graph(strategy, models.lm_train_step(graphdef, tx), params, tx.init(params), batch)
    scans = [n for n in graph.nodes if n.op == "jax.scan"]
    assert len(scans) == 2  # forward and backward over the layers
    backward = scans[1]
    assert backward.attrs["length"] == cfg.layers
    in_loop = [n for r in backward.regions for n in r.walk() if n.op == "all_reduce"]
    assert in_loop and all(n.attrs["origin"] == "autodiff" for n in in_loop)
    assert any(n.op == "jax.remat2" for n in backward.regions[0].walk())
    # the tied embedding is reduced twice: once for the lookup, once for the unembedding
    embed_shape = (cfg.vocab, cfg.width)
    tied = [
        n
        for n in graph.walk()
        if n.op == "all_reduce" and sorted(n.inputs[0].shape) == sorted(embed_shape)
    ]
    assert len(tied) == 2
    assert _origins(graph) == ["autodiff"] * len(_origins(graph))


def test_user_collectives_are_marked_user():
    strategy = xs.MirroredStrategy()

    def step(w, x):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        ctx = xs.get_replica_context()
        return w - grad, ctx.all_reduce(xs.ReduceOp.SUM, loss), lax.pmax(loss, "replica")

    w = np.ones((4, 2), np.float32)
    x = next(iter(strategy.experimental_distribute_dataset([np.ones((16, 4), np.float32)])))
    graph = _graph(strategy, step, w, x)
    ops = {(n.attrs["origin"], n.attrs["reduce_op"]) for n in graph.walk() if n.op == "all_reduce"}
    assert ops == {("autodiff", "sum"), ("user", "sum"), ("user", "max")}


def test_cond_becomes_a_region_node():
    strategy = xs.MirroredStrategy()

    def step(w, x):
        def loss(w):
            y = x @ w
            return lax.cond(
                jnp.sum(y) > 0, lambda v: jnp.mean(v**2), lambda v: jnp.mean(jnp.abs(v)), y
            )

        return w - jax.grad(loss)(w)

    x = next(iter(strategy.experimental_distribute_dataset([np.ones((16, 4), np.float32)])))
    graph = _graph(strategy, step, np.ones((4, 2), np.float32), x)
    conds = [n for n in graph.walk() if n.op == "jax.cond"]
    assert conds and all(len(n.regions) == 2 for n in conds)


def test_collective_on_an_unknown_axis_is_a_clear_error():
    strategy = xs.MirroredStrategy()
    step = strategy.compile(lambda x: lax.psum(x, "batch"))
    with pytest.raises(
        xs.UnknownAxisError,
        match="axis 'batch', but the strategy's mesh has only the axes \\['replica'\\]",
    ):
        step(np.ones(8, np.float32))


def test_capture_patches_nothing_outside_the_trace():
    """The named scope on pvary's transpose and the gradient marks on jax.vjp exist only
    while a step is traced; afterwards JAX's own rule and function are back."""
    from jax._src import api, core
    from jax._src.interpreters import ad

    rule, vjp, public_vjp = ad.primitive_transposes[core.pvary_p], api.vjp, jax.vjp
    strategy = xs.MirroredStrategy()
    x = next(iter(strategy.experimental_distribute_dataset([np.ones((8, 3), np.float32)])))
    graph = _graph(strategy, lambda w, x: jax.grad(lambda w: jnp.sum(x @ w))(w), np.ones(3), x)
    assert _origins(graph) == ["autodiff"]  # the scope was there while tracing
    assert [n.attrs["origin"] for n in graph.walk() if n.op == "scale"] == ["gradient"]
    assert ad.primitive_transposes[core.pvary_p] is rule
    assert not rule.__module__.startswith("xla_strategies")  # JAX's rule, not our wrapper
    assert api.vjp is vjp and jax.vjp is public_vjp
    # outside a capture, jax.grad marks nothing
    assert "gradient_scale" not in str(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(w**2)))(1.0))


def test_remat_policy_survives_the_text_form():
    from xla_strategies.passes.bridge.lowering import LoweringError, evaluate

    strategy = xs.MirroredStrategy()
    x = next(iter(strategy.experimental_distribute_dataset([np.ones((8, 3), np.float32)])))

    def step(w, x):
        layer = jax.checkpoint(
            lambda w: jnp.tanh(x @ w), policy=jax.checkpoint_policies.dots_saveable
        )
        return jax.grad(lambda w: jnp.sum(layer(w)))(w)

    text = print_graph(_graph(strategy, step, np.ones((3, 2), np.float32), x))
    assert '"policy": "dots_saveable"' in text
    assert print_graph(parse(text)) == text
    # a parsed remat region of known ops lowers with the named policy; an unnamed one refuses
    region = """\
func @f(%0: f32[2]) {
  %1: f32[2] = jax.remat2(%0) {"differentiated": false, "policy": "POLICY", "prevent_cse": true}
    region (%2: f32[2]) {
      %3: f32[2] = scale(%2) {"factor": 3}
      return %3
    }
  return %1
}
"""
    graph = parse(region.replace("POLICY", "dots_saveable"))
    np.testing.assert_allclose(evaluate(graph, [jnp.ones(2)])[0], [3.0, 3.0])
    with pytest.raises(LoweringError, match="policy 'custom'"):
        evaluate(parse(region.replace("POLICY", "custom")), [jnp.ones(2)])


def test_a_step_that_draws_a_prng_key_round_trips_through_the_text_form():
    """A dropout key's type prints as `key<fry>[]`: the text form parses it back (the
    dump command's `--format dot` and `xla-strategies opt` read that text)."""
    strategy = xs.MirroredStrategy()

    def step(x):
        key = jax.random.fold_in(
            jax.random.key(0), xs.get_replica_context().replica_id_in_sync_group
        )
        return x * jax.random.bernoulli(key, 0.5, x.shape)

    (batch,) = strategy.experimental_distribute_dataset([np.ones((8, 4), np.float32)])
    text = print_graph(_graph(strategy, step, batch))
    assert "key<fry>[]" in text
    assert print_graph(parse(text)) == text


def test_a_step_that_closes_over_a_prng_key_runs():
    """A key made outside the step and read from its closure (torch models' dropout key in
    `xla_strategies.torch`'s state) is a constant of the captured graph: the step runs,
    each replica drawing what one device draws from that key."""
    strategy = xs.MirroredStrategy()
    key = jax.random.key(7)

    @strategy.compile
    def step(x):
        return x + jax.random.normal(key, x.shape[1:])

    (batch,) = strategy.experimental_distribute_dataset([np.zeros((8, 4), np.float32)])
    out = strategy.gather(step(batch), axis=0)
    want = np.broadcast_to(jax.random.normal(key, (4,)), (8, 4))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
