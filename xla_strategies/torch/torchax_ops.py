"""Where torchax's op table computes something other than PyTorch, and what runs instead.

- BatchNorm in training mode (`aten.native_batch_norm`, `aten._native_batch_norm_legit`):
  torchax's lowering never writes the running statistics back, so a model trained under
  it keeps `running_mean == 0` and `running_var == 1` and evaluates wrongly, with no
  error. PyTorch's own decompositions (`torch._decomp`) run instead; they update the
  statistics in place, with the unbiased variance, as PyTorch does.
- Max pooling (`aten.max_pool{2,3}d_with_indices`): torchax's lowering builds a
  `reduce_window` with a traced initial value, which JAX cannot differentiate ("Linearization
  failed"), so no model with a MaxPool trains. The values are gathered at torchax's own
  indices instead, which is differentiable and sends each gradient to the element PyTorch
  sends it to.

The replacements are installed while a step is traced and the table is restored after
the last trace in any thread, so other torchax users in the process see it as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch._decomp import decomposition_table
from torchax.ops import jaten, ops_registry

from xla_strategies.core.patching import patched


def _max_pool_with_indices(inputs: Any, kernel_size: Any, *args: Any, **kwargs: Any) -> Any:
    frozen = jax.lax.stop_gradient(inputs)
    _, indices = jaten._aten_max_pool2d_with_indices(frozen, kernel_size, *args, **kwargs)
    lead = inputs.shape[: inputs.ndim - len(kernel_size)]
    flat = inputs.reshape(*lead, -1)
    picked = jnp.take_along_axis(flat, indices.reshape(*lead, -1), axis=-1)
    return picked.reshape(indices.shape), indices


_aten = torch.ops.aten
#: op -> (implementation, whether it is a JAX function; else it runs on torch tensors)
_CORRECTED: dict[Any, tuple[Callable[..., Any], bool]] = {
    _aten.native_batch_norm.default: (decomposition_table[_aten.native_batch_norm.default], False),
    _aten._native_batch_norm_legit.default: (
        decomposition_table[_aten._native_batch_norm_legit.default],
        False,
    ),
    _aten.max_pool2d_with_indices: (_max_pool_with_indices, True),
    _aten.max_pool3d_with_indices: (_max_pool_with_indices, True),
}


@contextlib.contextmanager
def corrected_ops(env: Any) -> Iterator[None]:
    """While active (in any thread), `env` runs the implementations above."""
    with contextlib.ExitStack() as stack:
        for op, (fn, is_jax) in _CORRECTED.items():
            operator = _operator(op, fn, is_jax)
            stack.enter_context(patched(env._ops, op, lambda _, new=operator: new))
        yield


def _operator(op: Any, fn: Callable[..., Any], is_jax: bool) -> Any:
    # (torchax's own override_op_definition cannot build an Operator in this release)
    return ops_registry.Operator(
        op,
        fn,
        is_jax_function=is_jax,
        is_user_defined=True,
        needs_env=False,
        is_view_op=False,
    )
