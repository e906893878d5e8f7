"""The `xla-strategies` command line: demo, dump, aot, plan, report, show, opt, ledger."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from xla_strategies.passes import DEFAULT_PIPELINE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xla-strategies", description=__doc__)
    commands = parser.add_subparsers(dest="command_name", required=True)
    demo = commands.add_parser("demo", help="train a transformer LM with MirroredStrategy")
    from xla_strategies.demo import train

    train.add_arguments(demo)

    dump = commands.add_parser(
        "dump",
        help="run a script with dumping on and index the dumps",
        usage="xla-strategies dump [options] -- python train.py ARGS...",
    )
    dump.add_argument("--out", default="dumps", help="dump directory (default: dumps)")
    printing = dump.add_mutually_exclusive_group()
    printing.add_argument("--print-ir-after-all", action="store_true")
    printing.add_argument("--print-ir-after-change", action="store_true")
    dump.add_argument("--pipeline", help="run this pass pipeline spec instead of the strategy's")
    dump.add_argument(
        "--stop-after-compile", action="store_true", help="exit once the first step compiled"
    )
    dump.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")

    aot = commands.add_parser(
        "aot",
        help="compile a script's first step for a TPU slice or GPU nodes, without them",
        usage="xla-strategies aot --topology v5e-256 [--out DIR] -- python train.py ARGS...",
    )
    aot.add_argument(
        "--topology",
        required=True,
        help="a TPU slice (v5e-256, 2xv5p-512) or GPU nodes (dgx-h100, 2xdgx-h100)",
    )
    aot.add_argument("--out", default="aot_dumps", help="dump directory (default: aot_dumps)")
    aot.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds before the script is ended, SIGTERM then SIGKILL 10 s later, and "
        "aot fails (default: 3600); while it waits, aot says what the script "
        "is doing (--progress-every)",
    )
    aot.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds between the lines that say what the script is doing (default: 30)",
    )
    aot.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")

    plan = commands.add_parser(
        "plan",
        help="before launch: compile a script's first step in every candidate configuration "
        "for a topology, and say what fits and what is fastest",
        usage="xla-strategies plan --topology v5e-256 [--budget MINUTES] -- python train.py",
    )
    plan.add_argument("--topology", required=True, help="a TPU slice or GPU nodes")
    plan.add_argument(
        "--budget", type=float, help="minutes of compiling, then the best so far (default: all)"
    )
    plan.add_argument("--out", default="plan_dumps", help="dump directory (default: plan_dumps)")
    plan.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds before the script is ended"
    )
    plan.add_argument(
        "--progress-every", type=float, default=30.0, metavar="SECONDS", help=argparse.SUPPRESS
    )
    plan.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")

    report = commands.add_parser(
        "report",
        help="read any compiled program's HLO text: its collectives and their cost",
        usage="xla-strategies report FILE.hlo.txt --topology v5e-256 "
        "[--logical-devices-per-replica K] [--json] [--timeline OUT.json]",
    )
    report.add_argument("file", help="HLO text after optimizations (compiled.as_text())")
    report.add_argument("--topology", help="the topology it was compiled for, e.g. v5e-256")
    report.add_argument(
        "--logical-devices-per-replica",
        type=int,
        default=1,
        metavar="K",
        help="devices each replica spans, neighbours on the topology's fastest axis (a "
        "tensor-parallel program; default: 1). Collectives inside a replica are read as "
        "the model axis's, as the step's own report reads them",
    )
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.add_argument(
        "--timeline",
        metavar="OUT.json",
        help="write the step's estimated timeline as XLA scheduled it: a Chrome trace "
        "(Perfetto, TensorBoard) at OUT.json and a picture at OUT.png (needs --topology)",
    )

    show = commands.add_parser("show", help="show a dumped step's IR")
    show.add_argument("directory")
    show.add_argument("--step", help="the step's name, when the dump holds several")
    show.add_argument("--after", help="the pass (default: the last one)")
    show.add_argument(
        "--diff", nargs=2, metavar=("PASS_A", "PASS_B"), help="unified diff of the IR"
    )
    show.add_argument("--format", choices=("text", "dot", "json"), default="text")

    opt = commands.add_parser("opt", help="run passes on a textual IR file, like mlir-opt")
    opt.add_argument("file")
    opt.add_argument("-p", "--pipeline", default=DEFAULT_PIPELINE, help="pass pipeline spec")
    opt.add_argument("--topology", help="topology name for the cost model, e.g. v5e-16")
    opt.add_argument("--mesh", help="axis sizes, e.g. x=4,y=4 (default: 8 per axis in the IR)")
    opt.add_argument("--print-ir-after-all", action="store_true")

    ledger = commands.add_parser("ledger", help="the collective ledger of a dumped step")
    ledger.add_argument("directory")
    ledger.add_argument("--step")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command_name == "demo":
        from xla_strategies.demo import train
        from xla_strategies.hardware.devices import emulate_cpu_devices

        emulate_cpu_devices()
        train.run(args)
        return 0
    from xla_strategies.cli import commands as cli_commands
    from xla_strategies.passes import IRParseError, PipelineSpecError
    from xla_strategies.step.dump_reader import DumpError

    try:
        return getattr(cli_commands, args.command_name)(args)
    except BrokenPipeError:  # the reader (e.g. `| head`) has gone: not an error
        sys.stderr.close()
        return 0
    except IRParseError as exc:  # `opt` names its input file; `show` reads dump files
        where = getattr(args, "file", None)
        prefix = f"{where}:" if where else f"xla-strategies {args.command_name}: "
        print(f"{prefix}{_bounded(exc)}", file=sys.stderr)
    except (DumpError, PipelineSpecError, OSError, ValueError) as exc:
        # OSError: a missing or unreadable input, a directory given as one, an --out that
        # cannot be written
        print(f"xla-strategies {args.command_name}: {_bounded(exc)}", file=sys.stderr)
    except RecursionError:
        print(
            f"xla-strategies {args.command_name}: the input nests too deeply to read (JSON "
            "or IR regions nested past Python's recursion limit)",
            file=sys.stderr,
        )
    return 1


def _bounded(exc: BaseException) -> str:
    """The error's text with every line cut short (`excerpt`): errors quote what they
    could not read, and a garbage input can be one 10 MB line."""
    from xla_strategies.hardware.hlo import excerpt

    return "\n".join(excerpt(line, 300) for line in str(exc).splitlines())


if __name__ == "__main__":
    sys.exit(main())
