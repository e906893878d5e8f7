"""tf.distribute's input, coordinator, preemption and TPU logical-device names."""

from __future__ import annotations

import signal

import numpy as np
import pytest

import xla_strategies as xs
from xla_strategies.core.layout import Layout

R = 8  # replicas (tests/conftest.py)


@pytest.fixture(scope="module")
def mirrored():
    return xs.MirroredStrategy()


def _batches(count=3, rows=16):
    return [np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 100 * i for i in range(count)]


# InputOptions under tf.distribute's names


def test_input_options_take_tfs_field_names():
    options = xs.InputOptions(
        experimental_fetch_to_device=False, experimental_per_replica_buffer_size=5
    )
    assert options.prefetch_to_device is False and options.buffer_size == 5
    assert xs.InputOptions().experimental_replication_mode is xs.InputReplicationMode.PER_WORKER
    by_name = xs.InputOptions(experimental_replication_mode="PER_REPLICA")
    assert by_name.experimental_replication_mode is xs.InputReplicationMode.PER_REPLICA
    with pytest.raises(ValueError, match="buffer_size=3 and experimental_per_replica_buffer_size"):
        xs.InputOptions(buffer_size=3, experimental_per_replica_buffer_size=4)
    with pytest.raises(ValueError, match="experimental_place_dataset_on_device=True"):
        xs.InputOptions(experimental_place_dataset_on_device=True)
    with pytest.raises(ValueError, match="must be an InputReplicationMode, got 'PER_HOST'"):
        xs.InputOptions(experimental_replication_mode="PER_HOST")


@pytest.mark.parametrize("prefetch", [True, False])
def test_per_replica_input_calls_dataset_fn_once_per_replica(mirrored, prefetch):
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        replica = context.input_pipeline_id
        return [np.full((2, 3), 10 * step + replica, np.float32) for step in range(2)]

    options = xs.InputOptions(
        experimental_replication_mode=xs.InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=prefetch,
    )
    dataset = mirrored.distribute_datasets_from_function(dataset_fn, options)
    assert isinstance(dataset, xs.DistributedDataset)
    assert [(c.input_pipeline_id, c.num_input_pipelines) for c in contexts] == [
        (i, R) for i in range(R)
    ]
    batches = list(dataset)
    assert len(batches) == 2
    for step, batch in enumerate(batches):  # replica r's rows are its dataset's
        expected = np.repeat(10 * step + np.arange(R, dtype=np.float32), 2)[:, None]
        np.testing.assert_array_equal(batch, np.broadcast_to(expected, (2 * R, 3)))
        assert mirrored.layout(batch) is Layout.SPLIT
    with pytest.raises(ValueError, match="PER_REPLICA needs a function"):
        mirrored.experimental_distribute_dataset(_batches(), options)


# DistributedIterator


def test_iterator_get_next_optional_and_element_spec(mirrored):
    iterator = iter(mirrored.experimental_distribute_dataset(_batches()))
    assert isinstance(iterator, xs.DistributedIterator)
    spec = iterator.element_spec  # fetches the first batch, which get_next still returns
    assert (spec.shape, spec.dtype) == ((16, 2), np.float32)
    assert spec.sharding == mirrored.split_sharding()
    np.testing.assert_array_equal(iterator.get_next(), _batches()[0])
    assert iterator.get_state()["batches"] == 1
    optional = iterator.get_next_as_optional()
    assert optional.has_value()
    np.testing.assert_array_equal(optional.get_value(), _batches()[1])
    np.testing.assert_array_equal(next(iterator), _batches()[2])
    empty = iterator.get_next_as_optional()
    assert not empty.has_value()
    with pytest.raises(ValueError, match="this optional is empty"):
        empty.get_value()
    with pytest.raises(xs.errors.OutOfRangeError, match="End of sequence"):
        iterator.get_next()


def test_element_spec_of_padded_batches_is_batch_and_mask(mirrored):
    options = xs.InputOptions(partial_batch="pad")
    iterator = iter(mirrored.experimental_distribute_dataset([np.ones((12, 2))], options))
    batch, mask = iterator.element_spec
    assert batch.shape == (16, 2) and mask.shape == (16,) and mask.dtype == np.bool_
    iterator.close()


# coordinator and preemption


def test_per_worker_values_give_each_worker_its_own():
    values = xs.experimental.coordinator.PerWorkerValues(["a", "b", "c"])

    class Worker:  # what a worker task tells a per-worker value: its index
        def __init__(self, index):
            self.index = index

    assert [values.local(Worker(i)) for i in range(3)] == ["a", "b", "c"]
    assert values.values == ("a", "b", "c")
    with pytest.raises(IndexError, match="holds 3 values; worker 3 has none"):
        values.local(Worker(3))


class _Manager:
    """What the handler needs of a checkpoint manager, recording its saves."""

    def __init__(self):
        self.saved = []

    def wait_until_finished(self):
        pass

    def all_steps(self):
        return [step for step, _ in self.saved]

    def save(self, step, state, dataset_iterator=None, force=False):
        self.saved.append((step, state))


def test_termination_config_watcher_save_and_exit(mirrored):
    events = []
    announced = {"now": False}
    config = xs.experimental.TerminationConfig(
        termination_watcher_fn=lambda: announced["now"],
        exit_fn=lambda: events.append("exit"),
        grace_period=30,
        save_fn=lambda: events.append("save"),
    )
    manager = _Manager()
    with xs.PreemptionCheckpointHandler(mirrored, manager, termination_config=config) as handler:
        handler.run(lambda s: (s + 1, None), 0)
        assert events == []
        announced["now"] = True  # the platform announces the termination
        handler.run(lambda s: (s + 1, None), 1)
    assert events == ["save", "exit"] and handler.preempted_at == 2
    assert manager.saved == []  # save_fn saved instead of the manager
    # without save_fn the manager saves the state of the step the watcher stopped at
    config = xs.experimental.TerminationConfig(lambda: True, exit_fn=lambda: None)
    with xs.PreemptionCheckpointHandler(mirrored, manager, termination_config=config) as handler:
        handler.run(lambda s: (s + 1, None), 6)
    assert manager.saved == [(1, 7)]
    assert handler.termination_config.grace_period is None


def test_preemption_handler_keeps_its_signal_handler_contract(mirrored):
    before = signal.getsignal(signal.SIGTERM)
    config = xs.experimental.TerminationConfig(exit_fn=lambda: None)
    with xs.PreemptionCheckpointHandler(mirrored, _Manager(), termination_config=config):
        pass
    assert signal.getsignal(signal.SIGTERM) is before
