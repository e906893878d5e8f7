"""The `xla-strategies` subcommands: dump, aot, report, show, opt and ledger."""

from __future__ import annotations

import difflib
import os
import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xla_strategies.cli.run_until_compiled import runs_in_process
from xla_strategies.cli.script_process import run_owned
from xla_strategies.hardware.hlo_collectives import executed_collectives
from xla_strategies.passes import PassContext, parse, print_graph
from xla_strategies.passes.dump import IRPrinter
from xla_strategies.passes.ir.render import to_dot, to_json_text
from xla_strategies.passes.pipeline import PassPipeline, parse_spec
from xla_strategies.step import dumping
from xla_strategies.step.dump_reader import DumpError, select_step, steps

if TYPE_CHECKING:
    from xla_strategies.hardware.topology import Topology


def dump(args: Namespace) -> int:
    """Run the user's script with dumping on, then print an index of what was dumped."""
    if args.pipeline:
        parse_spec(args.pipeline)  # fail before running anything
    env = {}
    if args.print_ir_after_all or args.print_ir_after_change:
        env[dumping.PRINT_IR] = "all" if args.print_ir_after_all else "change"
    if args.pipeline:
        env[dumping.PIPELINE] = args.pipeline
    returncode = _run_dumped("dump", args.command, Path(args.out), env, args.stop_after_compile)
    if returncode == 0:
        print_index(Path(args.out))
    return returncode


def aot(args: Namespace) -> int:
    """Compile the script's first step for a TPU slice (its TPUStrategy) or GPU nodes (its
    MirroredStrategy for one node, MultiWorkerMirroredStrategy for several), on this
    machine, and print what XLA's compiler says of it: does it fit, and its communication."""
    topology, kind, env = _compile_only_for(args.topology)
    env[dumping.SELECT_BY_COMPILING] = "1"  # the compiler decides what the model cannot
    out = Path(args.out)
    started = time.time()
    if args.progress_every <= 0:
        raise ValueError(f"--progress-every {args.progress_every:g} must be more than 0 s")
    returncode = _run_dumped(
        "aot",
        args.command,
        out,
        env,
        stop_after_compile=True,
        timeout=args.timeout,
        progress_every=args.progress_every,
    )
    if returncode != 0:
        return returncode  # a previous run's summaries in --out are not this run's
    try:
        dumped = steps(out)
    except DumpError:  # a script that compiled nothing left no dump
        dumped = []
    fresh = [s for s in dumped if _written_since(s.directory / "summary.txt", started)]
    on_target = [s for s in fresh if _platform(s.directory) == kind]
    for step in on_target:
        print((step.directory / "summary.txt").read_text(), end="")
    if not on_target:
        compiled = ", ".join(f"{s.name} for {_platform(s.directory)}" for s in fresh)
        strategies = (
            "xs.TPUStrategy(...)"
            if kind == "tpu"
            else "xs.MultiWorkerMirroredStrategy()"
            if topology.mesh_axes.get("host", 1) > 1
            else "xs.MirroredStrategy()"
        )
        print(
            f"xla-strategies aot: the script compiled no {kind.upper()} step"
            + (f" (it compiled {compiled})" if compiled else "")
            + f"; for {topology.name} it must build its strategy with {strategies} and call "
            "a compiled step",
            file=sys.stderr,
        )
        return 1
    return 0


