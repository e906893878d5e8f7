"""The tests' FileCheck: each directive can fail, and names carry across lines."""

from __future__ import annotations

import pytest

from tests.filecheck import filecheck

TEXT = """\
func @f(%0: f32[4]) {
  %1: f32[4] = all_reduce(%0) {"reduce_op": "sum"}
  %2: f32[4] = scale(%1) {"factor": 0.5}
  return %2
}
"""


def test_passing_checks():
    filecheck(
        TEXT,
        """
        CHECK: func @f
        CHECK-NEXT: %[[SUM:[0-9]+]]: f32[4] = all_reduce(%0)
        CHECK-SAME: "sum"
        CHECK-NOT: all_reduce
        CHECK: scale(%[[SUM]]) {"factor": {{0\\.5|1}}}
        CHECK-NEXT: return
        """,
    )


@pytest.mark.parametrize(
    ("checks", "message"),
    [
        ("CHECK: broadcast", "CHECK on check line 1 found no 'broadcast'"),
        ("CHECK: func\nCHECK-NEXT: scale", "CHECK-NEXT on check line 2"),
        ("CHECK: all_reduce\nCHECK-SAME: mean", "CHECK-SAME on check line 2"),
        ("CHECK: func\nCHECK-NOT: scale\nCHECK: return", "CHECK-NOT on check line 2 matched"),
        ("CHECK: scale\nCHECK-NOT: }", "CHECK-NOT on check line 2 matched text line 3"),
        ("CHECK: scale(%[[X]])", "[[X]] is used before"),
    ],
)
def test_failing_checks_say_which(checks, message):
    with pytest.raises(AssertionError, match=message.replace("[", r"\[").replace("(", r"\(")):
        filecheck(TEXT, checks)
