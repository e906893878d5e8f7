"""A lookup table's gradient summed where its block lies, on IR text: an all-to-all of the
cotangents and a local scatter-add into zeros of one block, no reduction of the whole
table; and when the rule is not taken."""

from __future__ import annotations

from tests.filecheck import filecheck
from tests.passes.pass_testing import MESH, run_pass
from xla_strategies.passes import ShardWeightUpdates

# SGD on a [64, 16] table: this replica's ids %1 [2, 7, 1] are looked up, the cotangent %2
# of the rows is scattered into zeros, summed over the replicas and applied
LOOKUP = """\
func @step(%0: f32[64,16] loc("table"), %1: i32[2,7,1]{replica}, %2: f32[2,7,16]{replica}) {
  %3: f32[2,7,16]{replica} = jax.gather(%0, %1) {"dimension_numbers": [[2], [0], [0], [], []], "indices_are_sorted": SORTED, "slice_sizes": [1, 16], "unique_indices": false}
  %4: f32[] = constant() {"value": 0.0}
  %5: f32[64,16] = jax.broadcast_in_dim(%4) {"broadcast_dimensions": [], "shape": [64, 16]}
  %6: f32[64,16]{replica} = pvary(%5) {"axes": ["replica"]}
  %7: f32[64,16]{replica} = jax.scatter-add(%6, %1, %2) {"dimension_numbers": [[2], [0], [0], [], []], "indices_are_sorted": SORTED, "unique_indices": false}
  %8: f32[64,16] = all_reduce(%7) {"axes": ["replica"], "origin": "autodiff", "param": "table", "reduce_op": "sum"}
  %9: f32[64,16] = jax.sub(%0, %8)
  return %9 state=%0, %3
}
"""


def test_the_gradient_of_a_lookup_is_summed_where_its_block_lies():
    changed, after, ctx = run_pass(ShardWeightUpdates(), LOOKUP.replace("SORTED", "false"), MESH)
    assert changed
    filecheck(
        after,
        """
        CHECK: %[[T:[0-9]+]]: f32[16,7,2]{replica} = all_to_all(%2) {"axes": ["replica"], "concat_axis": 0, "split_axis": 2}
        CHECK-NEXT: %[[Z:[0-9]+]]: f32[64,2]{replica} = jax.broadcast_in_dim(%4)
        CHECK-SAME: "shape": [64, 2]
        CHECK-NEXT: %[[ZV:[0-9]+]]: f32[64,2]{replica} = pvary(%[[Z]])
        CHECK-NEXT: %[[FLAT:[0-9]+]]: i32[2,7]{replica} = reshape(%1)
        CHECK-NEXT: %[[IDS:[0-9]+]]: i32[16,7] = all_gather(%[[FLAT]]) {"axes": ["replica"], "dimension": 0}
        CHECK-NEXT: %[[IDS1:[0-9]+]]: i32[16,7,1] = reshape(%[[IDS]])
        CHECK-NEXT: %[[G:[0-9]+]]: f32[64,2]{replica} = jax.scatter-add(%[[ZV]], %[[IDS1]], %[[T]])
        CHECK-NOT: reduce_scatter
        CHECK-NOT: all_reduce
        CHECK: jax.sub(%{{[0-9]+}}, %[[G]])
        """,
    )
    stats = ctx.stats["shard-weight-updates"]
    assert stats["lookup_gradients"] == 1 and stats["sharded_gradients"] == 1
    assert "table where it lies" in " ".join(ctx.remarks)


def test_ids_promised_sorted_keep_the_reduce_scatter():
    """Every replica's ids concatenated are not sorted, whatever one replica's were."""
    _, after, ctx = run_pass(ShardWeightUpdates(), LOOKUP.replace("SORTED", "true"), MESH)
    assert "all_to_all" not in after and "reduce_scatter" in after
    assert ctx.stats["shard-weight-updates"]["lookup_gradients"] == 0
