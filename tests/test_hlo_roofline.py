"""The reader's compute as a roofline: each instruction's matmul flops at peak or its
device-memory bytes at the memory's bandwidth, whichever is longer. Programs compiled by
this release's TPU compiler for one v5e chip, and HLO written by hand for the rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import one_tpu_chip
from xla_strategies.hardware.compiled_report import hlo_report
from xla_strategies.hardware.hlo import computations
from xla_strategies.hardware.hlo_roofline import hbm_bytes
from xla_strategies.hardware.topology import Topology

pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")

MIB = 2**20
V5E = Topology.from_name("v5e-4")


def _one_chip_spec(shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=one_tpu_chip())


def _read(fn, *shapes, donate=()) -> tuple[float, float]:
    """(compute, matmul) of `fn` compiled for one v5e chip, as bytes at its bandwidth."""
    args = [_one_chip_spec(*s) if isinstance(s[0], tuple) else _one_chip_spec(s) for s in shapes]
    text = jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()
    estimate = hlo_report(text, V5E).estimate
    bandwidth = V5E.memory_bandwidth
    return estimate["compute_s"] * bandwidth, estimate["matmul_s"] * bandwidth


def test_an_elementwise_update_costs_its_bytes_at_the_memory_bandwidth():
    """SGD with momentum on a 4 MiB weight: no matmul flops, so a flops-only estimate made
    it free; it reads the weight, gradient and momentum and writes two of them."""

    def update(w, g, m):
        momentum = 0.9 * m + g
        return w - 0.1 * momentum, momentum

    compute, matmul = _read(update, (1024, 1024), (1024, 1024), (1024, 1024), donate=(0, 2))
    assert matmul == 0
    assert compute == pytest.approx(5 * 4 * MIB)


def _layers(ws, x):
    return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]


def _layers_kept(ws, x):
    def layer(x, w):
        y = jnp.tanh(x @ w)
        return y, y

    return jax.lax.scan(layer, x, ws)[1]


def test_a_scanned_layer_reads_its_slice_of_the_stacked_weight_not_the_stack():
    """Eight 4 MiB layers in a loop: each trip reads one layer (dynamic-slice inside the
    fusion), 32 MiB a step with the activations; the whole stack each trip would be 256."""
    compute, _ = _read(_layers, (8, 1024, 1024), (128, 1024))
    assert 8 * 4 * MIB <= compute <= 8 * 6 * MIB


def test_an_in_place_update_of_a_stacked_output_writes_only_the_update():
    """Each trip writes its 0.5 MiB of activations into the stacked output where it lies
    (dynamic-update-slice): 4 MiB over the loop, not the 4 MiB buffer each trip."""
    plain, _ = _read(_layers, (8, 1024, 1024), (128, 1024))
    kept, _ = _read(_layers_kept, (8, 1024, 1024), (128, 1024))
    assert 0 < kept - plain <= 8 * MIB


def test_a_large_matmul_is_bound_by_its_flops():
    compute, matmul = _read(
        lambda a, b: a @ b, ((4096, 4096), jnp.bfloat16), ((4096, 4096), jnp.bfloat16)
    )
    assert matmul > 0 and matmul <= compute <= 1.1 * matmul


_HAND_WRITTEN = """\
HloModule m

%inner (p0: f32[8,256,128], p1: s32[]) -> f32[256,128] {
  %p0 = f32[8,256,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,256,128]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,256,128}
}

%outer (q0: f32[8,256,128], q1: s32[], q2: f32[256,128]) -> f32[256,128] {
  %q0 = f32[8,256,128]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %q2 = f32[256,128]{1,0:T(8,128)S(1)} parameter(2)
  %f = f32[256,128]{1,0} fusion(%q0, %q1), kind=kLoop, calls=%inner
  ROOT %add = f32[256,128]{1,0} add(%f, %q2)
}

