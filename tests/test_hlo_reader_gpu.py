"""XLA:GPU's asynchronous spellings, read as what they move and compute: an
`all-reduce-start` returns `((operands), result)` and a `fusion-start` runs its fused
computation once, in place. Checked on hand-counted HLO, and against the result shapes of
a program XLA's GPU compiler compiled on this JAX release."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import xla_strategies as xs
from xla_strategies.hardware.compiled_report import hlo_report
from xla_strategies.hardware.hlo import (
    COLLECTIVES,
    computations,
    hlo_bytes,
)
from xla_strategies.hardware.hlo_collectives import collectives
from xla_strategies.hardware.hlo_flops import hlo_flops
from xla_strategies.hardware.hlo_loops import executions
from xla_strategies.hardware.hlo_roofline import hbm_bytes, instruction_seconds
from xla_strategies.hardware.hlo_timeline import hlo_timeline
from xla_strategies.hardware.topology import Topology

_ASYNC = """HloModule m, num_partitions=8

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(bf16[] %a, bf16[] %b)
}

%fused_save (p0: f32[4,256,256], p1: f32[256,256], p2: s32[]) -> f32[4,256,256] {
  %p0 = f32[4,256,256]{2,1,0} parameter(0)
  %p1 = f32[256,256]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %d = f32[256,256]{1,0} dot(f32[256,256]{1,0} %p1, f32[256,256]{1,0} %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %b = f32[1,256,256]{2,1,0} bitcast(f32[256,256]{1,0} %d)
  %z = s32[] constant(0)
  ROOT %dus = f32[4,256,256]{2,1,0} dynamic-update-slice(f32[4,256,256]{2,1,0} %p0, f32[1,256,256]{2,1,0} %b, s32[] %p2, s32[] %z, s32[] %z)
}

ENTRY %main (a: f32[4,256,256], u: f32[256,256], i: s32[], g: bf16[1024]) -> (f32[4,256,256], bf16[1024]) {
  %a = f32[4,256,256]{2,1,0} parameter(0)
  %u = f32[256,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %g = bf16[1024]{0} parameter(3)
  %ars = ((bf16[1024]{0}), bf16[1024]{0}) all-reduce-start(bf16[1024]{0} %g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %fs = ((f32[4,256,256]{2,1,0}, f32[256,256]{1,0}, s32[]), f32[4,256,256]{2,1,0}, u32[]) fusion-start(f32[4,256,256]{2,1,0} %a, f32[256,256]{1,0} %u, s32[] %i), kind=kLoop, calls=%fused_save
  %fd = f32[4,256,256]{2,1,0} fusion-done(%fs)
  %ard = bf16[1024]{0} all-reduce-done(%ars)
  ROOT %t = (f32[4,256,256]{2,1,0}, bf16[1024]{0}) tuple(%fd, %ard)
}
"""


def test_an_all_reduce_start_is_read_by_its_result_not_its_operands_too():
    (found,) = collectives(_ASYNC)
    assert (found.kind, found.nbytes, found.group_size) == ("all-reduce", 2 * 1024, 8)
    assert found.asynchronous and found.overlapped_ops == 1  # the async fusion beside it
    tpu = _ASYNC.replace(
        "((bf16[1024]{0}), bf16[1024]{0}) all-reduce-start", "bf16[1024]{0} all-reduce-start"
    )
    assert collectives(tpu)[0].nbytes == 2 * 1024  # libtpu's spelling: the result alone


def test_without_cycle_estimates_the_compute_before_a_done_hides_its_collective():
    """XLA:GPU writes no cycle estimates: the report hides an asynchronous collective
    behind the roofline of the compute scheduled before its done, as the timeline draws
    it, where it once counted all of it as exposed."""
    topology = Topology.from_name("dgx-h100")
    comps, _ = computations(_ASYNC)
    types = {op[0]: op[1] for op in comps["main"]}
    (fusion,) = [op for op in comps["main"] if op[2] == "fusion-start"]
    beside = instruction_seconds(fusion, comps, types, topology)
    estimate = hlo_report(_ASYNC, topology).estimate
    assert 0 < beside < estimate["communication_s"]
    assert estimate["exposed_s"] == pytest.approx(estimate["communication_s"] - beside)
    waited = hlo_timeline(_ASYNC, topology)["metadata"]["waited_s"]
    assert estimate["exposed_s"] == pytest.approx(waited)


def test_a_fusion_start_runs_its_computation_once_and_writes_in_place():
    comps, entry = computations(_ASYNC)
    assert "fused_save" not in executions(comps, entry)  # not run again as a computation
    assert hlo_flops(_ASYNC) == {"f32": 2 * 256**3}  # its dot, once
    ops = comps["main"]
    types = {op[0]: op[1] for op in ops}
    (start,) = [op for op in ops if op[2] == "fusion-start"]
    # it reads the update's operand and the index, and writes the update in place: not the
    # 4 MiB stacked buffer, neither read nor written whole
    assert hbm_bytes(start, comps, types) == 256 * 256 * 4 * 2 + 4


def _hand_counted(text: str) -> int:
    """Every collective's result bytes per step, read from the instructions that hold the
    result (a synchronous collective, or the done of an asynchronous one)."""
    comps, entry = computations(text)
    times = executions(comps, entry)
    return sum(
        times.get(name, 0) * hlo_bytes(types)
        for name, ops in comps.items()
        for _, types, opcode, _ in ops
        if opcode in COLLECTIVES
        or opcode.removesuffix("-done") in COLLECTIVES
        and opcode.endswith("-done")
    )


def test_the_readers_bytes_equal_the_result_shapes_xla_gpu_compiled():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="the [gpu] extra: XLA's GPU compiler")
    strategy = xs.MirroredStrategy(topology="dgx-h100", compile_only=True)
    mesh = Mesh(np.array(strategy.devices), ("d",))
    layers, width, vocab = 2, 256, 1024

    def loss(params, tokens):
        x = params["embed"][tokens[:, :-1]].astype(jnp.bfloat16)

        def layer(h, w):
            def block(h):
                up = jax.nn.gelu(h @ w["up"].astype(h.dtype))
                return h + up @ w["down"].astype(h.dtype)

            return jax.checkpoint(block)(h), None

        h, _ = jax.lax.scan(layer, x, params["layers"])
        logits = (h @ params["embed"].T.astype(h.dtype)).astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    def step(params, tokens):
        grads = jax.grad(loss)(params, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    whole = NamedSharding(mesh, PartitionSpec())
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=whole)  # noqa: E731
    params = {
        "embed": spec(vocab, width),
        "layers": {"up": spec(layers, width, 4 * width), "down": spec(layers, 4 * width, width)},
    }
    tokens = jax.ShapeDtypeStruct(
        (32, 129), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("d"))
    )
    text = jax.jit(step, donate_argnums=0).lower(params, tokens).compile().as_text()
    found = collectives(text)
    assert any(c.asynchronous for c in found), "XLA kept no asynchronous collective to read"
    assert sum(c.times * c.nbytes for c in found) == _hand_counted(text)
