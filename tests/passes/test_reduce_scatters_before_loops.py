"""reduce-scatters-before-loops: a loop after a reduce-scatter waits for it, in the IR and
in the HLO XLA is given; gathers, and reduce-scatters the loop reads already, are left free;
a step with a layer loop trains to the same numbers under parameter sharding."""

from __future__ import annotations

import flax.linen as nn
import optax
import pytest

from tests import helpers
from tests.filecheck import filecheck
from tests.passes.pass_testing import MESH, run_pass
from xla_strategies.hardware.topology import Topology
from xla_strategies.passes import DEFAULT_PIPELINE, ReduceScattersBeforeLoops

# a gradient reduce-scattered, then a loop that reads neither it nor its block
STEP = """\
func @step(%0: f32[64,4]{replica}, %1: f32[2,4]{replica}) {
  %2: f32[8,4]{replica} = reduce_scatter(%0) {"axes": ["replica"], "dimension": 0}
  %3: f32[64,4] = all_gather(%2) {"axes": ["replica"], "dimension": 0}
  %4: f32[2,4]{replica} = jax.scan(%1) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%5: f32[2,4]{replica}) {
      %6: f32[2,4]{replica} = jax.tanh(%5)
      return %6
    }
  return %2, %3, %4
}
"""


# the default pipeline with this pass on everywhere (emulated devices have no topology)
ON = DEFAULT_PIPELINE.replace(
    "reduce-scatters-before-loops{mode=auto}", "reduce-scatters-before-loops{mode=on}"
)


def test_the_loop_waits_for_the_reduce_scatter_before_it():
    changed, after, ctx = run_pass(ReduceScattersBeforeLoops(mode="on"), STEP, MESH)
    assert changed and ctx.stats["reduce-scatters-before-loops"] == {"held": 1}
    filecheck(
        after,
        """
        CHECK: %2: f32[8,4]{replica} = reduce_scatter(%0)
        CHECK-NEXT: %3: f32[64,4] = all_gather(%2)
        CHECK-NEXT: %[[W:[0-9]+]]: f32[2,4]{replica} = after(%1, %2)
        CHECK-NEXT: jax.scan(%[[W]])
        """,
    )


# the loop reads the reduce-scatter's block itself: it waits for it already
READS = """\
func @step(%0: f32[64,4]{replica}) {
  %2: f32[8,4]{replica} = reduce_scatter(%0) {"axes": ["replica"], "dimension": 0}
  %4: f32[8,4]{replica} = jax.scan(%2) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%5: f32[8,4]{replica}) {
      %6: f32[8,4]{replica} = jax.tanh(%5)
      return %6
    }
  return %4
}
"""

# only a gather before the loop: it grows its operand, so nothing is held for it
GATHER_ONLY = """\
func @step(%0: f32[8,4]{replica}, %1: f32[2,4]{replica}) {
  %3: f32[64,4] = all_gather(%0) {"axes": ["replica"], "dimension": 0}
  %4: f32[2,4]{replica} = jax.scan(%1) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%5: f32[2,4]{replica}) {
      %6: f32[2,4]{replica} = jax.tanh(%5)
      return %6
    }
  return %3, %4
}
"""


@pytest.mark.parametrize("step", [READS, GATHER_ONLY], ids=["reads-the-block", "gather-only"])
def test_a_loop_that_reads_the_block_already_and_a_gather_are_left_free(step):
    changed, after, _ = run_pass(ReduceScattersBeforeLoops(mode="on"), step, MESH)
    assert not changed and "after(" not in after


@pytest.mark.parametrize(
    ("topology", "runs"),
    [("v5e-256", True), ("v6e-256", True), ("v5p-512", False), ("2xv5p-512", True), (None, False)],
)
def test_auto_mode_runs_where_the_hardware_file_says_it_pays(topology, runs):
    """Measured on Llama-2-7B under parameter sharding: v5e-256 2.97 -> 2.69 GiB per chip,
    v6e-256 3.43 -> 3.16; v5p-512 3.16 -> 3.62 (the peak is in the forward loop there);
    2xv5p-512 3.86 -> 3.62 (v5p's `[multislice]` table)."""
    where = {"topology": Topology.from_name(topology)} if topology else {}
    changed, _, ctx = run_pass(ReduceScattersBeforeLoops(), STEP, MESH, **where)
    assert changed == runs
    assert runs or any("mode=auto}: off" in r for r in ctx.remarks)


class Block(nn.Module):
    width: int = 16

    @nn.compact
    def __call__(self, x, _):
        return nn.tanh(nn.Dense(self.width)(x)), None


class UntiedLM(nn.Module):
    """Layers under `nn.scan`, as flax's docs stack them, and an output layer of its own,
    whose gradient is reduce-scattered between the forward and the backward loop."""

    vocab: int = 32
    width: int = 16

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = layers(self.width)(x, None)
        return nn.Dense(self.vocab)(x)


def test_a_layer_loop_step_trains_to_the_numbers_of_one_device_and_waits_in_its_hlo():
    _, state, step, batch = helpers.lm_trains_as_jit(
        UntiedLM(), optax.adam(1e-2), shard_parameters=True, pipeline=ON
    )
    assert step.executable(*state, batch).pass_stats["reduce-scatters-before-loops"]["held"] >= 1
    assert "opt-barrier" in step.lower(*state, batch).as_text(dialect="hlo")
