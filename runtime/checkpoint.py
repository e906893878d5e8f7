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

One process writes a directory: a second writer is refused, naming the first's host and
process id (`checkpoint_lock`); an evaluator restores beside it with `read_only=True`,
which never deletes or cleans anything. A listed step always restores: deletion renames a
step out of the list before removing it, and a step found incomplete is set aside with a
warning (`checkpoint_steps`). A failed background save is raised, and its threads are let
go so that the process can still exit (`checkpoint_threads`).

Nothing is lost or changed silently. Saving a step at or before the latest checkpoint (a
run that went back) is an error unless `overwrite=True` deletes the later steps. A restore
into a target of another dtype or shape is an error naming the leaf (the checkpoint is
whole). A damaged checkpoint is a `CheckpointError` naming its step and the newest earlier
step that reads back whole; damage is never reported as another structure.
Functions a state holds as leaves (an equinox module's activations) are not saved; they
come from the restore target.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from xla_strategies.core.layout import Layout
from xla_strategies.core.trees import map_arrays, with_functions_of, without_functions
from xla_strategies.runtime import checkpoint_steps, checkpoint_threads
from xla_strategies.runtime.checkpoint_lock import WriterLock
from xla_strategies.runtime.checkpoint_plan import restore_plan
from xla_strategies.runtime.checkpoint_tree import (
    CheckpointError,
    check_dtypes,
    check_shapes,
    check_structure,
    normalized,
    refused_write,
    stored_shape,
)

if TYPE_CHECKING:
    from xla_strategies.core.strategy_like import StrategyLike


#: a reader opening beside a writer lists the steps and then reads each one's time; a step
#: the writer deletes between the two is gone: the reader lists them again
_OPEN_ATTEMPTS = 10


class CheckpointManager:
    """Save and restore training state every `save_interval_steps`, keeping `max_to_keep`.

    Args:
        directory: where the checkpoints live (a writer creates it).
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
        read_only: only restore (an evaluator beside the trainer): take no lock, create,
            delete and clean nothing, and list only whole steps, read afresh each time.

    Raises:
        CheckpointError: another process writes `directory` (unless `read_only`).
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
        read_only: bool = False,
    ) -> None:
        import orbax.checkpoint as ocp

        if max_to_keep < 1 or save_interval_steps < 1:
            raise ValueError(
                f"max_to_keep and save_interval_steps must be at least 1, got {max_to_keep} "
                f"and {save_interval_steps}"
            )
        self.directory = Path(directory).absolute()
        self.strategy = strategy
        self.read_only = read_only
        self._lock = self._take_directory() if not read_only else None
        self._whole_steps = checkpoint_steps.WholeSteps(self.directory)  # a reader's checks
        self._before_save = checkpoint_threads.running()
        self._operation: str | None = None  # orbax's id of the latest save
        if read_only:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False)
        else:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                save_interval_steps=save_interval_steps,
                enable_async_checkpointing=async_save,
                create=True,
                # only the lock's holder cleans: no other writer can have a save in flight
                cleanup_tmp_directories=self._lock is not None,
                todelete_subdir=checkpoint_steps.DELETING,  # unlisted before removed
            )
        self._ocp = ocp
        handlers = {
            "state": ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_compression=compression),
            "input": ocp.JsonCheckpointHandler(),
            "layout": ocp.JsonCheckpointHandler(),
        }
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                self._manager = ocp.CheckpointManager(
                    self.directory, options=options, item_handlers=handlers
                )
                break
            except FileNotFoundError:  # a reader's: the writer deleted a step orbax listed
                if not read_only or attempt == _OPEN_ATTEMPTS - 1:
                    raise

    def _take_directory(self) -> WriterLock | None:
        """The writer's lock, and the clean-up of what a crashed writer left (deleted
        steps not yet removed, incomplete steps). In a multi-process run the primary
        process locks and cleans; the others write their shards beside it."""
        if jax.process_index() != 0:
            return None
        lock = WriterLock(self.directory)
        checkpoint_steps.remove_deleted(self.directory)
        checkpoint_steps.set_aside_incomplete(self.directory)
        return lock

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
        if self.read_only:
            raise CheckpointError(
                f"cannot save step {step} in {self.directory}: this manager was opened "
                "with read_only=True"
            )
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
        self._before_save, self._operation = checkpoint_threads.running(), None
        with self._refused_writes(f"could not save step {step}"):
            saved = self._manager.save(step, args=self._ocp.args.Composite(**items), force=force)
        self._operation = checkpoint_threads.current_operation()
        self._remove_deleted()  # what max_to_keep renamed away, once a sync save is done
        return saved

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
        for stale in sorted(later, reverse=True):  # a crash keeps the older steps listed
            self._manager.delete(stale)  # renamed out of the list at once, then removed
        self._remove_deleted()
        self._manager.reload()  # orbax's cached step list and its next-save bookkeeping

    def wait_until_finished(self) -> None:
        """Block until a background save has been committed (or raise its error)."""
        with self._refused_writes("a background save failed"):
            self._manager.wait_until_finished()
        self._remove_deleted()

    def _remove_deleted(self) -> None:
        if self._lock is not None:
            checkpoint_steps.remove_deleted(self.directory)

    @contextlib.contextmanager
    def _refused_writes(self, what: str) -> Iterator[None]:
        """Raise a write the OS refused as a `CheckpointError`; other errors as they are.
        Either way the failed save's threads are let go, so the process can exit."""
        try:
            yield
        except Exception as exc:
            operation = self._operation or checkpoint_threads.current_operation()
            checkpoint_threads.release(self._before_save, operation)
            error = refused_write(f"{what} in {self.directory}", exc, self.latest_step())
            if error is None:
                raise
            raise error from exc

    def _stacked_leaves(self, state: Any) -> dict[str, Any]:
        """The paths of the stacked per-replica leaves of `state`, and the replica count."""
        stacked = [
            list(normalized(path))
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if self.strategy.layout(leaf) is Layout.STACKED
        ]
        return {"stacked": stacked, "replicas": self.strategy.num_replicas_in_sync}

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The checkpoints' steps, oldest first. A read-only manager reads them afresh
        each time (the writer beside it saves and deletes) and leaves out a step found
        incomplete, with a warning; a writer set such steps aside when it opened."""
        if not self.read_only:
            return sorted(self._manager.all_steps())
        # the names on disk, not orbax's reload, which fails on a step deleted mid-read
        return [
            s for s in sorted(checkpoint_steps.step_dirs(self.directory)) if self._whole_steps(s)
        ]

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
        """`restore` of a target without function leaves. A read-only manager whose step
        the writer deleted while it was read restores the new latest step instead (when
        asked for the latest), or says the step was deleted."""
        for _ in range(_READ_ATTEMPTS):
            chosen = self.latest_step() if step is None else step
            try:
                return self._restore_step(chosen, target, dataset_iterator)
            except CheckpointError as exc:
                if not self.read_only or chosen is None or chosen in self.all_steps():
                    raise
                if step is not None:
                    raise CheckpointError(
                        f"checkpoint step {step} in {self.directory} was deleted while it was "
                        f"read, by the writer's max_to_keep or an overwrite (steps now: "
                        f"{self.all_steps()})"
                    ) from exc
        raise CheckpointError(
            f"the latest checkpoint in {self.directory} was deleted while it was read, "
            f"{_READ_ATTEMPTS} times: the writer's max_to_keep is too small to restore beside it"
        )

    def _restore_step(self, step: int | None, target: Any, dataset_iterator: Any) -> Any:
        """`restore` of one step."""
        if step is None or step not in self.all_steps():
            known = ", ".join(map(str, self.all_steps())) or "none"
            raise CheckpointError(
                f"no checkpoint {'' if step is None else step} in {self.directory} (steps: {known})"
            )
        map_arrays(lambda a, _: a, target, "target")  # a bad target is the caller's error
        reason = checkpoint_steps.incomplete_reason(self.directory / str(step))
        if reason is not None:  # damage, never reported as another structure
            raise self._damaged(step, target, reason)
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception as exc:  # orbax and TensorStore raise many kinds for a damaged file
            raise self._damaged(step, target, _first_line(exc)) from exc
        check_structure(saved, target, self.directory / str(step))
        check_dtypes(saved, target, self.directory / str(step))
        try:
            return self._read(step, target, dataset_iterator)
        except CheckpointError:
            raise
        except Exception as exc:
            raise self._damaged(step, target, _first_line(exc)) from exc

    def _read(self, step: int, target: Any, dataset_iterator: Any) -> Any:
        """Checkpoint `step`'s arrays read into `target`'s shapes, dtypes and placement."""
        layout = self._saved_layout(step)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(
            map_arrays(lambda a, _: a, target, "target")
        )
        plans = [restore_plan(self.strategy, path, leaf, layout) for path, leaf in leaves]
        stored = [stored_shape(plan[0]) for plan in plans]
        reads = {normalized(p): shape for (p, _), shape in zip(leaves, stored, strict=True)}
        check_shapes(self._manager.item_metadata(step)["state"], reads, self.directory / str(step))
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

    def _saved_layout(self, step: int) -> dict[str, Any]:
        """Which leaves checkpoint `step` holds stacked per replica (none for checkpoints
        written before layouts were recorded)."""
        if not (self.directory / str(step) / "layout").exists():
            return {}
        restored = self._manager.restore(
            step, args=self._ocp.args.Composite(layout=self._ocp.args.JsonRestore())
        )
        return restored["layout"] or {}

    def _damaged(self, step: int, target: Any, why: str) -> CheckpointError:
        """The error for a checkpoint that could not be read: which step, and the newest
        earlier step that reads back whole into the same target (read in full to know)."""
        intact = None
        for earlier in sorted((s for s in self.all_steps() if s < step), reverse=True):
            if checkpoint_steps.incomplete_reason(self.directory / str(earlier)) is not None:
                continue
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
            f"({why}); {advice}"
        )

    def close(self) -> None:
        """Finish the background save (raising its error), and let the next writer in."""
        try:
            with self._refused_writes("a background save failed"):
                self._manager.close()
            self._remove_deleted()
        finally:
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# How often a read-only manager restores the newest step when the writer deletes it mid-read.
_READ_ATTEMPTS = 3


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
