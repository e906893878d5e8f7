"""What holds a compiled program's memory: the buffers live at its peak, read from XLA's
own buffer assignment.

XLA's compiler, asked to dump (`dump_options`), writes beside the optimised HLO its buffer
assignment (every allocation, and the values placed in it at an offset) and the live range
of every value in the program's schedule (loop bodies flattened into it). Summing the bytes
live at each point of the schedule gives the peak and what is live there; the optimised
HLO's metadata gives each buffer's op name and, through its stack frames, the source line
that made it. XLA's `memory_analysis()` totals (arguments + outputs + temporaries) are an
upper bound of the same peak: the temporaries' heap is sized for its peak with
fragmentation, and an output counts from the step's start.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


#: the compiler options that make XLA write what this module reads into `directory`
def dump_options(directory: str | Path) -> dict[str, object]:
    return {"xla_dump_to": str(directory), "xla_dump_hlo_as_text": True}


#: how a buffer is grouped, by what made it (op names as JAX writes them)
ARGUMENTS = "arguments (parameters, optimizer state, batch)"
OUTPUTS = "outputs made by the step"
SAVED = "activations kept for the backward pass"
BACKWARD = "backward pass (gradients)"
COLLECTED = "collectives' results (reduced gradients, gathered weights)"
OTHER = "other temporaries"
HEAP_GAPS = "gaps in XLA's heap at the peak (buffers of other times laid out above them)"
_COLLECTIVES = ("psum", "psum_scatter", "all_gather", "all_to_all", "ppermute", "pmax", "pmin")

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_LIVE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?metadata=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELDS = re.compile(r"(\w+)=(\d+)")


@dataclass(frozen=True)
class Buffer:
    """One buffer live at the peak."""

    name: str  # the HLO value (instruction, and tuple index where it has one)
    shape: str
    nbytes: int
    group: str
    op_name: str  # JAX's name of the operation that made it ("" for an argument)
    source: str  # the source line that made it, "file:line (function)"; "" where unknown
    argument: int | None = None  # the program argument it holds, where it is one


@dataclass(frozen=True)
class MemoryAtPeak:
    """What a program holds at its peak as XLA counts it: every argument and output, and
    the temporaries live where the most of them are; largest first."""

    peak_bytes: int
    buffers: tuple[Buffer, ...]
    #: bytes of the temporaries' heap that no buffer holds at the peak: XLA laid buffers
    #: live at other times above them (the heap's extent is its largest live offset+size)
    heap_gaps_bytes: int = 0

    def by_group(self) -> dict[str, int]:
        """Bytes at the peak per group, largest first."""
        totals: Counter[str] = Counter()
        for b in self.buffers:
            totals[b.group] += b.nbytes
        return dict(totals.most_common())

    def describe(self, buffer: Buffer, argument_names: list[str] | None = None) -> str:
        """What made `buffer`: its argument's name (`argument_names`: the program's
        flattened arguments), or its source line and op name."""
        if buffer.argument is not None:
            names = argument_names or []
            return (
                names[buffer.argument]
                if buffer.argument < len(names)
                else (f"argument {buffer.argument}")
            )
        op = buffer.op_name.rpartition("/")[2] or buffer.name
        return f"{buffer.source}: {op}" if buffer.source else buffer.op_name or buffer.name

    def text(self, top: int = 10, argument_names: list[str] | None = None) -> str:
        """The groups and the `top` largest buffers, a line each."""
        lines = [f"memory at the peak: {self.peak_bytes / 2**30:.2f} GiB"]
        lines += [f"  {n / 2**30:8.2f} GiB  {g}" for g, n in self.by_group().items()]
        if self.heap_gaps_bytes:
            lines.append(f"  {self.heap_gaps_bytes / 2**30:8.2f} GiB  {HEAP_GAPS}")
        lines.append("  largest buffers live at the peak:")
        for b in self.buffers[:top]:
            what = self.describe(b, argument_names)
            lines.append(f"  {b.nbytes / 2**20:10.1f} MiB  {b.shape:<28} {what}")
        return "\n".join(lines)


def library_directories() -> tuple[str, ...]:
    """This package's source directories: frames there are the library's, not the user's.
    Its passes and runtime lie beside it in a checkout (`package-dir`), inside it once
    installed."""
    import xla_strategies.passes

    package = Path(__file__).parents[1]
    passes = Path(xla_strategies.passes.__file__).parent
    return tuple(f"{d}/" for d in dict.fromkeys((package, passes, passes.parent / "runtime")))


def memory_at_peak(dump_directory: str | Path, library_paths: tuple[str, ...] = ()) -> MemoryAtPeak:
    """The buffers live at the peak of the program XLA dumped into `dump_directory` (the
    largest module there, by its buffer assignment); a buffer's source line is the
    innermost frame outside JAX and outside `library_paths`."""
    assignment = _largest(Path(dump_directory))
    stem = assignment.name.removesuffix("-buffer-assignment.txt")
    hlo = assignment.with_name(stem + ".txt").read_text()
    live = _live_ranges(assignment.with_name(stem + "-live-range.txt").read_text())
    slots = _slots(assignment.read_text(), live)
    at = _temporaries_peak(slots)
    made_by = _made_by(hlo, library_paths)
    buffers = []
    live_temporaries = 0
    for (kind, _, _, size), values in slots.items():
        if _is_whole(kind):  # named by the largest value placed there: the output itself
            name, shape = max(values, key=lambda v: _elements(v[2]))[1:]
        else:
            alive = [(n, s) for ranges, n, s in values if any(a <= at <= b for a, b in ranges)]
            if not alive:
                continue
            name, shape = alive[0]
            live_temporaries += size
        op_name, source = made_by.get(name.partition("{")[0], ("", ""))
        argument = int(kind.split()[1]) if kind.startswith("parameter") else None
        group = _group(kind, op_name)
        buffers.append(Buffer(name, _short(shape), size, group, op_name, source, argument))
    buffers.sort(key=lambda b: -b.nbytes)
    gaps = max(0, _heap_bytes(assignment.read_text()) - live_temporaries)
    return MemoryAtPeak(sum(b.nbytes for b in buffers), tuple(buffers), gaps)


def _largest(directory: Path) -> Path:
    found = sorted(directory.rglob("*after_optimizations-buffer-assignment.txt"))
    if not found:
        raise FileNotFoundError(
            f"{directory} holds no buffer assignment: compile with dump_options({directory!r})"
        )
    return max(found, key=lambda p: p.stat().st_size)


def _live_ranges(text: str) -> dict[str, list[tuple[int, int]]]:
    """Value name ("name" or "name{i}") -> its live ranges in the flattened schedule."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for line in text.split("BufferLiveRange:", 1)[-1].splitlines():
        found = _LIVE.match(line)
        if found:
            name = found[1].removesuffix("{}")
            ranges.setdefault(name, []).append((int(found[2]), int(found[3])))
    return ranges


