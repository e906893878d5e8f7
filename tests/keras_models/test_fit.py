"""Keras 3 under `strategy.scope()`: fit, evaluate and predict run data-parallel through
the compiled pipeline and give single-device Keras' numbers."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import xla_strategies as xs
from tests.helpers import run_example
from xla_strategies.arguments import Layout

R = 8


def _data(rows=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype("float32")
    return x, (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(rows, 1))).astype("float32")


def sequential():
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )


def functional():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    skip = keras.layers.Dense(16)(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Add()([hidden, skip]))
    return keras.Model(inputs, outputs)


def batch_normalized(momentum=0.99):
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.BatchNormalization(momentum=momentum),
            keras.layers.Dense(1),
        ]
    )


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def _compiled(make, **compile_args):
    keras.utils.set_random_seed(1)
    model = make()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"], **compile_args
    )
    return model


@pytest.mark.parametrize("make", [sequential, functional, Subclassed])
def test_fit_equals_single_device_keras(make):
    x, y = _data()
    reference = _compiled(make)
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = _compiled(make)
    assert model.distribute_strategy is strategy
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)


def test_fit_on_a_tpu_topology_shards_the_optimizer_state_and_equals_keras():
    """TPUStrategy's cost model turns weight-update sharding on: Adam's moments live split
    across the devices between steps, and fit still gives single-device Keras' numbers."""
    x, y = _data()
    reference = _compiled(sequential)
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = xs.TPUStrategy("v5e-8", emulate=True)
    with strategy.scope():
        model = _compiled(sequential)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    moments = [v.value for v in model.optimizer.variables if len(v.shape) == 2]
    assert moments and all(strategy.is_held_sharded(m) for m in moments)


def test_evaluate_and_predict_with_batches_that_do_not_divide():
    x, y = _data(rows=100)
    strategy = xs.MirroredStrategy()
    reference = _compiled(sequential)
    with strategy.scope():
        model = _compiled(sequential)
    # batches of 30 and a last one of 10 do not divide across 8 replicas: they run on the
    # gcd(rows, 8) = 2 first replicas
    ours = model.evaluate(x, y, batch_size=30, verbose=0, return_dict=True)
    theirs = reference.evaluate(x, y, batch_size=30, verbose=0, return_dict=True)
    assert ours.keys() == theirs.keys()
    for key in ours:  # a global mean, not a mean of per-replica means
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6)
    predicted = model.predict(x[:45], batch_size=16, verbose=0)  # 16, 16, then 13 rows
    assert predicted.shape == (45, 1)
    np.testing.assert_allclose(
        predicted, reference.predict(x[:45], batch_size=16, verbose=0), rtol=1e-6, atol=1e-7
    )


def test_batch_normalization_statistics_are_per_replica_then_averaged():
    x, y = _data(rows=32)

    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = _compiled(lambda: batch_normalized(momentum=0.5))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    bn = model.layers[0]
    local = x.reshape(R, -1, 6)
    # one step from mean 0 / variance 1; the variable holds the replicas' mean
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * local.mean(1).mean(0), rtol=1e-5)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), 0.5 + 0.5 * local.var(1).mean(0), rtol=1e-5
    )


def test_stacked_statistics_stay_per_replica_within_an_epoch():
    x, y = _data(rows=64)

    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = _compiled(batch_normalized)
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=1, shuffle=False, verbose=0)
    model.make_train_function()
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    batch = (x[:32], y[:32])
    _, (_, non_trainable, _, _) = model.train_function(state, iter([batch]))
    assert all(strategy.layout(v) is Layout.STACKED for v in non_trainable)
    assert non_trainable[0].shape == (R, 6)


def test_callbacks_checkpoint_and_saved_model(tmp_path):
    x, y = _data()
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = _compiled(sequential)
    path = tmp_path / "best.keras"
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=20,
        validation_split=0.25,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0),
            keras.callbacks.ModelCheckpoint(path, monitor="val_loss"),
        ],
    )
    assert len(history.history["loss"]) == 2  # stopped early: no epoch improves by 10
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(
        restored.predict(x[:8], verbose=0), model.predict(x[:8], verbose=0), rtol=1e-5, atol=1e-7
    )


