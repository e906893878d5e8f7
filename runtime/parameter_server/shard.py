"""A parameter-server task: holds its pieces of the variables and applies the optimizer to
them as gradients arrive, one push at a time (a Ray actor runs one call at a time)."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import numpy as np

from xla_strategies.core.errors import UnavailableError

# A PS task that does not answer within this long counts as lost; one that Ray reports
# temporarily unavailable is asked again this many times (1, 2, 4 s apart).
PS_TIMEOUT_SECONDS = 300
UNAVAILABLE_RETRIES = 3


class ParameterShard:
    """PS task `task_id`: pull the current pieces, push gradients for them.

    Each push names the closure step that computed it, so a closure retried after its
    worker died updates the variables at most once per step it runs. Staleness is how many
    updates were applied between the pull a gradient was computed from and its own
    application.
    """

    def __init__(self, task_id: int, pieces: dict[str, np.ndarray], optimizer: Any) -> None:
        import jax
        import optax

        self.task_id = task_id
        self.params = {k: jax.numpy.asarray(v) for k, v in pieces.items()}
        self.optimizer = optimizer
        self.opt_state = optimizer.init(self.params)
        self.version = 0
        self.staleness: Counter[int] = Counter()
        self.applied: set[Any] = set()

        def update(grads, opt_state, params):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._update = jax.jit(update)

    def pull(self) -> tuple[int, dict[str, np.ndarray]]:
        return self.version, {k: np.asarray(v) for k, v in self.params.items()}

    def push(self, grads: dict[str, np.ndarray], pulled_version: int, push_id: Any) -> bool:
        """Apply `grads`; False when this push was applied already (a retried closure)."""
        if push_id in self.applied:
            return False
        self.params, self.opt_state = self._update(grads, self.opt_state, self.params)
        self.staleness[self.version - pulled_version] += 1
        self.version += 1
        self.applied.add(push_id)
        return True

    def stats(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "version": self.version, "staleness": dict(self.staleness)}

    def pid(self) -> int:
        return os.getpid()


def call_shards(
    shards: list[Any],
    method: str,
    args: list[tuple] | None = None,
    timeout: float = PS_TIMEOUT_SECONDS,
) -> list[Any]:
    """`method(*args[i])` on every PS task `shards[i]` at once; their results in order. A
    task that is gone or silent is an `UnavailableError` naming it."""
    import ray

    args = args if args is not None else [()] * len(shards)
    refs = [getattr(s, method).remote(*a) for s, a in zip(shards, args, strict=True)]
    results = []
    for task, (ref, call_args) in enumerate(zip(refs, args, strict=True)):
        for attempt in range(UNAVAILABLE_RETRIES + 1):
            try:
                results.append(ray.get(ref, timeout=timeout))
                break
            except ray.exceptions.ActorUnavailableError:
                # Ray's word for "maybe back soon"; pulls and (deduplicated) pushes can be
                # sent again.
                if attempt == UNAVAILABLE_RETRIES:
                    raise _lost(task, "ActorUnavailableError") from None
                time.sleep(2**attempt)
                ref = getattr(shards[task], method).remote(*call_args)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                raise _lost(task, type(exc).__name__) from None
    return results


def _lost(task: int, why: str) -> UnavailableError:
    return UnavailableError(f"parameter server task ps:{task} is unavailable ({why})")
