"""tf.distribute's public names, each where tf keeps it, with tf's signature and meaning."""

from __future__ import annotations

import inspect

import jax
import numpy as np
import pytest

import xla_strategies as xs
from xla_strategies.core.layout import Layout

R = 8  # replicas (tests/conftest.py)


@pytest.fixture(scope="module")
def mirrored():
    return xs.MirroredStrategy()


def _data(rows=16, cols=4):
    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) / 10


def _batch(strategy, data):
    return next(iter(strategy.experimental_distribute_dataset([data])))


# Parameter names as tensorflow.org's API pages list them.
TF_SIGNATURES = [
    (lambda: xs.experimental.ValueContext, ["replica_id_in_sync_group", "num_replicas_in_sync"]),
    (
        lambda: xs.experimental.CommunicationOptions,
        ["bytes_per_pack", "timeout_seconds", "implementation"],
    ),
    (
        lambda: xs.experimental.TerminationConfig,
        ["termination_watcher_fn", "exit_fn", "grace_period", "save_fn"],
    ),
    (lambda: xs.NcclAllReduce, ["num_packs"]),
    (lambda: xs.HierarchicalCopyAllReduce, ["num_packs"]),
    (lambda: xs.ReductionToOneDevice, ["reduce_to_device", "accumulation_fn"]),
    (lambda: xs.MirroredStrategy, ["devices", "cross_device_ops"]),
    (lambda: xs.MultiWorkerMirroredStrategy, ["cluster_resolver", "communication_options"]),
    (lambda: xs.experimental.coordinator.PerWorkerValues, ["values"]),
    (lambda: xs.experimental_set_strategy, ["strategy"]),
    (lambda: xs.Strategy.experimental_distribute_values_from_function, ["self", "value_fn"]),
    (lambda: xs.ReplicaContext.all_gather, ["self", "value", "axis", "options"]),
    (lambda: xs.ReplicaContext.merge_call, ["self", "merge_fn", "args", "kwargs"]),
    (
        lambda: xs.StrategyExtended.reduce_to,
        ["self", "reduce_op", "value", "destinations", "options"],
    ),
    (
        lambda: xs.StrategyExtended.batch_reduce_to,
        ["self", "reduce_op", "value_destination_pairs", "options"],
    ),
    (lambda: xs.DistributedIterator.get_next, ["self"]),
    (
        lambda: xs.cluster_resolver.SlurmClusterResolver,
        [
            "jobs",
            "port_base",
            "gpus_per_node",
            "gpus_per_task",
            "tasks_per_node",
            "auto_set_gpu",
            "rpc_layer",
        ],
    ),
    (
        lambda: xs.cluster_resolver.KubernetesClusterResolver,
        ["job_to_label_mapping", "tf_server_port", "rpc_layer", "override_client"],
    ),
    (
        lambda: xs.cluster_resolver.GCEClusterResolver,
        [
            "project",
            "zone",
            "instance_group",
            "port",
            "task_type",
            "task_id",
            "rpc_layer",
            "credentials",
            "service",
        ],
    ),
    (
        lambda: xs.cluster_resolver.TPUClusterResolver,
        ["tpu", "zone", "project", "job_name", "coordinator_name", "coordinator_address"],
    ),
    (
        lambda: xs.TPUStrategy.experimental_split_to_logical_devices,
        ["self", "tensor", "partition_dimensions"],
    ),
    (
        lambda: xs.TPUStrategy.experimental_assign_to_logical_device,
        ["self", "tensor", "logical_device_id"],
    ),
    (lambda: xs.TPUStrategy.experimental_replicate_to_logical_devices, ["self", "tensor"]),
]


@pytest.mark.parametrize(("get", "params"), TF_SIGNATURES)
def test_names_take_tf_distributes_arguments_in_its_order(get, params):
    """Ours may add keyword arguments after tf's; tf's come first, in tf's order."""
    ours = list(inspect.signature(get()).parameters)
    assert ours[: len(params)] == params


def test_tpu_strategy_and_input_options_take_tfs_keywords():
    tpu = inspect.signature(xs.TPUStrategy).parameters
    assert {"tpu_cluster_resolver", "experimental_device_assignment"} <= set(tpu)
    fields = set(inspect.signature(xs.InputOptions).parameters)
    assert {
        "experimental_fetch_to_device",
        "experimental_replication_mode",
        "experimental_place_dataset_on_device",
        "experimental_per_replica_buffer_size",
    } <= fields
    assert [m.name for m in xs.InputReplicationMode] == ["PER_WORKER", "PER_REPLICA"]
    assert [m.name for m in xs.experimental.CommunicationImplementation] == ["AUTO", "RING", "NCCL"]
    assert xs.experimental.CollectiveCommunication is xs.experimental.CommunicationImplementation


