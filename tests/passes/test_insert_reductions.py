"""insert-reductions, text in and text out."""

from __future__ import annotations

import pytest

from tests.passes.pass_testing import run_pass
from xla_strategies.passes import (
    InsertReductions,
    MirroredOutputError,
    PassContext,
)

BEFORE = """\
func @step(%0: f32[4]{replica}, %1: f32[]{replica}) {
  %2: f32[4] = all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  %3: f32[] = all_reduce(%1) {"axes": ["replica"], "origin": "user", "reduce_op": "sum"}
  %4: f32[] = jax.scan(%0) {"length": 2, "num_carry": 0, "num_consts": 1, "reverse": false, "unroll": 1}
    region (%5: f32[4]{replica}) {
      %6: f32[4] = all_reduce(%5) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
      %7: f32[] = jax.reduce_sum(%6) {"axes": [0]}
      return %7
    }
  return %2 loc("output[0]"), %3 loc("output[1]"), %1 loc("output[2]")
}
"""


def _run(text: str, **options) -> tuple[bool, str, PassContext]:
    return run_pass(InsertReductions(**options), text)


def test_mean_applies_to_autodiff_reductions_only():
    changed, after, ctx = _run(BEFORE)
    assert changed
    expected = BEFORE.replace(
        '"origin": "autodiff", "reduce_op": "sum"}',
        '"origin": "autodiff", "reduce_op": "mean"}  // by insert-reductions',
    )
    assert after == expected  # the user's all_reduce is untouched, the one in the loop body is not
    assert ctx.stats["insert-reductions"] == {"mirrored_outputs": 2, "per_replica_outputs": 1}


def test_sum_leaves_everything_alone():
    changed, after, _ = _run(BEFORE, gradient_reduction="sum")
    assert not changed and after == BEFORE


def test_declared_mirrored_output_that_varies_names_its_path():
    text = BEFORE.replace('%1 loc("output[2]")', '%1 mirrored loc("output[2]")')
    with pytest.raises(MirroredOutputError, match=r"output\[2\] \(varies over \['replica'\]\)"):
        _run(text)
    # a declared-mirrored output that really is mirrored is fine
    ok = BEFORE.replace('%2 loc("output[0]")', '%2 mirrored loc("output[0]")')
    assert _run(ok)[0]
