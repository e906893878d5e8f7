"""`CheckpointManager`: strategy-aware checkpoints on orbax-checkpoint.

A checkpoint holds the training state (any pytree of the strategy's arrays) and, when
given, the input iterator's position. Saves are asynchronous by default and atomic: orbax
writes into a temporary directory and renames it when complete, so a save that is
interrupted never becomes the latest checkpoint. In multi-process runs every host writes
its own shards and the primary host commits. Restoring places the state with the
restoring strategy's shardings, so a checkpoint saved under one strategy restores under
another (MirroredStrategy(8) to OneDeviceStrategy, or a different replica count).

Optimizer state that weight-update sharding holds split across the replicas is one
mirrored value: it is saved as its logical array, and restores into a target of any replica
count, sharded (read straight into each device's block) or not.

Per-replica state (stacked values, such as BatchNorm statistics a step keeps per replica)
is saved whole, every replica's value, with a note of which leaves are stacked. Restored
into a stacked target of the same replica count it comes back exactly; into a mirrored
target, or under another replica count, every replica gets the mean of the saved
replicas' values: the aggregated value tf.distribute saves for a `SyncOnRead` variable.

Nothing is lost or changed silently. Saving a step at or before the latest checkpoint (a
run that went back) is an error unless `overwrite=True` deletes the later steps. A restore
into a target of another dtype is an error naming the leaf. A damaged checkpoint is a
`CheckpointError` naming its step and the newest earlier step that reads back whole.
Functions a state holds as leaves (an equinox module's activations) are not saved; they
come from the restore target.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from xla_strategies.core.layout import Layout, fold_stacked
from xla_strategies.core.trees import map_arrays, with_functions_of, without_functions
from xla_strategies.runtime.checkpoint_tree import (
    CheckpointError,
    check_dtypes,
    check_structure,
    normalized,
)

if TYPE_CHECKING:
    from xla_strategies.core.protocols import StrategyLike


class CheckpointManager:
    """Save and restore training state every `save_interval_steps`, keeping `max_to_keep`.

    Args:
        directory: where the checkpoints live (created on the first save).
        strategy: the strategy whose arrays are saved and whose shardings restore uses.
        max_to_keep: how many recent checkpoints to keep.
        save_interval_steps: `save(step, ...)` writes only on multiples of this, the first
            save into an empty directory, and `force`d saves (orbax's rule).
        async_save: write in the background; `wait_until_finished()` waits for it.
        ocdbt: pack each host's arrays into a few large files (orbax's OCDBT format). Off
            by default: on a local disk it made a 1 GiB save 3.6 to 5x and a restore 2.3 to
            3.4x slower (benchmarks/README.md); on an object store with thousands of hosts,
            where the number of files is what costs, turn it on. Either format restores.
        compression: zstd the arrays. Off by default: weights hardly compress (11% on
            random float32) and it costs a core while the step runs.
    """

    def __init__(
        self,
        directory: str | Path,
        strategy: StrategyLike,
        max_to_keep: int = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        ocdbt: bool = False,
        compression: bool = False,
    ) -> None:
        import orbax.checkpoint as ocp

        if max_to_keep < 1 or save_interval_steps < 1:
            raise ValueError(
                f"max_to_keep and save_interval_steps must be at least 1, got {max_to_keep} "
                f"and {save_interval_steps}"
            )
        self.directory = Path(directory).absolute()
        self.strategy = strategy
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,  # what an interrupted save left behind
        )
        self._ocp = ocp
        handlers = {
            "state": ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_compression=compression),
            "input": ocp.JsonCheckpointHandler(),
            "layout": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )

    def save(
        self,
        step: int,
        state: Any,
        dataset_iterator: Any = None,
        force: bool = False,
        overwrite: bool = False,
    ) -> bool:
        """Write `state` (and the iterator's position) as checkpoint `step`. Returns whether
        a save started (steps off the interval are skipped unless `force`).

        A step at or before the latest checkpoint is a run that went back (a rollback, a
        restart from an earlier step): that is a `CheckpointError`, since writing it would
        either keep the other run's checkpoint or leave `latest_step()` naming it. With
        `overwrite=True` the checkpoints from `step` on are deleted first, so the new run's
        is the latest."""
        self._make_room_for(step, overwrite)
        if not (force or self._manager.should_save(step)):
            return False  # a training loop calls this every step: skip the work too
        state = without_functions(state)  # an equinox module's activations: not data
        map_arrays(lambda a, _: a, state, "save(state)")  # every other leaf must be an array
        items = {
            "state": self._ocp.args.PyTreeSave(state),
            "layout": self._ocp.args.JsonSave(self._stacked_leaves(state)),
        }
        if dataset_iterator is not None:
            items["input"] = self._ocp.args.JsonSave(dataset_iterator.get_state())
        self.wait_until_finished()  # a failure of the previous save is reported as such
        with self._refused_writes(f"could not save step {step}"):
            return self._manager.save(step, args=self._ocp.args.Composite(**items), force=force)

    def _make_room_for(self, step: int, overwrite: bool) -> None:
        """Refuse, or with `overwrite` delete, the checkpoints at `step` and after it."""
        later = [s for s in self.all_steps() if s >= step]
        if not later:
            return
        if not overwrite:
            raise CheckpointError(
                f"cannot save step {step} in {self.directory}: checkpoint(s) {later} are at "
                f"or after it, from a run this one went back from; pass overwrite=True to "
                f"delete them and save this run's step {step}, or save to another directory"
            )
        self.wait_until_finished()
        for stale in later:
            self._manager.delete(stale)
        self._manager.reload()  # orbax's cached step list and its next-save bookkeeping

    def wait_until_finished(self) -> None:
        """Block until a background save has been committed (or raise its error)."""
        with self._refused_writes("a background save failed"):
            self._manager.wait_until_finished()

    @contextlib.contextmanager
    def _refused_writes(self, what: str) -> Iterator[None]:
        """Raise a write the OS refused as a `CheckpointError`; other errors as they are."""
        try:
            yield
        except (OSError, ValueError) as exc:
            error = self._write_error(what, exc)
            if error is None:
                raise
            raise error from exc

    def _write_error(self, what: str, exc: Exception) -> CheckpointError | None:
        """A failed write as a `CheckpointError` that says what the OS refused (tensorstore
        reports it as a ValueError carrying the errno); None for other errors."""
        code = getattr(exc, "errno", None)
        if code is None:
            found = re.search(r"os_error_code='(\d+)'", str(exc))
            if found is None:
                return None
            code = int(found.group(1))
        reason = f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"
        if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            reason += " (the disk is full or a file size limit was reached)"
        kept = self.latest_step()
        return CheckpointError(
            f"{what} in {self.directory}: the file system refused a write ({reason}); "
            f"the latest complete checkpoint is still "
            f"{'none' if kept is None else f'step {kept}'}\n{exc}"
        )

    def _stacked_leaves(self, state: Any) -> dict[str, Any]:
        """The paths of the stacked per-replica leaves of `state`, and the replica count."""
        stacked = [
            list(normalized(path))
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if self.strategy.layout(leaf) is Layout.STACKED
        ]
        return {"stacked": stacked, "replicas": self.strategy.num_replicas_in_sync}

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(
        self, step: int | None = None, target: Any = None, dataset_iterator: Any = None
    ) -> Any:
        """The state of checkpoint `step` (the latest by default), shaped like `target` and
        placed where this strategy keeps state (`strategy.state_sharding()`: mirrored, or
        CentralStorageStrategy's parameter device); the iterator resumes where it was."""
        if target is None:
            raise ValueError("restore needs target=: a pytree shaped like the saved state")
        data = self._restore_data(step, without_functions(target), dataset_iterator)
        return with_functions_of(target, data)

    def _restore_data(self, step: int | None, target: Any, dataset_iterator: Any) -> Any:
        """`restore` of a target without function leaves."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            known = ", ".join(map(str, self.all_steps())) or "none"
            raise CheckpointError(
                f"no checkpoint {'' if step is None else step} in {self.directory} (steps: {known})"
            )
        map_arrays(lambda a, _: a, target, "target")  # a bad target is the caller's error
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception as exc:  # orbax and TensorStore raise many kinds for a damaged file
            raise self._damaged(step, target, exc) from exc
        check_structure(saved, target, self.directory / str(step))
        check_dtypes(saved, target, self.directory / str(step))
        try:
            return self._read(step, target, dataset_iterator)
        except CheckpointError:
            raise
        except Exception as exc:
            raise self._damaged(step, target, exc) from exc

    def _read(self, step: int, target: Any, dataset_iterator: Any) -> Any:
        """Checkpoint `step`'s arrays read into `target`'s shapes, dtypes and placement."""
        layout = self._saved_layout(step)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(
            map_arrays(lambda a, _: a, target, "target")
        )
        plans = [self._plan(path, leaf, layout) for path, leaf in leaves]
        abstract = jax.tree_util.tree_unflatten(treedef, [plan[0] for plan in plans])
        restore_args = self._ocp.checkpoint_utils.construct_restore_args(abstract)
        items = {"state": self._ocp.args.PyTreeRestore(abstract, restore_args=restore_args)}
        if dataset_iterator is not None:
            items["input"] = self._ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=self._ocp.args.Composite(**items))
        if dataset_iterator is not None:
            dataset_iterator.set_state(restored["input"])
        values = jax.tree.leaves(restored["state"])
        return jax.tree_util.tree_unflatten(
            treedef, [finish(v) for v, (_, finish) in zip(values, plans, strict=True)]
        )

    def _plan(self, path: Any, leaf: Any, layout: dict[str, Any]) -> tuple[Any, Any]:
        """How to restore one leaf: what to read (shape, dtype, sharding) and what to make
        of it. A stacked leaf restores as it is into a stacked target of the saved replica
        count; otherwise its replicas' mean is every replica's value."""
        state = self.strategy.state_sharding()
        keep = lambda value: value  # noqa: E731
        if list(normalized(path)) not in layout.get("stacked", []):
            # optimizer state a step holds sharded is read straight into its blocks
            sharding = leaf.sharding if self.strategy.is_held_sharded(leaf) else state
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), keep
        saved_replicas = layout["replicas"]
        stacked = self.strategy.layout(leaf) is Layout.STACKED
        per_replica = leaf.shape[1:] if stacked else leaf.shape
        if stacked and leaf.shape[0] == saved_replicas:
            sharding = self.strategy.stacked_sharding()
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), keep
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise CheckpointError(
                f"{jax.tree_util.keystr(path)} was saved per replica ({saved_replicas} "
                f"values of {leaf.dtype}), and integer values have no mean to restore "
                f"into one value or another replica count; restore it into a stacked "
                f"target under {saved_replicas} replicas"
            )
        target_sharding = self.strategy.stacked_sharding() if stacked else state

        def aggregate(value: jax.Array) -> jax.Array:
            mean = fold_stacked(value, jax.tree_util.keystr(path))
            if stacked:
                mean = jnp.broadcast_to(mean, leaf.shape)
            return jax.device_put(mean, target_sharding)

        raw = (saved_replicas, *per_replica)
        return jax.ShapeDtypeStruct(raw, leaf.dtype, sharding=state), aggregate

    def _saved_layout(self, step: int) -> dict[str, Any]:
        """Which leaves checkpoint `step` holds stacked per replica (none for checkpoints
        written before layouts were recorded)."""
        if not (self.directory / str(step) / "layout").exists():
            return {}
        restored = self._manager.restore(
            step, args=self._ocp.args.Composite(layout=self._ocp.args.JsonRestore())
        )
        return restored["layout"] or {}

    def _damaged(self, step: int, target: Any, exc: Exception) -> CheckpointError:
        """The error for a checkpoint that could not be read: which step, and the newest
        earlier step that reads back whole into the same target (read in full to know)."""
        intact = None
        for earlier in sorted((s for s in self.all_steps() if s < step), reverse=True):
            try:
                saved = self._manager.item_metadata(earlier)["state"]
                check_structure(saved, target, self.directory / str(earlier))
                self._read(earlier, target, None)
            except Exception:  # damaged too, or another structure: look further back
                continue
            intact = earlier
            break
        advice = (
            "no earlier checkpoint reads back whole"
            if intact is None
            else f"step {intact} is the newest earlier checkpoint that reads back whole: "
            f"restore(step={intact}, ...)"
        )
        return CheckpointError(
            f"checkpoint step {step} at {self.directory / str(step)} is damaged or incomplete "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); {advice}"
        )

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
