"""The `torch.optim` hyperparameters a step takes as inputs instead of compiling in.

A `torch.optim.lr_scheduler` sets `param_groups[i]["lr"]` between steps, and OneCycleLR
also cycles SGD's and RMSprop's `momentum` or Adam's `betas[0]`. Compiled in as numbers,
each new value would compile the step again. For the optimizers in `TRACED`, a step binds
them to tensors holding traced values, so one program serves every value. Two things
make torch's own update code run on such tensors:

- a number argument given a tensor (`param.add_(grad, alpha=-lr)`,
  `addcdiv_(..., value=-lr)`) would be read back with `.item()`, which a traced value
  cannot do; while the update runs, those methods multiply by the tensor instead
  (`_tensor_scaled`);
- a comparison with 0 (`if momentum != 0:`) needs a Python bool: the bound tensor
  answers it from the value's sign, which stays in the compile key (`SignKnown`);
- Adagrad reads its step count back with `_get_value` (`.item()`), which under
  `torch.compile` returns the tensor itself; while the update runs, it does here too.

Other hyperparameters, and other optimizers' (ASGD's; Adamax's update does not run under
torchax at all), stay part of the compiled program: a new value compiles again.
Which optimizer takes which hyperparameter is checked against eager torch by
`tests/torch_models/test_traced_hyperparameters.py`.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import torch
import torchax.tensor

from xla_strategies.core.patching import patched

# A hyperparameter's place in a param group: (key,) or (key, index) for a tuple entry.
Place = tuple[Any, ...]

_LR, _MOMENTUM, _BETA1 = ("lr",), ("momentum",), ("betas", 0)
TRACED: dict[type, tuple[Place, ...]] = {
    torch.optim.SGD: (_LR, _MOMENTUM),
    torch.optim.Adam: (_LR, _BETA1),
    torch.optim.AdamW: (_LR, _BETA1),
    torch.optim.NAdam: (_LR, _BETA1),
    torch.optim.RAdam: (_LR, _BETA1),
    torch.optim.RMSprop: (_LR, _MOMENTUM),
    torch.optim.Adagrad: (_LR,),
    torch.optim.Adadelta: (_LR,),
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
    """`group` with each traced hyperparameter replaced by its sign, for the compile key
    (the bound tensor answers comparisons with 0 from it)."""
    group = dict(group)
    for place in traced_places(optimizer):
        _write(group, place, ("traced", _sign(group, place)))
    return group


@contextlib.contextmanager
def bound(optimizer: Any, values: tuple[tuple[Any, ...], ...], env: Any) -> Iterator[None]:
    """While active, the optimizer's traced hyperparameters are tensors holding `values`
    (traced arrays), and torch's number arguments take tensors (see the module
    docstring). The caller restores the param groups."""
    for group, group_values in zip(optimizer.param_groups, values, strict=True):
        for place, value in zip(traced_places(optimizer), group_values, strict=True):
            _write(group, place, SignKnown(value, env, _sign(group, place)))
    with contextlib.ExitStack() as stack:
        for method, argument in _NUMBER_ARGUMENTS.items():
            replace = lambda original, a=argument: _tensor_scaled(original, a)  # noqa: E731
            stack.enter_context(patched(torch.Tensor, method, replace))
        adagrad = importlib.import_module("torch.optim.adagrad")
        stack.enter_context(patched(adagrad, "_get_value", lambda _: _as_is))
        yield


class SignKnown(torchax.tensor.Tensor):
    """A traced scalar hyperparameter that compares with 0 as its value's sign did when
    the step was compiled (the sign is in the compile key)."""

    def __new__(cls, elem: Any, env: Any, sign: int) -> SignKnown:
        return super().__new__(cls, elem, env)

    def __init__(self, elem: Any, env: Any, sign: int) -> None:
        super().__init__(elem, env)
        self._sign = sign

    def _compared(self, other: Any, compare: Callable[[Any, Any], Any], name: str) -> Any:
        if isinstance(other, int | float) and other == 0:
            return compare(self._sign, 0)
        return getattr(super(), name)(other)

    def __eq__(self, other: Any) -> Any:
        return self._compared(other, operator.eq, "__eq__")

    def __ne__(self, other: Any) -> Any:
        return self._compared(other, operator.ne, "__ne__")

    def __gt__(self, other: Any) -> Any:
        return self._compared(other, operator.gt, "__gt__")

    def __lt__(self, other: Any) -> Any:
        return self._compared(other, operator.lt, "__lt__")

    __hash__ = torchax.tensor.Tensor.__hash__


# torch.Tensor methods whose number argument a traced hyperparameter reaches
_NUMBER_ARGUMENTS = {
    "add": "alpha",
    "add_": "alpha",
    "sub": "alpha",
    "sub_": "alpha",
    "addcmul_": "value",
    "addcdiv_": "value",
}


def _tensor_scaled(original: Callable[..., Any], argument: str) -> Callable[..., Any]:
    """`original`, except that a tensor given as its number `argument` multiplies the
    operand instead of being read back as a number: `x.add_(y, alpha=t)` is
    `x.add_(y * t)`, `x.addcdiv_(a, b, value=t)` is `x.add_(a / b * t)`."""
    name = original.__name__

    def method(self: torch.Tensor, *operands: Any, **kwargs: Any) -> Any:
        scale = kwargs.get(argument)
        if not isinstance(scale, torch.Tensor):
            return original(self, *operands, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != argument}
        if name == "addcmul_":
            operand = operands[0] * operands[1]
        elif name == "addcdiv_":
            operand = operands[0] / operands[1]
        else:
            operand = operands[0]
        combine = {"addcmul_": "add_", "addcdiv_": "add_"}.get(name, name)
        return getattr(torch.Tensor, combine)(self, operand * scale, **kwargs)

    return method


def _as_is(value: Any) -> Any:
    """torch's `_get_value` as under `torch.compile`: a tensor stays a tensor."""
    return value


def _sign(group: dict[str, Any], place: Place) -> int:
    """The sign of a hyperparameter's value now: what `SignKnown` answers comparisons with
    0 from, and so part of the compile key."""
    return int(np.sign(float(_read(group, place))))


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