def _compile_only_for(name: str) -> tuple[Any, str, dict[str, str]]:
    """The topology `--topology` names, its kind ("tpu" or "gpu"), and the environment
    that makes the script's strategy compile-only for it."""
    from xla_strategies.hardware.topology import AOT_TOPOLOGY, Topology, hardware_config

    topology = Topology.from_name(name)
    kind = hardware_config(topology.hardware)["kind"]
    if kind not in ("tpu", "gpu"):
        raise ValueError(
            f"--topology {name!r} is neither a TPU slice nor GPU nodes "
            "(e.g. v5e-256, dgx-h100, 2xdgx-h100)"
        )
    env = {AOT_TOPOLOGY: topology.name, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    return topology, kind, env


def plan(args: Namespace) -> int:
    """Run the script until its first step, and plan that step for the topology: every
    candidate configuration compiled, a table of what fits and what is fastest, and the
    lines to paste (`xla_strategies.distribute.planner`)."""
    _, _, env = _compile_only_for(args.topology)
    if args.budget is not None and args.budget <= 0:
        raise ValueError(f"--budget {args.budget:g} must be more than 0 minutes")
    env[dumping.PLAN] = "none" if args.budget is None else str(args.budget * 60)
    return _run_dumped(
        "plan",
        args.command,
        Path(args.out),
        env,
        stop_after_compile=True,
        timeout=args.timeout,
        progress_every=args.progress_every,
    )


def _written_since(path: Path, started: float) -> bool:
    return path.is_file() and path.stat().st_mtime >= started - 1.0  # coarse file clocks


def _platform(directory: Path) -> str:
    import json

    try:
        return json.loads((directory / "compiled_report.json").read_text())["platform"]
    except (OSError, ValueError, KeyError):
        return "an unknown platform"


def report(args: Namespace) -> int:
    """Read a compiled program's HLO text (any program's: ours, `jax.jit`'s, a peer's dump)
    with the reader the step reports use, and print its collectives and their cost."""
    import json

    from xla_strategies.core.layout import checked_devices_per_replica
    from xla_strategies.hardware.compiled_report import hlo_report
    from xla_strategies.hardware.report_text import summary_text
    from xla_strategies.hardware.topology import Topology

    text = Path(args.file).read_text(errors="replace")
    if "HloModule" not in text.split("\n", 1)[0]:
        raise ValueError(f"{args.file} is not HLO text: its first line is not an HloModule")
    devices_per_replica = checked_devices_per_replica(args.logical_devices_per_replica)
    if devices_per_replica > 1 and not args.topology:
        raise ValueError("--logical-devices-per-replica needs --topology: the replicas' axis")
    topology = Topology.from_name(args.topology) if args.topology else None
    if topology is not None:
        topology = topology.split_model_axis(devices_per_replica)
    found = hlo_report(text, topology, devices_per_replica)
    if args.json:
        print(json.dumps(found.to_json(), indent=1))
    else:
        print(summary_text(found, Path(args.file).name))
    if args.timeline:
        _write_timeline(text, topology, devices_per_replica, Path(args.timeline))
    return 0


def _write_timeline(
    text: str, topology: Topology | None, devices_per_replica: int, out: Path
) -> None:
    """`report --timeline`: the trace at `out`, its picture beside it (`.png`)."""
    from xla_strategies.hardware.hlo_timeline import hlo_timeline, save_timeline

    if topology is None:
        raise ValueError("--timeline needs --topology: the rates the timeline is drawn at")
    trace = hlo_timeline(text, topology, devices_per_replica)
    save_timeline(trace, out)
    said = trace["metadata"]
    print(
        f"timeline: {out} and {out.with_suffix('.png')}: {said['step_s'] * 1e3:.2f} ms as "
        f"scheduled, {said['waited_s'] * 1e3:.2f} ms waiting for collectives"
    )


def _run_dumped(
    name: str,
    command: list[str],
    out: Path,
    env: dict[str, str],
    stop_after_compile: bool,
    timeout: float | None = None,
    progress_every: float | None = None,
) -> int:
    """Run `command` with dumping to `out` and `env` on; its exit code. The script ends
    with this command: a SIGTERM or SIGINT to it, or `timeout` seconds, end the script.
    Every `progress_every` seconds a line says what the script is doing."""
    command = command[1:] if command and command[0] == "--" else list(command)
    if not command:
        raise SystemExit(f"{name}: give the command to run after --, e.g. -- python train.py")
    env = {**os.environ, dumping.DUMP_TO: str(out.resolve()), **env}
    if stop_after_compile:
        env[dumping.STOP_AFTER_COMPILE] = "1"
        if runs_in_process(command):  # it stops by raising; this runner exits cleanly
            command = [sys.executable, "-m", "xla_strategies.cli.run_until_compiled", *command]
    (out / dumping.PROGRESS_FILE).unlink(missing_ok=True)  # an earlier run's
    heartbeat = None
    if progress_every is not None:
        heartbeat = (progress_every, lambda elapsed: _heartbeat(name, out, elapsed, timeout))
    returncode = run_owned(command, env, timeout, heartbeat)
    if returncode is None:
        print(
            f"xla-strategies {name}: the script did not finish within --timeout {timeout:g} s "
            "(it may loop before its first step); it was stopped",
            file=sys.stderr,
        )
        return 124  # timeout(1)'s status
    if returncode != 0:
        print(
            f"xla-strategies {name}: the script failed with exit code {returncode}; "
            "its output and traceback are above",
            file=sys.stderr,
        )
    return returncode


def _heartbeat(name: str, out: Path, elapsed: float, timeout: float | None) -> None:
    try:
        phase = (out / dumping.PROGRESS_FILE).read_text().strip()
    except OSError:
        phase = "no step has started compiling yet"
    bound = f" of --timeout {timeout:g} s" if timeout is not None else ""
    print(
        f"xla-strategies {name}: still running after {elapsed:.0f} s{bound}; last: {phase}",
        file=sys.stderr,
        flush=True,
    )


def print_index(out: Path) -> None:
    for step in steps(out):
        ledger = step.ledger() or {"passes": [], "topology": None}
        topology = ledger.get("topology") or "no topology"
        print(f"\nstep {step.name}  ({step.directory}; estimates on {topology})")
        print(f"  {'#':<5}{'pass':<28}{'changed':<9}", end="")
        print(f"{'collectives/step':>17}{'bytes/step':>14}{'est. ms':>10}{'exposed ms':>12}")
        for index, record in enumerate(ledger["passes"]):
            totals = record["totals"]
            estimate = totals["estimated_s"]
            shown = f"{estimate * 1e3:.3f}" if estimate is not None else "n/a"
            exposed = totals.get("exposed_s")  # absent in dumps from before it was recorded
            exposed_ms = f"{exposed * 1e3:.3f}" if exposed is not None else "n/a"
            print(
                f"  {index:04d} {record['pass']:<28}{'yes' if record['changed'] else 'no':<9}"
                f"{totals['collectives_per_step']:>17}{totals['bytes_per_step']:>14,}{shown:>10}"
                f"{exposed_ms:>12}"
            )
        hlo = step.compiled_hlo()
        if hlo is not None:
            reduce = executed_collectives(hlo)["all-reduce"]
            print(
                f"  XLA's compiled HLO runs {reduce['count']} all-reduce(s) per step, "
                f"{reduce['bytes']:,} bytes"
            )


def show(args: Namespace) -> int:
    step = select_step(Path(args.directory), args.step)
    if args.diff:
        before, after = (step.ir_after(name) for name in args.diff)
        diff = difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            f"after {args.diff[0]}",
            f"after {args.diff[1]}",
        )
        sys.stdout.writelines(diff)
        return 0
    text = step.ir_after(args.after)
    if args.format == "text":
        sys.stdout.write(text)
    else:
        graph = parse(text)
        sys.stdout.write(to_dot(graph) if args.format == "dot" else to_json_text(graph))
    return 0


