"""reassociate-all-reduces, text in and text out."""

from __future__ import annotations

from tests.filecheck import filecheck
from tests.passes.pass_testing import run_pass
from xla_strategies.passes import PassContext, ReassociateAllReduces, parse, print_graph

TIED = """\
func @step(%0: f32[32,64]{replica}, %1: f32[64,32]{replica}) {
  %2: f32[32,64] = all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "mean"}
  %3: f32[64,32] = jax.transpose(%2) {"permutation": [1, 0]}
  %4: f32[64,32] = all_reduce(%1) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "mean"}
  %5: f32[64,32] = jax.add_any(%3, %4)
  return %5
}
"""


def _run(text: str) -> tuple[bool, str, PassContext]:
    return run_pass(ReassociateAllReduces(), text)


def test_tied_weight_is_reduced_once():
    changed, after, ctx = _run(TIED)
    assert changed
    filecheck(
        after,
        """
        CHECK: %[[T:[0-9]+]]: f32[64,32]{replica} = jax.transpose(%0)
        CHECK-NEXT: %[[ADD:[0-9]+]]: f32[64,32]{replica} = jax.add_any(%[[T]], %1)
        CHECK-NEXT: %[[SUM:[0-9]+]]: f32[64,32] = all_reduce(%[[ADD]])
        CHECK-NOT: all_reduce
        CHECK: return %[[SUM]]
        """,
    )
    assert ctx.stats["reassociate-all-reduces"] == {"merged": 1}


def test_sum_of_three_with_invariant_scaling_collapses_to_one():
    text = """\
func @step(%0: f32[4]{replica}, %1: f32[4]{replica}, %2: f32[4]{replica}, %3: f32[]) {
  %4: f32[4] = all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  %5: f32[4] = all_reduce(%1) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  %6: f32[4] = jax.mul(%5, %3)
  %7: f32[4] = jax.add(%4, %6)
  %8: f32[4] = all_reduce(%2) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  %9: f32[4] = jax.add_any(%7, %8)
  return %9
}
"""
    changed, after, ctx = _run(text)
    assert changed and after.count("all_reduce(") == 1
    assert ctx.stats["reassociate-all-reduces"] == {"merged": 2}


def test_not_applied_where_it_would_change_numbers():
    cases = [
        # a max is not linear
        TIED.replace('"mean"', '"max"'),
        # the two parts are reduced differently
        TIED.replace('"mean"}\n  %3', '"sum"}\n  %3'),
        # a reduced part is also read elsewhere, which still needs it reduced
        TIED.replace("return %5", "return %5, %2"),
        # scaling by a varying value does not commute with the reduction
        """\
func @step(%0: f32[4]{replica}, %1: f32[4]{replica}) {
  %2: f32[4] = all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  %3: f32[4]{replica} = jax.mul(%2, %1)
  %4: f32[4] = all_reduce(%1) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  %5: f32[4]{replica} = jax.add(%3, %4)
  return %5
}
""",
    ]
    for text in cases:
        changed, after, _ = _run(text)
        assert not changed and after == print_graph(parse(text))


def test_a_dtype_conversion_stops_the_rewrite():
    """Summing f16 values in f32 instead of f16 changes the result (f16 overflows)."""
    text = """\
func @step(%0: f16[4]{replica}, %1: f32[4]{replica}) {
  %2: f16[4] = all_reduce(%0) {"axes": ["replica"], "origin": "user", "reduce_op": "sum"}
  %3: f32[4] = jax.convert_element_type(%2) {"new_dtype": "float32", "weak_type": false}
  %4: f32[4] = all_reduce(%1) {"axes": ["replica"], "origin": "user", "reduce_op": "sum"}
  %5: f32[4] = jax.add(%3, %4)
  return %5
}
"""
    changed, after, _ = _run(text)
    assert not changed and after == print_graph(parse(text))
