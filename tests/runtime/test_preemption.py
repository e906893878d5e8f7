"""PreemptionCheckpointHandler: a SIGTERM saves at the step it interrupted and exits with
the documented code; the restarted run finishes with no step lost or repeated, bitwise
equal to an uninterrupted run. Single process, and 2 processes x 4 devices."""

from __future__ import annotations

import os
import random
import re
import signal

import jax
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from tests.multiprocess import check, run_workers
from xla_strategies.demo import models

STEPS, SIGNAL_AT = 12, 5


def _train(tmp_path, strategy, sigterm_at=None):
    """Train to STEPS under the handler; returns (state, steps run here, exit code)."""
    graphdef, params = helpers.mlp()
    tx = optax.adam(1e-2)
    compiled = strategy.compile(models.mlp_train_step(graphdef, tx))
    ran = []

    def train_step(state, batch):
        *new, loss = compiled(state["params"], state["opt"], batch)
        ran.append(handler.total_run_calls + 1)
        if ran[-1] == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # handled after this step
        return {"params": new[0], "opt": new[1]}, loss

    iterator = iter(strategy.experimental_distribute_dataset(helpers.mlp_batches(STEPS)))
    manager = xs.CheckpointManager(tmp_path, strategy)
    with manager, xs.PreemptionCheckpointHandler(strategy, manager, iterator) as handler:
        state = handler.restore(
            jax.tree.map(strategy.replicate, {"params": params, "opt": tx.init(params)})
        )
        try:
            while handler.total_run_calls < STEPS:
                state, _ = handler.run(train_step, state, next(iterator))
        except SystemExit as exit:
            return None, ran, exit.code
    return state, ran, 0


def test_sigterm_saves_the_step_and_the_restart_finishes_exactly(tmp_path):
    strategy = xs.MirroredStrategy()
    straight, _, _ = _train(tmp_path / "straight", strategy)
    before = signal.getsignal(signal.SIGTERM)

    _, first, code = _train(tmp_path / "run", strategy, sigterm_at=SIGNAL_AT)
    assert code == xs.PREEMPTION_EXIT_CODE and first == list(range(1, SIGNAL_AT + 1))
    assert signal.getsignal(signal.SIGTERM) is before  # the handler gave the signal back
    resumed, second, code = _train(tmp_path / "run", xs.MirroredStrategy())
    assert code == 0 and second == list(range(SIGNAL_AT + 1, STEPS + 1))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_step_must_return_a_pair_and_an_existing_step_is_not_saved_again(tmp_path):
    strategy = xs.OneDeviceStrategy()
    state = strategy.replicate({"w": np.zeros(3, np.float32)})
    manager = xs.CheckpointManager(tmp_path, strategy, async_save=False)
    exits = []
    with xs.PreemptionCheckpointHandler(strategy, manager, exit_fn=lambda: exits.append(1)) as h:
        with pytest.raises(TypeError, match=r"must return a pair \(new_state, outputs\), got dict"):
            h.run(lambda s: s, state)
        h.total_run_calls = 4
        manager.save(4, state)  # the loop's own periodic save of this step
        os.kill(os.getpid(), signal.SIGTERM)
        h.save_checkpoint_if_preempted(state)
        h.save_checkpoint_if_preempted(state)  # handled once, not on every later step
    assert exits == [1] and h.preempted_at == 4 and manager.all_steps() == [4]
    manager.close()


def test_handler_rejects_no_signals(tmp_path):
    strategy = xs.OneDeviceStrategy()
    with pytest.raises(ValueError, match="signals must name at least one signal"):
        xs.PreemptionCheckpointHandler(
            strategy, xs.CheckpointManager(tmp_path, strategy), signals=()
        )


def _steps(worker) -> list[int]:
    return [int(n) for n in re.findall(r"^STEP (\d+)$", worker.output, re.MULTILINE)]


def _run_two(tmp_path, name, *extra, **options):
    argv = ["-m", "tests.workers.preemptible", "--dir", str(tmp_path / name)]
    argv += ["--out", str(tmp_path / f"{name}.npz"), "--steps", str(STEPS), *extra]
    return run_workers(argv, count=2, timeout=240, **options)


def _assert_preempted_then_finished(tmp_path, name, first, reference):
    for worker in first:
        assert worker.process.returncode == xs.PREEMPTION_EXIT_CODE, worker.output[-3000:]
    saved = {max(_steps(w)) for w in first}
    assert len(saved) == 1, f"workers stopped after different steps: {saved}"
    second = _run_two(tmp_path, name)
    check(second)
    (at,) = saved
    for before, after in zip(first, second, strict=True):
        assert f"RESUMED {at}" in after.output
        assert _steps(before) + _steps(after) == list(range(1, STEPS + 1))  # none lost/repeated
    result = np.load(tmp_path / f"{name}.npz")
    assert sorted(result) == sorted(reference)
    for key in reference:
        np.testing.assert_array_equal(result[key], reference[key], err_msg=key)


def test_two_workers_resume_bitwise_after_a_save_at_step_5(tmp_path):
    check(reference := _run_two(tmp_path, "straight"))
    assert _steps(reference[0]) == list(range(1, STEPS + 1))
    expected = dict(np.load(tmp_path / "straight.npz"))

    stopped = _run_two(tmp_path, "at5", "--sigterm-self-at", str(SIGNAL_AT))
    assert {max(_steps(w)) for w in stopped} == {SIGNAL_AT}
    _assert_preempted_then_finished(tmp_path, "at5", stopped, expected)

    at = random.randint(1, STEPS - 4)
    preempted = _run_two(
        tmp_path, "random", "--step-sleep", "0.05", kill=(1, at), kill_signal=signal.SIGTERM
    )
    assert all(max(_steps(w)) >= at for w in preempted), f"SIGTERM after step {at}"
    _assert_preempted_then_finished(tmp_path, "random", preempted, expected)
