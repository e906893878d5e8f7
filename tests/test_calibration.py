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


def test_the_fitted_generations_say_what_they_were_fitted_to():
    v6e = hlo_report(_HLO, Topology.from_name("v6e-8"))
    assert v6e.calibration.startswith("calibrated against 2 measured step(s), checked on 2 more")
    v5p = hlo_report(_HLO, Topology.from_name("v5p-16"))
    assert "none kept out to check it" in v5p.calibration


@pytest.mark.parametrize("name", ["dgx-h100", "v5e-8"])
def test_an_uncalibrated_estimate_says_so(name):
    report = hlo_report(_HLO, Topology.from_name(name))
    assert report.calibration.startswith("uncalibrated: ")
    assert "never fitted to a measured step" in report.calibration
