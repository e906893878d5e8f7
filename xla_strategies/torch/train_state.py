"""`TrainState`: a torch module's parameters, buffers and optimizer state as JAX arrays.

The state is a pytree of arrays, so a compiled step takes it and returns it like any JAX
training state, and `CheckpointManager` saves it. The module and the optimizer stay the
user's torch objects; the state only holds their values:

- `params`: `named_parameters()` by name (a tied weight once, under its first name);
- `buffers`: `named_buffers()` by name (BatchNorm running statistics). A buffer a step
  updates from its replica's batch comes back stacked per replica, as any per-replica
  state does, and the next step gives each replica its own row;
- `opt_state`: a `torch.optim` optimizer's `state` keyed as in its `state_dict()` (the
  index of the parameter across `param_groups`), or an optax optimizer's state;
- `rng`: the key torch's random operations (dropout) draw from inside a step;
- `hyperparams`: the `torch.optim` hyperparameters a step takes as inputs (the learning
  rate, and the momentum or `betas[0]` OneCycleLR cycles; `traced_hyperparameters.py`
  says which, for which optimizers), per param group. An lr_scheduler sets
  them on the optimizer between steps, so a state read outside a step (entering one, or
  saved) reads them from the optimizer as they are now; inside a step it holds the
  traced values it was given.

What the trace reads from the torch objects is part of the state's structure, so changing
it compiles the step again instead of running a stale program: each module's `training`
flag, each parameter's `requires_grad`, and every optimizer hyperparameter that is not
traced (a new learning rate compiles again only for optimizers that read it in Python).
"""

from __future__ import annotations

import collections
import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torchax.ops import mappings

from xla_strategies.core.layout import fold_stacked, is_stacked
from xla_strategies.torch.traced_hyperparameters import current_values, without_traced

_CHILDREN = ("params", "buffers", "opt_state", "rng", "hyperparams")


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True, eq=False)
class TrainState:
    """A torch module's training state, as a pytree of arrays; see the module docstring."""

    module: torch.nn.Module
    optimizer: Any  # a torch.optim.Optimizer, an optax.GradientTransformation, or None
    params: dict[str, Any]
    buffers: dict[str, Any]
    opt_state: Any
    rng: Any
    hyperparams: tuple = ()

    @classmethod
    def create(cls, module: torch.nn.Module, optimizer: Any = None, seed: int = 0) -> TrainState:
        """The state of `module` and `optimizer` as they are now (an optimizer's existing
        state, loaded from a torch checkpoint, is kept).

        Args:
            module: the `torch.nn.Module` to train.
            optimizer: a `torch.optim.Optimizer` over `module`'s parameters, an optax
                `GradientTransformation`, or None (no `train_step`).
            seed: seeds `rng`, which torch's random operations draw from in a step.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        params = {name: to_jax(p) for name, p in module.named_parameters()}
        buffers = {name: to_jax(b) for name, b in module.named_buffers()}
        if isinstance(optimizer, torch.optim.Optimizer):
            opt_state = _torch_optimizer_state(module, optimizer)
        elif optimizer is None:
            opt_state = None
        elif hasattr(optimizer, "init") and hasattr(optimizer, "update"):
            opt_state = optimizer.init(trainable(module, params))
        else:
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer, an optax GradientTransformation "
                f"or None, got {type(optimizer).__name__}"
            )
        return cls(module, optimizer, params, buffers, opt_state, jax.random.key(seed))

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)

    # pytree

    def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], Any]:
        values = {n: getattr(self, n) for n in _CHILDREN}
        values["hyperparams"] = _hyperparams(self)
        children = [(jax.tree_util.GetAttrKey(n), values[n]) for n in _CHILDREN]
        return children, (self.module, self.optimizer, _traced_settings(self))

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> TrainState:
        module, optimizer, _ = aux
        return cls(module, optimizer, *children)

    # torch's formats

    def state_dict(self) -> collections.OrderedDict[str, torch.Tensor]:
        """The module's `state_dict()` with this state's values, as CPU torch tensors.

        A buffer kept per replica is folded by `fold_stacked`: a floating one to the
        replicas' mean, as a checkpoint folds it; an integer one to its value, which must
        be every replica's.
        """
        values = {**self.params, **self.buffers}
        return collections.OrderedDict(
            (key, to_torch(_folded(values[name], key)))
            for key, name in _state_dict_names(self.module).items()
        )

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> TrainState:
        """A state whose params and buffers are `state_dict`'s (a module's `state_dict()`
        format); every name of this state must be in it, with its shape."""
        keys = {name: key for key, name in _state_dict_names(self.module).items()}
        current = {**self.params, **self.buffers}
        missing = [keys[n] for n in current if keys.get(n) not in state_dict]
        if missing:
            raise KeyError(f"state_dict has no entry for {missing}")
        loaded = {n: to_jax(state_dict[keys[n]]) for n in current}
        for name, old in current.items():
            shape = tuple(_folded(old, keys[name]).shape)
            if tuple(loaded[name].shape) != shape:
                raise ValueError(
                    f"state_dict[{keys[name]!r}] has shape {tuple(loaded[name].shape)}, "
                    f"the module's is {shape}"
                )
        return self.replace(
            params={n: loaded[n] for n in self.params},
            buffers={n: loaded[n] for n in self.buffers},
        )

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The torch optimizer's `state_dict()` with this state's values."""
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer_state_dict needs a torch.optim optimizer")
        saved = self.optimizer.state_dict()
        saved["state"] = {
            index: {k: to_torch(_folded(v, f"state[{index}][{k!r}]")) for k, v in entry.items()}
            for index, entry in self.opt_state.items()
        }
        return saved


