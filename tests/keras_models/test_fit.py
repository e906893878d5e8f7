"""Keras 3 under `strategy.scope()`: fit, evaluate and predict run data-parallel through
the compiled pipeline and give single-device Keras' numbers."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import xla_strategies as xs
from tests.helpers import run_example
from tests.keras_models.models import (
    R,
    Subclassed,
    batch_normalized,
    compiled_model,
    functional,
    regression_data,
    sequential,
)
from xla_strategies.core.layout import Layout


@pytest.mark.parametrize("make", [sequential, functional, Subclassed])
def test_fit_equals_single_device_keras(make):
    x, y = regression_data()
    reference = compiled_model(make)
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = compiled_model(make)
    assert model.distribute_strategy is strategy
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)


@pytest.mark.parametrize("shard_weight_updates", [None, True])
def test_fit_on_a_tpu_topology_equals_keras_with_the_update_sharded_or_not(shard_weight_updates):
    """Left to TPUStrategy's cost model (None), this Dense model's Adam update stays
    replicated: XLA's TPU compiler runs a reduce-scatter over both axes of v5e-4 as an
    all-reduce, and gathering the new weights back costs more than the update it splits.
    Asked for (`set_compile_defaults(shard_weight_updates=True)`), Adam's moments live split
    across the devices between steps. Either way fit gives single-device Keras' numbers."""

    def wide():
        return keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(1)]
        )

    x, y = regression_data()
    reference = compiled_model(wide)
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    strategy = xs.TPUStrategy("v5e-4", emulate=True)
    if shard_weight_updates is not None:
        strategy.set_compile_defaults(shard_weight_updates=shard_weight_updates)
    with strategy.scope():
        model = compiled_model(wide)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    moments = [v.value for v in model.optimizer.variables if len(v.shape) == 2]
    held = [strategy.is_held_sharded(m) for m in moments]
    assert len(moments) == 4 and held == [bool(shard_weight_updates)] * 4


def test_evaluate_and_predict_with_batches_that_do_not_divide():
    x, y = regression_data(rows=100)
    strategy = xs.MirroredStrategy()
    reference = compiled_model(sequential)
    with strategy.scope():
        model = compiled_model(sequential)
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
    x, y = regression_data(rows=32)

    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = compiled_model(lambda: batch_normalized(momentum=0.5))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    bn = model.layers[0]
    local = x.reshape(R, -1, 6)
    # one step from mean 0 / variance 1; the variable holds the replicas' mean
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * local.mean(1).mean(0), rtol=1e-5)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), 0.5 + 0.5 * local.var(1).mean(0), rtol=1e-5
    )


def test_stacked_statistics_stay_per_replica_within_an_epoch():
    x, y = regression_data(rows=64)

    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = compiled_model(batch_normalized)
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
    x, y = regression_data()
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = compiled_model(sequential)
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
    x, y = regression_data(rows=32)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = compiled_model(sequential)
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
    model = compiled_model(sequential)
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
    x, y = regression_data(rows=74)

    def batches():
        while True:
            for lo, hi in ((0, 32), (32, 42), (42, 74)):
                yield x[lo:hi], y[lo:hi]

    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = compiled_model(batch_normalized)
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
            results["scoped"] = compiled_model(sequential)

    thread = threading.Thread(target=scoped)
    thread.start()
    inside.wait(timeout=60)
    results["plain"] = compiled_model(sequential)  # this thread has no scope
    outside.set()
    thread.join(timeout=60)
    assert "make_train_function" not in vars(results["plain"])
    assert results["scoped"].distribute_strategy is strategy
    assert keras.Model.compile is original and "compile" not in vars(keras.Model)


def test_fit_warns_nothing_about_donation():
    """Keras' empty variable groups (a Dense model has no non-trainable variables) have
    nothing to donate: `fit` must not warn that they were not returned."""
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((64, 4), "float32"), np.ones((64, 2), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not [w for w in caught if "donated" in str(w.message)]


def test_fit_holds_the_parameters_split_when_the_strategy_asks():
    """`strategy.set_compile_defaults(shard_parameters=True)`: Keras' own train step, which
    the library compiles, holds the weights and optimizer state split, and trains as
    single-device Keras does."""
    x, y = regression_data(rows=64)
    reference = compiled_model(sequential)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = xs.MirroredStrategy()
    strategy.set_compile_defaults(shard_parameters=True)
    with strategy.scope():
        model = compiled_model(sequential)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    kernels = [v.value for v in model.trainable_variables if v.value.ndim == 2]
    assert kernels and any(strategy.is_held_sharded(k) for k in kernels)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    with pytest.raises(TypeError, match=r"not \['name'\]"):
        strategy.set_compile_defaults(name="x")


def test_fit_with_the_exact_gelu_equals_single_device_keras():
    """`activation="gelu"` is Keras' exact GELU (erf)."""
    x, y = regression_data(rows=64)

    def gelu_model():
        return keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(16, activation="gelu"), keras.layers.Dense(1)]
        )

    reference = compiled_model(gelu_model)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = compiled_model(gelu_model)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
