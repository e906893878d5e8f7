"""Keras 3 (JAX backend): `model.fit`, `evaluate` and `predict` through a strategy.

As in tf.distribute, a model built and compiled inside `strategy.scope()` belongs to that
strategy, wherever `fit` is called later:

    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=64, epochs=3)   # data-parallel over the strategy's replicas

Inside the scope, `keras.Model.compile` is wrapped (once for all threads, removed when the
last scope exits; a model compiled in a thread with no scope is left alone); each model
compiled there gets its train, test and predict functions from
`xla_strategies.keras.trainer`, which compiles Keras' own stateless `train_step`,
`test_step` and `predict_step` with `strategy.compile`. Keras itself is not changed.
Keras is imported only when it is already imported by the program: the scope never
imports it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xla_strategies.strategy import Strategy


_local = threading.local()  # this thread's strategies in scope, innermost last
_lock = threading.Lock()
_installed: list[Any] = []  # [keras.Model, compile as it was, how many scopes use it]


@contextlib.contextmanager
def models_compiled_in(strategy: Strategy) -> Iterator[None]:
    """While active, a Keras model compiled in this thread belongs to `strategy`."""
    keras = sys.modules.get("keras")
    if keras is None or _backend(keras) != "jax":
        yield
        return
    stack = _local.__dict__.setdefault("strategies", [])
    stack.append(strategy)
    _install(keras.Model)
    try:
        yield
    finally:
        stack.pop()
        _uninstall()


def _install(model_class: type) -> None:
    """Wrap `compile` once for every thread's scopes; the wrapper asks this thread's."""
    from xla_strategies.keras.trainer import attach

    with _lock:
        if _installed:
            _installed[2] += 1
            return
        own = "compile" in vars(model_class)
        original = model_class.compile

        def compile(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            original(model, *args, **kwargs)
            strategies = getattr(_local, "strategies", None)
            if strategies:
                attach(model, strategies[-1])

        model_class.compile = compile
        _installed.extend([model_class, original if own else None, 1])


def _uninstall() -> None:
    with _lock:
        _installed[2] -= 1
        if _installed[2]:
            return
        model_class, original, _ = _installed
        if original is None:
            del model_class.compile  # it was inherited: inherit it again
        else:
            model_class.compile = original
        _installed.clear()


def _backend(keras) -> str:  # noqa: ANN001
    try:
        return keras.backend.backend()
    except AttributeError:  # keras still initialising
        return os.environ.get("KERAS_BACKEND", "")
