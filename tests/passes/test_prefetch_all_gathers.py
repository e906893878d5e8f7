"""prefetch-all-gathers, text in and text out: a layer loop's gather becomes a carry,
prefetched one layer ahead, also from inside a checkpoint region."""

from __future__ import annotations

import xla_strategies as xs
from tests.filecheck import filecheck
from tests.passes.pass_testing import run_pass
from xla_strategies.passes import PrefetchAllGathers

# a forward scan over 3 layers whose body gathers its bf16 layer from f32 blocks
FORWARD = """\
func @step(%0: f32[2,16]{replica}, %1: f32[3,2,16]{replica}) {
  %2: f32[2,16]{replica}, %3: f32[3,2,16]{replica} = jax.scan(%0, %1) {"length": 3, "num_carry": 1, "num_consts": 0, "reverse": false, "unroll": 1}
    region (%4: f32[2,16]{replica}, %5: f32[2,16]{replica}) {
      %6: bf16[2,16]{replica} = jax.convert_element_type(%5) {"new_dtype": "bfloat16", "weak_type": false}
      %7: bf16[16,16] = all_gather(%6) {"axes": ["replica"], "dimension": 0}
      %8: bf16[16,16]{replica} = pvary(%7) {"axes": ["replica"]}
      %9: f32[2,16]{replica} = jax.dot_general(%4, %8) {"dimension_numbers": [[[1], [0]], [[], []]]}
      return %9, %4
    }
  return %2, %3
}
"""


def test_the_next_layer_is_gathered_into_a_carry():
    changed, after, ctx = run_pass(PrefetchAllGathers(mode="on"), FORWARD)
    assert changed
    filecheck(
        after,
        """
        CHECK: %[[ROW:[0-9]+]]: f32[1,2,16]{replica} = slice(%1) {"limit": [1, 2, 16], "start": [0, 0, 0]}
        CHECK-NEXT: %[[L0:[0-9]+]]: f32[2,16]{replica} = reshape(%[[ROW]])
        CHECK-NEXT: %[[C0:[0-9]+]]: bf16[2,16]{replica} = jax.convert_element_type(%[[L0]])
        CHECK-NEXT: %[[G0:[0-9]+]]: bf16[16,16] = all_gather(%[[C0]])
        CHECK-NEXT: %[[LATER:[0-9]+]]: f32[2,2,16]{replica} = slice(%1) {"limit": [3, 2, 16], "start": [1, 0, 0]}
        CHECK-NEXT: %[[FIRST:[0-9]+]]: f32[1,2,16]{replica} = slice(%1) {"limit": [1, 2, 16], "start": [0, 0, 0]}
        CHECK-NEXT: %[[NEXT:[0-9]+]]: f32[3,2,16]{replica} = concatenate(%[[LATER]], %[[FIRST]]) {"dimension": 0}
        CHECK-NEXT: %[[OUT:[0-9]+]]: f32[2,16]{replica}, %{{[0-9]+}}: bf16[16,16], %[[YS:[0-9]+]]: f32[3,2,16]{replica} = jax.scan(%0, %[[G0]], %1, %[[NEXT]]) {"length": 3, "num_carry": 2,
        CHECK-NEXT: region (%[[H:[0-9]+]]: f32[2,16]{replica}, %[[W:[0-9]+]]: bf16[16,16], %{{[0-9]+}}: f32[2,16]{replica}, %[[XN:[0-9]+]]: f32[2,16]{replica}) {
        CHECK-NEXT: %[[CN:[0-9]+]]: bf16[2,16]{replica} = jax.convert_element_type(%[[XN]])
        CHECK-NEXT: %[[GN:[0-9]+]]: bf16[16,16] = all_gather(%[[CN]])
        CHECK-NEXT: pvary(%[[W]])
        CHECK-NOT: all_gather
        CHECK: return %{{[0-9]+}}, %[[GN]], %[[H]]
        CHECK: return %[[OUT]], %[[YS]]
        """,
    )
    assert ctx.stats["prefetch-all-gathers"]["loops"] == 1
    assert ctx.stats["prefetch-all-gathers"]["gathered_bytes_per_layer"] == 16 * 16 * 2


