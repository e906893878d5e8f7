"""The estimated timeline: valid Chrome-trace events, properly nested, loops included."""

from __future__ import annotations

import json

import optax
import pytest

import xla_strategies as xs
from tests import helpers
from xla_strategies.demo import models
from xla_strategies.passes.cost.timeline import chrome_trace


def assert_properly_nested(trace: dict) -> None:
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events and all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    assert all(e["dur"] >= 0 for e in events)
    for tid in {e["tid"] for e in events}:
        spans = sorted((e["ts"], -e["dur"]) for e in events if e["tid"] == tid)
        stack: list[float] = []
        for start, negative in spans:
            end = start - negative
            while stack and stack[-1] <= start + 1e-9:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-9, (tid, start, end, stack[-1])
            stack.append(end)


def test_transformer_timeline_nests_loop_bodies_inside_loops():
    strategy = xs.TPUStrategy("v5e-8", emulate=True)
    graphdef, params, cfg = helpers.transformer(layers=3)
    tx = optax.adamw(1e-3)
    batch = next(iter(strategy.experimental_distribute_dataset(helpers.lm_batches(1, cfg))))
    step = strategy.compile(models.lm_train_step(graphdef, tx))
    graph = step.graph(params, tx.init(params), batch, after="decompose-all-reduces")
    trace = json.loads(json.dumps(chrome_trace(graph, strategy.topology)))  # JSON-clean
    assert_properly_nested(trace)
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert "jax.scan x3" in names
    collective = next(e for e in trace["traceEvents"] if e.get("tid") == 2 and e["ph"] == "X")
    assert collective["dur"] > 0 and collective["args"]["bytes"] > 0
    # the compute track alone, without laying out the collectives, is the same compute
    from xla_strategies.passes.cost.timeline import compute_estimate

    compute = compute_estimate(graph, strategy.topology)
    assert compute > 0
    assert compute == pytest.approx(trace["metadata"]["compute_s"], rel=1e-12)


def test_exposed_communication_is_the_collective_time_compute_does_not_hide():
    from xla_strategies.passes import parse
    from xla_strategies.passes.cost.timeline import step_estimate

    waits = """\
func @step(%0: f32[1024,1024]{x,y}) {
  %1: f32[1024,1024] = all_reduce(%0) {"axes": ["x", "y"], "reduce_op": "sum"}
  %2: f32[1024,1024] = jax.dot_general(%1, %1) {"dimension_numbers": [[[1], [0]], [[], []]]}
  return %2
}
"""
    hides = (
        waits.replace("jax.dot_general(%1, %1)", "jax.dot_general(%0, %0)")
        .replace("return %2", "return %1, %2")
        .replace("%2: f32[1024,1024] =", "%2: f32[1024,1024]{x,y} =")
    )
    topology = xs.Topology.from_name("v5e-8")
    exposed = step_estimate(parse(waits), topology)
    hidden = step_estimate(parse(hides), topology)
    collective = topology.collective_time("all_reduce", 1024 * 1024 * 4)
    assert abs(exposed["exposed_s"] - collective) < 1e-9  # the matmul waits for all of it
    # the matmul runs while it reduces: only what outlasts it is exposed
    assert abs(hidden["exposed_s"] - max(0.0, collective - hidden["compute_s"])) < 1e-9
    assert hidden["exposed_s"] < exposed["exposed_s"]
    assert abs(hidden["compute_s"] - exposed["compute_s"]) < 1e-12 and hidden["compute_s"] > 0
    trace = chrome_trace(parse(waits), topology)
    assert trace["metadata"]["exposed_s"] == exposed["exposed_s"]


