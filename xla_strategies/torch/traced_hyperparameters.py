"""The `torch.optim` hyperparameters a step takes as inputs instead of compiling in.

A `torch.optim.lr_scheduler` sets `param_groups[i]["lr"]` (and OneCycleLR Adam's
`betas[0]`) between steps. Compiled in as a number, each new value would compile the
step again. For the optimizers below, torch's own update reads these through tensor ops
when they are 0-dim tensors that require a gradient (its "differentiable
hyperparameter" path: SGD's `addcmul_(grad, lr, value=-1)`, Adam's capturable
`lr / bias_correction1`), so a step binds them to traced tensors and one program serves
every value. Other optimizers, and other hyperparameters (SGD's `momentum`, which torch
compares with 0 in Python), stay part of the compiled program: a new value compiles again.
Which optimizer reads which hyperparameter as a tensor is checked against eager torch by
`tests/torch_models/test_traced_hyperparameters.py`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

# A hyperparameter's place in a param group: (key,) or (key, index) for a tuple entry.
Place = tuple[Any, ...]

TRACED: dict[type, tuple[Place, ...]] = {
    torch.optim.SGD: (("lr",),),
    torch.optim.Adam: (("lr",), ("betas", 0)),
    torch.optim.AdamW: (("lr",), ("betas", 0)),
    torch.optim.NAdam: (("lr",),),
    torch.optim.RAdam: (("lr",),),
}


def traced_places(optimizer: Any) -> tuple[Place, ...]:
    """The hyperparameters of `optimizer` a step traces (by exact type: a subclass may
    read them in Python)."""
    return TRACED.get(type(optimizer), ())


def current_values(optimizer: Any) -> tuple[tuple[np.ndarray, ...], ...]:
    """Each param group's traced hyperparameters as they are now, as scalars of JAX's
    default float type."""
    dtype = np.float64 if jax.config.jax_enable_x64 else np.float32
    places = traced_places(optimizer)
    return tuple(
        tuple(np.asarray(float(_read(group, place)), dtype) for place in places)
        for group in optimizer.param_groups
    )


def without_traced(optimizer: Any, group: dict[str, Any]) -> dict[str, Any]:
    """`group` with its traced hyperparameters left out (None), for the compile key."""
    group = dict(group)
    for place in traced_places(optimizer):
        _write(group, place, None)
    return group


def bind(optimizer: Any, values: tuple[tuple[Any, ...], ...], to_tensor: Any) -> None:
    """Set the optimizer's traced hyperparameters to tensors holding `values` (traced
    arrays; `to_tensor` wraps one as a torch tensor) for the update that follows."""
    for group, group_values in zip(optimizer.param_groups, values, strict=True):
        for place, value in zip(traced_places(optimizer), group_values, strict=True):
            tensor = to_tensor(value)
            tensor.requires_grad_(True)  # torch's tensor-op path (see the module docstring)
            _write(group, place, tensor)


def _read(group: dict[str, Any], place: Place) -> Any:
    value = group[place[0]]
    return value[place[1]] if len(place) > 1 else value


def _write(group: dict[str, Any], place: Place, value: Any) -> None:
    if len(place) == 1:
        group[place[0]] = value
        return
    entry = list(group[place[0]])
    entry[place[1]] = value
    group[place[0]] = tuple(entry)
