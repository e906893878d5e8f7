"""Keras 3 (JAX backend): `model.fit`, `evaluate` and `predict` through a strategy.

As in tf.distribute, a model built and compiled inside `strategy.scope()` belongs to that
strategy, wherever `fit` is called later:

    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=64, epochs=3)   # data-parallel over the strategy's replicas

Inside the scope, `keras.Model.compile` is wrapped (the wrapper is removed when the scope
exits); each model compiled there gets its train, test and predict functions from
`xla_strategies.keras.trainer`, which compiles Keras' own stateless `train_step`,
`test_step` and `predict_step` with `strategy.compile`. Keras itself is not changed.
Keras is imported only when it is already imported by the program: the scope never
imports it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xla_strategies.strategy import Strategy


@contextlib.contextmanager
def models_compiled_in(strategy: Strategy) -> Iterator[None]:
    """While active, a Keras model compiled in this thread belongs to `strategy`."""
    keras = sys.modules.get("keras")
    if keras is None or _backend(keras) != "jax":
        yield
        return
    from xla_strategies.keras.trainer import attach

    model_class = keras.Model
    original = model_class.compile

    def compile(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        original(model, *args, **kwargs)
        attach(model, strategy)

    model_class.compile = compile
    try:
        yield
    finally:
        model_class.compile = original


def _backend(keras) -> str:  # noqa: ANN001
    try:
        return keras.backend.backend()
    except AttributeError:  # keras still initialising
        return os.environ.get("KERAS_BACKEND", "")
