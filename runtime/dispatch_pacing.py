"""Pacing of asynchronous step dispatch on CPU devices that share a host's cores.

XLA's CPU runtime runs a multi-device program's per-device parts on one thread pool with
as many threads as devices (on a host with fewer cores), and each device admits 32
programs in flight; the 33rd launch blocks a pool thread until one finishes. When the
launches queued ahead of it wait in a collective's rendezvous for that very device, the
process deadlocks, and XLA aborts it after 40 s ("Expected 8 threads to join the
rendezvous, but only 7 of them arrived"). In plain JAX, 5000 tiny `psum` steps on 8 CPU
devices of a 2-core host aborted in every run when Python waited for a step's output every
64 calls or never, and in none when it waited every 32 calls or fewer.

So steps of a strategy whose CPU devices share cores wait, every `STEPS_BETWEEN_WAITS`
calls, for the previous call's outputs: a few steps still run ahead of Python, well below
the limit even with the small programs a call adds (placements, root copies). It costs
nothing measurable: the loop above took 1.24 s waiting every 4 calls, 1.28 s every 16 and
1.40 s every call. Accelerators are never paced.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax

STEPS_BETWEEN_WAITS = 4


class DispatchPacer:
    """Counts step calls; every `every` calls, waits for the outputs of the last one."""

    def __init__(self, every: int = STEPS_BETWEEN_WAITS) -> None:
        self._every = every
        self._lock = threading.Lock()
        self._calls = 0
        # weak references: the outputs stay the caller's to free
        self._last: list[weakref.ref] = []

    def before_dispatch(self) -> None:
        with self._lock:
            self._calls += 1
            if self._calls < self._every:
                return
            self._calls = 0
            # skip outputs freed since, or deleted by donation to another program
            pending = [a for r in self._last if (a := r()) is not None and not a.is_deleted()]
        jax.block_until_ready(pending)

    def after_dispatch(self, outputs: Sequence[Any]) -> None:
        """`outputs`: the call's flat outputs."""
        last = [weakref.ref(a) for a in outputs if isinstance(a, jax.Array)]
        with self._lock:
            self._last = last


# One per process: every strategy's programs share the devices' queues.
CPU_PACER = DispatchPacer()