# values from a function


def test_values_from_function_are_one_per_replica(mirrored):
    def value_fn(context):
        return {"id": np.full((2,), context.replica_id_in_sync_group, np.float32),
                "n": np.int32(context.num_replicas_in_sync)}  # fmt: skip

    values = mirrored.experimental_distribute_values_from_function(value_fn)
    assert mirrored.layout(values["id"]) is Layout.STACKED
    local = mirrored.experimental_local_results(values)
    assert [int(v["id"][0]) for v in local] == list(range(R))
    assert local[5]["id"].devices() == {mirrored.devices[5]}
    assert all(int(v["n"]) == R for v in local)
    # a step sees its own replica's value
    ids = mirrored.run(lambda v: v["id"].sum() + xs.get_replica_context().replica_id_in_sync_group,
                       args=(values,))  # fmt: skip
    np.testing.assert_array_equal(ids, 3 * np.arange(R))
    np.testing.assert_allclose(mirrored.reduce("sum", values["id"]), [28.0, 28.0])


def test_values_from_function_errors(mirrored):
    with pytest.raises(ValueError, match="differs in shape or dtype across replicas"):
        mirrored.experimental_distribute_values_from_function(
            lambda c: np.zeros(c.replica_id_in_sync_group + 1)
        )
    with pytest.raises(ValueError, match="must have the same structure"):
        mirrored.experimental_distribute_values_from_function(
            lambda c: [1.0] * (1 + (c.replica_id_in_sync_group == 3))
        )
    with pytest.raises(ValueError, match="replica_id_in_sync_group=4 is out of range"):
        xs.experimental.ValueContext(4, 4)
    assert xs.experimental.ValueContext(2, 4).replica_id_in_sync_group == 2


# the replica context


def test_all_gather_concatenates_in_replica_order(mirrored):
    data = _data()

    def step(x):
        ctx = xs.get_replica_context()
        return ctx.all_gather(x, axis=0), ctx.all_gather({"t": x.T}, axis=-1)

    rows, cols = mirrored.run(step, args=(_batch(mirrored, data),))
    parts = np.split(data, R)  # each replica's slice: the reference
    # as lax.all_gather's result, it is typed per replica: it comes back stacked, one
    # (identical) copy per replica, as tf.distribute's run returns a PerReplica of them
    assert rows.shape == (R, 16, 4)
    for replica in range(R):
        np.testing.assert_array_equal(rows[replica], np.concatenate(parts, axis=0))
        np.testing.assert_array_equal(
            cols["t"][replica], np.concatenate([p.T for p in parts], axis=1)
        )
    with pytest.raises(ValueError, match="axis=2 is out of range for a value of rank 2"):
        mirrored.run(lambda x: xs.get_replica_context().all_gather(x, axis=2),
                     args=(_batch(mirrored, data),))  # fmt: skip


def test_merge_call_runs_merge_fn_on_every_replicas_values(mirrored):
    data = _data()
    seen = {}

    def merge_fn(strategy, per_replica, mirrored_value):
        seen["cross_replica"] = xs.in_cross_replica_context()
        seen["context"] = xs.get_replica_context()
        total = strategy.reduce("sum", per_replica, axis=0)
        first = strategy.experimental_local_results(per_replica)[0]
        to = strategy.extended.reduce_to("max", per_replica, destinations=strategy.devices[0])
        return total + mirrored_value, first, to, per_replica

    def step(x, w):
        return xs.get_replica_context().merge_call(merge_fn, args=(x.sum(axis=1), w))

    total, first, biggest, own = mirrored.run(step, args=(_batch(mirrored, data), np.float32(1)))
    assert seen == {"cross_replica": True, "context": None}
    per_replica = data.sum(axis=1).reshape(R, 2)  # numpy reference
    np.testing.assert_allclose(total, per_replica.sum() + 1, rtol=1e-6)
    assert total.shape == ()  # what merge_fn computes is mirrored
    np.testing.assert_allclose(first, per_replica[0], rtol=1e-6)
    np.testing.assert_allclose(biggest, per_replica.max(axis=0), rtol=1e-6)
    np.testing.assert_allclose(own, per_replica, rtol=1e-6)  # back to each replica: stacked


