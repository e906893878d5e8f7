"""insert-reductions, text in and text out."""

from __future__ import annotations

import pytest

from tests.filecheck import filecheck
from tests.passes.pass_testing import run_pass
from xla_strategies.passes import (
    InsertReductions,
    MirroredOutputError,
    PassContext,
    parse,
    print_graph,
)

BEFORE = """\
func @step(%0: f32[4]{replica}, %1: f32[]{replica}) {
  %2: f32[4] = all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  %3: f32[] = all_reduce(%1) {"axes": ["replica"], "origin": "user", "reduce_op": "sum"}
  %4: f32[] = jax.scan(%0) {"length": 2, "num_carry": 0, "num_consts": 1, "reverse": false, "unroll": 1}
    region (%5: f32[4]{replica}) {
      %6: f32[4] = all_reduce(%5) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
      %7: f32[] = jax.reduce_sum(%6) {"axes": [0]}
      %8: f32[] = scale(%7) {"axes": ["replica"], "factor": 1, "origin": "gradient"}
      return %8
    }
  %9: f32[4] = scale(%2) {"axes": ["replica"], "factor": 1, "origin": "gradient"}
  %10: f32[] = scale(%3) {"factor": 1}
  return %9 loc("output[0]"), %10 loc("output[1]"), %1 loc("output[2]")
}
"""


def _run(text: str, **options) -> tuple[bool, str, PassContext]:
    return run_pass(InsertReductions(**options), text)


def test_mean_scales_the_marked_gradients_only():
    changed, after, ctx = _run(BEFORE)
    assert changed
    # the reductions stay sums; the gradient scales, in the loop body too, become 1/8, and
    # the user's own scale is untouched
    filecheck(
        after,
        """
        CHECK: all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
        CHECK: region
        CHECK: scale({{.*}}) {"axes": ["replica"], "factor": 0.125, "origin": "gradient"}  // by insert-reductions
        CHECK: scale(%2) {"axes": ["replica"], "factor": 0.125, "origin": "gradient"}  // by insert-reductions
        CHECK-NEXT: scale(%3) {"factor": 1}
        CHECK-NOT: // by
        CHECK: return
        """,
    )
    assert ctx.stats["insert-reductions"] == {"mirrored_outputs": 2, "per_replica_outputs": 1}


def test_sum_leaves_everything_alone():
    changed, after, _ = _run(BEFORE, gradient_reduction="sum")
    assert not changed and after == print_graph(parse(BEFORE))


def test_declared_mirrored_output_that_varies_names_its_path():
    text = BEFORE.replace('%1 loc("output[2]")', '%1 mirrored loc("output[2]")')
    with pytest.raises(MirroredOutputError, match=r"output\[2\] \(varies over \['replica'\]\)"):
        _run(text)
    # a declared-mirrored output that really is mirrored is fine
    ok = BEFORE.replace('%9 loc("output[0]")', '%9 mirrored loc("output[0]")')
    assert _run(ok)[0]


AGGREGATED = """\
func @step(%0: f32[2,3]{replica} stacked loc("args[0]"), %1: f32[3]) {
  %2: f32[3]{replica} = jax.reduce_sum(%0) {"axes": [0]}
  %3: f32[3] = jax.neg(%1)
  return %2 aggregate=mean loc("output[0]"), %3 aggregate=sum loc("output[1]"), %2 aggregate=max
}
"""


def test_declared_aggregations_become_reductions_after_their_values():
    changed, after, _ = _run(AGGREGATED)
    assert changed
    filecheck(
        after,
        """
        CHECK: func @step(%0: f32[2,3]{replica} stacked loc("args[0]"), %1: f32[3])
        CHECK-NEXT: %[[V:[0-9]+]]: f32[3]{replica} = jax.reduce_sum(%0)
        CHECK-NEXT: %[[MAX:[0-9]+]]: f32[3] = all_reduce(%[[V]])
        CHECK-SAME: "origin": "aggregation", "output": "output #2", "reduce_op": "max"
        CHECK-NEXT: %[[SUM:[0-9]+]]: f32[3] = all_reduce(%[[V]])
        CHECK-SAME: "origin": "aggregation", "output": "output[0]", "reduce_op": "sum"
        CHECK-NEXT: %[[MEAN:[0-9]+]]: f32[3] = scale(%[[SUM]]) {"factor": 0.125, "output": "output[0]"}
        CHECK-NEXT: %[[NEG:[0-9]+]]: f32[3] = jax.neg(%1)
        CHECK-NEXT: %[[TIMES:[0-9]+]]: f32[3] = scale(%[[NEG]]) {"factor": 8, "output": "output[1]"}
        CHECK-NEXT: return %[[MEAN]] loc("output[0]"), %[[TIMES]] loc("output[1]"), %[[MAX]]
        """,
    )


GATHERED = """\
func @step(%0: f32[1,2]{replica} loc("args[0]")) {
  %1: f32[8,1,2]{replica} = jax.all_gather(%0) {"all_gather_dimension": 0, "axis_name": ["replica"], "axis_size": 8, "tiled": false}
  %2: f32[] = constant() {"value": 1.0}
  %3: f32[]{replica} = pvary(%2) {"axes": ["replica"]}
  %4: f32[8,1,2]{replica} = jax.add(%1, %3)
  %5: i32[]{replica} = axis_index() {"axes": ["replica"]}
  %6: f32[]{replica} = jax.convert_element_type(%5) {"new_dtype": "float32"}
  %7: f32[8,1,2]{replica} = jax.add(%1, %6)
  return %4 mirrored loc("output[0]"), %7 loc("output[1]")
}
"""


def test_an_all_gathers_result_declared_mirrored_is_typed_invariant():
    changed, after, _ = _run(GATHERED)
    assert changed
    filecheck(
        after,
        """
        CHECK: %[[SUM:[0-9]+]]: f32[8,1,2]{replica} = jax.add
        CHECK: %[[SAME:[0-9]+]]: f32[8,1,2] = pinvariant(%[[SUM]])
        CHECK: return %[[SAME]] mirrored
        """,
    )
    # what reads the replica's index differs across replicas, gathered or not
    with pytest.raises(MirroredOutputError, match=r"output\[1\]"):
        _run(GATHERED.replace('%7 loc("output[1]")', '%7 mirrored loc("output[1]")'))
