"""Reading XLA's compiled HLO text: how many collectives survived compilation."""

from __future__ import annotations

import re

_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def count_hlo_collectives(hlo_text: str) -> dict[str, int]:
    """Instructions per collective kind; async pairs (`-start`/`-done`) count once."""
    counts = {}
    for kind in _COLLECTIVES:
        pattern = re.compile(rf"=\s*[^=]*?\s{re.escape(kind)}(?:-start)?\(")
        counts[kind] = sum(1 for line in hlo_text.splitlines() if pattern.search(line))
    return counts
