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
class DumpedStep:
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
                return _strip_header(_read_text(path))
        known = ", ".join(name for name, _ in passes)
        raise DumpError(f"step {self.name!r} has no IR after {pass_name!r}; it has: {known}")

    def ledger(self) -> dict[str, Any] | None:
        """The step's ledger (None when it was not written); a damaged one is a DumpError
        naming the file."""
        path = self.directory / "ledger.json"
        if not path.exists():
            return None
        try:
            data = json.loads(_read_text(path))
        except json.JSONDecodeError as exc:
            raise DumpError(f"{path} is not valid JSON (truncated or damaged?): {exc}") from None
        _check_ledger(data, path)
        return data

    def compiled_hlo(self) -> str | None:
        path = self.directory / "compiled.hlo.txt"
        return _read_text(path) if path.exists() else None


# What each pass's record of a ledger holds, as `LedgerRecorder` writes it.
_RECORD_KEYS = {"pass", "changed", "totals", "delta", "collectives"}
_TOTALS_KEYS = {"collectives_per_step", "bytes_per_step", "estimated_s"}


def _check_ledger(data: Any, path: Path) -> None:
    """Raise a DumpError naming `path` and what is missing, for a ledger that is cut
    short or was written by something else."""
    records = data.get("passes") if isinstance(data, dict) else None
    if not isinstance(records, list):
        raise DumpError(f"{path} is not a step ledger: it has no 'passes' list")
    for index, record in enumerate(records):
        missing = _RECORD_KEYS - set(record) if isinstance(record, dict) else _RECORD_KEYS
        if not missing and isinstance(record["totals"], dict):
            missing = {f"totals.{k}" for k in _TOTALS_KEYS - set(record["totals"])}
        if missing:
            raise DumpError(
                f"{path}: pass record {index} lacks {sorted(missing)} (incomplete or damaged)"
            )


def _read_text(path: Path) -> str:
    """A dump file's text; a DumpError naming it when it cannot be read as text."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DumpError(f"{path} is not text (damaged?): {exc}") from None
    except OSError as exc:
        raise DumpError(f"cannot read {path}: {exc.strerror}") from None


def _strip_header(text: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("// "))


def steps(directory: Path) -> list[DumpedStep]:
    """Every dumped step under `directory` (or `directory` itself when it is one)."""
    if not directory.is_dir():
        raise DumpError(f"{directory} is not a directory")
    candidates = [directory] + sorted(p for p in directory.iterdir() if p.is_dir())
    found = [DumpedStep(p.name, p) for p in candidates if DumpedStep(p.name, p).passes()]
    if not found:
        raise DumpError(
            f"{directory} holds no dumps: no NNNN.<pipeline>.after_<pass>.txt files in it or in "
            "its subdirectories; run 'xla-strategies dump -- python your_script.py' first"
        )
    return found


def select_step(directory: Path, name: str | None) -> DumpedStep:
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


__all__ = ["DumpError", "DumpedStep", "dump_header", "select_step", "steps"]
