"""A cache of what XLA's compiler said of a program, by the program's fingerprint, so the
next compile of the same step (`select_by_compiling`) or the next plan of it pays nothing.

Entries are JSON files under `XLA_STRATEGIES_CACHE` (default `~/.cache/xla_strategies`),
one folder per kind, each written whole (a temporary file renamed into place). An entry
that cannot be read is a miss; a cache that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from xla_strategies.hardware.compiled_report import compiler_versions
from xla_strategies.passes.cost.topology_like import TopologyLike

CACHE = "XLA_STRATEGIES_CACHE"
#: part of every key: raised when the lowering gives XLA another program for the same
#: captured IR, so no verdict on the old program is read as the new one's (2: the user's
#: nested `jax.jit` calls called again, `bridge.called_functions`)
LOWERING = 2


def fingerprint(captured_ir: str, topology: TopologyLike | None, options: Any) -> str:
    """The key of a program: its captured IR, where it compiles for (the topology whole:
    its rates too, so a refitted `[calibration]` judges the program again), with what
    options, and the compiler's releases."""
    key = json.dumps(
        [
            captured_ir,
            repr(topology),
            repr(options),
            compiler_versions(),
            LOWERING,
        ],  # fmt: skip
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def read(kind: str, key: str) -> Any | None:
    try:
        return json.loads((_folder(kind) / f"{key}.json").read_text())
    except (OSError, ValueError):  # none yet, or unreadable: compile
        return None


def write(kind: str, key: str, data: Any) -> None:
    folder = _folder(kind)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = folder / f".{key}.{os.getpid()}.tmp"
        temporary.write_text(json.dumps(data, indent=1))
        temporary.replace(folder / f"{key}.json")
    except OSError:
        pass  # a read-only home: the next compile decides again


def _folder(kind: str) -> Path:
    return Path(os.environ.get(CACHE) or Path.home() / ".cache" / "xla_strategies") / kind
