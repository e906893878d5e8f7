"""fold-invariant-reductions, text in and text out."""

from __future__ import annotations

from tests.filecheck import filecheck
from tests.passes.pass_testing import run_pass
from xla_strategies.passes import FoldInvariantReductions, parse, print_graph

BEFORE = """\
func @step(%0: f32[3], %1: f32[3]{replica}) {
  %2: f32[3]{replica} = pvary(%0) {"axes": ["replica"]}
  %3: f32[3] = all_reduce(%2) {"axes": ["replica"], "origin": "user", "reduce_op": "sum"}
  %4: f32[3]{replica} = pvary(%0) {"axes": ["replica"]}
  %5: f32[3] = all_reduce(%4) {"axes": ["replica"], "origin": "user", "reduce_op": "max"}
  %6: f32[3] = all_reduce(%1) {"axes": ["replica"], "origin": "user", "reduce_op": "sum"}
  return %3, %5, %6
}
"""


def test_reductions_of_replicated_values_fold_and_real_ones_stay():
    changed, after, ctx = run_pass(FoldInvariantReductions(), BEFORE)
    assert changed and ctx.stats["fold-invariant-reductions"] == {"folded": 2}
    filecheck(
        after,
        """
        CHECK: %[[SUM:[0-9]+]]: f32[3] = scale(%0) {"factor": 8}  // by fold-invariant-reductions
        CHECK: %[[MAX:[0-9]+]]: f32[3] = scale(%0) {"factor": 1}  // by fold-invariant-reductions
        CHECK-NEXT: %[[REAL:[0-9]+]]: f32[3] = all_reduce(%1)
        CHECK-NEXT: return %[[SUM]], %[[MAX]], %[[REAL]]
        """,
    )


def test_a_reduction_over_axes_the_value_already_varies_on_stays():
    text = """\
func @step(%0: f32[3]{x}) {
  %1: f32[3]{x,y} = pvary(%0) {"axes": ["y"]}
  %2: f32[3] = all_reduce(%1) {"axes": ["x", "y"], "origin": "user", "reduce_op": "sum"}
  return %2
}
"""
    changed, after, _ = run_pass(FoldInvariantReductions(), text, mesh={"x": 2, "y": 4})
    assert not changed and after == print_graph(parse(text))