def test_a_reverse_loop_prefetches_the_layer_before_from_a_checkpoint():
    text = (
        FORWARD.replace('"reverse": false', '"reverse": true')
        .replace(
            "      %6: bf16[2,16]{replica} = jax.convert_element_type(%5)",
            '      %20: f32[2,16]{replica} = jax.remat2(%4, %5) {"prevent_cse": true}\n'
            "        region (%21: f32[2,16]{replica}, %22: f32[2,16]{replica}) {\n"
            "          %23: bf16[2,16]{replica} = jax.convert_element_type(%22) "
            '{"new_dtype": "bfloat16", "weak_type": false}\n'
            '          %24: bf16[16,16] = all_gather(%23) {"axes": ["replica"], "dimension": 0}\n'
            '          %25: bf16[16,16]{replica} = pvary(%24) {"axes": ["replica"]}\n'
            "          %26: f32[2,16]{replica} = jax.dot_general(%21, %25) "
            '{"dimension_numbers": [[[1], [0]], [[], []]]}\n'
            "          return %26\n"
            "        }\n"
            "      %6: bf16[2,16]{replica} = jax.convert_element_type(%5)",
        )
        .replace(
            "      return %9, %4",
            "      %27: f32[2,16]{replica} = jax.add(%9, %20)\n      return %27, %4",
        )
    )
    changed, after, _ = run_pass(PrefetchAllGathers(mode="on"), text)
    assert changed
    filecheck(
        after,
        """
        CHECK: slice(%1) {"limit": [3, 2, 16], "start": [2, 0, 0]}
        CHECK: %[[LAST:[0-9]+]]: f32[1,2,16]{replica} = slice(%1) {"limit": [3, 2, 16], "start": [2, 0, 0]}
        CHECK-NEXT: %[[EARLIER:[0-9]+]]: f32[2,2,16]{replica} = slice(%1) {"limit": [2, 2, 16], "start": [0, 0, 0]}
        CHECK-NEXT: concatenate(%[[LAST]], %[[EARLIER]]) {"dimension": 0}
        CHECK: "num_carry": 3
        CHECK: region (%[[H:[0-9]+]]: f32[2,16]{replica}, %[[W:[0-9]+]]: bf16[16,16],
        CHECK: jax.remat2(%[[H]], %{{[0-9]+}}, %[[W]]) {"prevent_cse": true}
        CHECK-NEXT: region (%{{[0-9]+}}: f32[2,16]{replica}, %{{[0-9]+}}: f32[2,16]{replica}, %[[INNER:[0-9]+]]: bf16[16,16]) {
        CHECK-NOT: all_gather
        CHECK: pvary(%[[INNER]])
        """,
    )


def test_auto_mode_leaves_emulated_devices_alone():
    changed, after, ctx = run_pass(PrefetchAllGathers(), FORWARD)
    assert not changed and after == FORWARD
    assert ctx.stats["prefetch-all-gathers"]["reason"] == "no topology"


def test_auto_mode_leaves_a_compiler_with_synchronous_gathers_alone():
    """On v5p, libtpu runs a layer loop's all-gathers synchronously: a prefetch would hold
    one more layer and hide nothing (Llama-2-70B on v5p-512: 16.51 against 15.41 GiB)."""
    v5p, h100 = xs.Topology.from_name("v5p-8"), xs.Topology.from_name("dgx-h100")
    changed, after, ctx = run_pass(PrefetchAllGathers(), FORWARD, topology=v5p)
    assert not changed and after == FORWARD
    assert ctx.stats["prefetch-all-gathers"]["reason"] == "synchronous gathers"
    assert "runs a layer loop's all-gathers synchronously" in ctx.remarks[0]
    assert run_pass(PrefetchAllGathers(), FORWARD, topology=h100)[0]
    assert run_pass(PrefetchAllGathers(mode="on"), FORWARD, topology=v5p)[0]


def test_auto_mode_leaves_gathers_the_compiler_overlaps_per_weight_alone():
    """On v5e, libtpu runs each weight's gather beside the matmul before its use: with the
    gathers apart, a prefetch held one more layer for a slower step (Llama-2-7B on
    v5e-256)."""
    v5e = xs.Topology.from_name("v5e-4")
    changed, after, ctx = run_pass(PrefetchAllGathers(), FORWARD, topology=v5e)
    assert not changed and after == FORWARD
    assert ctx.stats["prefetch-all-gathers"]["reason"] == "gathers overlapped per weight"
    assert "runs each weight's gather beside the compute" in ctx.remarks[0]
    assert run_pass(PrefetchAllGathers(mode="on"), FORWARD, topology=v5e)[0]
