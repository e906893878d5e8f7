"""Training-state types the frontends know (checked without importing a frontend)."""

from __future__ import annotations

import sys
from typing import Any

_STATE_TYPES = (
    ("flax.training.train_state", "TrainState"),
    ("xla_strategies.torch.train_state", "TrainState"),
)


def is_state_type(value: Any) -> bool:
    """A training state type of a frontend the process has imported (never imports one)."""
    for module, name in _STATE_TYPES:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(value, cls):
            return True
    return False
