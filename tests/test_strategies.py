"""The Strategy API: placement, replica context, reductions, caching, donation, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_strategies as xs
from xla_strategies.hardware.hlo import count_hlo_collectives
from xla_strategies.step import compiled_step


@pytest.fixture(scope="module")
def mirrored():
    return xs.MirroredStrategy()


def _sgd_step(w, batch):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((batch @ w) ** 2))(w)
    return w - 0.1 * grad, loss


def _batch(strategy, rows=16, cols=4):
    data = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) / 100
    return next(iter(strategy.experimental_distribute_dataset([data])))


def test_replica_counts_and_devices(mirrored):
    assert mirrored.num_replicas_in_sync == 8
    assert xs.OneDeviceStrategy().num_replicas_in_sync == 1
    assert xs.MirroredStrategy(devices=[0, 3]).devices == (jax.devices()[0], jax.devices()[3])
    assert xs.OneDeviceStrategy("cpu:2").devices == (jax.devices()[2],)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: xs.MirroredStrategy(devices=[]), ValueError, "devices is empty"),
        (lambda: xs.MirroredStrategy(devices=[1, 1]), ValueError, "more than once"),
        (lambda: xs.MirroredStrategy(devices=0), TypeError, "sequence of devices"),
        (lambda: xs.OneDeviceStrategy(device=99), ValueError, "device=99 is out of range"),
        (lambda: xs.OneDeviceStrategy(device="tpu:0"), ValueError, "names no device"),
    ],
)
def test_bad_device_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_scope_and_contexts(mirrored):
    assert isinstance(xs.get_strategy(), xs.OneDeviceStrategy)
    assert xs.get_replica_context().num_replicas_in_sync == 1
    with mirrored.scope():
        assert xs.get_strategy() is mirrored
        assert xs.get_replica_context() is None
        assert xs.in_cross_replica_context()
    assert not xs.has_strategy()


def test_replica_context_inside_a_step(mirrored):
    seen = {}

    def step(x):
        ctx = xs.get_replica_context()
        seen["strategy"] = xs.get_strategy()
        seen["replicas"] = ctx.num_replicas_in_sync
        return ctx.replica_id_in_sync_group, ctx.all_reduce("mean", x.sum())

    ids, mean = mirrored.run(step, args=(_batch(mirrored),))
    assert seen == {"strategy": mirrored, "replicas": 8}
    np.testing.assert_array_equal(ids, np.arange(8))
    data = np.arange(64, dtype=np.float32).reshape(16, 4) / 100
    np.testing.assert_allclose(mean, data.sum() / 8, rtol=1e-6)
    assert mean.shape == ()  # mirrored: one value, not stacked


def test_per_replica_outputs_stack_and_reduce(mirrored):
    per_example = mirrored.run(lambda x: x.sum(axis=1), args=(_batch(mirrored),))
    data = np.arange(64, dtype=np.float32).reshape(16, 4) / 100
    assert per_example.shape == (8, 2)
    np.testing.assert_allclose(mirrored.reduce("sum", per_example, axis=0), data.sum(), rtol=1e-6)
    np.testing.assert_allclose(
        mirrored.reduce(xs.ReduceOp.MEAN, per_example, axis=0), data.sum(1).mean(), rtol=1e-6
    )
    np.testing.assert_allclose(
        mirrored.reduce("max", per_example), data.sum(1).reshape(8, 2).max(0), rtol=1e-6
    )
    np.testing.assert_allclose(mirrored.gather(per_example, axis=0), data.sum(1), rtol=1e-6)
    parts = mirrored.experimental_local_results(per_example)
    assert len(parts) == 8 and parts[3].shape == (2,)
    assert parts[3].devices() == {mirrored.devices[3]}
    np.testing.assert_allclose(parts[3], data.sum(1)[6:8], rtol=1e-6)
    # a mirrored value: SUM counts every replica, MEAN is the value itself
    np.testing.assert_allclose(mirrored.reduce("sum", np.float32(2.0)), 16.0)
    np.testing.assert_allclose(mirrored.reduce("mean", np.ones(3, np.float32), axis=0), 1.0)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        mirrored.reduce("sum", per_example, axis=2)
    with pytest.raises(ValueError, match="reduce_op must be one of SUM, MEAN, MAX, MIN, got 'avg'"):
        mirrored.reduce("avg", per_example)


def test_indivisible_global_batch_names_path_and_sizes(mirrored):
    dataset = mirrored.experimental_distribute_dataset([{"x": np.ones((12, 2)), "y": np.ones(12)}])
    with pytest.raises(
        ValueError, match=r"dataset element 0\['x'\] has a global batch of 12, .* 8 replicas"
    ):
        next(iter(dataset))
    uneven = mirrored.experimental_distribute_dataset([{"x": np.ones((16, 2)), "y": np.ones(12)}])
    with pytest.raises(ValueError, match=r"\['y'\] has batch size 12 but .*\['x'\] has 16"):
        next(iter(uneven))


def test_replicate_rejects_non_array_leaves(mirrored):
    with pytest.raises(TypeError, match=r"replicate\(tree\)\['w'\] is a object"):
        mirrored.replicate({"w": object()})


def test_declared_mirrored_output_that_varies(mirrored):
    step = mirrored.compile(_sgd_step, mirrored_outputs=(True, True))
    w = mirrored.replicate(np.ones((4, 2), np.float32))
    with pytest.raises(xs.MirroredOutputError, match=r"output\[1\] \(varies over \['replica'\]\)"):
        step(w, _batch(mirrored))
    assert not w.is_deleted()  # nothing ran half-way: the state is intact
    ok = mirrored.compile(_sgd_step, mirrored_outputs=(True, False))
    new_w, loss = ok(w, _batch(mirrored))
    assert loss.shape == (8,)
    with pytest.raises(ValueError, match="mirrored_outputs must be a pytree prefix"):
        mirrored.compile(_sgd_step, mirrored_outputs=(True, True, True))(new_w, _batch(mirrored))


def test_changed_structure_or_shape_retraces(mirrored):
    step = mirrored.compile(lambda tree: jax.tree.map(lambda v: v * 2, tree))
    assert step({"a": np.ones(2, np.float32)})["a"].tolist() == [2, 2]
    out = step({"a": np.ones(2, np.float32), "b": np.ones(3, np.int32)})
    assert out["b"].tolist() == [2, 2, 2]
    step({"a": np.ones(5, np.float32)})
    step({"a": np.ones(2, np.float32)})  # cached
    assert step.cache_size == 3


def test_the_executable_cache_keeps_the_most_recently_used(mirrored, monkeypatch):
    """A static value that changes every call compiles every call, but the cache keeps only
    the CACHE_SIZE executables used last; one in use stays cached."""
    monkeypatch.setattr(compiled_step, "CACHE_SIZE", 3)
    step = mirrored.compile(lambda x, scale: x * scale, static_argnames="scale")
    x = np.ones(2, np.float32)
    for scale in range(6):
        assert step(x, scale=scale).tolist() == [scale, scale]
        step(x, scale=0)  # used again after every other one: never dropped
    assert step.cache_size == 3
    assert step.executable(x, scale=0) is step.executable(x, scale=0)


def test_only_declared_arguments_are_donated(mirrored):
    train = mirrored.compile(_sgd_step)
    w = mirrored.replicate(np.ones((4, 2), np.float32))
    new_w, _ = train(w, _batch(mirrored))
    assert not w.is_deleted() and train.executable(new_w, _batch(mirrored)).donated == ()
    for declared in (
        mirrored.compile(_sgd_step, donate_argnums=0),
        mirrored.compile(_sgd_step, donate_argnames="w"),
    ):
        w = mirrored.replicate(np.ones((4, 2), np.float32))
        new_w, _ = declared(w, _batch(mirrored))
        assert w.is_deleted() and not new_w.is_deleted()
        assert declared.executable(new_w, _batch(mirrored)).donated == (0,)
        with pytest.raises(ValueError, match=r"args\[0\] was donated to an earlier call"):
            declared(w, _batch(mirrored))
    evaluate = mirrored.compile(lambda w, x: jnp.mean(x @ w))
    evaluate(new_w, _batch(mirrored))
    assert not new_w.is_deleted()


def test_lower_graph_and_compiled_hlo(mirrored):
    step = mirrored.compile(_sgd_step)
    w, batch = mirrored.replicate(np.ones((4, 2), np.float32)), _batch(mirrored)
    lowered = step.lower(w, batch)
    assert isinstance(lowered, jax.stages.Lowered)
    assert count_hlo_collectives(lowered.compile().as_text())["all-reduce"] == 1
    captured = step.graph(w, batch)
    after = step.graph(w, batch, after="insert-reductions")
    assert [n.attrs["reduce_op"] for n in captured.walk() if n.op == "all_reduce"] == ["sum"]
    assert [n.attrs["reduce_op"] for n in after.walk() if n.op == "all_reduce"] == ["sum"]
    factors = [n.attrs["factor"] for n in after.walk() if n.attrs.get("origin") == "gradient"]
    assert factors == [1 / 8]  # MEAN: the finished gradient is scaled once
    no_reduction = mirrored.compile(lambda x: x * 2)
    assert count_hlo_collectives(no_reduction.lower(batch).compile().as_text())["all-reduce"] == 0


def test_dump_directory_from_environment(mirrored, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_STRATEGIES_DUMP_TO", str(tmp_path))
    step = mirrored.compile(_sgd_step, name="train_step")
    step(mirrored.replicate(np.ones((4, 2), np.float32)), _batch(mirrored))
    names = sorted(p.name for p in (tmp_path / "train_step").iterdir())
    assert names == [
        "0000.mirrored.after_capture.txt",
        "0001.mirrored.after_insert-reductions.txt",
        "0002.mirrored.after_fold-invariant-reductions.txt",
        "0003.mirrored.after_shard-parameters.txt",
        "0004.mirrored.after_schedule-all-reduces.txt",
        "0005.mirrored.after_reassociate-all-reduces.txt",
        "0006.mirrored.after_shard-weight-updates.txt",
        "0007.mirrored.after_combine-all-reduces.txt",
        "0008.mirrored.after_prefetch-all-gathers.txt",
        "0009.mirrored.after_split-stacked-all-reduces.txt",
        "0010.mirrored.after_sink-casts-below-lookups.txt",
        "0011.mirrored.after_scatter-adds-as-selects.txt",
        "0012.mirrored.after_reduce-scatters-before-loops.txt",
        "0013.mirrored.after_materialize-early-matmuls.txt",
        "0014.mirrored.after_inline-nested-calls.txt",
        "compiled.hlo.txt",
        "compiled_report.json",
        "ledger.json",
        "stablehlo.mlir",
        "summary.txt",
        "timeline.json",
    ]


def test_gradient_reduction_must_be_mean_or_sum(mirrored):
    with pytest.raises(
        ValueError, match="gradient_reduction must be ReduceOp.MEAN or ReduceOp.SUM, got MAX"
    ):
        mirrored.compile(_sgd_step, gradient_reduction=xs.ReduceOp.MAX)


def test_reduce_and_gather_of_a_distributed_batch(mirrored):
    """A distributed batch (2 examples per replica) is per-replica data too."""
    data = np.arange(64, dtype=np.float32).reshape(16, 4)
    batch = _batch(mirrored)
    np.testing.assert_allclose(mirrored.reduce("sum", batch, axis=0), data.sum(0) / 100, rtol=1e-6)
    np.testing.assert_allclose(mirrored.gather(batch, axis=0), data / 100, rtol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_hands_back_each_replicas_bits(mirrored, axis):
    """Per-replica values (signed zeros, NaN's payload, infinities) come back unchanged: a
    gather moves data, it does no arithmetic (a sum of masked parts would make -0.0 +0.0)."""
    rng = np.random.default_rng(0)
    parts = rng.normal(size=(8, 2, 3)).astype(np.float32)
    parts[::2, 0, 0] = -0.0
    parts[1, 1, :] = [np.inf, -np.inf, np.nan]
    batch = next(iter(mirrored.experimental_distribute_dataset([parts.reshape(16, 3)])))
    stacked = mirrored.run(lambda x: x, (batch,))  # a step's per-replica output
    gathered = np.asarray(mirrored.gather(stacked, axis=axis))
    expected = np.concatenate(list(parts), axis=axis)
    assert gathered.tobytes() == expected.tobytes()
    # a mirrored value: every replica's part is the value itself
    whole = np.asarray(mirrored.gather(mirrored.replicate(parts[1]), axis=axis))
    assert whole.tobytes() == np.concatenate([parts[1]] * 8, axis=axis).tobytes()


def test_an_undeclared_argument_is_never_donated_whatever_the_outputs(mirrored):
    """eval(temperature, x) returns a scalar of the temperature's type at its position, and
    f(x, y) -> 0.9 * x + 0.1 * y the type of x: neither deletes what the caller passed."""
    temperature = mirrored.replicate(np.float32(2.0))
    evaluate = mirrored.compile(lambda t, x: (jnp.mean(x) / t,))
    evaluate(temperature, _batch(mirrored))
    evaluate(temperature, _batch(mirrored))
    assert not temperature.is_deleted()
    x, y = mirrored.replicate(np.ones(3, np.float32)), mirrored.replicate(np.zeros(3, np.float32))
    blend = mirrored.compile(lambda x, y: 0.9 * x + 0.1 * y)
    np.testing.assert_allclose(np.asarray(blend(x, y)), 0.9)
    assert not x.is_deleted() and not y.is_deleted()


def test_a_pipeline_object_keeps_its_disabled_passes(mirrored):
    from xla_strategies.passes import PassPipeline

    pipeline = PassPipeline.from_spec(
        "insert-reductions,combine-all-reduces", disabled=frozenset({"combine-all-reduces"})
    )
    assert mirrored.pipeline(xs.ReduceOp.MEAN, pipeline).disabled == {"combine-all-reduces"}


def test_a_pipeline_spec_option_is_honoured_or_conflicts(mirrored):
    w, batch = mirrored.replicate(np.ones((4, 2), np.float32)), _batch(mirrored)

    def factors(step):
        graph = step.graph(w, batch, after="insert-reductions")
        return [n.attrs["factor"] for n in graph.walk() if n.attrs.get("origin") == "gradient"]

    summed = mirrored.compile(_sgd_step, pipeline="insert-reductions{gradient-reduction=sum}")
    assert factors(summed) == [1]  # the spec's SUM, not the compile default's MEAN
    assert factors(mirrored.compile(_sgd_step, gradient_reduction="sum")) == [1]
    assert factors(mirrored.compile(_sgd_step)) == [1 / 8]
    with pytest.raises(xs.passes.PipelineSpecError, match=r"compile\(gradient_reduction=MEAN\)"):
        mirrored.compile(
            _sgd_step,
            gradient_reduction="mean",
            pipeline="insert-reductions{gradient-reduction=sum}",
        )


def test_compiled_hlo_keeps_the_users_source_lines_and_names(mirrored):
    def train_step(w, batch):
        with jax.named_scope("my_forward"):
            loss, grad = jax.value_and_grad(lambda w: jnp.mean((batch @ w) ** 2))(w)
        return w - 0.1 * grad, loss

    step = mirrored.compile(train_step)
    w, batch = mirrored.replicate(np.ones((4, 2), np.float32)), _batch(mirrored)
    lowered = step.lower(w, batch)
    assert 'op_name="jit(body)/shard_map/my_forward/' in lowered.compile().as_text()
    line = train_step.__code__.co_firstlineno + 2  # the value_and_grad line
    assert f'test_strategies.py":{line}:' in lowered.as_text(debug_info=True)


def test_stop_after_compile_raises_instead_of_exiting(mirrored, monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_STRATEGIES_STOP_AFTER_COMPILE", "1")
    step = mirrored.compile(_sgd_step, name="stopping")
    with pytest.raises(xs.errors.StoppedAfterCompile, match="stopping compiled"):
        try:
            step(mirrored.replicate(np.ones((4, 2), np.float32)), _batch(mirrored))
        except Exception:  # a script's own handler must not swallow it
            pytest.fail("StoppedAfterCompile was caught as an Exception")


def test_an_all_gather_declared_mirrored_comes_back_replicated(mirrored):
    from jax import lax

    def step(x):
        gathered = lax.all_gather(x, "replica", tiled=True)
        return gathered * 2.0 + 1.0, jnp.sum(gathered)

    data = np.arange(16, dtype=np.float32).reshape(8, 2)
    x = next(iter(mirrored.experimental_distribute_dataset([data])))
    scaled, total = mirrored.compile(step, mirrored_outputs=True)(x)
    np.testing.assert_array_equal(np.asarray(scaled), data * 2.0 + 1.0)
    assert float(total) == data.sum()
    assert scaled.sharding.is_fully_replicated


def test_loops_whose_carry_starts_mirrored_and_becomes_per_replica(mirrored):
    from jax import lax

    def step(x):
        total = lax.fori_loop(0, 3, lambda i, carry: carry + x * i, jnp.zeros(x.shape))
        doubled = lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + x), (0, jnp.zeros(x.shape))
        )
        return total, doubled[1]

    data = np.arange(16, dtype=np.float32).reshape(8, 2)
    x = next(iter(mirrored.experimental_distribute_dataset([data])))
    total, doubled = mirrored.compile(step)(x)
    np.testing.assert_allclose(np.asarray(total).reshape(8, 2), data * 3)  # 0 + 1 + 2
    np.testing.assert_allclose(np.asarray(doubled).reshape(8, 2), 2 * data)
