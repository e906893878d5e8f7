"""The user's nested `jax.jit` calls are called again in the lowered program, one function
per callee as JAX lowers them, wherever the passes left a call as it was imported."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import xla_strategies as xs
from tests.helpers import counted_compiles
from xla_strategies.passes.bridge.called_functions import whole_site


@jax.jit
def norm(x):
    """A layer norm without weights, jitted as a library's function is (`jnp.var` is)."""
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def _loss(w, x):
    for layer in w:
        x = norm(x @ layer)
    return jnp.mean(x**2)


def _step(w, x):
    loss, grads = jax.value_and_grad(_loss)(w, x)
    return w - 0.1 * grads, loss


def _arguments():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 8, 8)).astype(np.float32)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    return w, x


def test_a_function_called_in_three_places_is_one_function_called_three_times():
    """Three layers call `norm`: the lowered program defines it once and calls it three
    times (and its gradient's function three times), as `jax.jit` lowers the same step, and
    trains to the one-device run's numbers."""
    strategy = xs.MirroredStrategy()
    step = strategy.compile(_step)
    w, x = _arguments()
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    text = step.lower(strategy.replicate(w), batch).as_text()
    assert text.count("func.func private @norm(") == 1
    assert len(re.findall(r"call @norm\(", text)) == 3
    got, loss = step(strategy.replicate(w), batch)
    one = xs.OneDeviceStrategy()
    want, want_loss = one.compile(_step)(one.replicate(w), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(loss).mean(), np.asarray(want_loss), rtol=1e-5)


def test_a_call_a_pass_changed_runs_inlined():
    """A call site is called again only while its nodes are as imported: rewire one of its
    nodes (as a pass replacing a value's uses does) and the site runs node by node."""
    strategy = xs.MirroredStrategy()
    w, x = _arguments()
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    graph = strategy.compile(_step).graph(strategy.replicate(w), batch)
    starts = [i for i, n in enumerate(graph.nodes) if n.call and n.call.nodes[0] is n]
    assert len(starts) >= 3  # each layer's forward call
    at = starts[0]
    site = whole_site(graph.nodes, at)
    assert site is not None and site.name == "norm"
    inner = next(n for n in site.nodes if n.inputs)
    inner.inputs[0] = graph.inputs[0]  # a value from outside the call
    assert whole_site(graph.nodes, at) is None
    assert whole_site(graph.nodes, starts[1]) is not None  # the others stay calls


def test_a_gpus_program_keeps_the_calls_inlined():
    """XLA's GPU compiler fuses less across calls (the plain-JAX GPT-2's step on a DGX
    node reads 4.6 % longer with them): a GPU's program inlines them, as before."""
    strategy = xs.MirroredStrategy(topology="dgx-h100", compile_only=True)
    w = strategy.replicate(jax.ShapeDtypeStruct((3, 8, 8), jnp.float32))
    x = jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=strategy.split_sharding())
    text = strategy.compile(_step).lower(w, x).as_text()
    assert "@norm" not in text
    default = strategy.compile(_step, select_by_compiling=False)
    stats = default.executable(w, x).pass_stats["inline-nested-calls"]
    assert stats["inlined"] >= 3  # the default pipeline's pass, `mode=auto`, for GPUs


def test_inline_nested_calls_on_runs_each_call_inlined_with_the_same_numbers():
    strategy = xs.MirroredStrategy()
    step = strategy.compile(_step, pipeline="insert-reductions,inline-nested-calls{mode=on}")
    w, x = _arguments()
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    assert "@norm" not in step.lower(strategy.replicate(w), batch).as_text()
    assert step.executable(strategy.replicate(w), batch).pass_stats["inline-nested-calls"] == {
        "inlined": 6  # three layers' calls, and their gradients' three
    }
    got, _ = step(strategy.replicate(w), batch)
    one = xs.OneDeviceStrategy()
    want, _ = one.compile(_step)(one.replicate(w), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_tpu_step_tries_its_calls_inlined_by_compiling(tmp_path, monkeypatch):
    """Which of the two programs XLA's TPU compiler makes better depends on the program
    (Hugging Face's GPT-2: the calls 2 GiB less; plain-JAX Llama-2-7B: inlined 0.2 GiB
    less), so a step compiled for a topology compiles both."""
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    strategy = xs.TPUStrategy("v5e-16", compile_only=True)
    w = strategy.replicate(jax.ShapeDtypeStruct((3, 8, 8), jnp.float32))
    x = jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=strategy.split_sharding())
    remarks = strategy.compile(_step, select_by_compiling=True).executable(w, x).remarks
    verdict = next(r for r in remarks if r.startswith("select-by-compiling"))
    assert "+inline-nested-calls" in verdict


def test_a_gpu_step_whose_alternatives_leave_one_program_compiles_it_once(tmp_path, monkeypatch):
    """A GPU's program runs every call inlined, with or without the pass: alternatives that
    differ only in the sites they still mark are one program, compiled once."""
    compiles = counted_compiles(monkeypatch)
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    strategy = xs.MirroredStrategy(topology="dgx-h100", compile_only=True)

    def evaluate(w, x):  # no gradient: the alternatives differ only in the pass
        return jnp.mean(norm(x @ w))

    w = strategy.replicate(jax.ShapeDtypeStruct((8, 8), jnp.float32))
    x = jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=strategy.split_sharding())
    strategy.compile(evaluate, select_by_compiling=True).executable(w, x)
    assert len(compiles) == 1
