"""A worker task: runs scheduled functions; a step pulls the variables, computes gradients
on the worker's local devices (synchronously, with the compiler's passes) and pushes them."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xla_strategies.runtime.parameter_server.shard import call_shards


@dataclass
class _Closure:
    """The closure a worker is running: steps it takes push under `closure_id/pushed`."""

    worker: Worker
    closure_id: Any
    pushed: int = 0


# The closure this thread is running, if any (one per thread, not per process).
_running: contextvars.ContextVar[_Closure | None] = contextvars.ContextVar(
    "running_closure", default=None
)


class Worker:
    """Worker task `index`. `shards` are the PS actors, `placement` says which piece is
    where, and `make_strategy` (the parameter-server strategy passes `MirroredStrategy`)
    gives the strategy that runs the worker's functions on its devices."""

    def __init__(
        self, index: int, shards: list[Any], placement: Any, make_strategy: Callable[[], Any]
    ) -> None:
        self.index, self.shards, self.placement = index, shards, placement
        self.strategy = make_strategy()
        self.iterators: dict[str, Any] = {}
        self._steps: dict[str, Any] = {}

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, closure_id: Any) -> Any:
        token = _running.set(_Closure(self, closure_id))
        try:
            return fn(
                *(self.local(a) for a in args), **{k: self.local(v) for k, v in kwargs.items()}
            )
        finally:
            _running.reset(token)

    def local(self, value: Any) -> Any:
        """This worker's own object for a per-worker value (its dataset iterator)."""
        return value.local(self) if hasattr(value, "local") else value

    def gradient_step(self, uid: str, grad_fn: Callable[..., Any], batch: Any) -> Any:
        import jax
        from jax.sharding import NamedSharding

        # Each step of each closure updates the variables once, however often it is retried.
        closure = _running.get()  # set by `run`; PSStep refuses calls outside it
        push_id = f"{closure.closure_id}/{closure.pushed}"
        closure.pushed += 1
        versions, parts = zip(*call_shards(self.shards, "pull"), strict=True)
        if uid not in self._steps:
            self._steps[uid] = self.strategy.compile(grad_fn)
        params = self.strategy.replicate(self.placement.join(list(parts)))
        split = NamedSharding(self.strategy.mesh, self.strategy.input_spec(True))
        grads, aux = self._steps[uid](params, jax.device_put(batch, split))
        grad_parts = self.placement.split(jax.tree.map(np.asarray, grads))
        pushes = [(g, v, push_id) for g, v in zip(grad_parts, versions, strict=True)]
        call_shards(self.shards, "push", pushes)
        return jax.tree.map(np.asarray, aux)

    def pid(self) -> int:
        return os.getpid()


class PSStep:
    """What `ParameterServerStrategy.compile(grad_fn)` returns: call it with a batch inside a
    scheduled function. `grad_fn(params, batch) -> (grads, aux)` is a per-replica step, as
    for MirroredStrategy; `grads` is shaped like the variables."""

    def __init__(self, grad_fn: Callable[..., Any]) -> None:
        import uuid

        self.grad_fn = grad_fn
        self.uid = uuid.uuid4().hex  # workers cache their compiled program under it

    def __call__(self, batch: Any) -> Any:
        closure = _running.get()
        if closure is None:
            raise RuntimeError(
                "a ParameterServerStrategy step runs on a worker: call it inside a function "
                "given to coordinator.schedule"
            )
        return closure.worker.gradient_step(self.uid, self.grad_fn, batch)
