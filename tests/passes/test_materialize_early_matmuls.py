"""materialize-early-matmuls: a matmul a sum adds, after a loop, to what the loop made gets a
barrier of its own, in the IR and in the HLO XLA is given; matmuls the rule leaves alone
stay free; a tied-embedding language model written the flax way trains to the numbers of
one device with it."""

from __future__ import annotations

import flax.linen as nn
import optax
import pytest

from tests import helpers
from tests.filecheck import filecheck
from tests.passes.pass_testing import MESH, run_pass
from tests.passes.test_reduce_scatters_before_loops import Block  # a tanh layer for nn.scan
from xla_strategies.passes import MaterializeEarlyMatmuls

# a tied weight's gradient: a matmul of larger operands made before the loop, reduced
# and transposed, added after the loop to what the loop made
STEP = """\
func @step(%0: f32[64,32]{replica}, %1: f32[64,8]{replica}, %2: f32[8,32]{replica}) {
  %3: f32[8,32]{replica} = jax.dot_general(%1, %0) {"dimension_numbers": [[[0], [0]], [[], []]]}
  %4: f32[8,32] = all_reduce(%3) {"axes": ["replica"], "reduce_op": "sum"}
  %5: f32[8,32]{replica} = jax.scan(%2) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%6: f32[8,32]{replica}) {
      %7: f32[8,32]{replica} = jax.tanh(%6)
      return %7
    }
  %8: f32[8,32] = all_reduce(%5) {"axes": ["replica"], "reduce_op": "sum"}
  %9: f32[8,32] = jax.add_any(%4, %8)
  return %9
}
"""


def test_the_matmul_added_after_the_loop_is_materialized_where_it_is_made():
    changed, after, ctx = run_pass(MaterializeEarlyMatmuls(), STEP, MESH)
    assert changed and ctx.stats["materialize-early-matmuls"] == {"materialized": 1}
    filecheck(
        after,
        """
        CHECK: %[[D:[0-9]+]]: f32[8,32]{replica} = jax.dot_general(%1, %0)
        CHECK-NEXT: %[[M:[0-9]+]]: f32[8,32]{replica} = after(%[[D]])
        CHECK-NEXT: %[[R:[0-9]+]]: f32[8,32] = all_reduce(%[[M]])
        CHECK: jax.scan
        CHECK: jax.add_any(%[[R]],
        """,
    )


# the same sum, both addends made before the loop: nothing to keep apart
BEFORE_ONLY = STEP.replace("jax.add_any(%4, %8)", "jax.add_any(%4, %4)")
# a matmul whose operands are smaller than its result (an outer product): held whole, it
# would cost more than the operands it frees
GROWING = """\
func @step(%0: f32[64,1]{replica}, %1: f32[1,64]{replica}, %2: f32[64,64]{replica}) {
  %3: f32[64,64]{replica} = jax.dot_general(%0, %1) {"dimension_numbers": [[[1], [0]], [[], []]]}
  %5: f32[64,64]{replica} = jax.scan(%2) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%6: f32[64,64]{replica}) {
      %7: f32[64,64]{replica} = jax.tanh(%6)
      return %7
    }
  %9: f32[64,64]{replica} = jax.add_any(%3, %5)
  return %9
}
"""


@pytest.mark.parametrize(
    ("step", "mode", "changed"),
    [(BEFORE_ONLY, "on", False), (GROWING, "auto", False), (GROWING, "on", True)],
    ids=["no-loop-between", "growing-auto", "growing-on"],
)
def test_only_a_matmul_a_loop_separates_from_its_sum_is_materialized(step, mode, changed):
    did, after, _ = run_pass(MaterializeEarlyMatmuls(mode=mode), step, MESH)
    assert did == changed and ("after(" in after) == changed


class TiedLM(nn.Module):
    """Layers under `nn.scan`, and the output layer the embedding's `attend`, as flax's
    docs tie them."""

    vocab: int = 32
    width: int = 16

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width)
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = layers(self.width)(embed(tokens), None)
        return embed.attend(x)


def test_a_tied_embedding_step_trains_to_the_numbers_of_one_device_with_its_barrier():
    # plain SGD: adam divides near-zero gradients by their size, and so scales up the
    # summation-order differences the test must not depend on
    _, state, step, batch = helpers.lm_trains_as_jit(
        TiedLM(), optax.sgd(0.5), pipeline="insert-reductions,materialize-early-matmuls"
    )
    assert step.executable(*state, batch).pass_stats["materialize-early-matmuls"] == {
        "materialized": 1
    }
    assert "opt-barrier" in step.lower(*state, batch).as_text(dialect="hlo")
