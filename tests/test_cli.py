"""The `xla-strategies` command line: opt (golden files), dump end to end, show, ledger,
and clear errors with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pydot
import pytest

from tests.filecheck import filecheck
from tests.helpers import ALL_REDUCE_HLO as _HLO
from tests.passes.test_timeline import assert_properly_nested
from xla_strategies.cli.main import main
from xla_strategies.passes import parse, print_graph

ROOT = Path(__file__).parents[1]
GOLDEN = ROOT / "tests" / "golden"
CLI = [sys.executable, "-m", "xla_strategies.cli.main"]


@pytest.mark.parametrize(
    ("source", "options", "expected"),
    [
        ("tied_weight.ir", [], "tied_weight.default.check"),
        (
            "two_level.ir",
            ["-p", "decompose-all-reduces{force=rotated}", "--topology", "v5e-16"],
            "two_level.v5e-16.check",
        ),
        (
            "two_level.ir",
            ["-p", "decompose-all-reduces", "--topology", "v5e-16"],
            "two_level.v5e-16.flat.check",
        ),
    ],
)
def test_opt_output_passes_its_checks(source, options, expected, capsys):
    assert main(["opt", str(GOLDEN / source), *options]) == 0
    out = capsys.readouterr().out
    filecheck(out, (GOLDEN / expected).read_text())
    assert print_graph(parse(out)) == out  # and it is valid IR text


def test_opt_print_ir_after_all_shows_every_pass(capsys):
    assert main(["opt", str(GOLDEN / "tied_weight.ir"), "--print-ir-after-all"]) == 0
    out = capsys.readouterr().out
    assert out.count("// -----// IR Dump After") == 15  # capture + fourteen passes


def test_opt_errors(tmp_path, capsys):
    bad = tmp_path / "bad.ir"
    bad.write_text("func @f(%0: f32[2]) {\n  %1: f32[2] = jax.neg(%7)\n  return %1\n}\n")
    assert main(["opt", str(bad)]) == 1
    assert f"{bad}:2:24: use of undefined value %7" in capsys.readouterr().err
    assert main(["opt", str(GOLDEN / "tied_weight.ir"), "-p", "fuse-everything"]) == 1
    assert (
        "unknown pass 'fuse-everything'; known passes: combine-all-reduces"
        in capsys.readouterr().err
    )


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    out = tmp_path_factory.mktemp("dumps")
    done = subprocess.run(
        [
            *CLI,
            "dump",
            "--out",
            str(out),
            "--stop-after-compile",
            "--",
            sys.executable,
            "examples/train_mlp.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_dump_indexes_every_pass_and_the_compiled_hlo(dumped):
    out, stdout = dumped
    assert "step train_step" in stdout
    for name in ("capture", "insert-reductions", "schedule-all-reduces", "combine-all-reduces"):
        assert name in stdout
    assert "XLA's compiled HLO runs 1 all-reduce(s) per step" in stdout
    step = out / "train_step"
    names = {p.name for p in step.iterdir()}
    assert {"ledger.json", "timeline.json", "stablehlo.mlir", "compiled.hlo.txt"} <= names
    first = (step / "0000.mirrored.after_capture.txt").read_text()
    assert first.startswith("// -----// IR Dump After capture //----- //")


def test_timeline_is_a_properly_nested_chrome_trace(dumped):
    trace = json.loads((dumped[0] / "train_step" / "timeline.json").read_text())
    assert_properly_nested(trace)
    assert any(e["ph"] == "X" and e["tid"] == 2 for e in trace["traceEvents"])  # collectives


def test_show_formats_and_diff(dumped, capsys):
    out = dumped[0]
    assert main(["show", str(out), "--format", "dot"]) == 0
    (graph,) = pydot.graph_from_dot_data(capsys.readouterr().out)
    styles = [n.get("fillcolor") for n in graph.get_nodes()]
    assert '"#f4a261"' in styles  # the collective is highlighted
    assert main(["show", str(out), "--after", "capture", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sum(n["op"] == "all_reduce" for n in data["nodes"]) == 6
    assert main(["show", str(out), "--diff", "insert-reductions", "combine-all-reduces"]) == 0
    diff = capsys.readouterr().out
    assert diff.startswith("--- after insert-reductions\n+++ after combine-all-reduces")
    assert "+" in diff and "concatenate" in diff
    assert main(["ledger", str(out)]) == 0
    ledger = capsys.readouterr().out
    assert "== after combine-all-reduces: 1 collectives/step" in ledger
    assert "args[0]['layers'][0]['kernel']" in ledger  # members name their parameters


def test_show_errors(tmp_path, dumped, capsys):
    assert main(["show", str(tmp_path)]) == 1
    assert "holds no dumps" in capsys.readouterr().err
    assert main(["show", str(dumped[0]), "--after", "fuse-everything"]) == 1
    assert (
        "has no IR after 'fuse-everything'; it has: capture, insert-reductions"
        in capsys.readouterr().err
    )


def test_dump_of_a_failing_script_shows_its_traceback(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("def train():\n    raise RuntimeError('bad learning rate')\n\ntrain()\n")
    done = subprocess.run(
        [*CLI, "dump", "--out", str(tmp_path / "d"), "--", sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "bad learning rate" in done.stderr
    assert "the script failed with exit code 1" in done.stderr
    bad_spec = subprocess.run(
        [*CLI, "dump", "--pipeline", "nope", "--", sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad_spec.returncode == 1 and "unknown pass 'nope'; known passes:" in bad_spec.stderr


def test_show_reports_a_corrupt_dump_file(tmp_path, capsys):
    step = tmp_path / "train_step"
    step.mkdir()
    header = "// -----// IR Dump After capture //----- //\n"
    (step / "0000.mirrored.after_capture.txt").write_text(header + "func @f(%0: f32[2]) {\n")
    assert main(["show", str(tmp_path), "--format", "dot"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("xla-strategies show: ") and "expected" in err


def test_show_and_ledger_name_the_damaged_file(tmp_path, capsys):
    step = tmp_path / "train_step"
    step.mkdir()
    ir = step / "0000.mirrored.after_capture.txt"
    ir.write_bytes(b"\xff\xfe\x00binary")
    assert main(["show", str(tmp_path)]) == 1
    assert f"{ir} is not text" in capsys.readouterr().err
    ir.write_text("// -----// IR Dump After capture //----- //\nfunc @f() {\n  return\n}\n")
    ledger = step / "ledger.json"
    ledger.write_text('{"passes": [{"pass": "capture", "chan')
    assert main(["ledger", str(tmp_path)]) == 1
    assert f"{ledger} is not valid JSON" in capsys.readouterr().err
    ledger.write_text('{"passes": [{"pass": "capture", "changed": false}]}')
    assert main(["ledger", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{ledger}: pass record 0 lacks" in err and "'totals'" in err


def test_report_fails_on_a_truncated_hlo_file_instead_of_reporting_nothing(tmp_path, capsys):
    whole, cut = tmp_path / "whole.hlo.txt", tmp_path / "cut.hlo.txt"
    whole.write_text(_HLO)
    cut.write_text(_HLO[: _HLO.index("  ROOT %n")])
    assert main(["report", str(whole)]) == 0
    assert "all-reduce x1 (32 B)" in capsys.readouterr().out
    assert main(["report", str(cut)]) == 1
    err = capsys.readouterr().err
    assert "ends inside the computation that starts on line 9" in err and "truncated" in err
    garbled = tmp_path / "garbled.hlo.txt"
    garbled.write_text(_HLO.replace("  %ar = f32[8]{0} all-reduce", "  %ar = all-reduce"))
    assert main(["report", str(garbled)]) == 1
    assert "line 11: cannot read this instruction: " in capsys.readouterr().err


def _deep_ir(depth: int) -> str:
    lines = ["func @step(%0: f32[4]) {"]
    for i in range(depth):
        operand = "%0" if i == 0 else f"%r{i - 1}"
        lines += [f"%v{i}: f32[4] = jax.cond({operand}) {{}}", f"region (%r{i}: f32[4]) {{"]
    for i in reversed(range(depth)):
        lines += [f"return %r{i}", "}"]
    return "\n".join([*lines, "return %v0", "}"]) + "\n"


def test_hostile_inputs_are_one_line_errors_not_tracebacks(tmp_path, capsys):
    cases = {
        "a directory": (["report", str(tmp_path)], "Is a directory"),
        "nested regions": (["opt", "DEEP"], "nests too deeply to read"),
        "an empty axis": (["opt", "GOLDEN", "--mesh", "x=0"], "size of at least 1"),
        "an --out that cannot be made": (
            ["aot", "--topology", "v5e-4", "--out", "FILE/aot", "--", "true"],
            "Not a directory",
        ),
    }
    deep = tmp_path / "deep.ir"
    deep.write_text(_deep_ir(3000))
    a_file = tmp_path / "file"
    a_file.write_text("")
    for name, (argv, expected) in cases.items():
        argv = [
            a.replace("DEEP", str(deep))
            .replace("GOLDEN", str(GOLDEN / "two_level.ir"))
            .replace("FILE", str(a_file))
            for a in argv
        ]
        assert main(argv) == 1, name
        err = capsys.readouterr().err
        assert err.startswith("xla-strategies ") and expected in err, (name, err)
    garbage = tmp_path / "garbage.ir"
    garbage.write_text("func @step(%0: f32[4]) {\n  %1: f32[4] = " + "x" * 10_000_000 + "\n}\n")
    assert main(["opt", str(garbage)]) == 1
    assert len(capsys.readouterr().err) < 2_000  # a bounded excerpt, not the 10 MB line
