"""FileCheck for the tests: match IR text against `CHECK` lines, as LLVM's FileCheck does.

    CHECK: pattern        the pattern appears on a later line than the last match
    CHECK-NEXT: pattern   ... on the very next line
    CHECK-SAME: pattern   ... on the same line, after the last match
    CHECK-NOT: pattern    does not appear between the last match and the next one (or the end)

A pattern is literal text, except `{{regex}}`, `[[NAME:regex]]` (match and remember) and
`[[NAME]]` (what NAME matched), so SSA names need not be spelled out: `%[[SUM:[0-9]+]]`.
Lines of `checks` that hold no directive are ignored, so checks can carry comments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DIRECTIVE = re.compile(r"^\s*(CHECK(?:-NEXT|-SAME|-NOT)?):\s?(.*)$")
_PIECE = re.compile(r"\{\{(.+?)\}\}|\[\[(\w+):(.+?)\]\]|\[\[(\w+)\]\]")


@dataclass
class _Check:
    kind: str
    pattern: str
    line: int  # in the checks, for messages


def filecheck(text: str, checks: str) -> None:
    """Raise AssertionError, naming the check and where matching stood, unless `text`
    satisfies every CHECK line of `checks`."""
    directives = [
        _Check(m.group(1), m.group(2).rstrip(), n)
        for n, line in enumerate(checks.splitlines(), 1)
        if (m := _DIRECTIVE.match(line))
    ]
    if not directives:
        raise ValueError("no CHECK lines in the checks")
    lines = text.splitlines()
    names: dict[str, str] = {}
    row, column = -1, 0  # position after the last positive match
    pending_not: list[_Check] = []
    for check in directives:
        if check.kind == "CHECK-NOT":
            pending_not.append(check)
            continue
        found = _find(check, lines, row, column, names)
        if found is None:
            _fail(check, lines, row)
        new_row, start, end = found
        _forbid(pending_not, lines, (row, column), (new_row, start), names)
        pending_not = []
        row, column = new_row, end
    _forbid(pending_not, lines, (row, column), (len(lines), 0), names)


def _find(check: _Check, lines: list[str], row: int, column: int, names: dict[str, str]):
    if check.kind == "CHECK-SAME":
        candidates = [(row, column)] if row >= 0 else []
    elif check.kind == "CHECK-NEXT":
        candidates = [(row + 1, 0)] if row + 1 < len(lines) else []
    else:
        candidates = [(r, 0) for r in range(row + 1, len(lines))]
    for r, c in candidates:
        regex, groups = _regex(check.pattern, names)
        match = regex.search(lines[r], c)
        if match:
            names.update({name: match.group(group) for name, group in groups.items()})
            return r, match.start(), match.end()
    return None


def _forbid(checks, lines, start: tuple[int, int], end: tuple[int, int], names) -> None:
    for check in checks:
        regex, _ = _regex(check.pattern, names)
        for r in range(max(start[0], 0), min(end[0] + 1, len(lines))):
            line = lines[r]
            lo = start[1] if r == start[0] else 0
            hi = end[1] if r == end[0] else len(line)
            if regex.search(line[lo:hi]):
                raise AssertionError(
                    f"CHECK-NOT on check line {check.line} matched text line {r + 1}: "
                    f"{check.pattern!r} in {line!r}"
                )


def _regex(pattern: str, names: dict[str, str]) -> tuple[re.Pattern[str], dict[str, str]]:
    parts, groups, pos = [], {}, 0
    for piece in _PIECE.finditer(pattern):
        parts.append(re.escape(pattern[pos : piece.start()]))
        raw, name, defined, used = piece.groups()
        if raw is not None:
            parts.append(f"(?:{raw})")
        elif name is not None:
            group = f"g{len(groups)}"
            groups[name] = group
            parts.append(f"(?P<{group}>{defined})")
        else:
            if used not in names:
                raise AssertionError(f"[[{used}]] is used before a check defines it")
            parts.append(re.escape(names[used]))
        pos = piece.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts)), groups


def _fail(check: _Check, lines: list[str], row: int) -> None:
    after = f"after text line {row + 1} ({lines[row]!r})" if row >= 0 else "in the text"
    raise AssertionError(
        f"{check.kind} on check line {check.line} found no {check.pattern!r} {after}\n"
        + "\n".join(lines)
    )
