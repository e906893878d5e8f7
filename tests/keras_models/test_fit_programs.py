"""Keras programs from keras.io that ran wrong or crashed before: dropout across replicas,
every loss reduction, models loaded in the scope, several steps per execution, batches
that do not divide, synchronized batch normalization."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import xla_strategies as xs
from tests.keras_models.models import R, compiled_model, regression_data, sequential


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


class MCDropout(keras.layers.Dropout):
    """Monte-Carlo dropout as its users write it: dropout at inference too."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=True)


class MCBlock(keras.layers.Layer):
    """Monte-Carlo dropout inside a layer of the user's own, as users write it there."""

    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.dropout = keras.layers.Dropout(rate)

    def call(self, inputs):
        return self.dropout(inputs, training=True)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "uncompiled"])
@pytest.mark.parametrize("layer", [MCDropout, MCBlock])
def test_monte_carlo_dropout_in_predict_draws_a_mask_per_replica(layer, compiled):
    """Monte-Carlo dropout in a functional model built in the scope, then predict, with
    the model compiled or not (Keras predicts with either). Each replica's rows get their
    own masks, and the seed state advances as single-device Keras advances it."""
    rows, features = 64, 16

    def model():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((features,))
        net = keras.Model(inputs, layer(0.5)(inputs))
        if compiled:
            net.compile(loss="mse")
        return net

    x = np.ones((rows, features), "float32")
    single = model()
    single.predict(x, batch_size=rows, verbose=0)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        ours = model()
    assert ours.distribute_strategy is strategy  # predicted on its replicas, not one device
    kept = ours.predict(x, batch_size=rows, verbose=0) != 0
    assert 0.3 < kept.mean() < 0.7
    blocks = kept.reshape(R, rows // R, features)
    assert len({block.tobytes() for block in blocks}) == R, "replicas drew the same mask"
    seed_state = [v for v in ours.non_trainable_variables if "seed_generator" in v.path]
    expected = [v for v in single.non_trainable_variables if "seed_generator" in v.path]
    assert seed_state and [np.asarray(v.value).tolist() for v in seed_state] == [
        np.asarray(v.value).tolist() for v in expected
    ]


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight", "sum_over_batch_size"])
def test_fit_equals_single_device_keras_for_every_loss_reduction(reduction):
    """`keras.losses.MeanSquaredError(reduction=...)`, with uneven sample weights and an
    L2 regularizer: weights and the history's loss as single-device Keras has them."""
    x, y = regression_data(rows=64)
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
    x, y = regression_data()
    path = tmp_path / "model.keras"
    compiled_model(sequential).save(path)
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
    x, _ = regression_data(rows=37)
    reference = compiled_model(sequential, steps_per_execution=4)
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = compiled_model(sequential, steps_per_execution=4)
    predicted = model.predict(x, batch_size=32, verbose=0)
    expected = reference.predict(x, batch_size=32, verbose=0)
    np.testing.assert_allclose(predicted, expected, rtol=1e-6, atol=1e-7)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_batch_that_does_not_divide_runs_on_a_sub_strategy_of_the_models_kind():
    x, y = regression_data(rows=37)
    reference = compiled_model(sequential)
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    strategy = xs.CentralStorageStrategy()
    part = strategy.sub_strategy(5)
    assert type(part) is xs.CentralStorageStrategy and part.num_replicas_in_sync == 5
    assert part.parameter_device == strategy.parameter_device
    with strategy.scope():
        model = compiled_model(sequential)
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

    import xla_strategies.distribute.strategy

    tree = ast.parse(inspect.getsource(xla_strategies.distribute.strategy))
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
    x, y = regression_data(rows=64)

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
