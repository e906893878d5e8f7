"""One writer per checkpoint directory: an exclusive lock that a second writer is refused by.

Two processes writing one directory (a restarted job whose old process still runs, two
jobs given the same path) corrupt it silently: each one's clean-up and `max_to_keep`
delete the other's saves, and steps mix both writers' arrays. The writer holds an
exclusive `flock` on `<directory>/.writer.lock` for its manager's life. The kernel
releases it when the process ends, however it ends, so a kill -9'd writer never blocks
its restart. The holder writes its host and process id into the file, so the refusal
names who holds it.

`flock` excludes processes on one host, and on file systems that pass it on (local
disks, most NFS mounts); on an object store there is no lock to take.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from xla_strategies.runtime.checkpoint_tree import CheckpointError

LOCK_NAME = ".writer.lock"


class WriterLock:
    """The exclusive lock of `directory`'s writer (created with the directory).

    Raises:
        CheckpointError: another writer holds it; the message names its host and pid.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOCK_NAME
        # a file object, not a bare descriptor: a manager dropped without close() lets
        # its lock go when the object is collected
        self._file: IO[str] | None = open(self.path, "a+")  # noqa: SIM115 - held open
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(self._file)
            self._file.close()
            self._file = None
            raise CheckpointError(
                f"checkpoint directory {directory} is locked by {holder}, which writes its "
                "checkpoints: one writer per directory, or each one's clean-up and "
                "max_to_keep delete the other's saves. To restore beside it (an evaluator), "
                "open CheckpointManager(..., read_only=True); to write, stop that process "
                "or save to another directory"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(
            json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
        )
        self._file.flush()

    def release(self) -> None:
        """Let the next writer in (closing the file drops the lock)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def _holder(file: IO[str]) -> str:
    """Who holds the lock, as its file says ("process 123 on host-a since 12:00:05")."""
    file.seek(0)
    try:
        found = json.loads(file.read() or "{}")
    except ValueError:
        found = {}
    if "pid" not in found:
        return "another process (it has not yet written its name)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found.get("since", 0)))
    return f"process {found['pid']} on {found.get('host', '?')} since {since}"
