"""Checkpoints never lose or silently change data: a save over a later run's steps, a
restore into another dtype, a damaged file, and modules that hold functions."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

import xla_strategies as xs
from xla_strategies.runtime.checkpoint import CheckpointError, CheckpointManager


def _state(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((4, 3), value, np.float32), "b": np.full(3, value, np.float32)}


def _manager(directory, **options) -> CheckpointManager:
    return CheckpointManager(directory, xs.OneDeviceStrategy(), async_save=False, **options)


def test_a_save_over_a_later_runs_steps_is_an_error_unless_overwritten(tmp_path):
    with _manager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
        with pytest.raises(CheckpointError, match=r"cannot save step 2 .*\[2, 3\].*overwrite=True"):
            manager.save(2, _state(20.0))
        assert manager.all_steps() == [1, 2, 3]  # nothing was deleted
        assert manager.save(2, _state(20.0), overwrite=True)
        assert manager.latest_step() == 2 and manager.all_steps() == [1, 2]
        restored = manager.restore(target=_state(0.0))
    np.testing.assert_array_equal(restored["w"], _state(20.0)["w"])


def test_a_restore_into_another_dtype_is_an_error_naming_the_leaf(tmp_path):
    with _manager(tmp_path) as manager:
        manager.save(1, _state(0.5))
        target = {"w": np.zeros((4, 3), np.int32), "b": np.zeros(3, np.float32)}
        with pytest.raises(CheckpointError, match=r"holds w as float32, the target as int32"):
            manager.restore(target=target)
        target = {"w": np.zeros((4, 3), np.float16), "b": np.zeros(3, np.float32)}
        with pytest.raises(CheckpointError, match=r"holds w as float32, the target as float16"):
            manager.restore(target=target)


@pytest.mark.parametrize("shape", [(32, 16), (128, 16), (16, 64)])
def test_a_restore_into_another_shape_names_the_leaf_and_says_the_checkpoint_is_whole(
    tmp_path, shape
):
    saved = {"w": np.ones((64, 16), np.float32), "b": np.ones(16, np.float32)}
    with _manager(tmp_path) as manager:
        manager.save(1, _state(1.0) | saved)
        manager.save(2, _state(2.0) | saved)
        target = _state(0.0) | saved | {"w": np.zeros(shape, np.float32)}
        with pytest.raises(CheckpointError) as caught:
            manager.restore(target=target)
        assert "damaged" not in str(caught.value)
        assert f"holds w with shape (64, 16), the target with shape {shape}" in str(caught.value)
        assert "the checkpoint is whole" in str(caught.value)
        restored = manager.restore(target=_state(0.0) | saved)  # it is whole indeed
    np.testing.assert_array_equal(restored["w"], saved["w"])


def test_a_typed_prng_key_is_held_to_its_key_datas_shape(tmp_path):
    """orbax stores a typed key as its key data ((2,) for a () threefry key): the shape
    check compares that, so the key restores, and a key of another shape is still named."""
    state = {"w": np.ones(3, np.float32), "rng": jax.random.key(7)}
    with _manager(tmp_path) as manager:
        manager.save(1, state)
        restored = manager.restore(target={"w": np.zeros(3, np.float32), "rng": jax.random.key(0)})
        other = {"w": np.zeros(3, np.float32), "rng": jax.random.split(jax.random.key(0), 4)}
        with pytest.raises(CheckpointError, match=r"holds rng with shape \(2,\), the target"):
            manager.restore(target=other)
    assert np.array_equal(jax.random.key_data(restored["rng"]), jax.random.key_data(state["rng"]))


def test_a_leaf_nested_one_level_deeper_is_another_structure_not_damage(tmp_path):
    with _manager(tmp_path) as manager:
        manager.save(2, _state(2.0))
        for target in (
            {"w": {"kernel": _state(0.0)["w"]}, "b": _state(0.0)["b"]},
            {"w": [_state(0.0)["w"]], "b": _state(0.0)["b"]},
        ):
            with pytest.raises(CheckpointError, match=r"structure differs") as caught:
                manager.restore(target=target)
            assert "damaged" not in str(caught.value)


def _damage_step_2(tmp_path, damage: str) -> None:
    with _manager(tmp_path) as manager:
        manager.save(1, _state(1.0))
        manager.save(2, _state(2.0))
    data = [p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file() and p.stat().st_size]
    chunks = [p for p in data if "/w/" in p.as_posix() or "/w." in p.as_posix()] or data
    victim = max(chunks, key=lambda p: p.stat().st_size)
    if damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])


def test_a_damaged_checkpoint_names_its_step_and_the_newest_intact_one(tmp_path):
    _damage_step_2(tmp_path, "truncate")
    with _manager(tmp_path) as manager:
        with pytest.raises(CheckpointError, match=r"step 2 .* damaged.*restore\(step=1"):
            manager.restore(target=_state(0.0))
        restored = manager.restore(step=1, target=_state(0.0))
    np.testing.assert_array_equal(restored["w"], _state(1.0)["w"])


def test_a_checkpoint_missing_a_file_is_set_aside_and_the_previous_is_the_latest(tmp_path):
    """A missing file is what a deletion cut short leaves: the next writer sets the step
    aside with a warning, and it is never listed."""
    _damage_step_2(tmp_path, "delete")
    with pytest.warns(UserWarning, match=r"step 2 .* incomplete \(its array 'w' is missing"):
        manager = _manager(tmp_path)
    with manager:
        assert manager.all_steps() == [1]
        restored = manager.restore(target=_state(0.0))
    np.testing.assert_array_equal(restored["w"], _state(1.0)["w"])
    assert (tmp_path / "incomplete_steps" / "2").is_dir()


def test_an_equinox_module_saves_its_arrays_and_restores_into_the_module(tmp_path):
    """Equinox's docs save a module's arrays and load them into a module of the same
    shape; its MLP holds its activation (a custom_jvp) as a leaf."""
    model = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.key(0))
    strategy = xs.MirroredStrategy()
    replicated = strategy.replicate(model)
    assert replicated.activation is model.activation
    with CheckpointManager(tmp_path, strategy, async_save=False) as manager:
        manager.save(1, {"model": replicated})
        fresh = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.key(1))
        restored = manager.restore(target={"model": fresh})["model"]
    x = np.ones((5, 3), np.float32)
    np.testing.assert_array_equal(jax.vmap(restored)(x), jax.vmap(model)(x))
