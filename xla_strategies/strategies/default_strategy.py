"""`xs.get_strategy()`: the strategy in scope, or a one-device default, as in tf.distribute.

Kept apart from `context.py` so that the replica context, which every compiled step uses,
depends on no strategy class.
"""

from __future__ import annotations

import functools
import threading

from xla_strategies.core.context import register_default_strategy, scope_depth, strategy_in_scope
from xla_strategies.distribute.strategy import Strategy
from xla_strategies.strategies.one_device import OneDeviceStrategy


def get_strategy() -> Strategy:
    """The strategy in scope, or the default `OneDeviceStrategy` outside any scope."""
    return strategy_in_scope() or _default_strategy()


@functools.cache
def _default_strategy() -> OneDeviceStrategy:
    return OneDeviceStrategy()


register_default_strategy(_default_strategy)  # the default replica context's strategy


_set_scopes = threading.local()


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Make `strategy` current in this thread without a `with strategy.scope():` block, as
    `tf.distribute.experimental_set_strategy` does; `None` clears it. Replaces the
    strategy an earlier call set, and must not be called inside a strategy's scope."""
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a Strategy or None, got {type(strategy).__name__}")
    previous = getattr(_set_scopes, "scope", None)
    if scope_depth() > (previous is not None):
        raise RuntimeError(
            "experimental_set_strategy must not be called inside a strategy's scope; "
            "leave the `with strategy.scope():` block first"
        )
    if previous is not None:
        _set_scopes.scope = None
        previous.__exit__(None, None, None)
    if strategy is not None:
        _set_scopes.scope = strategy.scope()
        _set_scopes.scope.__enter__()
