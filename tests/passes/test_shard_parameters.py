"""shard-parameters, text in and text out: a stack of layers read by a forward and a
backward scan, the gradient reduced inside the backward loop, and the update."""

from __future__ import annotations

from tests.filecheck import filecheck
from tests.passes.pass_testing import run_pass
from xla_strategies.passes import (
    PassContext,
    PassPipeline,
    ShardParameters,
    ShardWeightUpdates,
    parse,
    print_graph,
    verify,
)

# %0 holds 3 layers of f32[16,16] weights: the forward scan reads one layer per iteration,
# the backward scan reads it again and reduces its gradient inside the loop; the step
# returns the updated stack as the next value of %0.
LAYERS = """\
func @step(%0: f32[3,16,16] loc("w"), %1: f32[2,16]{replica}, %2: f32[] loc("lr")) {
  %3: f32[2,16]{replica}, %4: f32[3,2,16]{replica} = jax.scan(%1, %0) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%5: f32[2,16]{replica}, %6: f32[16,16]) {
      %7: bf16[16,16] = jax.convert_element_type(%6) {"new_dtype": "bfloat16", "weak_type": false}
      %8: bf16[16,16]{replica} = pvary(%7) {"axes": ["replica"]}
      %9: f32[2,16]{replica} = jax.dot_general(%5, %8) {"dimension_numbers": [[[1], [0]], [[], []]]}
      return %9, %5
    }
  %10: f32[2,16]{replica}, %11: f32[3,16,16] = jax.scan(%3, %0, %4) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": true, "unroll": 1}
    region (%12: f32[2,16]{replica}, %13: f32[16,16], %14: f32[2,16]{replica}) {
      %15: f32[16,16]{replica} = pvary(%13) {"axes": ["replica"]}
      %16: f32[16,16]{replica} = jax.dot_general(%14, %12) {"dimension_numbers": [[[0], [0]], [[], []]]}
      %17: f32[16,16] = all_reduce(%16) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
      %18: f32[2,16]{replica} = jax.dot_general(%12, %15) {"dimension_numbers": [[[1], [0]], [[], []]]}
      return %18, %17
    }
  %19: f32[3,16,16] = jax.mul(%11, %2)
  %20: f32[3,16,16] = jax.sub(%0, %19)
  return %20 state=%0 loc("w"), %10
}
"""


def test_the_stack_is_held_split_and_each_loop_gathers_one_layer():
    changed, after, ctx = run_pass(ShardParameters(), LAYERS)
    assert changed
    filecheck(
        after,
        """
        CHECK: func @step(%0: f32[3,2,16]{replica} sharded=1{replica} loc("w"),
        CHECK-NEXT: %[[WHOLE:[0-9]+]]: f32[3,16,16] = all_gather(%0) {"axes": ["replica"], "deferred": true, "dimension": 1}
        CHECK-NEXT: jax.scan(%1, %0)
        CHECK-NEXT: region (%{{[0-9]+}}: f32[2,16]{replica}, %[[FWD:[0-9]+]]: f32[2,16]{replica})
        CHECK-NOT: all_gather
        CHECK: %[[CAST:[0-9]+]]: bf16[2,16]{replica} = jax.convert_element_type(%[[FWD]])
        CHECK-NEXT: %[[W:[0-9]+]]: bf16[16,16] = all_gather(%[[CAST]]) {"axes": ["replica"], "dimension": 0}
        CHECK-NEXT: pvary(%[[W]])
        CHECK: %{{[0-9]+}}: f32[2,16]{replica}, %[[GRADS:[0-9]+]]: f32[3,2,16]{replica} = jax.scan(%{{[0-9]+}}, %0, %{{[0-9]+}})
        CHECK-NEXT: region (%{{[0-9]+}}: f32[2,16]{replica}, %[[BWD:[0-9]+]]: f32[2,16]{replica},
        CHECK-NEXT: %[[W2:[0-9]+]]: f32[16,16] = all_gather(%[[BWD]]) {"axes": ["replica"], "dimension": 0}
        CHECK-NEXT: pvary(%[[W2]])
        CHECK: %[[G:[0-9]+]]: f32[2,16]{replica} = reduce_scatter(%{{[0-9]+}}) {"axes": ["replica"], "dimension": 0,
        CHECK-NOT: all_reduce
        CHECK: return %{{[0-9]+}}, %[[G]]
        CHECK: %[[G3:[0-9]+]]: f32[3,16,16] = all_gather(%[[GRADS]]) {"axes": ["replica"], "deferred": true, "dimension": 1}
        CHECK-NEXT: %[[STEP:[0-9]+]]: f32[3,16,16] = jax.mul(%[[G3]], %2)
        CHECK-NEXT: jax.sub(%[[WHOLE]], %[[STEP]])
        """,
    )
    stats = ctx.stats["shard-parameters"]
    assert stats["split_state"] == 1 and stats["split_state_bytes"] == 3 * 16 * 16 * 4
    assert stats["loop_gathers"] == 2 and stats["loop_reduce_scatters"] == 1


def test_with_the_weight_update_the_stack_comes_back_split_and_is_never_gathered_whole():
    graph = parse(LAYERS)
    ctx = PassContext(mesh_axes={"replica": 8})
    PassPipeline((ShardParameters(), ShardWeightUpdates())).run(graph, ctx)
    verify(graph, ctx.mesh_axes)
    after = print_graph(graph)
    filecheck(
        after,
        """
        CHECK: func @step(%0: f32[3,2,16]{replica} sharded=1{replica} loc("w"),
        CHECK: %[[GRADS:[0-9]+]]: f32[3,2,16]{replica} = jax.scan(%{{[0-9]+}}, %0, %{{[0-9]+}})
        CHECK: %[[STEP:[0-9]+]]: f32[3,2,16]{replica} = jax.mul(%[[GRADS]], %2)
        CHECK-NEXT: %[[NEW:[0-9]+]]: f32[3,2,16]{replica} = jax.sub(%0, %[[STEP]])
        CHECK-NEXT: return %[[NEW]] state=%0 sharded=1{replica} loc("w"), %{{[0-9]+}}
        """,
    )
    top_level = [n.op for n in graph.nodes]
    assert "all_gather" not in top_level and "all_reduce" not in top_level
    assert ctx.stats["shard-weight-updates"]["decision"]["reason"] == "shard-parameters"


def test_a_value_with_no_dividing_dimension_stays_replicated_with_a_remark():
    text = LAYERS.replace("f32[3,16,16]", "f32[3,15,15]").replace("f32[16,16]", "f32[15,15]")
    changed, after, ctx = run_pass(ShardParameters(), text)
    assert "sharded=" not in after and "all_gather" not in after
    assert ctx.stats["shard-parameters"]["replicated"] == [
        {
            "state": "w",
            "type": "f32[3,15,15]",
            "reason": "no dividing dimension besides the layer dimension",
        }
    ]


def test_auto_mode_needs_a_chip_memory_size():
    changed, _, ctx = run_pass(ShardParameters(mode="auto"), LAYERS)
    assert not changed
    assert ctx.stats["shard-parameters"]["decision"] == {
        "on": False,
        "reason": "no chip memory size",
    }
