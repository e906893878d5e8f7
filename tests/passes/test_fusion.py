"""The bytes each op moves as XLA fuses it (`passes/cost/fusion.py`): the cost model's
compute estimate of small programs against the reader's roofline of XLA's own compile of
them for one TPU v5e chip, and the rules on graphs written by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import xla_strategies as xs
from tests.helpers import one_tpu_chip
from xla_strategies.hardware.compiled_report import hlo_report
from xla_strategies.passes import parse
from xla_strategies.passes.cost.fusion import fused_bytes
from xla_strategies.passes.cost.timeline import compute_estimate, compute_seconds

V5E = xs.Topology.from_name("v5e-4")


def _ours_and_xlas(fn, *args, donate=()) -> tuple[float, float]:
    """The cost model's compute seconds of `fn`'s captured graph, and the roofline of
    XLA's compile of `fn` for one v5e chip."""
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    specs = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_tpu_chip()), args
    )
    text = jax.jit(fn, donate_argnums=donate).lower(*specs).compile().as_text()
    graph = xs.OneDeviceStrategy("cpu:0").compile(fn).executable(*args).graph
    return compute_estimate(graph, V5E), hlo_report(text, V5E).estimate["compute_s"]


def test_the_optimizer_update_reads_and_writes_what_xla_compiles_it_to():
    """AdamW on 48 Mi parameters: elementwise ops only, which the cost model had priced as
    fused into neighbours that the update does not have (0 s). It is a loop fusion of its
    own: parameters, gradients and moments read once, parameters and moments written."""
    tx = optax.adamw(1e-3)
    params = {"w": jnp.zeros((4096, 4096)), "v": jnp.zeros((8192, 4096))}

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    ours, xla = _ours_and_xlas(update, params, tx.init(params), params, donate=(0, 1))
    assert ours == pytest.approx(xla, rel=0.05)


def test_a_transpose_next_to_a_matmul_is_the_layout_it_reads_or_writes():
    def transposed(x, w):
        return (x.T @ w).T

    x, w = jnp.zeros((4096, 2048), jnp.bfloat16), jnp.zeros((4096, 8192), jnp.bfloat16)
    ours, xla = _ours_and_xlas(transposed, x, w)
    assert ours == pytest.approx(xla, rel=0.05)


def test_a_reduction_of_a_matmul_result_fuses_into_the_matmul():
    """Attention's row maximum of its scores: XLA computes it in the matmul's output
    fusion, which writes the scores once; the reduction reads nothing of its own."""

    def row_max(q, k):
        scores = q @ k.T
        return scores, scores.max(-1)

    q, k = jnp.zeros((4096, 128), jnp.bfloat16), jnp.zeros((8192, 128), jnp.bfloat16)
    ours, xla = _ours_and_xlas(row_max, q, k)
    assert ours == pytest.approx(xla, rel=0.05)


def test_reductions_read_what_the_fused_ops_before_them_read_once():
    """BatchNorm's statistics: the mean and the mean of squares of a bf16 activation cast
    to f32. XLA fuses the cast and the square into one multi-output reduction that reads
    the bf16 activation once; the estimate prices that, not two f32 passes."""
    graph = parse(
        """\
func @stats(%0: bf16[64,1024,256]) {
  %1: f32[64,1024,256] = jax.convert_element_type(%0) {"new_dtype": "float32"}
  %2: f32[256] = jax.reduce_sum(%1) {"axes": [0, 1]}
  %3: f32[64,1024,256] = jax.square(%1)
  %4: f32[256] = jax.reduce_sum(%3) {"axes": [0, 1]}
  return %2, %4
}
"""
    )
    mean, squares = (n for n in graph.nodes if n.op == "jax.reduce_sum")
    activation, statistic = graph.inputs[0].nbytes, 256 * 4
    moved = fused_bytes(graph)
    assert moved == {mean: activation + statistic, squares: statistic}
    fused = compute_seconds(mean, V5E, moved[mean]) + compute_seconds(squares, V5E, moved[squares])
    unfused = compute_seconds(mean, V5E) + compute_seconds(squares, V5E)
    assert fused == pytest.approx((activation + 2 * statistic) / V5E.memory_bandwidth)
    assert unfused == pytest.approx((2 * 2 * activation + 2 * statistic) / V5E.memory_bandwidth)


def test_only_the_steps_own_results_are_an_update_fusion():
    """A loop's body returns its carry through elementwise ops fused into the ops that make
    them; the step's results are written by a fusion of their own."""
    graph = parse(
        """\
func @update(%0: f32[1024], %1: f32[1024]) {
  %2: f32[1024] = jax.mul(%1, %1)
  %3: f32[1024] = jax.sub(%0, %2)
  return %3
}
"""
    )
    (square, difference) = graph.nodes
    assert fused_bytes(graph) == {}
    assert fused_bytes(graph, whole_step=True) == {difference: 3 * 4096}