def test_the_train_step_runs_the_pass_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_STRATEGIES_DUMP_TO", str(tmp_path))
    x, y = _data(rows=32)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = _compiled(sequential)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    dumped = sorted(p.name for p in (tmp_path / "keras_train_step").iterdir())
    name = "0007.mirrored.after_combine-all-reduces.txt"
    assert name in dumped
    combined = (tmp_path / "keras_train_step" / name).read_text()
    assert combined.count("= all_reduce(") < 4 + 2  # 4 gradients and 2 metric sums, bucketed


def test_models_outside_the_scope_are_untouched():
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        pass
    model = _compiled(sequential)
    assert not hasattr(model, "distribute_strategy") or model.distribute_strategy is None
    assert "make_train_function" not in vars(model)


def test_the_keras_example_learns_with_batchnorm_and_uneven_batches():
    """examples/keras_fit.py: BatchNormalization, Dropout, a validation split whose last
    training batch (38 rows) and test set (1000 rows) do not divide across 8 replicas."""
    stdout = run_example("keras_fit.py", "--epochs", "3")
    accuracy = float(stdout.strip().split("accuracy ")[-1].split(";")[0])
    assert accuracy > 0.8 and "1000 predictions" in stdout


def test_a_generator_with_uneven_batches_mid_epoch():
    """Batches of 32, 10, 32 rows: the middle one runs on 2 replicas, and BatchNorm's
    per-replica statistics are folded on the way there and back."""
    x, y = _data(rows=74)

    def batches():
        while True:
            for lo, hi in ((0, 32), (32, 42), (42, 74)):
                yield x[lo:hi], y[lo:hi]

    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = _compiled(batch_normalized)
    history = model.fit(batches(), steps_per_epoch=3, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.layers[0].moving_mean.shape == (6,)


def test_a_scope_in_one_thread_leaves_other_threads_models_alone():
    import threading

    strategy = xs.MirroredStrategy()
    original = keras.Model.compile
    inside, outside = threading.Event(), threading.Event()
    results = {}

    def scoped():
        with strategy.scope():
            inside.set()
            outside.wait(timeout=60)
            results["scoped"] = _compiled(sequential)

    thread = threading.Thread(target=scoped)
    thread.start()
    inside.wait(timeout=60)
    results["plain"] = _compiled(sequential)  # this thread has no scope
    outside.set()
    thread.join(timeout=60)
    assert "make_train_function" not in vars(results["plain"])
    assert results["scoped"].distribute_strategy is strategy
    assert keras.Model.compile is original and "compile" not in vars(keras.Model)


def test_dropout_masks_differ_across_replicas_and_follow_keras_seed_state():
    """Dropout(0.5) on all-ones rows, a bias-free Dense(16) after it, SGD on the mean
    output: each kernel row's step counts how many of the 32 rows kept that input, so
    with one mask per replica repeated on all 8 replicas every count is a multiple of 8.
    The seed state then advances as single-device Keras advances it."""
    rows, features = 32, 16
    x = np.ones((rows, features), "float32")
    y = np.zeros((rows, 1), "float32")

    def model():
        keras.utils.set_random_seed(3)
        net = keras.Sequential(
            [
                keras.Input((features,)),
                keras.layers.Dropout(0.5, seed=7),
                keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
            ]
        )
        net.compile(optimizer=keras.optimizers.SGD(1.0), loss=lambda _, p: keras.ops.mean(p))
        return net

    single = model()
    single.fit(x, y, batch_size=rows, epochs=1, shuffle=False, verbose=0)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        ours = model()
    ours.fit(x, y, batch_size=rows, epochs=1, shuffle=False, verbose=0)
    # the kernel moved by -(2 / rows) per row that kept the input (Dropout scales by 2)
    kept = np.rint(-ours.get_weights()[0][:, 0] * rows / 2).astype(int)
    assert kept.min() >= 0 and kept.max() <= rows
    assert np.any(kept % R != 0), kept  # the replicas drew different masks
    seed_state = [v for v in ours.non_trainable_variables if "seed_generator" in v.path]
    expected = [v for v in single.non_trainable_variables if "seed_generator" in v.path]
    assert seed_state and [np.asarray(v.value).tolist() for v in seed_state] == [
        np.asarray(v.value).tolist() for v in expected
    ]


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight", "sum_over_batch_size"])
def test_fit_equals_single_device_keras_for_every_loss_reduction(reduction):
    """`keras.losses.MeanSquaredError(reduction=...)`, with uneven sample weights and an
    L2 regularizer: weights and the history's loss as single-device Keras has them."""
    x, y = _data(rows=64)
    weights = np.random.default_rng(4).uniform(0.1, 3.0, size=64).astype("float32")

    def model():
        keras.utils.set_random_seed(1)
        net = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2"),
                keras.layers.Dense(1),
            ]
        )
        net.compile(
            optimizer=keras.optimizers.SGD(1e-3),
            loss=keras.losses.MeanSquaredError(reduction=reduction),
        )
        return net

    single = model()
    expected = single.fit(
        x, y, sample_weight=weights, batch_size=32, epochs=2, shuffle=False, verbose=0
    )
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        ours = model()
    history = ours.fit(
        x, y, sample_weight=weights, batch_size=32, epochs=2, shuffle=False, verbose=0
    )
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for got, want in zip(ours.get_weights(), single.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        ours.evaluate(x, y, sample_weight=weights, batch_size=32, verbose=0),
        single.evaluate(x, y, sample_weight=weights, batch_size=32, verbose=0),
        rtol=1e-5,
    )


