"""Reading a dump directory back: which steps it holds, their IR after each pass, ledger."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xla_strategies.passes.dump import dump_header

_PASS_FILE = re.compile(r"^(\d{4})\.(.+)\.after_(.+)\.txt$")


class DumpError(ValueError):
    """A dump directory is missing, empty, or lacks what was asked for."""


@dataclass(frozen=True)
class StepDump:
    name: str
    directory: Path

    def passes(self) -> list[tuple[str, Path]]:
        """(pass name, IR file) in pipeline order, capture first."""
        found = []
        for path in sorted(self.directory.iterdir()):
            match = _PASS_FILE.match(path.name)
            if match:
                found.append((match.group(3), path))
        return found

    def ir_after(self, pass_name: str | None) -> str:
        """The IR text after `pass_name` (the last pass when None), without the header."""
        passes = self.passes()
        if pass_name is None:
            pass_name = passes[-1][0]
        for name, path in passes:
            if name == pass_name:
                return _strip_header(path.read_text())
        known = ", ".join(name for name, _ in passes)
        raise DumpError(f"step {self.name!r} has no IR after {pass_name!r}; it has: {known}")

    def ledger(self) -> dict[str, Any] | None:
        path = self.directory / "ledger.json"
        return json.loads(path.read_text()) if path.exists() else None

    def compiled_hlo(self) -> str | None:
        path = self.directory / "compiled.hlo.txt"
        return path.read_text() if path.exists() else None


def _strip_header(text: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("// "))


def steps(directory: Path) -> list[StepDump]:
    """Every dumped step under `directory` (or `directory` itself when it is one)."""
    if not directory.is_dir():
        raise DumpError(f"{directory} is not a directory")
    candidates = [directory] + sorted(p for p in directory.iterdir() if p.is_dir())
    found = [StepDump(p.name, p) for p in candidates if StepDump(p.name, p).passes()]
    if not found:
        raise DumpError(
            f"{directory} holds no dumps: no NNNN.<pipeline>.after_<pass>.txt files in it or in "
            "its subdirectories; run 'xla-strategies dump -- python your_script.py' first"
        )
    return found


def select_step(directory: Path, name: str | None) -> StepDump:
    found = steps(directory)
    if name is None:
        if len(found) > 1:
            names = ", ".join(s.name for s in found)
            raise DumpError(f"{directory} holds several steps ({names}); choose one with --step")
        return found[0]
    for step in found:
        if step.name == name:
            return step
    raise DumpError(
        f"no step {name!r} in {directory}; it holds: {', '.join(s.name for s in found)}"
    )


__all__ = ["DumpError", "StepDump", "dump_header", "select_step", "steps"]
