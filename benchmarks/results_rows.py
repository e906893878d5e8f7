"""A benchmark's results file of rows (`{"rows": [...]}`), each row one measured cell."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def merge_rows(
    results: Path, rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], tuple]
) -> list[dict[str, Any]]:
    """Write `rows` into `results` in place of the rows recorded before for the same cells
    (equal `key`), keeping every other cell's; returns all the file's rows."""
    old = json.loads(results.read_text())["rows"] if results.exists() else []
    done = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in done] + rows
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps({"rows": merged}, indent=1) + "\n")
    return merged
