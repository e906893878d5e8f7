"""Distributed datasets: every example once per epoch, partial batches, per-host input,
producer errors, early exit without leaked threads, and resumable state."""

from __future__ import annotations

import gc
import threading
import time
import traceback

import numpy as np
import pytest

import xla_strategies as xs

REPLICAS = 8


@pytest.fixture(scope="module")
def strategy():
    return xs.MirroredStrategy()


def _batches(sizes, start=0):
    """Global batches of consecutive example ids, {"id": [n], "x": [n, 3]}."""
    out, next_id = [], start
    for size in sizes:
        ids = np.arange(next_id, next_id + size)
        out.append({"id": ids, "x": np.repeat(ids[:, None], 3, axis=1).astype(np.float32)})
        next_id += size
    return out


def _ids(batch):
    return np.asarray(batch["id"]).tolist()


_threads_before_the_test: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _ignore_earlier_tests_threads():
    # Another test on this worker may leave an iterator in a reference cycle, its
    # thread running until the collector finds it: each test counts only its own.
    _threads_before_the_test.clear()
    _threads_before_the_test.update(threading.enumerate())
    yield


def _input_threads():
    return [
        t
        for t in threading.enumerate()
        if t.name == "xla_strategies-input" and t not in _threads_before_the_test
    ]


def _wait_for_no_input_threads():
    deadline = time.monotonic() + 5
    while _input_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _input_threads()


