"""Compile for GPU nodes without a GPU: XLA's GPU compiler (the `[gpu]` extra's CUDA plugin)
compiles a step for one DGX H100 node and for two, and the report reads its executable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import xla_strategies as xs
from xla_strategies.hardware import gpu_compile
from xla_strategies.hardware.compiled_report import compiled_report
from xla_strategies.hardware.hlo_flops import hlo_flops

pytest.importorskip("jax_plugins.xla_cuda12", reason="the [gpu] extra provides XLA's GPU compiler")

REPO = Path(__file__).resolve().parents[1]
WIDTH = 1024


def _sgd_step(strategy):
    def step(w, x):
        grad = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * grad

    w = strategy.replicate(jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32))
    rows = 4 * strategy.num_replicas_in_sync
    x = jax.ShapeDtypeStruct((rows, WIDTH), jnp.float32, sharding=strategy.split_sharding())
    return strategy.compile(step, donate_argnums=0, shard_weight_updates=False), (w, x)


def test_one_node_compiles_for_its_eight_gpus_and_the_report_reads_the_executable():
    strategy = xs.MirroredStrategy(topology="dgx-h100", compile_only=True)
    assert strategy.num_replicas_in_sync == 8 and strategy.compile_only
    assert strategy.topology.name == "dgx-h100"
    assert {d.platform for d in strategy.devices} == {"gpu"}
    step, args = _sgd_step(strategy)
    compiled = step.lower(*args).compile()
    report = compiled_report(compiled, strategy)
    assert report.platform == "gpu" and report.fits
    # the planned gradient reduction is the one XLA kept: one all-reduce of the whole
    # gradient over the node's 8 GPUs
    reductions = [c for c in report.collectives if c.kind == "all-reduce"]
    assert sum(c.nbytes * c.times for c in reductions) == WIDTH * WIDTH * 4
    assert {c.group_size for c in reductions} == {8}
    # XLA's GPU executable reports no flops; the HLO's matmuls do: forward, and the
    # gradient's product with the input, per replica's 4 rows
    assert report.flops == 2 * 2 * 4 * WIDTH * WIDTH
    assert 0 < report.estimate["compute_s"] < report.estimate["step_s"]
    with pytest.raises(TypeError, match=r"only compiles\. Use <lambda>|only compiles"):
        step(*args)


def test_two_nodes_lay_out_one_mesh_row_per_node():
    strategy = xs.MultiWorkerMirroredStrategy(topology="2xdgx-h100", compile_only=True)
    assert dict(strategy.mesh.shape) == {"host": 2, "local": 8}
    for node, row in enumerate(strategy.mesh.devices):
        assert {d.process_index for d in row} == {node}
    assert [a.level for a in strategy.topology.axes] == ["infiniband", "nvlink"]
    step, args = _sgd_step(strategy)
    report = compiled_report(step.lower(*args).compile(), strategy)
    assert report.collectives and all(c.group_size > 1 for c in report.collectives)
    assert "compile_only=True" in repr(strategy) and "2xdgx-h100" in repr(strategy)


def test_a_step_larger_than_the_gpus_memory_is_an_out_of_memory_error():
    strategy = xs.MirroredStrategy(topology="dgx-h100", compile_only=True)
    w = strategy.replicate(jax.ShapeDtypeStruct((120_000, 120_000), jnp.float32))  # 53.6 GiB
    x = jax.ShapeDtypeStruct((64, 120_000), jnp.float32, sharding=strategy.split_sharding())
    tx = optax.adam(1e-3)
    state = strategy.replicate(jax.eval_shape(tx.init, w))

    def step(w, state, x):
        grad = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        updates, state = tx.update(grad, state, w)
        return optax.apply_updates(w, updates), state

    compiled = strategy.compile(step, donate_argnums=(0, 1), shard_weight_updates=False)
    with pytest.raises(xs.errors.OutOfMemoryError) as caught:
        compiled.lower(w, state, x).compile()
    message = str(caught.value)
    assert "dgx-h100" in message and "80.00 GiB of memory per GPU" in message
    assert "shard_parameters=True" in message


@pytest.mark.parametrize(
    ("make", "wrong"),
    [
        (lambda: xs.MirroredStrategy(topology="dgx-h100"), "pass compile_only=True"),
        (lambda: xs.MirroredStrategy(compile_only=True), "needs a topology"),
        (lambda: xs.MirroredStrategy(topology="v5e-16", compile_only=True), "not a GPU topology"),
        (lambda: xs.MirroredStrategy(topology="2xdgx-h100", compile_only=True), "2 nodes"),
        (
            lambda: xs.MultiWorkerMirroredStrategy(topology="dgx-h100", compile_only=True),
            "is one node",
        ),
    ],
)
def test_a_topology_that_does_not_fit_the_strategy_is_a_precise_error(make, wrong):
    with pytest.raises(ValueError, match=wrong):
        make()


def test_without_the_cuda_plugin_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(gpu_compile, "_find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'xla-strategies\[gpu\]'"):
        xs.MirroredStrategy(topology="dgx-h100", compile_only=True)


def test_hlo_flops_count_a_scanned_loop_per_trip():
    strategy = xs.MirroredStrategy(topology="dgx-h100", compile_only=True)

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=4)
        return jnp.mean(h)

    w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=strategy.state_sharding())
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=strategy.split_sharding())
    text = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
    # per GPU: 8 rows; forward and two backward products per trip, 4 trips
    assert hlo_flops(text) == {"bf16": 3 * 4 * 2 * 8 * 256 * 256}


def test_aot_compiles_a_scripts_mirrored_step_for_a_gpu_node(tmp_path):
    code = textwrap.dedent(
        """
        import jax.numpy as jnp, numpy as np
        import xla_strategies as xs
        strategy = xs.MirroredStrategy()
        step = strategy.compile(lambda w, x: w - 0.1 * jnp.mean(x) * w)
        batches = strategy.experimental_distribute_dataset([np.ones((8, 4), np.float32)])
        step(strategy.replicate(np.ones(4, np.float32)), next(iter(batches)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-m", "xla_strategies.cli.main", "aot", "--topology", "dgx-h100",
         "--out", str(tmp_path / "aot"), "--timeout", "240", "--", "python", "-c", code],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step <lambda> on dgx-h100" in done.stdout
    assert "of 80.00 GiB HBM (fits)" in done.stdout


def test_an_h200_node_compiles_for_its_own_target_config():
    strategy = xs.MirroredStrategy(topology="dgx-h200", compile_only=True)
    assert {d.device_kind for d in strategy.devices} == {"NVIDIA H200"}
    step, args = _sgd_step(strategy)
    report = compiled_report(step.lower(*args).compile(), strategy)
    assert report.platform == "gpu" and report.fits
    assert report.hbm_bytes == strategy.topology.hbm_bytes > 80 * 2**30


def test_two_nodes_with_a_replica_per_node_compile_tensor_parallel_over_nvlink():
    """Each replica spans one node's 8 GPUs (`logical_devices_per_replica=8`): the weight
    is split over them (NVLink), and only the gradient reduction crosses the network."""
    from jax.sharding import NamedSharding, PartitionSpec

    strategy = xs.MultiWorkerMirroredStrategy(
        topology="2xdgx-h100", compile_only=True, logical_devices_per_replica=8
    )
    assert strategy.num_replicas_in_sync == 2
    assert dict(strategy.mesh.shape) == {"host": 2, "local": 1, "model": 8}
    assert strategy.topology.mesh_axes == {"host": 2, "local": 1, "model": 8}
    split = NamedSharding(strategy.mesh, PartitionSpec(None, "model"))
    w = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=split)
    x = jax.ShapeDtypeStruct((8, WIDTH), jnp.float32, sharding=strategy.split_sharding())

    def step(w, x):
        grad = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * grad

    compiled = strategy.compile(step, donate_argnums=0).lower(w, x).compile()
    report = compiled_report(compiled, strategy)
    across = [c for c in report.collectives if not c.inside_replica]
    # the gradient's own 1/8 per GPU, summed over the two nodes
    assert sum(c.nbytes * c.times for c in across) == WIDTH * WIDTH * 4 // 8
    assert all(c.group_size == 2 for c in across)
    assert report.memory.argument_bytes < WIDTH * WIDTH * 4 // 4  # the weight held 1/8
