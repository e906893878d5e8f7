"""`python -m xla_strategies.cli.run_until_compiled COMMAND...`: run a Python program in this
process and exit 0 when its first step has compiled (`xs.errors.StoppedAfterCompile`).

`xla-strategies dump --stop-after-compile` runs the user's command through this, so the
command line, not the library, owns the exit. COMMAND is `python script.py ARGS`,
`python -m module ARGS`, `python -c CODE ARGS` or `xla-strategies SUBCOMMAND ARGS`.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from xla_strategies.core.errors import StoppedAfterCompile


def runs_in_process(command: Sequence[str]) -> bool:
    """Whether `command` is a Python program this module can run."""
    program = os.path.basename(command[0]) if command else ""
    return program.startswith("python") or program == "xla-strategies"


def main(command: Sequence[str]) -> int:
    if not runs_in_process(command):
        raise SystemExit(f"run_until_compiled: not a Python command: {' '.join(command)}")
    args = list(command[1:])
    if os.path.basename(command[0]) == "xla-strategies":  # the console script's module
        args = ["-m", "xla_strategies.cli.main", *args]
    try:
        if args[:1] == ["-m"]:
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[:1] == ["-c"]:  # `python -c CODE ARGS`, as Python runs it
            if len(args) < 2:
                raise SystemExit("run_until_compiled: -c needs the code to run")
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            sys.argv = args
            runpy.run_path(args[0], run_name="__main__")
    except StoppedAfterCompile as stop:
        print(f"xla_strategies: {stop}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
