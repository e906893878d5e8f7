"""decompose-all-reduces: the cost model's choices, the rewrite, and its numbers on 16
emulated devices laid out as the topology (a separate process: the suite has 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import xla_strategies as xs
from tests.filecheck import filecheck
from xla_strategies.passes import DecomposeAllReduces, PassContext, parse, print_graph, verify

ONE = """\
func @step(%0: f32[{n}]{{x,y}}) {{
  %1: f32[{n}] = all_reduce(%0) {{"axes": ["x", "y"], "origin": "autodiff", "reduce_op": "mean"}}
  return %1
}}
"""


def _run(text: str, topology: str, **options) -> tuple[bool, str, PassContext]:
    graph = parse(text)
    topo = xs.Topology.from_name(topology)
    ctx = PassContext(mesh_axes=topo.mesh_axes, topology=topo)
    changed = DecomposeAllReduces(**options).run(graph, ctx)
    verify(graph, topo.mesh_axes)
    return changed, print_graph(graph), ctx


def test_small_reductions_stay_flat_with_a_remark():
    changed, after, ctx = _run(ONE.format(n=16), "v5e-256")
    assert not changed and after == ONE.format(n=16)
    assert "all_reduce of 64 bytes over ['x', 'y']: flat" in ctx.remarks[0]
    assert ctx.stats["decompose-all-reduces"]["decisions"][0]["algorithm"] == "flat"


def test_inside_a_slice_even_large_reductions_stay_xlas():
    """XLA's TPU all-reduce over a 16x16 slice already drives both torus dimensions
    (StrategyND): a chain of one-axis collectives only adds steps."""
    n = 64 * 1024 * 1024
    changed, after, ctx = _run(ONE.format(n=n), "v5e-256")
    assert not changed and after == ONE.format(n=n)
    estimates = ctx.stats["decompose-all-reduces"]["decisions"][0]["estimates_s"]
    assert estimates["flat"] <= estimates["rotated"] < estimates["ordered"]


def test_across_tpu_slices_even_large_reductions_stay_xlas():
    """XLA's own all-reduce across TPU slices is already hierarchical: a reduce-scatter in
    each slice, each chip's shard summed among the slices by the DCN runtime, an all-gather
    back (`cost_model.slices_time`). A chain of one-axis collectives only adds steps: on
    2xv5p-512 the chains made every data-parallel step of the one table slower, read from
    XLA's compile (benchmarks/README.md)."""
    text = ONE.replace("x,y", "dcn,x,y,z").replace('["x", "y"]', '["dcn", "x", "y", "z"]')
    changed, after, ctx = _run(text.format(n=64 * 1024 * 1024), "2xv5p-512")
    assert not changed and after == text.format(n=64 * 1024 * 1024)
    estimates = ctx.stats["decompose-all-reduces"]["decisions"][0]["estimates_s"]
    assert estimates["flat"] < min(estimates["ordered"], estimates["rotated"])


def test_across_gpu_nodes_large_reductions_decompose():
    """NCCL's ring across nodes runs at the slow network's speed for all the data:
    reducing inside each node first sends 1/8 of it across."""
    text = ONE.replace("x,y", "host,local").replace('["x", "y"]', '["host", "local"]')
    changed, after, ctx = _run(text.format(n=64 * 1024 * 1024), "4xdgx-h100")
    assert changed
    decision = ctx.stats["decompose-all-reduces"]["decisions"][0]
    assert decision["algorithm"] != "flat"
    graph = parse(after)
    assert [n.attrs["axes"] for n in graph.walk() if n.op == "all_reduce"] == [["host"]] * len(
        [n for n in graph.walk() if n.op == "all_reduce"]
    )
    assert graph.count_ops("scale") == 1  # the mean, applied once
    assert graph.nodes[-1].outputs[0].shape == (64 * 1024 * 1024,)


def test_multislice_reduces_ici_then_dcn_then_ici():
    text = ONE.replace("x,y", "dcn,x,y,z").replace('["x", "y"]', '["dcn", "x", "y", "z"]')
    _, after, ctx = _run(text.format(n=8 * 1024 * 1024), "2xv5p-512", force="ordered")
    graph = parse(after)
    order = [tuple(n.attrs["axes"]) + (n.op,) for n in graph.walk() if n.is_collective]
    assert order == [
        ("x", "reduce_scatter"),
        ("y", "reduce_scatter"),
        ("z", "reduce_scatter"),
        ("dcn", "all_reduce"),
        ("z", "all_gather"),
        ("y", "all_gather"),
        ("x", "all_gather"),
    ]