@pytest.mark.parametrize(
    "make",
    [xs.MirroredStrategy, lambda: xs.TPUStrategy("v5e-8", emulate=True)],
    ids=["mirrored", "tpu-2d"],
)
def test_merge_call_hands_merge_fn_each_replicas_bits(make):
    """On one mesh axis and on two, the values merge_fn sees, gathers and hands back are each replica's bits (signed
    zeros, infinities, NaN): gathering them moves data, it adds nothing (a sum of masked
    parts would make -0.0 +0.0)."""
    parts = np.arange(R * 3, dtype=np.float32).reshape(R, 3)
    parts[::2, 0] = -0.0
    parts[1] = [np.inf, -np.inf, np.nan]

    def merge_fn(strategy, per_replica):
        return strategy.gather(per_replica, axis=0), per_replica

    def step(x):
        return xs.get_replica_context().merge_call(merge_fn, args=(x[0],))

    strategy = make()
    batch = next(iter(strategy.experimental_distribute_dataset([parts])))
    gathered, own = strategy.run(step, args=(batch,))
    assert np.asarray(gathered).tobytes() == parts.reshape(-1).tobytes()
    assert np.asarray(strategy.gather(own, axis=0)).tobytes() == parts.reshape(-1).tobytes()


def test_merge_call_outside_a_step_sees_one_replica():
    out = xs.get_replica_context().merge_call(lambda s, v: (s, v * 2), args=(3,))
    assert isinstance(out[0], xs.OneDeviceStrategy) and out[1] == 6


# strategy.extended, cluster_resolver, experimental_set_strategy


def test_extended_answers_from_the_strategy(mirrored):
    extended = mirrored.extended
    assert extended is mirrored.extended and isinstance(extended, xs.StrategyExtended)
    assert extended.worker_devices == mirrored.devices
    assert extended.parameter_devices == mirrored.devices
    assert extended.experimental_require_static_shapes
    central = xs.CentralStorageStrategy(parameter_device=2)
    assert central.extended.parameter_devices == (jax.devices()[2],)
    per_replica = mirrored.run(lambda x: x.sum(), args=(_batch(mirrored, _data()),))
    reduced = extended.reduce_to("sum", per_replica, destinations="cpu:3")
    np.testing.assert_allclose(reduced, _data().sum(), rtol=1e-6)
    assert reduced.devices() == {jax.devices()[3]}
    on_all = extended.batch_reduce_to("mean", [(per_replica, per_replica)])[0]
    assert on_all.devices() == set(mirrored.devices) and on_all.sharding.is_fully_replicated
    np.testing.assert_allclose(on_all, _data().sum() / R, rtol=1e-6)
    for call in (
        lambda: extended.update(None, lambda v: v),
        lambda: extended.colocate_vars_with(None),
        lambda: extended.variable_created_in_scope(None),
    ):
        with pytest.raises(NotImplementedError, match="state is functional"):
            call()


def test_every_strategy_has_a_cluster_resolver(mirrored):
    assert mirrored.cluster_resolver is None
    assert xs.OneDeviceStrategy().cluster_resolver is None
    assert xs.CentralStorageStrategy().cluster_resolver is None
    assert xs.TPUStrategy("v5e-8", emulate=True).cluster_resolver is None
    resolver = xs.cluster_resolver.SimpleClusterResolver({"worker": ["a:1"]}, "worker", 0)
    tpu = xs.TPUStrategy("v5e-8", emulate=True, tpu_cluster_resolver=resolver)
    assert tpu.cluster_resolver is resolver


def test_experimental_set_strategy(mirrored):
    xs.experimental_set_strategy(mirrored)
    try:
        assert xs.get_strategy() is mirrored and xs.in_cross_replica_context()
        other = xs.OneDeviceStrategy()
        xs.experimental_set_strategy(other)  # replaces, does not stack
        assert xs.get_strategy() is other
        with other.scope(), pytest.raises(RuntimeError, match="must not be called inside"):
            xs.experimental_set_strategy(None)
    finally:
        xs.experimental_set_strategy(None)
    assert not xs.has_strategy()
    with pytest.raises(TypeError, match="must be a Strategy or None"):
        xs.experimental_set_strategy("mirrored")
