"""Keras models and data the Keras tests share, written as keras.io writes them."""

from __future__ import annotations

import keras
import numpy as np

R = 8


def regression_data(rows=128, seed=0):
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


def compiled_model(make, **compile_args):
    keras.utils.set_random_seed(1)
    model = make()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"], **compile_args
    )
    return model
