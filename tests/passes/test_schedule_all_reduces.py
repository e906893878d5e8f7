"""schedule-all-reduces: per loop, the cost model's choice between hoisting the layers'
gradient reductions and leaving them pipelined in the body, and what the compiled HLO runs."""

from __future__ import annotations

import optax
import pytest

import xla_strategies as xs
from tests import helpers
from xla_strategies.demo import models
from xla_strategies.hardware.hlo_collectives import executed_collectives
from xla_strategies.passes import (
    DEFAULT_PIPELINE,
    PassContext,
    ScheduleAllReduces,
    parse,
    print_graph,
    verify,
)
from xla_strategies.passes.transforms.schedule_all_reduces import readiness

# A backward scan over 4 layers: each reduces an [n, n] gradient, then computes the next
# layer's input gradient (a matmul) while that reduction could run.
LAYERS = """\
func @step(%0: f32[4,{n},{n}]{{x,y}}) {{
  %1: f32[4,{n},{n}], %2: f32[4,{n},{n}]{{x,y}} = jax.scan(%0) {{"length": 4, "num_carry": 0, "num_consts": 0, "reverse": true, "unroll": 1}}
    region (%3: f32[{n},{n}]{{x,y}}) {{
      %4: f32[{n},{n}] = all_reduce(%3) {{"axes": ["x", "y"], "origin": "autodiff", "reduce_op": "sum"}}
      %5: f32[{n},{n}]{{x,y}} = jax.dot_general(%3, %3) {{"dimension_numbers": [[[1], [0]], [[], []]]}}
      return %4, %5
    }}
  return %1, %2
}}
"""


def _run(text: str, topology: str | None, **options) -> tuple[bool, str, PassContext]:
    graph = parse(text)
    topo = xs.Topology.from_name(topology) if topology else None
    mesh = topo.mesh_axes if topo else {"x": 2, "y": 4}
    ctx = PassContext(mesh_axes=mesh, topology=topo)
    changed = ScheduleAllReduces(**options).run(graph, ctx)
    verify(graph, mesh)
    return changed, print_graph(graph), ctx


def test_readiness_gives_each_reduction_the_compute_left_after_it():
    loop = parse(LAYERS.format(n=1024)).nodes[0]
    (ready,) = readiness(loop)
    assert ready.nbytes == 1024 * 1024 * 4
    assert ready.ready_s == 0.0 and ready.compute_after_s > 1e-3  # a 2 GFLOP matmul


def test_large_layers_with_compute_behind_them_stay_pipelined():
    # at v5e's 197 TFLOP/s a layer's matmul (2n^3 flops) outlasts its n^2 gradient's
    # reduction over 256 chips once n is in the thousands
    changed, after, ctx = _run(LAYERS.format(n=8192), "v5e-256")
    assert not changed and after == print_graph(parse(LAYERS.format(n=8192)))
    (decision,) = ctx.stats["schedule-all-reduces"]["decisions"]
    assert decision["choice"] == "pipeline"
    assert decision["exposed_s"]["pipeline"] < decision["exposed_s"]["hoist"]
    assert any(
        "jax.scan x4, 268,435,456 bytes reduced per iteration: pipeline" in r for r in ctx.remarks
    )


def test_small_latency_bound_reductions_are_hoisted():
    changed, after, ctx = _run(LAYERS.format(n=4), "v5e-256")
    assert changed
    loop_body = after.split("region")[1].split("}")[0]
    assert "all_reduce" not in loop_body
    (decision,) = ctx.stats["schedule-all-reduces"]["decisions"]
    assert decision["choice"] == "hoist"


def test_without_a_topology_it_hoists_as_before_and_says_why():
    changed, _, ctx = _run(LAYERS.format(n=1024), None)
    assert changed
    assert any("hoist (exposed: no topology" in r for r in ctx.remarks)


def test_force_overrides_the_cost_model_and_is_checked():
    changed, _, _ = _run(LAYERS.format(n=1024), "v5e-256", force="hoist")
    assert changed
    with pytest.raises(ValueError, match="force must be one of"):
        ScheduleAllReduces(force="sometimes")


@pytest.mark.parametrize(("force", "per_step"), [("pipeline", 3), ("hoist", 0)])
def test_the_compiled_hlo_keeps_pipelined_reductions_in_the_backward_loop(force, per_step):
    """Read from XLA's compiled HLO on TPUStrategy(emulate=True): pipelined, each layer's
    reduction runs inside the while loop's body, once per layer, between its backward
    computations; hoisted, the stacked gradients are reduced after the loop."""
    strategy = xs.TPUStrategy("v5e-8", emulate=True)
    graphdef, params, cfg = helpers.transformer(layers=3)
    tx = optax.sgd(0.1)
    batch = next(iter(strategy.experimental_distribute_dataset(helpers.lm_batches(1, cfg))))
    spec = DEFAULT_PIPELINE.replace(
        "schedule-all-reduces", f"schedule-all-reduces{{force={force}}}"
    ).replace("shard-weight-updates{mode=auto}", "shard-weight-updates{mode=on}")
    step = strategy.compile(models.lm_train_step(graphdef, tx), pipeline=spec)
    hlo = step.lower(params, tx.init(params), batch).compile().as_text()
    # all-reduces executed per step, while bodies counted once per trip: one per layer
    # when they stay in the loop; hoisted, the stacked gradients are reduce-scattered
    # after it (weight-update sharding on: the cost model would keep these tiny ones whole)
    assert executed_collectives(hlo)["all-reduce"]["count"] == per_step
