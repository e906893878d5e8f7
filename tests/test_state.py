"""Per-replica state (tf.distribute's SyncOnRead) and declared aggregation
(VariableAggregation): stacked values keep their shape step after step, whatever it is,
and declared reductions are IR that rides the gradient bucket."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import xla_strategies as xs
from xla_strategies.core.layout import Layout
from xla_strategies.hardware.hlo import count_hlo_collectives

R = 8


@pytest.fixture(scope="module")
def mirrored():
    return xs.MirroredStrategy()


def _running_stats_step(w, stats, batch):
    """A BatchNorm-like step: a gradient step on `w`, and a running mean of the local batch
    kept per replica (it differs across replicas, so it comes back stacked)."""
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((batch @ w) ** 2))(w)
    new_stats = 0.9 * stats + 0.1 * jnp.mean(batch, axis=0)
    return w - 0.1 * grad, new_stats, loss


def _batches(steps, rows=16, cols=R):
    # cols == R: a per-replica statistic of shape [R] stacks to [R, R], which is also the
    # shape of a batch of R rows. Only the layout may tell them apart.
    rng = np.random.default_rng(0)
    return [rng.normal(size=(rows, cols)).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize(
    "make",
    [xs.MirroredStrategy, lambda: xs.CentralStorageStrategy(parameter_device=5)],
    ids=["mirrored", "central-storage"],
)
def test_per_replica_state_keeps_its_shape_and_equals_a_per_replica_reference(make):
    mirrored = make()
    step = mirrored.compile(_running_stats_step)
    batches = _batches(4)
    w = mirrored.replicate(np.ones((R, 1), np.float32))
    stats = np.zeros(R, np.float32)  # mirrored at first, as an init function makes it
    expected = np.zeros((R, R), np.float32)
    dataset = mirrored.experimental_distribute_dataset(batches)
    for batch, global_batch in zip(dataset, batches, strict=True):
        w, stats, _ = step(w, stats, batch)
        assert stats.shape == (R, R) and mirrored.layout(stats) is Layout.STACKED
        parts = global_batch.reshape(R, -1, R)  # replica r sees rows 2r, 2r+1
        expected = 0.9 * expected + 0.1 * parts.mean(axis=1)
        np.testing.assert_allclose(np.asarray(stats), expected, rtol=1e-6, atol=1e-7)
    assert step.cache_size == 2  # mirrored stats at step 1, stacked stats after
    w_ref = np.ones((R, 1), np.float32)
    for global_batch in batches:  # the weights follow one device on the global batch
        grad = 2 * global_batch.T @ (global_batch @ w_ref) / len(global_batch)
        w_ref = w_ref - 0.1 * grad
    np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5, atol=1e-6)


def test_stacked_state_of_a_batch_shape_is_not_split(mirrored):
    """A stacked [R, R] value passed together with a [R, R] batch: each replica gets its own
    row of the state, and its two rows of the batch."""

    @mirrored.compile
    def step(state, batch):
        return state.shape, batch.shape, state + 0 * jnp.sum(batch)

    state = jax.device_put(np.eye(R, dtype=np.float32), mirrored.stacked_sharding())
    batch = next(iter(mirrored.experimental_distribute_dataset([np.ones((R, R), np.float32)])))
    graph = step.graph(state, batch)
    assert [v.shape for v in graph.inputs] == [(R,), (1, R)]
    assert [i for i, a in enumerate(graph.io.inputs) if a.stacked] == [0]
    *_, again = step(state, batch)
    np.testing.assert_array_equal(np.asarray(again), np.eye(R))


def test_reduce_local_results_and_gather_read_stacked_state(mirrored):
    stacked = jax.device_put(
        np.arange(R * 3, dtype=np.float32).reshape(R, 3), mirrored.stacked_sharding()
    )
    host = np.asarray(stacked)
    np.testing.assert_allclose(mirrored.reduce("mean", stacked), host.mean(0))
    np.testing.assert_allclose(mirrored.reduce("sum", stacked, axis=0), host.sum())
    parts = mirrored.experimental_local_results(stacked)
    assert len(parts) == R and all(p.shape == (3,) for p in parts)
    assert parts[5].devices() == {mirrored.devices[5]}
    np.testing.assert_array_equal(np.asarray(parts[5]), host[5])
    np.testing.assert_array_equal(mirrored.gather(stacked, axis=0), host.reshape(-1))


def test_checkpoint_keeps_per_replica_state_or_restores_its_mean(mirrored, tmp_path):
    step = mirrored.compile(_running_stats_step)
    w = mirrored.replicate(np.ones((R, 1), np.float32))
    stats = np.zeros(R, np.float32)
    for batch in mirrored.experimental_distribute_dataset(_batches(2)):
        w, stats, _ = step(w, stats, batch)
    with xs.CheckpointManager(tmp_path, mirrored) as manager:
        manager.save(2, {"w": w, "stats": stats})
        manager.wait_until_finished()
        exact = manager.restore(target={"w": w, "stats": stats})
        fresh = manager.restore(target={"w": w, "stats": np.zeros(R, np.float32)})
    assert mirrored.layout(exact["stats"]) is Layout.STACKED
    np.testing.assert_array_equal(np.asarray(exact["stats"]), np.asarray(stats))
    assert mirrored.layout(fresh["stats"]) is Layout.MIRRORED
    np.testing.assert_allclose(np.asarray(fresh["stats"]), np.asarray(stats).mean(0), rtol=1e-6)

    four = xs.MirroredStrategy(jax.devices()[:4])
    target = jax.device_put(np.zeros((4, R), np.float32), four.stacked_sharding())
    with xs.CheckpointManager(tmp_path, four) as manager:
        other = manager.restore(target={"w": w, "stats": target})
    assert four.layout(other["stats"]) is Layout.STACKED and other["stats"].shape == (4, R)
    np.testing.assert_allclose(
        np.asarray(other["stats"]), np.tile(np.asarray(stats).mean(0), (4, 1)), rtol=1e-6
    )


def test_declared_aggregation_reduces_inside_the_step_in_the_gradient_bucket(mirrored):
    step = mirrored.compile(_running_stats_step, mirrored_outputs=(True, xs.ReduceOp.MEAN, False))
    batches = _batches(1)
    batch = next(iter(mirrored.experimental_distribute_dataset(batches)))
    w = mirrored.replicate(np.ones((R, 1), np.float32))
    stats = mirrored.replicate(np.zeros(R, np.float32))

    captured = step.graph(w, stats, batch)
    assert [a.aggregation for a in captured.io.outputs][1] == "mean"
    inserted = step.graph(w, stats, batch, after="insert-reductions")
    aggregations = [n for n in inserted.walk() if n.attrs.get("origin") == "aggregation"]
    assert len(aggregations) == 1 and aggregations[0].attrs["output"] == "output[1]"
    combined = step.graph(w, stats, batch, after="combine-all-reduces")
    buckets = [n for n in combined.walk() if n.op == "all_reduce"]
    assert len(buckets) == 1 and "output[1]" in buckets[0].attrs["members"]

    new_w, new_stats, _ = step(w, stats, batch)
    assert new_stats.shape == (R,) and mirrored.layout(new_stats) is Layout.MIRRORED
    np.testing.assert_allclose(np.asarray(new_stats), 0.1 * batches[0].mean(0), rtol=1e-6)
    hlo = step.lower(new_w, new_stats, batch).compile().as_text()
    assert count_hlo_collectives(hlo)["all-reduce"] == 1


def test_aggregating_an_already_mirrored_output_follows_psum(mirrored):
    @mirrored.compile(mirrored_outputs=("sum", "max"))
    def step(x):
        return x * 2, x + 1

    total, biggest = step(mirrored.replicate(np.float32(3.0)))
    assert float(total) == 6.0 * R and float(biggest) == 4.0


def test_bad_aggregation_names_the_output(mirrored):
    step = mirrored.compile(lambda x: (x, x), mirrored_outputs=(True, "avg"))
    with pytest.raises(ValueError, match=r"mirrored_outputs for output\[1\] must be one of"):
        step(np.float32(1.0))


def test_declared_sum_of_a_partly_varying_output_counts_every_replica():
    strategy = xs.TPUStrategy("v5e-8", emulate=True)  # a 2-d mesh
    axes = strategy.mesh.axis_names

    @strategy.compile(mirrored_outputs=("sum", "mean"))
    def step(x):
        first = lax.axis_index(axes[0]).astype(jnp.float32)  # varies over one axis only
        return first + 0 * x, first + 0 * x

    total, mean = step(strategy.replicate(np.float32(0)))
    rows, cols = strategy.mesh.devices.shape
    expected = cols * sum(range(rows))  # as lax.psum over both axes
    assert float(total) == expected and float(mean) == expected / (rows * cols)


def test_integer_per_replica_state_restores_only_exactly(mirrored, tmp_path):
    counters = jax.device_put(np.arange(R, dtype=np.int32), mirrored.stacked_sharding())
    with xs.CheckpointManager(tmp_path, mirrored) as manager:
        manager.save(1, {"c": counters})
        manager.wait_until_finished()
        exact = manager.restore(target={"c": counters})
        np.testing.assert_array_equal(np.asarray(exact["c"]), np.arange(R))
        with pytest.raises(xs.CheckpointError, match=r"integer values have no mean"):
            manager.restore(target={"c": np.int32(0)})
