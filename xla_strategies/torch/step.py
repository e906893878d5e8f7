"""Running torch code inside a compiled step: the forward, the gradient, the update.

`train_step(state, loss_fn, *batch)` is one optimizer step of a loss written in torch:

1. torchax runs `loss_fn(module, *batch)` on JAX values, with the module's parameters and
   buffers swapped for the state's (`torch.func.functional_call`'s reparametrization, so
   `loss_fn` may call any method or submodule of the module);
2. `jax.value_and_grad` differentiates it, so the gradient is a JAX gradient and the
   strategy's reduction (MEAN by default) applies to it as it does to a JAX step's;
3. the optimizer updates the parameters: a `torch.optim` optimizer runs its own `step()`
   on the traced tensors (see `optimizer_update.py`), an optax one its `update`.

Buffers the forward updates in place (BatchNorm's running statistics) come back in the
new state; torch's random operations (dropout) draw from the state's `rng`, folded with
the replica's id so that replicas draw different masks, and advanced every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torchax
from torch.nn.utils.stateless import _reparametrize_module

from xla_strategies.core.context import get_replica_context
from xla_strategies.torch.optimizer_update import apply_optimizer
from xla_strategies.torch.sync_batch_norm import synced_batch_norm
from xla_strategies.torch.torchax_ops import corrected_ops
from xla_strategies.torch.train_state import TrainState, trainable


def train_step(
    state: TrainState,
    loss_fn: Callable[..., Any],
    *batch: Any,
    has_aux: bool = False,
    max_grad_norm: float | None = None,
) -> tuple[Any, ...]:
    """One optimizer step of `loss_fn(module, *batch)`, a scalar torch loss.

    Where eager torch calls `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`
    between `loss.backward()` and `optimizer.step()`, pass `max_grad_norm=max_norm`: the
    gradients (reduced across the replicas) are scaled as torch's function scales them.
    Inside `loss_fn` there are no gradients yet, so calling it there is an error.

    Args:
        state: the `TrainState` of the module and its optimizer.
        loss_fn: torch code: called with the module (its parameters and buffers the
            state's) and the batch as torch tensors; returns the loss, or `(loss, aux)`
            with `has_aux=True`.
        *batch: the step's arrays (JAX arrays; torch sees them as torch tensors).
        has_aux: whether `loss_fn` returns `(loss, aux)`.
        max_grad_norm: clip the gradients to this global L2 norm before the optimizer
            step, as `torch.nn.utils.clip_grad_norm_` does; None: no clipping.

    Returns:
        `(new_state, loss)`, or `(new_state, loss, aux)` with `has_aux`, as JAX values.
    """
    if state.optimizer is None:
        raise ValueError("train_step needs a state created with an optimizer")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
    rng, step_key = jax.random.split(state.rng)

    def loss_of(params: dict[str, Any]) -> tuple[Any, tuple[Any, Any]]:
        everything = {**state.params, **params}
        with _drawing_from(step_key), _no_gradients_to_clip():
            out, buffers = _call(state.module, everything, state.buffers, loss_fn, batch)
        loss, aux = out if has_aux else (out, None)
        _check_scalar(loss)
        return loss, (buffers, aux)

    grad_of = jax.value_and_grad(loss_of, has_aux=True)
    (loss, (buffers, aux)), grads = grad_of(trainable(state.module, state.params))
    if max_grad_norm is not None:
        grads = _clip_by_global_norm(grads, max_grad_norm)
    params, opt_state = apply_optimizer(state, grads)
    new_state = state.replace(params=params, buffers=buffers, opt_state=opt_state, rng=rng)
    return (new_state, loss, aux) if has_aux else (new_state, loss)


def apply(state: TrainState, *inputs: Any, method: Callable[..., Any] | None = None) -> Any:
    """The module's output on `inputs` with the state's values: `module(*inputs)`, or
    `method(module, *inputs)`. Buffer updates (a module left in training mode) are dropped:
    evaluate in `module.eval()` mode, and train with `train_step`. Outside a compiled step
    the inputs may be numpy arrays or torch CPU tensors, as eager torch takes them."""
    call = method or (lambda module, *args: module(*args))
    inputs = jax.tree.map(_as_jax, inputs)
    with _drawing_from(state.rng):
        out, _ = _call(state.module, state.params, state.buffers, call, inputs)
    return out


def _call(
    module: torch.nn.Module,
    params: dict[str, Any],
    buffers: dict[str, Any],
    fn: Callable[..., Any],
    args: tuple,
) -> tuple[Any, dict[str, Any]]:
    """`fn(module, *args)` in torch on JAX values; its result and the buffers after it."""
    env = torchax.default_env()
    with env, corrected_ops(env), synced_batch_norm():
        tensors = env.j2t_iso({**params, **buffers})
        torch_args = env.j2t_iso(args)
        with _reparametrize_module(module, tensors, tie_weights=True):
            out = fn(module, *torch_args)
        # an in-place update (running_mean.mul_) rebinds the torchax tensor's value
        return env.t2j_iso(out), env.t2j_iso({name: tensors[name] for name in buffers})


@contextlib.contextmanager
def _drawing_from(key: Any) -> Iterator[None]:
    """torch's random operations draw from `key`, folded with this replica's id."""
    context = get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        key = jax.random.fold_in(key, context.replica_id_in_sync_group)
    env = torchax.default_env()
    if not isinstance(getattr(env._property, "content", []), list):
        # torchax 0.0.13 keeps one property per thread and restores it after the override
        with env.override_property(prng=key):
            yield
        return
    # torchax 0.0.6 keeps its key in a per-thread stack of properties; push ours for the
    # trace and pop it after, so no traced key outlives the step.
    if not getattr(env._property, "content", None):  # a thread torchax has not run in
        env._property.content = [torchax.tensor.RuntimeProperty(None, None, None)]
    stack = env._property.content
    pushed = env.param.override(prng=key)
    stack.append(pushed)
    try:
        yield
    finally:
        stack.remove(pushed)


def _as_jax(x: Any) -> Any:
    """A numpy array or a torch tensor (not one torchax traces) as a JAX array."""
    if isinstance(x, torch.Tensor) and not isinstance(x, torchax.tensor.Tensor):
        return jnp.asarray(x.detach().cpu().numpy())
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    return x


def _clip_by_global_norm(grads: dict[str, Any], max_norm: float) -> dict[str, Any]:
    """torch's `clip_grad_norm_`: scale every gradient by max_norm / (norm + 1e-6) where
    that is below 1 (the norm over all of them, in float32 or wider)."""
    leaves = jax.tree.leaves(grads)
    wide = jnp.promote_types(jnp.float32, jnp.result_type(*leaves)) if leaves else jnp.float32
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(wide))) for g in leaves))
    scale = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)


@contextlib.contextmanager
def _no_gradients_to_clip() -> Iterator[None]:
    """torch's gradient clipping, called while the loss is traced (where eager torch has no
    gradients either), raises instead of silently clipping nothing."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "torch.nn.utils.clip_grad_norm_ / clip_grad_value_ called inside loss_fn: no "
            "gradients exist there, so it would clip nothing. Pass max_grad_norm=... to "
            "xst.train_step, which clips the gradients before the optimizer step"
        )

    utils, clip = torch.nn.utils, torch.nn.utils.clip_grad
    names = ("clip_grad_norm_", "clip_grad_value_")
    saved = [(owner, name, getattr(owner, name)) for owner in (utils, clip) for name in names]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _check_scalar(loss: Any) -> None:
    if getattr(loss, "shape", None) != ():
        raise ValueError(
            f"loss_fn must return a scalar loss, got shape {getattr(loss, 'shape', None)} "
            f"({type(loss).__name__}); reduce it with .mean() or .sum()"
        )
