"""Checkpoints: exact resume, restore under another strategy or replica count, bad input,
interrupted and refused saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from xla_strategies.demo import models
from xla_strategies.runtime.checkpoint import CheckpointError, CheckpointManager

STEPS, SAVE_AT = 10, 5


def _setup():
    graphdef, params = helpers.mlp()
    tx = optax.adam(1e-2)
    return models.mlp_train_step(graphdef, tx), params, tx


def _run(strategy, step_fn, state, iterator, steps):
    step = strategy.compile(step_fn)
    seen = []
    for _ in range(steps):
        batch = next(iterator)
        seen.append(np.asarray(batch["y"]).tolist())
        *state, _ = step(*state, batch)
    return state, seen


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    step_fn, params, tx = _setup()
    batches = helpers.mlp_batches(STEPS)
    strategy = xs.MirroredStrategy()

    fresh = strategy.replicate(params), strategy.replicate(tx.init(params))
    straight, straight_seen = _run(
        strategy, step_fn, fresh, iter(strategy.experimental_distribute_dataset(batches)), STEPS
    )

    first = iter(strategy.experimental_distribute_dataset(batches))
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    state, seen = _run(strategy, step_fn, state, first, SAVE_AT)
    with CheckpointManager(tmp_path, strategy) as manager:
        assert manager.save(SAVE_AT, {"params": state[0], "opt": state[1]}, first)
        manager.wait_until_finished()
    first.close()

    restarted = xs.MirroredStrategy()  # a new process would build everything again
    with CheckpointManager(tmp_path, restarted) as manager:
        assert manager.latest_step() == SAVE_AT
        second = iter(restarted.experimental_distribute_dataset(batches))
        restored = manager.restore(
            target={"params": params, "opt": tx.init(params)}, dataset_iterator=second
        )
    state, later = _run(
        restarted, step_fn, (restored["params"], restored["opt"]), second, STEPS - SAVE_AT
    )
    assert seen + later == straight_seen  # the same batches, none skipped or repeated
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_under_another_strategy_or_replica_count(tmp_path):
    _, params, tx = _setup()
    mirrored = xs.MirroredStrategy()
    state = {"params": mirrored.replicate(params), "opt": mirrored.replicate(tx.init(params))}
    packed = {"async_save": False, "ocdbt": True, "compression": True}  # not the default format
    with CheckpointManager(tmp_path, mirrored, **packed) as manager:
        manager.save(1, state)
    expected = jax.tree.map(np.asarray, state)
    strategies = (
        xs.OneDeviceStrategy(),
        xs.MirroredStrategy(devices=[0, 1, 2, 3]),
        xs.CentralStorageStrategy(parameter_device=2),
    )
    for strategy in strategies:
        with CheckpointManager(tmp_path, strategy) as manager:
            restored = manager.restore(target={"params": params, "opt": tx.init(params)})
        for leaf in jax.tree.leaves(restored):
            assert leaf.sharding == strategy.state_sharding(), strategy
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), expected)


def test_a_tuple_state_round_trips(tmp_path):
    _, params, tx = _setup()
    strategy = xs.MirroredStrategy()
    state = (strategy.replicate(params), strategy.replicate(tx.init(params)))
    with CheckpointManager(tmp_path, strategy, async_save=False) as manager:
        manager.save(7, state)
        restored = manager.restore(target=(params, tx.init(params)))
    assert isinstance(restored, tuple) and len(restored) == 2
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), state)


def test_bad_input_names_the_path(tmp_path):
    _, params, tx = _setup()
    strategy = xs.OneDeviceStrategy()
    target = {"params": params, "opt": tx.init(params)}
    with CheckpointManager(tmp_path / "empty", strategy) as manager:
        with pytest.raises(CheckpointError, match=r"no checkpoint .* in .*empty \(steps: none\)"):
            manager.restore(target=target)
    with CheckpointManager(tmp_path / "run", strategy, async_save=False) as manager:
        manager.save(3, target)
        with pytest.raises(
            CheckpointError, match=r"structure differs .*3; only in the checkpoint: \['opt/0/count'"
        ):
            manager.restore(target={"params": params})
        with pytest.raises(CheckpointError, match=r"no checkpoint 7 in .*run \(steps: 3\)"):
            manager.restore(step=7, target=target)
        with pytest.raises(TypeError, match=r"save\(state\)\['lr'\] is a str"):
            manager.save(4, {"lr": "high"})
    for path in (tmp_path / "run" / "3" / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"corrupt")
    with CheckpointManager(tmp_path / "run", strategy) as manager:
        with pytest.raises(CheckpointError, match=r"run/3"):
            manager.restore(target=target)
    with pytest.raises(ValueError, match="max_to_keep and save_interval_steps must be at least 1"):
        CheckpointManager(tmp_path, strategy, max_to_keep=0)


def test_a_save_killed_midway_never_becomes_the_latest(tmp_path):
    from tests.multiprocess import run_workers

    (worker,) = run_workers(
        ["tests/workers/save_and_die.py", str(tmp_path), "1024"], count=1, kill=(0, 2), timeout=180
    )
    assert worker.killed_at == 2, worker.output[-2000:]
    strategy = xs.OneDeviceStrategy()
    with CheckpointManager(tmp_path, strategy) as manager:
        assert manager.latest_step() == 1
        restored = manager.restore(target={"w": np.zeros(4, np.float32)})
        manager.save(3, restored)  # the restarted run carries on
        manager.wait_until_finished()
    assert not list(tmp_path.glob("*tmp*")), "the half-written save was left behind"
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones(4, np.float32))


def test_a_refused_write_is_a_clear_error_and_the_previous_checkpoint_stays(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tests.workers.disk_full", str(tmp_path / "ckpt")],
        cwd=Path(__file__).parents[2],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is not None, "the refused save did not raise CheckpointError"
    assert "the file system refused a write (EFBIG: File too large" in result["error"]
    assert "the latest complete checkpoint is still step 1" in result["error"]
    assert result["latest"] == 1 and result["intact"]
