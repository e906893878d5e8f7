"""Where torchax's op table computes something other than PyTorch, and what runs instead.

torchax lowers `aten.native_batch_norm` and `aten._native_batch_norm_legit` (BatchNorm in
training mode) to JAX code that never writes the running statistics back: a model trained
under it keeps `running_mean == 0` and `running_var == 1` and evaluates wrongly, with no
error. While a step is traced those two ops run PyTorch's own decompositions instead
(`torch._decomp`), which update the running statistics in place, with the unbiased
variance as PyTorch does. The table is restored afterwards: other torchax users in the
process see it as it was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch._decomp import decomposition_table
from torchax.ops import ops_registry

_CORRECTED = (
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default,
)

_lock = threading.Lock()
_users = [0]


@contextlib.contextmanager
def corrected_ops(env: Any) -> Iterator[None]:
    """While active (in any thread), `env` runs PyTorch's decompositions of the ops above."""
    with _lock:
        if _users[0] == 0:
            env._xla_strategies_saved = {op: env._ops.pop(op, None) for op in _CORRECTED}
            # (torchax's own override_op_definition builds an Operator it cannot build)
            for op in _CORRECTED:
                env._ops[op] = ops_registry.Operator(
                    op,
                    decomposition_table[op],
                    is_jax_function=False,
                    is_user_defined=True,
                    needs_env=False,
                    is_view_op=False,
                )
        _users[0] += 1
    try:
        yield
    finally:
        with _lock:
            _users[0] -= 1
            if _users[0] == 0:
                for op, original in env.__dict__.pop("_xla_strategies_saved").items():
                    if original is None:
                        env._ops.pop(op, None)
                    else:
                        env._ops[op] = original
