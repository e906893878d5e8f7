"""The optimizer's update inside a traced step: a `torch.optim` optimizer's own `step()`,
or an optax `update`.

A `torch.optim` optimizer runs unchanged on torchax tensors that hold the traced values:
for the duration of one `step()` its `param_groups` hold those tensors (with their `.grad`
set) and its `state` holds the traced optimizer state; both are put back afterwards, so
the user's optimizer object is as it was. Two of its switches are set for that call:
`foreach=False`, since torchax has no lowering of the `_foreach_*` kernels, and
`capturable=True` where the optimizer has it (Adam, AdamW, ...), which keeps the step
count a tensor instead of reading it back with `.item()`; both compute the same update.
The learning rate (and what else a scheduler changes) is bound to the step's traced input
(`traced_hyperparameters.py`), so a scheduler's new value does not compile again.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torchax

from xla_strategies.torch.traced_hyperparameters import bound, current_values
from xla_strategies.torch.train_state import TrainState, parameter_names

# Switches the traced step needs, applied only while it runs (see the module docstring).
_TRACED_SWITCHES = {"foreach": False, "capturable": True, "fused": None}


def apply_optimizer(state: TrainState, grads: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """New params and optimizer state from `grads` (by parameter name)."""
    if isinstance(state.optimizer, torch.optim.Optimizer):
        return _torch_optim_update(state, grads)
    import optax

    params = {name: state.params[name] for name in grads}  # the trainable ones
    updates, opt_state = state.optimizer.update(grads, state.opt_state, params)
    return {**state.params, **optax.apply_updates(params, updates)}, opt_state


def _torch_optim_update(state: TrainState, grads: dict[str, Any]) -> tuple[dict, dict]:
    optimizer = state.optimizer
    names = parameter_names(state.module, optimizer)
    env = torchax.default_env()
    with env:
        tensors = [env.j2t_iso(state.params[name]) for name in names]
        for tensor, name in zip(tensors, names, strict=True):
            tensor.grad = env.j2t_iso(grads[name]) if name in grads else None
        opt_state = {i: env.j2t_iso(entry) for i, entry in state.opt_state.items()}
        hyperparams = state.hyperparams or current_values(optimizer)
        with (
            _bound(optimizer, tensors, opt_state),
            bound(optimizer, hyperparams, env),
            _scalars_as_wide_as(tensors),
        ):
            optimizer.step()
            new_state = {
                i: dict(optimizer.state[t]) for i, t in enumerate(tensors) if t in optimizer.state
            }
        params = dict(state.params)
        params.update((name, tensor) for name, tensor in zip(names, tensors, strict=True))
        return env.t2j_iso(params), env.t2j_iso(new_state)


@contextlib.contextmanager
def _scalars_as_wide_as(tensors: list) -> Iterator[None]:
    """Torch's default dtype as wide as the widest float parameter while the optimizer
    steps. With `capturable=True` torch keeps the step count a tensor of the default
    dtype and computes the bias corrections from it; eager torch reads it back as a
    Python float (double). A float32 count rounds a float64 model's every update."""
    floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
    wide = max(floats, key=lambda d: torch.finfo(d).bits, default=None)
    saved = torch.get_default_dtype()
    if wide is None or torch.finfo(wide).bits <= torch.finfo(saved).bits:
        yield
        return
    torch.set_default_dtype(wide)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def _bound(optimizer: torch.optim.Optimizer, tensors: list, opt_state: dict) -> Iterator[None]:
    """`optimizer` steps `tensors` from `opt_state` (keyed by state_dict index)."""
    saved_state = optimizer.state
    saved_groups = [dict(group) for group in optimizer.param_groups]
    position = 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        group["params"] = tensors[position : position + count]
        position += count
        group.update((k, v) for k, v in _TRACED_SWITCHES.items() if k in group)
    optimizer.state = collections.defaultdict(
        dict, {tensors[i]: dict(entry) for i, entry in opt_state.items()}
    )
    try:
        yield
    finally:
        optimizer.state = saved_state
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            group.clear()
            group.update(saved)