def _slots(assignment: str, live: dict[str, list[tuple[int, int]]]) -> dict:
    """(allocation kind, allocation, offset, bytes) -> the values placed there, each as
    (live ranges, name, shape). Values at one place of a temporaries' allocation are either
    alive at different times (XLA reused the bytes) or one buffer under several names (a
    loop's carry): at any point of the schedule the place counts once. An argument's or an
    output's allocation counts whole (at offset 0), as XLA's memory analysis
    counts it, whatever the compiler put in it before the output was made."""
    slots: dict[tuple[str, int, int, int], list[tuple[list, str, str]]] = {}
    kind, index, size = "", -1, 0
    end = max((e for rs in live.values() for _, e in rs), default=0)
    for line in assignment.split("\nUsed values:", 1)[0].splitlines():
        allocation = _ALLOCATION.match(line)
        if allocation:
            index, size, kind = int(allocation[1]), int(allocation[2]), _kind(allocation[3])
            continue
        value = _VALUE.match(line)
        if value is None or kind in ("thread-local", "constant") or kind.startswith("color"):
            continue  # the program's own constants XLA counts with its code, not its memory
        name, shape = value[1].removesuffix("{}"), value[4]
        if shape.startswith("("):  # a tuple's table of pointers, not its elements' bytes
            continue
        if _is_whole(kind):
            place, ranges = (kind, index, 0, size), [(0, end)]
        else:
            place, ranges = (kind, index, int(value[3]), int(value[2])), live.get(name, [])
        slots.setdefault(place, []).append((ranges, name, shape))
    return slots


def _heap_bytes(assignment: str) -> int:
    """The bytes of the temporaries' allocations in device memory: their heap's extent."""
    return sum(
        int(found[2])
        for found in map(_ALLOCATION.match, assignment.splitlines())
        if found and _kind(found[3]) in ("preallocated-temp", "temporary")
    )