@pytest.mark.parametrize("prefetch", [True, False])
def test_every_example_once_in_order_and_placed_per_replica(strategy, prefetch):
    options = xs.InputOptions(prefetch_to_device=prefetch, buffer_size=3)
    dataset = strategy.experimental_distribute_dataset(_batches([16, 32, 8, 16]), options)
    for _ in range(2):  # two epochs, the same examples in the same order
        seen = []
        for batch in dataset:
            assert strategy.is_per_replica(batch["id"]) and strategy.is_per_replica(batch["x"])
            shard = next(
                s for s in batch["id"].addressable_shards if s.device == strategy.devices[1]
            )
            assert shard.data.shape == (batch["id"].shape[0] // REPLICAS,)  # replica 1's slice
            seen += _ids(batch)
        assert seen == list(range(72))


def test_partial_batch_policies(strategy):
    sizes = [16, 16, 5]  # the last batch does not divide across 8 replicas
    error = iter(strategy.experimental_distribute_dataset(_batches(sizes)))
    assert _ids(next(error)) + _ids(next(error)) == list(range(32))
    with pytest.raises(ValueError, match=r"dataset element 2\['id'\] has a global batch of 5"):
        next(error)

    dropped = strategy.experimental_distribute_dataset(
        _batches(sizes), xs.InputOptions(partial_batch="drop")
    )
    assert [i for b in dropped for i in _ids(b)] == list(range(32))

    padded = list(
        strategy.experimental_distribute_dataset(
            _batches(sizes), xs.InputOptions(partial_batch="pad")
        )
    )
    assert [b[0]["id"].shape[0] for b in padded] == [16, 16, 8]
    last, mask = padded[-1]
    assert np.asarray(mask).tolist() == [True] * 5 + [False] * 3
    assert strategy.is_per_replica(mask)
    kept = [
        i for batch, m in padded for i, keep in zip(_ids(batch), np.asarray(m), strict=True) if keep
    ]
    assert kept == list(range(37))  # every real example once, padding masked out
    assert np.asarray(last["x"])[5:].sum() == 0


def test_producer_exception_is_reraised_with_its_traceback(strategy):
    def broken():
        yield _batches([8])[0]
        raise OSError("disk went away")

    iterator = iter(strategy.experimental_distribute_dataset(broken()))
    next(iterator)
    with pytest.raises(OSError, match="disk went away") as info:
        next(iterator)
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "broken" in frames  # the producer's own frame, from the background thread
    assert any("background thread" in note for note in info.value.__notes__)
    assert not _wait_for_no_input_threads()


def test_early_break_close_and_garbage_collection_leak_no_thread(strategy):
    def endless():
        i = 0
        while True:
            yield {"id": np.arange(i, i + 8)}
            i += 8

    dataset = strategy.experimental_distribute_dataset(endless(), xs.InputOptions(buffer_size=2))
    for batch in dataset:
        assert _ids(batch) == list(range(8))
        break
    del batch
    gc.collect()
    assert not _wait_for_no_input_threads()

    def slow():
        for batch in _batches([8] * 20):
            time.sleep(0.05)
            yield batch

    slow_iterator = iter(strategy.experimental_distribute_dataset(slow()))
    next(slow_iterator)
    slow_iterator.close()  # the host stage is inside the source; both stages still stop
    assert not _wait_for_no_input_threads()

    dataset = strategy.experimental_distribute_dataset(_batches([8] * 50))
    with iter(dataset) as iterator:
        next(iterator)
        assert _input_threads()
    assert not _wait_for_no_input_threads()
    with pytest.raises(StopIteration):
        next(iterator)  # closed


def test_dropping_an_iterator_whose_source_is_stuck_does_not_wait_for_it(strategy):
    # An exception (a step that met a dead peer) drops the loop's iterator on its way to
    # the user's handler while the input thread still waits on that peer; the handler must
    # not wait with it.
    released = threading.Event()

    def stuck_after_two():
        yield from _batches([8, 8])
        released.wait()  # a read that never returns while the test looks
        yield from _batches([8])

    iterator = iter(strategy.experimental_distribute_dataset(stuck_after_two()))
    next(iterator)
    dropped = threading.Thread(target=lambda: iterator.__del__())
    dropped.start()
    dropped.join(timeout=2.0)  # the old finalizer joined each stage for 5 s
    was_waiting = dropped.is_alive()
    released.set()
    assert not was_waiting
    assert not _wait_for_no_input_threads()  # released, the stopped threads end


def test_state_round_trip_resumes_at_the_next_batch(strategy):
    batches = _batches([8] * 10)
    dataset = strategy.experimental_distribute_dataset(batches, xs.InputOptions(buffer_size=3))
    uninterrupted = [_ids(b) for b in dataset]
    first = iter(dataset)
    consumed = [_ids(next(first)) for _ in range(4)]  # more than this are already prefetched
    state = first.get_state()
    first.close()
    assert state == {"position": 4, "batches": 4, "source": None}
    resumed = iter(dataset)
    resumed.set_state(state)
    assert consumed + [_ids(b) for b in resumed] == uninterrupted
    with pytest.raises(ValueError, match=r"the state lacks \['batches', 'source'\]"):
        iter(dataset).set_state({"position": 1})


class _StatefulSource:
    """An iterator that keeps its own position, as grain's DataLoader iterators do."""

    def __init__(self, batches):
        self.batches, self.index, self.restored_from = batches, 0, None

    def __iter__(self):
        return self

    def __next__(self):
        if self.index >= len(self.batches):
            raise StopIteration
        self.index += 1
        return self.batches[self.index - 1]

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.restored_from, self.index = state, state["index"]


class _StatefulDataset:
    def __init__(self, batches):
        self.batches, self.sources = batches, []

    def __iter__(self):
        self.sources.append(_StatefulSource(self.batches))
        return self.sources[-1]


def test_state_uses_the_sources_own_state_when_it_has_one(strategy):
    data = _StatefulDataset(_batches([8, 5, 8, 8], 100))
    options = xs.InputOptions(partial_batch="drop")
    dataset = strategy.experimental_distribute_dataset(data, options)
    first = iter(dataset)
    assert _ids(next(first)) == list(range(100, 108))
    assert _ids(next(first)) == list(range(113, 121))  # the 5-example batch was dropped
    state = first.get_state()
    first.close()
    assert state["source"] == {"index": 3} and state["position"] == 3
    resumed = iter(dataset)
    resumed.set_state(state)
    assert [_ids(b) for b in resumed] == [list(range(121, 129))]
    assert data.sources[-1].restored_from == {"index": 3}


def test_per_host_input_from_function(strategy):
    contexts = []

    def dataset_fn(ctx: xs.InputContext):
        contexts.append(ctx)
        per_host = ctx.get_per_host_batch_size(32)
        everything = _batches([32] * 3)
        return [
            {
                k: v[ctx.input_pipeline_id * per_host : (ctx.input_pipeline_id + 1) * per_host]
                for k, v in b.items()
            }
            for b in everything
        ]

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    assert contexts == [xs.InputContext(1, 0, REPLICAS)]  # called once, for this host
    assert [_ids(b) for b in dataset] == [list(range(i, i + 32)) for i in (0, 32, 64)]
    assert [_ids(b) for b in dataset] == [list(range(i, i + 32)) for i in (0, 32, 64)]  # epoch 2
    assert len(contexts) == 1
    # standing in for host k of 2: the two hosts' pipelines partition every global batch
    hosts = [dataset_fn(xs.InputContext(2, k, REPLICAS)) for k in range(2)]
    for step in range(3):
        together = sorted(_ids(hosts[0][step]) + _ids(hosts[1][step]))
        assert together == list(range(32 * step, 32 * (step + 1)))
        assert len(_ids(hosts[1][step])) == 16


def test_input_context_and_options_validate():
    ctx = xs.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    assert ctx.get_per_replica_batch_size(64) == 8
    assert ctx.get_per_host_batch_size(64) == 32
    with pytest.raises(ValueError, match="global_batch_size 60 does not divide across 8 replicas"):
        ctx.get_per_replica_batch_size(60)
    with pytest.raises(
        ValueError, match="input_pipeline_id=2 is out of range for 2 input pipelines"
    ):
        xs.InputContext(2, 2, 8)
    with pytest.raises(ValueError, match="partial_batch must be one of"):
        xs.InputOptions(partial_batch="truncate")
    with pytest.raises(ValueError, match="buffer_size must be at least 1"):
        xs.InputOptions(buffer_size=0)


def test_a_training_loop_on_prefetched_batches(strategy):
    """The prefetched arrays feed a compiled step as per-replica values."""
    step = strategy.compile(lambda batch: batch["x"].sum(axis=1))
    dataset = strategy.experimental_distribute_dataset(_batches([16, 16]))
    totals = [np.asarray(strategy.gather(step(b), axis=0)) for b in dataset]
    np.testing.assert_array_equal(np.concatenate(totals), 3 * np.arange(32))