@pytest.mark.parametrize(
    ("op", "result"),
    [
        ("all_gather", "f32[1024,1024]"),  # a block gathered: priced on the whole result
        ("reduce_scatter", "f32[128,1024]{x,y}"),  # the whole operand scattered
        ("all_to_all", "f32[1024,1024]{x,y}"),
    ],
)
def test_the_ledger_and_the_timeline_price_a_collective_on_the_same_bytes(op, result):
    """The ledger's estimate per collective (the dump's) and the timeline's are one
    number: the cost model's time for the whole tensor the collective moves."""
    from xla_strategies.passes import parse
    from xla_strategies.passes.cost.ledger import collectives
    from xla_strategies.passes.cost.timeline import step_estimate

    operand = "f32[128,1024]{x,y}" if op == "all_gather" else "f32[1024,1024]{x,y}"
    attrs = '"axes": ["x", "y"]' + (', "dimension": 0' if op != "all_to_all" else "")
    if op == "all_to_all":
        attrs += ', "split_axis": 0, "concat_axis": 0'
    graph = parse(
        f"func @step(%0: {operand}) {{\n  %1: {result} = {op}(%0) {{{attrs}}}\n  return %1\n}}\n"
    )
    topology = xs.Topology.from_name("v5e-8")
    (entry,) = collectives(graph, topology)
    whole = topology.collective_time(op, 1024 * 1024 * 4, ("x", "y"))
    assert entry["estimated_s"] == whole
    assert step_estimate(graph, topology)["exposed_s"] == whole  # nothing computes beside it


def test_compute_estimates_take_the_topologys_rates():
    from xla_strategies.passes import parse
    from xla_strategies.passes.cost.timeline import BYTES_PER_S, FLOPS_PER_S, compute_seconds

    graph = parse(
        """\
func @mm(%0: f32[1024,1024], %1: f32[1024,1024]) {
  %2: f32[1024,1024] = jax.dot_general(%0, %1) {"dimension_numbers": [[[1], [0]], [[], []]]}
  return %2
}
"""
    )
    (matmul,) = graph.nodes
    flops, moved = 2 * 1024**3, 3 * 1024 * 1024 * 4
    v5e = xs.Topology.from_name("v5e-8")
    assert compute_seconds(matmul) == max(flops / FLOPS_PER_S, moved / BYTES_PER_S)
    assert compute_seconds(matmul, v5e) == max(flops / v5e.peak_flops, moved / v5e.memory_bandwidth)
    assert compute_seconds(matmul, v5e) < compute_seconds(matmul) / 10
    # a replica spanning four chips (the model axis) splits the matmul among them
    four_chip_replicas = v5e.split_model_axis(4)
    assert compute_seconds(matmul, four_chip_replicas) == compute_seconds(matmul, v5e) / 4


@pytest.mark.parametrize(
    "features, window, stride, groups", [(8, 3, 2, 2), (16, 1, 1, 1), (8, 7, 2, 1), (4, 3, 1, 4)]
)
def test_a_convolution_costs_the_flops_xla_counts(features, window, stride, groups):
    """Each convolution of a layer's gradient (forward, operand gradient, kernel gradient):
    the flops the estimate prices equal XLA's own cost analysis of that convolution
    compiled alone, padding and a strided convolution's zeros left out. Undeclared, they
    cost only their bytes."""
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from xla_strategies.hardware.topology import Topology
    from xla_strategies.passes.cost.timeline import compute_seconds

    layer = nn.Conv(features, (window, window), stride, feature_group_count=groups)
    images = jnp.ones((2, 16, 16, 8))
    params = layer.init(jax.random.key(0), images)

    def gradients(params, images):
        return jax.grad(lambda p, x: (layer.apply(p, x) ** 2).sum(), argnums=(0, 1))(params, images)

    graph = xs.OneDeviceStrategy("cpu:0").compile(gradients).executable(params, images).graph
    # a topology whose time is flops alone, one flop a second
    flops_only = dataclasses.replace(
        Topology.from_name("v5e-8"), peak_flops=1.0, memory_bandwidth=float("inf")
    )
    ours = [
        compute_seconds(node, flops_only)
        for region in graph.graphs()
        for node in region.nodes
        if node.op == "jax.conv_general_dilated"
    ]

    def xla_flops(eqn) -> float:
        operands = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        alone = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params)).lower(*operands)
        analysis = alone.compile().cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

    eqns = list(helpers.jaxpr_equations(jax.make_jaxpr(gradients)(params, images).jaxpr))
    xla = [xla_flops(e) for e in eqns if e.primitive.name == "conv_general_dilated"]
    assert len(ours) == len(xla) == 3
    assert sorted(ours) == sorted(xla)
