"""The estimate says what it was fitted to: a hardware file's `[calibration]` scales the
rates the report and the passes read alike, and a file without one is labelled
uncalibrated in every report."""

from __future__ import annotations

import pytest

from tests.helpers import ALL_REDUCE_HLO as _HLO
from xla_strategies.hardware import topology as topology_module
from xla_strategies.hardware.calibration import Calibration
from xla_strategies.hardware.compiled_report import hlo_report
from xla_strategies.hardware.topology import Topology

_TABLE = {
    "matmul_fraction": 0.5,
    "memory_fraction": 0.8,
    "link_fraction": 0.25,
    "hidden_fraction": 0.9,
    "fitted_to": ["a", "b"],
    "checked_on": ["c"],
    "error_band": 0.07,
}


def test_a_calibration_scales_every_rate_the_estimate_reads(monkeypatch):
    file = topology_module.hardware_config("v5p")
    datasheet = {k: v for k, v in file.items() if k != "calibration"}
    monkeypatch.setattr(topology_module, "hardware_config", lambda name: datasheet)
    raw = Topology.from_name("v5p-128")
    calibrated = {**datasheet, "calibration": _TABLE}
    monkeypatch.setattr(topology_module, "hardware_config", lambda name: calibrated)
    fitted = Topology.from_name("v5p-128")
    assert fitted.peak_flops == pytest.approx(raw.peak_flops * 0.5)
    assert fitted.memory_bandwidth == pytest.approx(raw.memory_bandwidth * 0.8)
    assert [a.bandwidth for a in fitted.axes] == pytest.approx(
        [a.bandwidth * 0.25 for a in raw.axes]
    )
    # the passes price a collective on the same links the report does
    assert fitted.collective_time("all_reduce", 2**30) > 3 * raw.collective_time(
        "all_reduce", 2**30
    )
    # MFU and a new fit read the datasheet's rates: the fractions come back out exactly
    back = fitted.at_datasheet_rates()
    assert (back.peak_flops, back.memory_bandwidth, back.calibration) == pytest.approx(
        (raw.peak_flops, raw.memory_bandwidth, None)
    )
    assert [a.bandwidth for a in back.axes] == pytest.approx([a.bandwidth for a in raw.axes])
    assert fitted.calibration.describe() == (
        "calibrated against 2 measured step(s), checked on 1 more, within ±7% "
        "(tpu_configs/ [calibration])"
    )


def test_a_calibration_must_name_its_steps_and_keep_fractions_in_range():
    with pytest.raises(ValueError, match="fitted_to must name the measured steps"):
        Calibration.of({"calibration": {**_TABLE, "fitted_to": []}}, "x.toml")
    with pytest.raises(ValueError, match=r"every fraction must lie in \(0, 1\]"):
        Calibration.of({"calibration": {**_TABLE, "link_fraction": 1.5}}, "x.toml")
    with pytest.raises(ValueError, match=r"unknown keys \['matmul'\]"):
        Calibration.of({"calibration": {**_TABLE, "matmul": 1}}, "x.toml")
    assert Calibration.of({}, "x.toml") is None
    with pytest.raises(ValueError, match="not_fitted names"):
        Calibration.of({"calibration": {**_TABLE, "not_fitted": ["links"]}}, "x.toml")
    with pytest.raises(ValueError, match="a fraction not fitted must be 1"):
        Calibration.of({"calibration": {**_TABLE, "not_fitted": ["link_fraction"]}}, "x.toml")


def test_the_gpu_fit_recovers_the_fractions_its_steps_ran_at():
    """Steps made at known fractions (a matmul-bound and a memory-bound instruction mix):
    the fit finds the memory fraction they ran at, and the estimate then equals them."""
    from benchmarks.gpu_calibration_fit import estimate_s, fit_memory_fraction

    topology = Topology.from_name("dgx-h200").at_datasheet_rates()
    peak = topology.peak_flops

    def terms(matmul_flops: float, matmul_bytes: float, other_bytes: float) -> dict:
        instruction = {"flops_at_bf16_peak": matmul_flops, "hbm_bytes": matmul_bytes}
        return {
            "matmul_instructions": [{**instruction, "times": 24}],
            "other_hbm_bytes": other_bytes,
            "async_copy_hbm_bytes": 0.0,
        }

    steps = [terms(peak * 1e-3, 2e9, 5e10), terms(peak * 4e-3, 1e9, 1e10)]
    rows = [(t, estimate_s(t, topology, 0.5, 0.7)) for t in steps]
    assert fit_memory_fraction(rows, topology, 0.5) == pytest.approx(0.7)
    assert fit_memory_fraction(rows, topology, 0.5) != fit_memory_fraction(rows, topology, 0.9)


def test_the_fitted_generations_say_what_they_were_fitted_to():
    v6e = hlo_report(_HLO, Topology.from_name("v6e-8"))
    assert v6e.calibration.startswith("calibrated against 2 measured step(s), checked on 2 more")
    v5p = hlo_report(_HLO, Topology.from_name("v5p-16"))
    assert "none kept out to check it" in v5p.calibration


_FITTED_ON_ONE_GPU = ("calibrated against 4 measured step(s)", "links and overlap not fitted")
_UNCALIBRATED = ("uncalibrated: ", "never fitted to a measured step")


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("dgx-h200", _FITTED_ON_ONE_GPU),
        ("2xdgx-h100", _FITTED_ON_ONE_GPU),
        ("v4-16", _UNCALIBRATED),
        ("v5e-8", _UNCALIBRATED),
    ],
)
def test_every_estimate_says_what_it_was_fitted_to_or_that_it_was_not(name, label):
    report = hlo_report(_HLO, Topology.from_name(name))
    starts, says = label
    assert report.calibration.startswith(starts)
    assert says in report.calibration


def test_a_verdict_cached_under_other_rates_is_not_reused():
    """The compiler's verdicts are cached by the program's fingerprint: a refitted
    `[calibration]` changes the estimates they were chosen by, so it changes the key."""
    from xla_strategies.step.verdict_cache import fingerprint

    fitted = Topology.from_name("dgx-h200")
    assert fingerprint("ir", fitted, None) == fingerprint(
        "ir", Topology.from_name("dgx-h200"), None
    )
    assert fingerprint("ir", fitted, None) != fingerprint("ir", fitted.at_datasheet_rates(), None)