ENTRY %main (a: f32[8,256,128], i: s32[], b: f32[256,128]) -> f32[256,128] {
  %a = f32[8,256,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %b = f32[256,128]{1,0} parameter(2)
  %cs = (f32[256,128]{1,0:T(8,128)S(1)}, f32[256,128]{1,0}, u32[]{:S(2)}) copy-start(%b)
  %cd = f32[256,128]{1,0:T(8,128)S(1)} copy-done(%cs)
  ROOT %fused = f32[256,128]{1,0} fusion(%a, %i, %cd), kind=kLoop, calls=%outer
}
"""


def test_slices_through_nested_fusions_on_chip_memory_and_prefetches():
    """A slice taken inside a nested fusion reads the slice (128 KiB of the 1 MiB stack);
    an operand in on-chip memory (`S(1)`) moves nothing through HBM; the copy that
    prefetched it read it from HBM once."""
    comps, entry = computations(_HAND_WRITTEN)
    ops = comps[entry]
    types = {op[0]: op[1] for op in ops}
    by_name = {op[0]: op for op in ops}
    block = 256 * 128 * 4
    assert hbm_bytes(by_name["cs"], comps, types) == block
    assert hbm_bytes(by_name["cd"], comps, types) == 0
    # the slice read and the result written; the prefetched operand is on chip
    assert hbm_bytes(by_name["fused"], comps, types) == block + 4 + block  # and the index


_PREFETCH_BESIDE_A_MATMUL = """\
HloModule m

ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096], c: f32[1024,1024]) -> bf16[4096,4096] {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %b = bf16[4096,4096]{1,0} parameter(1)
  %c = f32[1024,1024]{1,0} parameter(2)
  %cs = (f32[1024,1024]{1,0:T(8,128)S(1)}, f32[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%c)
  %d = bf16[4096,4096]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %cd = f32[1024,1024]{1,0:T(8,128)S(1)} copy-done(%cs)
  ROOT %t = (bf16[4096,4096]{1,0}, f32[1024,1024]{1,0:T(8,128)S(1)}) tuple(%d, %cd)
}
"""


def test_a_prefetch_runs_beside_the_compute():
    """A 4 MiB prefetch while a flops-bound matmul runs adds no time: the step is the
    matmul's flops at peak (its 96 MiB and the prefetch's 4 at the memory's bandwidth are
    less)."""
    from xla_strategies.hardware.hlo_roofline import roofline_seconds

    flops = 2 * 4096**3
    assert (3 * 32 + 4) * MIB / V5E.memory_bandwidth < flops / V5E.peak_flops
    assert roofline_seconds(_PREFETCH_BESIDE_A_MATMUL, V5E) == pytest.approx(flops / V5E.peak_flops)


_UNFUSED_SLICES = """\
HloModule m

ENTRY %main (a: f32[8,256,128], u: f32[1,256,128], i: s32[]) -> f32[8,256,128] {
  %a = f32[8,256,128]{2,1,0} parameter(0)
  %u = f32[1,256,128]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %ds = f32[1,256,128]{2,1,0} dynamic-slice(%a, %i, %z, %z), dynamic_slice_sizes={1,256,128}
  %sum = f32[1,256,128]{2,1,0} add(%ds, %u)
  ROOT %dus = f32[8,256,128]{2,1,0} dynamic-update-slice(%a, %sum, %i, %z, %z)
}
"""


def test_an_unfused_slice_reads_the_slice_and_an_unfused_update_writes_in_place():
    comps, entry = computations(_UNFUSED_SLICES)
    ops = comps[entry]
    types = {op[0]: op[1] for op in ops}
    by_name = {op[0]: op for op in ops}
    block = 256 * 128 * 4  # one of the eight
    assert hbm_bytes(by_name["ds"], comps, types) == block + 4 + 4 + 4 + block
    # the update read and written where it lies; the indices read
    assert hbm_bytes(by_name["dus"], comps, types) == block + 4 * 3 + block