def trainable(module: torch.nn.Module, params: dict[str, Any]) -> dict[str, Any]:
    """The entries of `params` whose parameter requires a gradient."""
    flags = dict((n, p.requires_grad) for n, p in module.named_parameters())
    return {name: value for name, value in params.items() if flags[name]}


def parameter_names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter `optimizer` updates, in its `state_dict()` order."""
    names = _names_by_identity(module)
    order = _in_order(optimizer)
    unknown = [i for i, p in enumerate(order) if id(p) not in names]
    if unknown:
        raise ValueError(
            f"optimizer updates parameters {unknown} (state_dict indices) that are not "
            "the module's; create the optimizer from module.parameters()"
        )
    return [names[id(p)] for p in order]


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """A copy: through dlpack the array would share the tensor's memory, and a later
    in-place update of the module (an eager forward) would change the state."""
    return mappings.t2j(tensor.detach().cpu(), use_dlpack=False)


def to_torch(array: Any) -> torch.Tensor:
    host = np.array(array)  # a writable copy of its own: torch may write to it
    if host.dtype == jnp.bfloat16:  # numpy knows bfloat16 only through ml_dtypes
        return torch.from_numpy(host.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(host)


def _torch_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    parameter_names(module, optimizer)  # every parameter is the module's
    return {
        index: {k: to_jax(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for index, p in enumerate(_in_order(optimizer))
        if (entry := optimizer.state.get(p))
    }


def _in_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in its `state_dict()` order (its state's indices)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names_by_identity(module: torch.nn.Module) -> dict[int, str]:
    """id(tensor) -> the state's name for it (a tied parameter's first name)."""
    names: dict[int, str] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        names.setdefault(id(tensor), name)
    return names


def _state_dict_names(module: torch.nn.Module) -> dict[str, str]:
    """Each `module.state_dict()` key -> the state's name for its tensor (a tied
    parameter's keys all name its first name)."""
    names = _names_by_identity(module)
    return {key: names[id(t)] for key, t in module.state_dict(keep_vars=True).items()}


def _traced_settings(state: TrainState) -> tuple:
    """What a trace reads from the torch objects, compared to reuse a compiled step. It
    runs on every call of a step, so it walks the modules once, reading each one's own
    parameters (`_parameters`, without `named_parameters`' name building)."""
    flags = tuple(
        (m.training, *(p.requires_grad for p in m._parameters.values() if p is not None))
        for m in state.module.modules()
    )
    groups = ()
    if isinstance(state.optimizer, torch.optim.Optimizer):
        groups = tuple(
            tuple(sorted((k, _hashable(v)) for k, v in group.items() if k != "params"))
            for group in map(partial(without_traced, state.optimizer), state.optimizer.param_groups)
        )
    return flags, groups


def _hyperparams(state: TrainState) -> tuple:
    """The traced hyperparameters to flatten: where the state holds concrete values (or
    none), the optimizer's as they are now, since the optimizer is where a scheduler sets
    them; anything else it holds (a step's traced values, `unflatten`'s placeholders) as
    it is."""
    held = jax.tree_util.tree_leaves(state.hyperparams)
    concrete = all(_is_concrete(v) for v in held)
    if concrete and isinstance(state.optimizer, torch.optim.Optimizer):
        return current_values(state.optimizer)
    return state.hyperparams


def _is_concrete(value: Any) -> bool:
    return isinstance(value, np.ndarray | jax.Array) and not isinstance(value, jax.core.Tracer)


def _hashable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.detach().cpu().reshape(-1).tolist()))
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _folded(array: Any, key: str) -> Any:
    """A per-replica (stacked) value as one value (`fold_stacked`); others as they are."""
    if not is_stacked(array):
        return array
    return fold_stacked(array, key)
