"""Op traits: passes name no frontend op, the verifier knows every IR op, and the three
walkers (statistics, ledger, timeline) count a step's collectives the same way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import helpers
from tests.passes.pass_testing import MESH
from xla_strategies.passes import VerificationError, parse, verify
from xla_strategies.passes.cost.collective_stats import collective_counts
from xla_strategies.passes.cost.ledger import collectives
from xla_strategies.passes.cost.timeline import chrome_trace
from xla_strategies.passes.ir.traits import Trait, traits_of

PASSES = Path(__file__).parents[2] / "passes"


def test_no_pass_names_a_jax_op():
    named = {
        str(path.relative_to(PASSES)): found
        for path in PASSES.rglob("*.py")
        if path.parent.name != "bridge"  # the frontend's bridge is where JAX ops are named
        and (found := re.findall(r"[\"']jax\.[a-z_0-9]+[\"']", path.read_text()))
    }
    assert named == {}


def test_frontend_ops_carry_their_traits():
    assert Trait.COUNTED_LOOP in traits_of("jax.scan")
    assert Trait.LINEAR in traits_of("jax.transpose") and Trait.LINEAR in traits_of("scale")
    assert traits_of("all_reduce") >= {Trait.COLLECTIVE, Trait.REDUCES}
    assert traits_of("jax.some_new_primitive") == frozenset()  # opaque


def test_the_verifier_rejects_an_undeclared_ir_op():
    text = "func @f(%0: f32[2]) {\n  %1: f32[2] = frobnicate(%0)\n  return %1\n}\n"
    with pytest.raises(VerificationError, match="unknown op 'frobnicate'"):
        verify(parse(text), MESH)


BRANCHY = """\
func @f(%0: i32[], %1: f32[4]{replica}, %2: f32[100]{replica}, %3: f32[3,2]{replica}) {
  %4: f32[4] = jax.cond(%0, %1, %2) {}
    region (%5: f32[4]{replica}, %6: f32[100]{replica}) {
      %7: f32[4] = all_reduce(%5) {"axes": ["replica"], "reduce_op": "sum"}
      return %7
    }
    region (%8: f32[4]{replica}, %9: f32[100]{replica}) {
      %10: f32[100] = all_reduce(%9) {"axes": ["replica"], "reduce_op": "sum"}
      %11: f32[4] = slice(%10) {"limit": [4], "start": [0]}
      return %11
    }
  %12: f32[2] = jax.scan(%3) {"length": 3, "num_carry": 0, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%13: f32[2]{replica}) {
      %14: f32[2] = all_reduce(%13) {"axes": ["replica"], "reduce_op": "sum"}
      return %14
    }
  return %4, %12
}
"""


def test_statistics_ledger_and_timeline_agree_on_branches_and_loops():
    graph = parse(BRANCHY)
    counts, nbytes = collective_counts(graph)
    assert counts["all_reduce"] == 1 + 3 and nbytes["all_reduce"] == 400 + 3 * 8
    entries = collectives(graph)
    assert sorted((e["bytes"], e["per_step"]) for e in entries) == [(8, 3), (400, 1)]
    events = [e for e in chrome_trace(graph, None)["traceEvents"] if e.get("name") == "all_reduce"]
    assert len(events) == 2  # the costlier branch's, and the scan body's first iteration


def test_ops_a_pass_may_retype_declare_their_shape_parameters():
    from xla_strategies.passes.ir.traits import result_shape_param

    # the block rewrite runs reshapes and broadcasts on blocks: the lowering must know
    # which of their parameters to give the block's shape
    assert result_shape_param("jax.reshape") == "new_sizes"
    assert result_shape_param("jax.broadcast_in_dim") == "shape"
    assert result_shape_param("jax.add") is None  # elementwise: no shape parameter


def test_every_op_of_tanh_gelus_gradient_is_known_to_the_passes():
    """GPT-2 and BERT's GELU (tanh approximation): its gradient's ops on this JAX release
    are all declared, the pointwise ones elementwise (JAX 0.12 made tanh's derivative a
    primitive of its own, `one_minus_square`). An undeclared op is opaque: the cost model
    charges it memory traffic that XLA fuses away, and no pass rewrites through it."""
    import jax
    import jax.numpy as jnp

    import xla_strategies.passes.bridge.ops  # noqa: F401  (declares the JAX ops)

    gradient = jax.grad(lambda x: jnp.sum(jax.nn.gelu(x, approximate=True)))
    jaxpr = jax.make_jaxpr(gradient)(jnp.ones((4, 8))).jaxpr
    found = {eqn.primitive.name for eqn in helpers.jaxpr_equations(jaxpr)}
    structural = {"pjit", "jit", "reduce_sum", "broadcast_in_dim", "reshape"}
    pointwise = found - structural
    assert pointwise and all(Trait.ELEMENTWISE in traits_of(f"jax.{p}") for p in pointwise), {
        p: traits_of(f"jax.{p}") for p in pointwise
    }