def opt(args: Namespace) -> int:
    """Run passes on a textual IR file, like mlir-opt."""
    from xla_strategies.hardware.topology import Topology

    path = Path(args.file)
    graph = parse(path.read_text())
    topology = Topology.from_name(args.topology) if args.topology else None
    mesh = topology.mesh_axes if topology else _mesh_from(args.mesh, graph)
    pipeline = PassPipeline.from_spec(args.pipeline)
    if args.print_ir_after_all:
        pipeline = pipeline.with_instruments(IRPrinter(sys.stdout))
    pipeline.run(graph, PassContext(mesh_axes=mesh, topology=topology))
    if not args.print_ir_after_all:
        sys.stdout.write(print_graph(graph))
    return 0


def _mesh_from(spec: str | None, graph) -> dict[str, int]:  # noqa: ANN001
    """`--mesh x=4,y=4`; by default every axis the IR names, with 8 participants."""
    if spec:
        mesh = {}
        for item in filter(None, spec.split(",")):
            name, _, size = item.partition("=")
            if not name or not size.isdigit() or int(size) < 1:
                raise ValueError(
                    f"--mesh {spec!r}: each axis is NAME=SIZE with a size of at least 1 "
                    f"(e.g. x=4,y=4), not {item!r}"
                )
            mesh[name] = int(size)
        return mesh
    axes = {a for n in graph.walk() for a in n.attrs.get("axes", [])} if graph else set()
    axes |= {a for v in graph.inputs for a in v.varying_axes}
    return dict.fromkeys(sorted(axes), 8)


def ledger(args: Namespace) -> int:
    step = select_step(Path(args.directory), args.step)
    data = step.ledger()
    if data is None:
        print(f"{step.directory} has no ledger.json", file=sys.stderr)
        return 1
    for record in data["passes"]:
        totals, delta = record["totals"], record["delta"]
        print(
            f"\n== after {record['pass']}: {totals['collectives_per_step']} collectives/step, "
            f"{totals['bytes_per_step']:,} bytes/step "
            f"(change: {delta['collectives_per_step']:+}, {delta['bytes_per_step']:+,} bytes)"
        )
        for c in record["collectives"]:
            estimate = f"{c['estimated_s'] * 1e6:.1f} us" if c["estimated_s"] is not None else "n/a"
            bucket = "" if c["bucket"] is None else f" bucket {c['bucket']}"
            members = ", ".join(c["members"][:4]) + (" ..." if len(c["members"]) > 4 else "")
            print(
                f"  #{c['id']:<3} {c['op']} {c['reduce_op'] or ''} over {c['axes']} {c['dtype']} "
                f"{c['bytes']:,} B x{c['per_step']}{bucket}  {estimate}  [{members}]"
            )
    return 0


__all__ = ["aot", "dump", "ledger", "opt", "plan", "show"]
