"""The step as XLA scheduled it: a timeline read from the compiled HLO, where an
asynchronous collective runs beside the compute scheduled before its done, and what it
does not hide is a wait on the compute track."""

from __future__ import annotations

import json
import zlib

import jax
import jax.numpy as jnp
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from tests.test_hlo_reader_gpu import _ASYNC
from xla_strategies.cli import main as cli
from xla_strategies.hardware.compiled_report import collective_seconds, compiled_report
from xla_strategies.hardware.hlo_collectives import collectives
from xla_strategies.hardware.hlo_timeline import COLLECTIVES, COMPUTE, hlo_timeline, timeline_png
from xla_strategies.hardware.topology import Topology


def _events(trace, category):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == category]


def test_an_asynchronous_collective_runs_beside_the_compute_before_its_done():
    """GPU's spelling (dgx-h100): the all-reduce starts, the async fusion runs, the done
    waits for whatever of the all-reduce the fusion did not hide."""
    topology = Topology.from_name("dgx-h100")
    trace = hlo_timeline(_ASYNC, topology)
    (reduce,) = _events(trace, "collective")
    assert reduce["tid"] == COLLECTIVES and reduce["ts"] == 0
    (collective,) = collectives(_ASYNC)
    assert reduce["dur"] == pytest.approx(1e6 * collective_seconds(collective, topology))
    beside = [e for e in _events(trace, "compute") if e["ts"] < reduce["dur"]]
    assert beside, "the fusion runs while the all-reduce is in flight"
    waits = _events(trace, "wait")
    compute_before_done = sum(e["dur"] for e in beside)
    expected_wait = max(0.0, reduce["dur"] - compute_before_done)
    assert sum(e["dur"] for e in waits) == pytest.approx(expected_wait, abs=1e-6)
    assert trace["metadata"]["waited_s"] == pytest.approx(expected_wait * 1e-6, abs=1e-12)


def test_a_compiled_tpu_step_is_drawn_as_long_as_the_report_estimates(tmp_path):
    strategy = xs.TPUStrategy("v5e-8", compile_only=True)
    tx = optax.adam(1e-3)
    stack = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.float32)

    step = strategy.compile(helpers.scanned_tanh_step(tx), select_by_compiling=False)
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=strategy.split_sharding())
    state = strategy.replicate(stack), strategy.replicate(jax.eval_shape(tx.init, stack))
    compiled = step.lower(*state, x).compile()
    report = compiled_report(compiled, strategy)
    trace = hlo_timeline(compiled.as_text(), strategy.topology)
    # the same rates and the same collectives: the scheduled step is the estimate's, up to
    # how overlap is counted (by schedule here, by XLA's cycle estimates there)
    assert trace["metadata"]["step_s"] == pytest.approx(report.estimate["step_s"], rel=0.1)
    assert {e["tid"] for e in _events(trace, "compute")} == {COMPUTE}
    assert any(e["name"] == "all-reduce" for e in _events(trace, "collective"))
    # the picture: a PNG of the step's width and two tracks
    png = timeline_png(trace, width=400, track_height=10)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[16:24] == bytes.fromhex("0000019000000014")
    (tmp_path / "step.hlo.txt").write_text(compiled.as_text())
    out = tmp_path / "step.json"
    assert cli.main(["report", str(tmp_path / "step.hlo.txt"), "--topology", "v5e-8",
                "--timeline", str(out)]) == 0  # fmt: skip
    assert json.loads(out.read_text())["traceEvents"] and out.with_suffix(".png").exists()
    zlib.decompress(out.with_suffix(".png").read_bytes()[41:-12])  # the pixel data reads
