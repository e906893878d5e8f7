"""cross_device_ops and CommunicationImplementation: compiler choices, each visible in the
compiled step's graph and each giving the default's numbers."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_strategies as xs
from xla_strategies.distribute.cross_device_ops import implementation_decomposes
from xla_strategies.passes import PassPipeline, PipelineSpecError

R = 8  # replicas (tests/conftest.py)
SHAPES = {"a": (4, 3), "b": (3,), "c": (3, 5), "d": (5,), "e": (5, 2), "f": (2,)}


def _params():
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(32, 4)).astype(np.float32)


def _sgd(params, x):
    def loss_fn(p):
        h = jnp.tanh(x @ p["a"] + p["b"])
        h = jnp.tanh(h @ p["c"] + p["d"])
        return jnp.mean((h @ p["e"] + p["f"]) ** 2)

    grads = jax.grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _train(strategy):
    """The compiled step, its new parameters, and the graph XLA got (the dump's last one)."""
    step = strategy.compile(_sgd)
    params = strategy.replicate(_params())
    batch = next(iter(strategy.experimental_distribute_dataset([_data()])))
    new = step(params, batch)
    return jax.tree.map(np.asarray, new), step.executable(params, batch).graph


@pytest.fixture(scope="module")
def reference():
    """One device on the whole batch, the independent reference."""
    return _train(xs.OneDeviceStrategy())[0]


def _assert_same(params, reference):
    for name in SHAPES:
        np.testing.assert_allclose(params[name], reference[name], rtol=2e-5, atol=2e-6)


def _all_reduces(graph):
    return [n for n in graph.nodes if n.op == "all_reduce"]


@pytest.mark.parametrize("num_packs", [1, 2, 3])
def test_nccl_num_packs_makes_that_many_buckets(reference, num_packs):
    params, graph = _train(xs.MirroredStrategy(cross_device_ops=xs.NcclAllReduce(num_packs)))
    _assert_same(params, reference)
    assert len(_all_reduces(graph)) == num_packs


def test_nccl_without_packing_reduces_each_gradient(reference):
    params, graph = _train(xs.MirroredStrategy(cross_device_ops=xs.NcclAllReduce(num_packs=0)))
    _assert_same(params, reference)
    assert len(_all_reduces(graph)) == len(SHAPES)
    _, default_graph = _train(xs.MirroredStrategy())
    assert len(_all_reduces(default_graph)) < len(SHAPES)  # the default buckets them


def test_hierarchical_copy_reduces_within_groups_then_across(reference):
    strategy = xs.MirroredStrategy(cross_device_ops=xs.HierarchicalCopyAllReduce(num_packs=1))
    assert strategy.mesh.shape == {"group": 2, "local": R // 2}
    params, graph = _train(strategy)
    _assert_same(params, reference)
    chain = [(n.op, n.attrs["axes"]) for n in graph.nodes if n.is_collective]
    assert chain == [
        ("reduce_scatter", ["local"]),
        ("all_reduce", ["group"]),
        ("all_gather", ["local"]),
    ]
    with pytest.raises(ValueError, match="two groups of equal size; 3 devices do not split"):
        xs.MirroredStrategy(devices=[0, 1, 2], cross_device_ops=xs.HierarchicalCopyAllReduce())


def test_reduction_to_one_device_reduces_to_it_and_broadcasts(reference):
    ops = xs.ReductionToOneDevice(reduce_to_device="cpu:2")
    strategy = xs.MirroredStrategy(cross_device_ops=ops)
    params, graph = _train(strategy)
    _assert_same(params, reference)
    ops_in_graph = {n.op for n in graph.nodes if n.is_collective}
    assert ops_in_graph == {"reduce_to_one", "broadcast"}
    assert {n.attrs["root"] for n in graph.nodes if n.is_collective} == {2}
    with pytest.raises(ValueError, match="shard_weight_updates=True.*nothing to shard"):
        strategy.compile(_sgd, shard_weight_updates=True)
    with pytest.raises(ValueError, match="not one of the strategy's devices.*CentralStorage"):
        xs.MirroredStrategy(devices=[0, 1], cross_device_ops=xs.ReductionToOneDevice(5))
    with pytest.raises(ValueError, match="accumulation_fn"):
        xs.ReductionToOneDevice(accumulation_fn=sum)


def test_bad_cross_device_ops():
    with pytest.raises(TypeError, match="cross_device_ops must be an xs.NcclAllReduce"):
        xs.MirroredStrategy(cross_device_ops="nccl")
    with pytest.raises(ValueError, match="num_packs must be a non-negative integer, got -1"):
        xs.NcclAllReduce(num_packs=-1)


def test_num_packs_in_a_pipeline_spec():
    (combine,) = PassPipeline.from_spec("combine-all-reduces{num-packs=3}").passes
    assert combine.num_packs == 3
    with pytest.raises(ValueError, match="num-packs sizes the buckets itself"):
        PassPipeline.from_spec("combine-all-reduces{num-packs=2 threshold-bytes=64}")


def test_rotated_decomposition_needs_a_topology():
    strategy = xs.MirroredStrategy(cross_device_ops=xs.HierarchicalCopyAllReduce())
    step = strategy.compile(_sgd, pipeline="insert-reductions,decompose-all-reduces{force=rotated}")
    batch = next(iter(strategy.experimental_distribute_dataset([_data()])))
    with pytest.raises(ValueError, match="force=rotated.*needs a topology"):
        step(strategy.replicate(_params()), batch)


def test_communication_implementation_picks_the_decomposition():
    impl = xs.experimental.CommunicationImplementation
    assert implementation_decomposes(impl.AUTO, "cpu")
    assert not implementation_decomposes(impl.RING, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not implementation_decomposes(impl.NCCL, "cpu")
    assert "needs GPUs" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on GPUs: no fallback, no warning
        assert not implementation_decomposes(impl.NCCL, "gpu")
    options = xs.experimental.CommunicationOptions(1024, 30, impl.RING)
    assert (options.bytes_per_pack, options.timeout_seconds) == (1024, 30)
    with pytest.raises(TypeError, match="implementation must be a CommunicationImplementation"):
        xs.experimental.CommunicationOptions(implementation="RING")
    with pytest.raises(PipelineSpecError):
        PassPipeline.from_spec("combine-all-reduces{packs=2}")