def test_a_model_loaded_inside_the_scope_is_compiled_and_trains_there(tmp_path):
    """keras.io's save-and-load guide: `keras.saving.load_model` in `strategy.scope()`
    compiles the loaded model from its saved config, and it trains on the strategy as the
    same model loaded on one device trains."""
    x, y = _data()
    path = tmp_path / "model.keras"
    _compiled(sequential).save(path)
    single = keras.saving.load_model(path)
    single.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert loaded.distribute_strategy is strategy
    loaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(loaded.get_weights(), single.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_predict_with_several_steps_per_execution_and_a_last_batch_that_does_not_divide():
    """`steps_per_execution=4` puts a 32-row batch (8 replicas) and the last 5 rows (one
    replica) in one call: their predictions join, and the model keeps its weights."""
    x, _ = _data(rows=37)
    reference = _compiled(sequential, steps_per_execution=4)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = _compiled(sequential, steps_per_execution=4)
    predicted = model.predict(x, batch_size=32, verbose=0)
    expected = reference.predict(x, batch_size=32, verbose=0)
    np.testing.assert_allclose(predicted, expected, rtol=1e-6, atol=1e-7)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_batch_that_does_not_divide_runs_on_a_sub_strategy_of_the_models_kind():
    x, y = _data(rows=37)
    reference = _compiled(sequential)
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    strategy = xs.CentralStorageStrategy()
    part = strategy.sub_strategy(5)
    assert type(part) is xs.CentralStorageStrategy and part.num_replicas_in_sync == 5
    assert part.parameter_device == strategy.parameter_device
    with strategy.scope():
        model = _compiled(sequential)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)  # 32 rows, then 5
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        model.predict(x, batch_size=32, verbose=0),
        reference.predict(x, batch_size=32, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_strategy_imports_no_frontend():
    import ast
    import inspect

    import xla_strategies.strategy

    tree = ast.parse(inspect.getsource(xla_strategies.strategy))
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [m for m in imported if "keras" in m or "torch" in m]


def test_synchronized_batch_normalization_uses_the_global_batch():
    """`BatchNormalization(synchronized=True)`, which Keras builds only on TensorFlow,
    normalizes with the global batch's statistics: the same as one device's batch."""
    x, y = _data(rows=64)

    def normalized(synchronized):
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8),
                keras.layers.BatchNormalization(momentum=0.5, synchronized=synchronized),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    reference = normalized(synchronized=False)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = normalized(synchronized=True)
    assert model.layers[1].synchronized
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)
    with pytest.raises(ValueError, match="only supported with the TensorFlow backend"):
        normalized(synchronized=True)  # outside a strategy's scope: Keras' own rule
