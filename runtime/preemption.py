"""`PreemptionCheckpointHandler`: on SIGTERM, every worker saves at the same step and exits.

Cloud TPU VMs (and most schedulers) send SIGTERM some seconds before taking a machine
away. The handler only records the signal; the training loop stays in charge. After
each step the workers agree whether any of them was signalled (a 4-byte reduction among
one device per process in multi-process runs, a flag read otherwise), so all of them stop
after the same step, save that step, and exit with `PREEMPTION_EXIT_CODE`. A restarted
run restores that checkpoint and carries on: no step is lost and none is repeated.

    with xs.PreemptionCheckpointHandler(strategy, manager, dataset_iterator=it) as handler:
        state = handler.restore(initial_state)
        while handler.total_run_calls < total_steps:
            state, loss = handler.run(train_step, state, next(it))  # (new_state, outputs)
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from xla_strategies.core.strategy_like import StrategyLike
    from xla_strategies.runtime.checkpoint import CheckpointManager

# What a preempted worker exits with, so a supervisor can tell "restart me" from a crash.
PREEMPTION_EXIT_CODE = 42


@dataclass(frozen=True)
class TerminationConfig:
    """How a platform announces a termination, as
    `tf.distribute.experimental.TerminationConfig`.

    Attributes:
        termination_watcher_fn: called after every step; True means "about to be taken
            away", as a signal does (for platforms that announce it some other way).
        exit_fn: called after the save instead of exiting.
        grace_period: seconds between the notice and the termination. Kept for reading
            back: the save always starts after the step in flight, whatever the grace.
        save_fn: called (no arguments) instead of the checkpoint manager's save.
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], Any] | None = None
    grace_period: float | None = None
    save_fn: Callable[[], Any] | None = None


class PreemptionCheckpointHandler:
    """Save a checkpoint and exit when any worker is told to stop.

    Args:
        strategy: the strategy the loop trains with.
        checkpoint_manager: an `xs.CheckpointManager`; its steps count completed `run` calls.
        dataset_iterator: the input iterator whose position is saved with the state.
        exit_code: the code a preempted worker exits with.
        signals: the signals that mean "preempted" (SIGTERM by default).
        exit_fn: called instead of `sys.exit(exit_code)` after the save, e.g. in a
            notebook that must not exit.
        termination_config: tf.distribute's `TerminationConfig`; its `exit_fn` is used
            when `exit_fn` is not given.
    """

    def __init__(
        self,
        strategy: StrategyLike,
        checkpoint_manager: CheckpointManager,
        dataset_iterator: Any = None,
        exit_code: int = PREEMPTION_EXIT_CODE,
        signals: tuple[int, ...] = (signal.SIGTERM,),
        exit_fn: Callable[[], Any] | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        if not signals:
            raise ValueError("signals must name at least one signal")
        self.termination_config = termination_config or TerminationConfig()
        exit_fn = exit_fn or self.termination_config.exit_fn
        self.strategy = strategy
        self.checkpoint_manager = checkpoint_manager
        self.dataset_iterator = dataset_iterator
        self.exit_code = exit_code
        self.signals = tuple(signals)
        self._exit_fn = exit_fn or (lambda: sys.exit(exit_code))
        self._signalled = False
        self._previous: dict[int, Any] = {}
        self.total_run_calls = 0
        self.preempted_at: int | None = None
        self._agree: Callable[[bool], bool] | None = None
        for signum in self.signals:  # from construction on, as tf.distribute's handler does
            self._previous[signum] = signal.signal(signum, self._on_signal)

    # -- the training loop's view -------------------------------------------------------

    def restore(self, target: Any) -> Any:
        """The latest checkpoint's state (shaped and typed like `target`), or `target`
        itself when there is none; `total_run_calls` becomes that checkpoint's step."""
        step = self.checkpoint_manager.latest_step()
        if step is None:
            self.total_run_calls = 0
            return target
        self.total_run_calls = step
        return self.checkpoint_manager.restore(
            step, target=target, dataset_iterator=self.dataset_iterator
        )

    def run(self, step_fn: Callable[..., Any], state: Any, *args: Any, **kwargs: Any) -> Any:
        """`step_fn(state, *args, **kwargs)`, which returns `(new_state, outputs)`; then, if
        any worker was signalled, save `new_state` and exit. Returns what `step_fn` did."""
        out = step_fn(state, *args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "step_fn must return a pair (new_state, outputs), got "
                f"{type(out).__name__}{f' of {len(out)}' if isinstance(out, tuple) else ''}"
            )
        self.total_run_calls += 1
        self.save_checkpoint_if_preempted(out[0])
        return out

    def save_checkpoint_if_preempted(self, state: Any) -> None:
        """For loops that count steps themselves: call once per step, after it, with the
        state and `total_run_calls` already advanced."""
        if not self._any_worker_signalled():
            return
        self._signalled = False  # handled, if exit_fn returns
        self.preempted_at = step = self.total_run_calls
        manager = self.checkpoint_manager
        manager.wait_until_finished()
        save_fn = self.termination_config.save_fn
        if save_fn is not None:
            save_fn()
        elif step not in manager.all_steps():  # a periodic save may have written it already
            manager.save(step, state, self.dataset_iterator, force=True)
            manager.wait_until_finished()
        self._exit_fn()

    def _any_worker_signalled(self) -> bool:
        watcher = self.termination_config.termination_watcher_fn
        if watcher is not None and watcher():
            self._signalled = True
        if jax.process_count() == 1:
            return self._signalled
        # Every process calls this after the same step, so all of them see the same answer.
        if self._agree is None:
            self._agree = _agreement()
        return self._agree(self._signalled)

    # -- signals --------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled = True  # acted on after the step in flight

    def close(self) -> None:
        """Give the signals back to their previous handlers."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionCheckpointHandler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _agreement() -> Callable[[bool], bool]:
    """`agree(flag)`: whether any process's flag is set. One device per process takes part,
    so the collective has as many members as there are processes, not devices."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    firsts = {}
    for device in jax.devices():
        firsts.setdefault(device.process_index, device)
    mesh = Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("process",))
    spread = NamedSharding(mesh, PartitionSpec("process"))
    any_set = jax.jit(lambda flags: flags.max(), out_shardings=NamedSharding(mesh, PartitionSpec()))

    def agree(flag: bool) -> bool:
        local = np.full((1,), int(flag), np.int32)
        return bool(any_set(jax.make_array_from_process_local_data(spread, local)))

    return agree
