"""Pass pipeline: spec strings, instruments, dumps, and errors that carry pass history."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest

from xla_strategies.passes import (
    PASS_REGISTRY,
    InsertReductions,
    Pass,
    PassContext,
    PassPipeline,
    parse,
)
from xla_strategies.passes.dump import IRDumper, IRPrinter, dump_header
from xla_strategies.passes.ir.verifier import VerificationError
from xla_strategies.passes.pipeline import PassTimer, PipelineSpecError, parse_spec

GRAD = """\
func @step(%0: f32[4]{replica}) {
  %1: f32[4] = all_reduce(%0) {"axes": ["replica"], "origin": "autodiff", "reduce_op": "sum"}
  %2: f32[4] = scale(%1) {"axes": ["replica"], "factor": 1, "origin": "gradient"}
  return %2
}
"""


def _ctx() -> PassContext:
    return PassContext(mesh_axes={"replica": 8})


def test_spec_builds_passes_with_options():
    (only,) = parse_spec("insert-reductions{gradient-reduction=sum}")
    assert only == InsertReductions(gradient_reduction="sum")
    assert only.spec() == "insert-reductions{gradient-reduction=sum}"
    pipeline = PassPipeline.from_spec(" insert-reductions , insert-reductions ")
    assert pipeline.spec() == "insert-reductions,insert-reductions"


def test_a_spec_names_the_passes_that_run():
    """Two pipelines with one spec run the same passes: a disabled pass is not in it (a
    verdict cached for one pipeline was reused for another that disabled a pass)."""
    from xla_strategies.passes.pipeline import without_pass

    pipeline = PassPipeline.from_spec("insert-reductions,fold-invariant-reductions")
    disabled = without_pass(pipeline, "fold-invariant-reductions")
    assert disabled.spec() == "insert-reductions"
    assert PassPipeline.from_spec(disabled.spec()).enabled_names() == disabled.enabled_names()


def test_spec_errors_name_the_problem():
    with pytest.raises(
        PipelineSpecError,
        match="unknown pass 'combine-everything'; known passes: combine-all-reduces, decompose-all-reduces, fold-invariant-reductions, hoist-all-reduces, inline-nested-calls, insert-reductions, materialize-early-matmuls, prefetch-all-gathers, reassociate-all-reduces",
    ):
        parse_spec("insert-reductions,combine-everything")
    with pytest.raises(
        PipelineSpecError, match="has no option 'threshold' \\(options: gradient-reduction\\)"
    ):
        parse_spec("insert-reductions{threshold=4}")
    with pytest.raises(PipelineSpecError, match="malformed pipeline spec at column 1"):
        parse_spec("{oops}")
    with pytest.raises(ValueError, match="gradient-reduction must be 'mean' or 'sum'"):
        parse_spec("insert-reductions{gradient-reduction=median}")


@dataclass(frozen=True)
class _Explode(Pass):
    name = "explode"

    def run(self, graph, ctx):
        raise RuntimeError("boom")


@dataclass(frozen=True)
class _Corrupt(Pass):
    name = "corrupt"

    def run(self, graph, ctx):
        graph.nodes[0].outputs[0].shape = (
            5,
        )  # the all_reduce result no longer matches its operand
        return True


def test_failing_pass_reports_the_passes_before_it():
    pipeline = PassPipeline(passes=(InsertReductions(), _Explode()))
    with pytest.raises(RuntimeError, match="boom") as info:
        pipeline.run(parse(GRAD), _ctx())
    assert (
        "while running pass 'explode'; passes run before it: capture, insert-reductions"
        in info.value.__notes__
    )


def test_verifier_runs_after_every_pass():
    pipeline = PassPipeline(passes=(_Corrupt(),))
    with pytest.raises(ValueError, match="differs from operand") as info:
        pipeline.run(parse(GRAD), _ctx())
    assert any("pass 'corrupt'" in note for note in info.value.__notes__)


def test_disabled_passes_are_skipped_and_stop_after_stops():
    graph = parse(GRAD)
    PassPipeline(passes=(InsertReductions(),), disabled=frozenset({"insert-reductions"})).run(
        graph, _ctx()
    )
    assert graph.nodes[1].attrs["factor"] == 1
    pipeline = PassPipeline(passes=(InsertReductions(), _Explode()))
    pipeline.run(graph, _ctx(), stop_after="insert-reductions")  # never reaches explode
    assert graph.nodes[1].attrs["factor"] == 1 / 8
    with pytest.raises(PipelineSpecError, match="no pass named 'nope'"):
        pipeline.run(graph, _ctx(), stop_after="nope")


def test_dumper_writes_one_file_per_pass(tmp_path):
    timer = PassTimer()
    pipeline = PassPipeline.from_spec("insert-reductions").with_instruments(
        IRDumper(tmp_path, "mirrored"), timer
    )
    ctx = _ctx()
    pipeline.run(parse(GRAD), ctx)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["0000.mirrored.after_capture.txt", "0001.mirrored.after_insert-reductions.txt"]
    after = (tmp_path / files[1]).read_text()
    assert after.startswith(dump_header("insert-reductions"))
    assert '"factor": 0.125' in after and "// by insert-reductions" in after
    assert (
        set(timer.seconds) == {"insert-reductions"}
        and ctx.stats["pass_seconds"]["insert-reductions"] >= 0
    )


def test_dumping_does_not_change_what_the_passes_report(tmp_path):
    spec = "insert-reductions,decompose-all-reduces,combine-all-reduces"
    plain, dumped = _ctx(), _ctx()
    PassPipeline.from_spec(spec).run(parse(GRAD), plain)
    PassPipeline.from_spec(spec).with_instruments(IRDumper(tmp_path)).run(parse(GRAD), dumped)
    assert (
        plain.remarks
        == dumped.remarks
        == ["decompose-all-reduces: no topology, nothing decomposed"]
    )
    files = sorted(tmp_path.iterdir())
    assert "// remark: decompose-all-reduces: no topology" in files[2].read_text()
    assert "// remark:" not in files[1].read_text() + files[3].read_text()


def test_printer_after_change_skips_unchanged_passes():
    stream = io.StringIO()
    graph = parse(GRAD)
    pipeline = PassPipeline.from_spec("insert-reductions,insert-reductions")
    pipeline.with_instruments(IRPrinter(stream, only_changed=True)).run(graph, _ctx())
    # the capture, then the first run (changed); the second run changes nothing
    assert stream.getvalue().count("// -----// IR Dump After") == 2


def test_registry_names_match_classes():
    for name, cls in PASS_REGISTRY.items():
        assert cls.name == name


def test_settings_fill_only_what_the_spec_left_unset():
    from xla_strategies.passes import CombineAllReduces
    from xla_strategies.passes.pipeline import fill_options

    spec = PassPipeline.from_spec("insert-reductions,combine-all-reduces")
    filled = fill_options(spec, CombineAllReduces, "bytes_per_pack", threshold_bytes=4096)
    assert filled.passes[1].threshold_bytes == 4096
    written = PassPipeline.from_spec("combine-all-reduces{threshold-bytes=65536}")
    assert fill_options(written, CombineAllReduces, "x", first_bucket_bytes=8).passes[0] == (
        CombineAllReduces(threshold_bytes=65536, first_bucket_bytes=8)
    )
    with pytest.raises(
        PipelineSpecError,
        match=r"sets combine-all-reduces\{threshold-bytes=65536\} but bytes_per_pack asks for 4096",
    ):
        fill_options(written, CombineAllReduces, "bytes_per_pack", threshold_bytes=4096)
    # an option written at its default value still counts as chosen
    default = PassPipeline.from_spec("insert-reductions{gradient-reduction=mean}")
    with pytest.raises(PipelineSpecError, match="gradient-reduction=mean"):
        fill_options(default, InsertReductions, "compile(...)", gradient_reduction="sum")


def test_a_broken_input_graph_is_caught_before_any_pass():
    broken = GRAD.replace(
        '{"axes": ["replica"], "origin": "autodiff"', '{"axes": ["model"], "origin": "autodiff"'
    )
    pipeline = PassPipeline(passes=(InsertReductions(),), disabled=frozenset({"insert-reductions"}))
    with pytest.raises(VerificationError, match=r"unknown mesh axis \['model'\]") as info:
        pipeline.run(parse(broken), _ctx())
    assert any("before any pass" in note for note in info.value.__notes__)