def _is_whole(kind: str) -> bool:
    return kind.startswith("parameter") or kind == "maybe-live-out"


def _kind(attributes: str) -> str:
    """An allocation's kind; "color N" for one outside device memory (N > 0: on-chip
    memories, which hold copies the compiler prefetched and count nothing here)."""
    color = re.match(r"color (\d+)", attributes)
    if color and color[1] != "0":
        return f"color {color[1]}"
    argument = re.search(r"parameter (\d+)", attributes)
    if argument:
        return f"parameter {argument[1]}"
    for kind in ("preallocated-temp", "maybe-live-out", "constant", "thread-local"):
        if kind in attributes:
            return kind
    return "temporary"


def _temporaries_peak(slots: dict) -> int:
    """The point of the schedule where the most bytes of temporaries are live."""
    events: Counter[int] = Counter()
    for (kind, _, _, size), values in slots.items():
        if _is_whole(kind):
            continue
        for start, end in _merged([r for ranges, _, _ in values for r in ranges]):
            events[start] += size
            events[end + 1] -= size
    at = live = peak = 0
    for time in sorted(events):
        live += events[time]
        if live > peak:
            at, peak = time, live
    return at


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _group(kind: str, op_name: str) -> str:
    if kind.startswith("parameter"):
        return ARGUMENTS
    if kind == "maybe-live-out":
        return OUTPUTS
    if op_name.endswith(_COLLECTIVES):
        return COLLECTED
    if "transpose(" in op_name:
        return BACKWARD
    if "jvp(" in op_name or "checkpoint" in op_name or "remat" in op_name:
        return SAVED
    return OTHER


def _elements(shape: str) -> int:
    dims = re.search(r"\[([\d,]*)\]", shape)
    count = 1
    for d in dims[1].split(",") if dims and dims[1] else []:
        count *= int(d)
    return count


def _short(shape: str) -> str:
    """`bf16[8,1024,1024]{2,1,0:T(8,128)}` -> `bf16[8,1024,1024]`."""
    return shape.split("{", 1)[0]


def _made_by(hlo: str, library_paths: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Instruction name -> (op name, the source line outside JAX and the library)."""
    frames = _stack_frames(hlo)
    made: dict[str, tuple[str, str]] = {}
    for line in hlo.splitlines():
        found = _INSTRUCTION.match(line)
        if found is None:
            continue
        metadata = found[2]
        op_name = _OP_NAME.search(metadata)
        frame = _FRAME_ID.search(metadata)
        source = _SOURCE.search(metadata)
        where = ""
        if frame:
            where = _user_frame(frames, int(frame[1]), library_paths)
        elif source:
            where = f"{source[1]}:{source[2]}"
        made[found[1]] = (op_name[1] if op_name else "", where)
    return made


def _stack_frames(hlo: str) -> dict[int, tuple[str, int, str, int]]:
    """Frame id -> (file, line, function, parent frame id), from the HLO module's
    FileNames / FunctionNames / FileLocations / StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
            continue
        row = _TABLE_ROW.match(line) if section else None
        if row is None:
            section = None
            continue
        tables[section][int(row[1])] = row[2]
    files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locations = {k: dict(_FIELDS.findall(v)) for k, v in tables.get("FileLocations", {}).items()}
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        fields = dict(_FIELDS.findall(v))
        where = locations.get(int(fields.get("file_location_id", 0)), {})
        frames[k] = (
            files.get(int(where.get("file_name_id", 0)), "").strip('"'),
            int(where.get("line", 0)),
            functions.get(int(where.get("function_name_id", 0)), "").strip('"'),
            int(fields.get("parent_frame_id", 0)),
        )
    return frames


def _user_frame(frames: dict, frame_id: int, library_paths: tuple[str, ...]) -> str:
    """The innermost frame of `frame_id`'s stack outside JAX and `library_paths`; "" where
    every one is inside them."""
    chain, seen = [], set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        chain.append(frames[frame_id])
        frame_id = frames[frame_id][3]
    if not chain:
        return ""
    outside = [f for f in chain if not _in_library(f[0], library_paths)]
    if not outside:  # made by JAX or the library itself: its op name says more
        return ""
    file, line, function, _ = outside[0]
    return f"{Path(file).name}:{line} ({function})"


def _in_library(file: str, library_paths: tuple[str, ...]) -> bool:
    return "/jax/" in file or "/jaxlib/" in file or any(file.startswith(p) for p in library_paths)
