"""Instruments that show the IR after each pass, the way MLIR and XLA do.

`IRDumper` writes one file per pass, `NNNN.<pipeline>.after_<pass>.txt`, into a directory
(`xla_strategies.step.dumping` says which environment switches it on); `IRPrinter` writes to a
stream (`--print-ir-after-all` / `--print-ir-after-change`). Both start with the capture.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from xla_strategies.passes.base import Instrument, Pass, PassContext
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.passes.ir.text import print_graph


def dump_header(pass_name: str) -> str:
    return f"// -----// IR Dump After {pass_name} //----- //\n"


@dataclass
class IRDumper(Instrument):
    """Writes the IR after capture and after every pass into `directory`."""

    directory: Path
    pipeline_label: str = "pipeline"
    _index: int = field(default=0, init=False)
    _remarks_seen: int = field(default=0, init=False)  # ctx.remarks stays the passes' own

    def before_pipeline(self, graph: Graph, ctx: PassContext) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._index, self._remarks_seen = 0, len(ctx.remarks)
        self._write("capture", graph)

    def after_pass(
        self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool, seconds: float
    ) -> None:
        self._write(pass_.name, graph, ctx.remarks[self._remarks_seen :])
        self._remarks_seen = len(ctx.remarks)

    def _write(self, pass_name: str, graph: Graph, remarks: Sequence[str] = ()) -> None:
        path = self.directory / f"{self._index:04d}.{self.pipeline_label}.after_{pass_name}.txt"
        notes = "".join(f"// remark: {r}\n" for r in remarks)
        path.write_text(dump_header(pass_name) + notes + print_graph(graph))
        self._index += 1


@dataclass
class IRPrinter(Instrument):
    """Prints the IR after capture and after each pass (or only after passes that changed it)."""

    stream: TextIO = field(default_factory=lambda: sys.stderr)
    only_changed: bool = False

    def before_pipeline(self, graph: Graph, ctx: PassContext) -> None:
        self.stream.write(dump_header("capture") + print_graph(graph))

    def after_pass(
        self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool, seconds: float
    ) -> None:
        if changed or not self.only_changed:
            self.stream.write(dump_header(pass_.name) + print_graph(graph))
