"""hoist-all-reduces, text in and text out: scan over layers, while loops, and loops where
hoisting would be wrong."""

from __future__ import annotations

from tests.filecheck import filecheck
from tests.passes.pass_testing import MESH, run_pass
from xla_strategies.passes import HoistAllReduces, PassContext, parse

SCAN = """\
func @step(%0: f32[], %1: f32[3,4]{replica}) {
  %2: f32[], %3: f32[3,4] = jax.scan(%0, %1) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%4: f32[], %5: f32[4]{replica}) {
      %6: f32[4] = all_reduce(%5) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "mean"}
      %7: f32[4] = jax.neg(%6)
      %8: f32[]{replica} = jax.reduce_sum(%5) {"axes": [0]}
      %9: f32[] = all_reduce(%8) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
      %10: f32[] = jax.add_any(%4, %9)
      return %10, %7
    }
  return %2, %3
}
"""


def _run(text: str) -> tuple[bool, str, PassContext]:
    return run_pass(HoistAllReduces(), text)


def test_scan_stacked_output_and_accumulator_are_hoisted():
    changed, after, ctx = _run(SCAN)
    assert changed
    filecheck(
        after,
        """
        CHECK: %[[ZERO:[0-9]+]]: f32[] = constant() {"value": 0}
        CHECK-NEXT: %[[INIT:[0-9]+]]: f32[]{replica} = pvary(%[[ZERO]])
        CHECK-NEXT: %[[ACC:[0-9]+]]: f32[]{replica}, %[[YS:[0-9]+]]: f32[3,4]{replica} = jax.scan(%[[INIT]], %1)
        CHECK-NOT: all_reduce
        CHECK: return
        CHECK-NEXT: }
        CHECK-NEXT: %[[STACK:[0-9]+]]: f32[3,4] = all_reduce(%[[YS]])
        CHECK-SAME: "reduce_op": "mean"
        CHECK-NEXT: %[[TOTAL:[0-9]+]]: f32[] = all_reduce(%[[ACC]])
        CHECK-SAME: "reduce_op": "sum"
        CHECK-NEXT: %[[OUT:[0-9]+]]: f32[] = add(%0, %[[TOTAL]])
        CHECK-NEXT: return %[[OUT]], %[[STACK]]
        """,
    )
    assert ctx.stats["hoist-all-reduces"] == {"hoisted": 2}
    assert ctx.remarks == []


WHILE = """\
func @step(%0: i32[], %1: f32[4], %2: f32[4]{replica}) {
  %3: i32[], %4: f32[4] = jax.while(%0, %2, %0, %1) {"body_nconsts": 1, "cond_nconsts": 1}
    region (%5: i32[], %6: i32[], %7: f32[4]) {
      %8: bool[] = jax.lt(%6, %5)
      return %8
    }
    region (%9: f32[4]{replica}, %10: i32[], %11: f32[4]) {
      %12: i32[] = constant() {"value": 1}
      %13: i32[] = jax.add(%10, %12)
      %14: f32[4] = all_reduce(%9) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "mean"}
      %15: f32[4] = jax.add(%11, %14)
      return %13, %15
    }
  return %4
}
"""


def test_while_loop_accumulator_is_hoisted():
    changed, after, _ = _run(WHILE)
    assert changed
    graph = parse(after)
    loop = next(n for n in graph.nodes if n.op == "jax.while")
    assert loop.regions[1].count_ops("all_reduce") == 0
    assert [n.op for n in graph.nodes] == ["constant", "pvary", "jax.while", "all_reduce", "add"]


def test_not_hoisted_where_it_would_change_numbers():
    # the while condition reads the accumulator: it would see unreduced partial sums
    reads_in_cond = WHILE.replace(
        "%8: bool[] = jax.lt(%6, %5)",
        '%99: f32[] = jax.reduce_sum(%7) {"axes": [0]}\n      %8: bool[] = jax.lt(%6, %5)',
    )
    # the reduced value scales the carry: not linear in the reduction
    scales_carry = SCAN.replace("jax.add_any(%4, %9)", "jax.mul(%4, %9)")
    # the reduced value is read again inside the body
    read_inside = SCAN.replace("%7: f32[4] = jax.neg(%6)", "%7: f32[4] = jax.mul(%6, %6)")
    for text, remark in [
        (reads_in_cond, None),
        (scales_carry, "its result is read inside the loop by jax.mul"),
        (read_inside, "its result is read inside the loop by jax.mul"),
    ]:
        graph = parse(text)
        ctx = PassContext(mesh_axes=MESH)
        HoistAllReduces().run(graph, ctx)
        loop = next(n for n in graph.nodes if n.op in ("jax.scan", "jax.while"))
        body = loop.regions[-1]
        assert body.count_ops("all_reduce") >= 1, text
        if remark:
            assert any(remark in r for r in ctx.remarks), ctx.remarks


def test_nothing_to_do():
    text = """\
func @step(%0: f32[4]{replica}) {
  %1: f32[4] = all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "mean"}
  return %1
}
"""
    changed, after, ctx = _run(text)
    assert not changed and after == text