def test_without_a_topology_nothing_changes():
    graph = parse(ONE.format(n=1 << 20))
    ctx = PassContext(mesh_axes={"x": 4, "y": 4})
    assert not DecomposeAllReduces().run(graph, ctx)
    assert ctx.remarks == ["decompose-all-reduces: no topology, nothing decomposed"]


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 16)
    import numpy as np, optax
    sys.path.insert(0, ".")
    from tests import helpers
    import xla_strategies as xs
    from xla_strategies.demo import models
    from xla_strategies.passes import DEFAULT_PIPELINE

    jax.config.update("jax_enable_x64", True)
    graphdef, params, cfg = helpers.transformer(np.float64, layers=2)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    batches = helpers.lm_batches(3, cfg, batch=16)
    step = models.lm_train_step(graphdef, tx)
    reference = helpers.train(xs.OneDeviceStrategy(), step, params, tx, batches)[-1]
    errors = {}
    for topology, force in [("v5e-16", "ordered"), ("v5e-16", "rotated"), ("2xv5e-8", "rotated")]:
        strategy = xs.TPUStrategy(topology, emulate=True)
        # the weight update sharded as asked (the cost model keeps these tiny tensors whole)
        spec = DEFAULT_PIPELINE.replace("shard-weight-updates{mode=auto}",
                                        "shard-weight-updates{mode=on}")
        spec += ",decompose-all-reduces{force=" + force + "}"
        compiled = strategy.compile(step, pipeline=spec)
        result = helpers.train(strategy, step, params, tx, batches, pipeline=spec)[-1]
        graph = compiled.graph(params, tx.init(params),
                               next(iter(strategy.experimental_distribute_dataset(batches))),
                               after="decompose-all-reduces")
        errors[topology + "/" + force] = {
            "error": helpers.max_relative_error(result, reference),
            "scatters": graph.count_ops("reduce_scatter"),
            "sharded_update_chains": sum(
                1 for n in graph.walk()
                if n.op == "reduce_scatter" and n.attrs.get("origin") == "autodiff"
                and len(n.attrs["axes"]) == 1
            ),
            "mesh": dict(strategy.mesh.shape),
        }
    print(json.dumps(errors))
    """
)


def test_decomposed_training_matches_one_device_on_16_emulated_devices():
    root = Path(__file__).parents[2]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["v5e-16/ordered"]["mesh"] == {"x": 4, "y": 4}
    assert results["2xv5e-8/rotated"]["mesh"] == {"dcn": 2, "x": 2, "y": 4}
    for name, r in results.items():
        assert r["scatters"] > 0, name
        if name.endswith("/ordered"):  # the sharded update's collectives, decomposed
            assert r["sharded_update_chains"] > 0, name
        assert r["error"] < 1e-9, (name, r)


def test_reduce_scatters_and_all_gathers_become_one_axis_chains_in_their_order():
    text = """\
func @step(%0: f32[8,256]{x,y}) {
  %1: f32[1,256]{x,y} = reduce_scatter(%0) {"axes": ["y", "x"], "bucket": 0, "dimension": 0}
  %2: f32[8,256] = all_gather(%1) {"axes": ["y", "x"], "dimension": 0}
  return %2
}
"""
    changed, after, ctx = _run(text, "v5e-8", force="ordered")
    assert changed
    filecheck(
        after,
        """
        CHECK: %[[A:[0-9]+]]: f32[2,256]{x,y} = reduce_scatter(%0) {"axes": ["y"], "bucket": 0, "dimension": 0}
        CHECK-NEXT: %[[B:[0-9]+]]: f32[1,256]{x,y} = reduce_scatter(%[[A]]) {"axes": ["x"], "bucket": 0, "dimension": 0}
        CHECK-NEXT: %[[C:[0-9]+]]: f32[2,256]{y} = all_gather(%[[B]]) {"axes": ["x"], "dimension": 0}
        CHECK-NEXT: %[[D:[0-9]+]]: f32[8,256] = all_gather(%[[C]]) {"axes": ["y"], "dimension": 0}
        CHECK-NEXT: return %[[D]]
        """,
    )
    assert any("reduce_scatter of 8,192 bytes over ['y', 'x']: ordered" in r for r in ctx.remarks)
