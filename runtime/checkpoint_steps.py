"""A checkpoint directory's steps on disk: which are whole, how one is deleted, and what a
crash left behind.

A listed step must restore. Orbax commits a step by renaming its temporary directory, so a
save that is cut short is never listed; but its deletion (by `max_to_keep` or an
overwrite) removes the files of a listed step one by one, and a crash in between left a
step listed that no longer restores. So a step is deleted in two moves: a rename into
`DELETING` (orbax's `todelete_subdir`, a name orbax never lists), which is atomic, then
the removal of that copy. Whatever a crash leaves in `DELETING` is no step, and the next
writer removes it. A step found incomplete anyway (a crash of an older release, a disk
that lost files) is moved into `SET_ASIDE` by the next writer, with a warning; a
read-only manager leaves it in place and does not list it.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

DELETING = ".deleting"  # steps renamed out of the list, about to be removed
SET_ASIDE = "incomplete_steps"  # steps found incomplete, kept for a person to look at
_STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's record of a step and its items
_ARRAY_TYPES = ("jax.Array", "np.ndarray")


def step_dirs(directory: Path) -> dict[int, Path]:
    """The committed step directories (orbax's plain integer names)."""
    if not directory.is_dir():
        return {}
    return {int(p.name): p for p in directory.iterdir() if p.name.isdigit() and p.is_dir()}


def incomplete_reason(step_dir: Path) -> str | None:
    """What `step_dir` misses to be a whole checkpoint, or None when nothing is missing.

    Only what is missing counts: a deletion cut short leaves files out, never half a file.
    A file that is there but unreadable is damage, which the restore reports. Reads only
    names and the small metadata files: each item orbax recorded, the state's tree, and
    every array's directory (or the OCDBT manifest)."""
    try:
        items = json.loads((step_dir / _STEP_METADATA).read_text()).get("item_handlers") or {}
    except FileNotFoundError:
        return f"its {_STEP_METADATA} is missing"
    except (OSError, ValueError):
        return None
    missing = [item for item in items if not (step_dir / item).is_dir()]
    if missing:
        return f"its item {missing[0]!r} is missing"
    if "state" not in items:
        return None
    state = step_dir / "state"
    try:
        tree = json.loads((state / "_METADATA").read_text())
    except FileNotFoundError:
        return "its state's _METADATA is missing"
    except (OSError, ValueError):
        return None
    if tree.get("use_ocdbt"):
        return None if (state / "manifest.ocdbt").exists() else "its OCDBT manifest is missing"
    for entry in (tree.get("tree_metadata") or {}).values():
        if entry.get("value_metadata", {}).get("value_type") not in _ARRAY_TYPES:
            continue
        name = ".".join(str(k["key"]) for k in entry.get("key_metadata", ()))
        if not _holds_array(state / name):
            return f"its array {name!r} is missing"
    return None


def _holds_array(path: Path) -> bool:
    """Whether `path` is an array's directory: zarr metadata and at least one chunk."""
    try:
        names = {p.name for p in path.iterdir()}
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable, not missing: the restore reports it
    header = names & {".zarray", "zarr.json"}
    return bool(header) and bool(names - header)


class WholeSteps:
    """Whether a step of `directory` is whole, warning once of one that is not (cached:
    a step's directory is replaced, never changed, once committed)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._verdicts: dict[tuple[int, int], str | None] = {}  # (step, inode) -> reason

    def __call__(self, step: int) -> bool:
        path = self._directory / str(step)
        try:
            key = (step, path.stat().st_ino)
        except OSError:
            return False  # deleted since it was listed
        if key not in self._verdicts:
            self._verdicts[key] = incomplete_reason(path)
            if self._verdicts[key] is not None:
                warnings.warn(
                    f"checkpoint step {step} at {path} is incomplete "
                    f"({self._verdicts[key]}); it is not listed",
                    stacklevel=3,
                )
        return self._verdicts[key] is None


def set_aside_incomplete(directory: Path) -> None:
    """At a writer's start: move each incomplete step into `SET_ASIDE`, with a warning."""
    for step, path in sorted(step_dirs(directory).items()):
        reason = incomplete_reason(path)
        if reason is None:
            continue
        aside = directory / SET_ASIDE / path.name
        suffix = 1
        while aside.exists():
            aside, suffix = directory / SET_ASIDE / f"{path.name}.{suffix}", suffix + 1
        aside.parent.mkdir(exist_ok=True)
        path.rename(aside)
        warnings.warn(
            f"checkpoint step {step} at {path} is incomplete ({reason}), left so by a crash "
            f"or a lost file; it is set aside in {aside} and not listed",
            stacklevel=3,
        )


def remove_deleted(directory: Path) -> None:
    """Remove the steps that deletion renamed out of the list (`DELETING`)."""
    deleting = directory / DELETING
    if deleting.is_dir():
        for path in deleting.iterdir():
            shutil.rmtree(path, ignore_errors=True)
