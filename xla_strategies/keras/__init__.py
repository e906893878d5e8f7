"""Keras 3 (JAX backend): `model.fit`, `evaluate` and `predict` through a strategy.

As in tf.distribute, a model built (or compiled) inside `strategy.scope()` belongs to that
strategy, wherever `fit`, `evaluate` or `predict` is called later:

    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=64, epochs=3)   # data-parallel over the strategy's replicas

Inside the scope, `keras.Model.compile` and Keras' `Trainer.__init__` are wrapped (once for
all threads, removed when the last scope exits; a model built and compiled in a thread with
no scope is left alone); each model built or compiled there gets its train, test and
predict functions from `xla_strategies.keras.trainer`, which compiles Keras' own
stateless `train_step`, `test_step` and `predict_step` with `strategy.compile`. Keras
itself is not changed. A strategy's `layout_map` (Keras' own `LayoutMap`) lays out, over
the strategy's model axis, the variables of models built in the scope
(`xla_strategies.keras.layout_map`). Keras is imported only when it is already imported by
the program: the scope never imports it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from xla_strategies.core.context import register_scope_hook
from xla_strategies.core.patching import patched
from xla_strategies.keras.layout_map import layout_map_scope
from xla_strategies.keras.synchronized_batch_norm import accepting_synchronized

if TYPE_CHECKING:
    from xla_strategies.distribute.strategy import Strategy


_local = threading.local()  # this thread's strategies in scope, innermost last


@contextlib.contextmanager
def models_compiled_in(strategy: Strategy) -> Iterator[None]:
    """While active, a Keras model compiled in this thread belongs to `strategy`."""
    keras = sys.modules.get("keras")
    if keras is None or _backend(keras) != "jax":
        yield
        return
    stack = _local.__dict__.setdefault("strategies", [])
    stack.append(strategy)
    try:
        # once for every thread's scopes; the wrapper asks this thread's. Patched where
        # Keras defines it: `keras.saving.load_model` compiles a loaded model only if its
        # class's `compile` is that one (otherwise it counts as a user's override)
        owner = next(c for c in keras.Model.__mro__ if "compile" in vars(c))
        # and every model built here belongs to it too, compiled or not: Keras predicts
        # with an uncompiled model, which would otherwise run on one device
        trainer = next(c for c in keras.Model.__mro__ if c.__name__ == "Trainer")
        with (
            patched(owner, "compile", _attaching),
            patched(trainer, "__init__", _attaching),
            accepting_synchronized(keras),
            layout_map_scope(keras, strategy),
        ):
            yield
    finally:
        stack.pop()


def _attaching(original: Callable[..., Any]) -> Callable[..., Any]:
    """A model method (`compile`, `__init__`) that also gives the model to the innermost
    strategy of the calling thread's scopes, if it has any."""
    from xla_strategies.keras.trainer import attach

    @functools.wraps(original)
    def attaching(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        original(model, *args, **kwargs)
        strategies = getattr(_local, "strategies", None)
        if strategies:
            attach(model, strategies[-1])

    return attaching


def _backend(keras) -> str:  # noqa: ANN001
    try:
        return keras.backend.backend()
    except AttributeError:  # keras still initialising
        return os.environ.get("KERAS_BACKEND", "")


register_scope_hook(models_compiled_in)
