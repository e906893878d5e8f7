"""`xs.get_strategy()`: the strategy in scope, or a one-device default, as in tf.distribute.

Kept apart from `context.py` so that the replica context, which every compiled step uses,
depends on no strategy class.
"""

from __future__ import annotations

import functools

from xla_strategies.context import strategy_in_scope
from xla_strategies.one_device import OneDeviceStrategy
from xla_strategies.strategy import Strategy


def get_strategy() -> Strategy:
    """The strategy in scope, or the default `OneDeviceStrategy` outside any scope."""
    return strategy_in_scope() or _default_strategy()


@functools.cache
def _default_strategy() -> OneDeviceStrategy:
    return OneDeviceStrategy()
