"""What the step estimate was fitted to: a hardware file's `[calibration]` table.

The estimate (`hlo_roofline` for compute, the cost model for each collective, XLA's
schedule for what hides) is a model whose rates are the chip's datasheet peaks. Measured
steps run slower: matmuls reach a fraction of peak, device memory a fraction of its
bandwidth, links a fraction of theirs, and XLA's schedule hides only part of the
communication it overlaps. A generation's `[calibration]` gives those fractions, fitted to
measured steps (the rows it names), and the error band over every measured row, the ones
kept out of the fit included:

    [calibration]
    matmul_fraction = 0.62     # of the peak flops a step's matmuls achieve
    memory_fraction = 0.80     # of device memory's bandwidth
    link_fraction = 0.70       # of each link's bandwidth
    hidden_fraction = 0.85     # of overlapped communication XLA's schedule really hides
    fitted_to = ["Llama 2 70B, v5p-128, MaxText: 692 tokens/s/chip", ...]
    checked_on = ["Mixtral 8x7B, v5p-128, MaxText: 2,909 tokens/s/chip"]
    error_band = 0.08          # the largest relative error of the estimate on those rows
    not_fitted = ["link_fraction"]   # left at 1: no measured row exercised it (one GPU)
    source = "..."

`Topology.from_name` applies the fractions to its rates, so the passes' cost model and the
report read one model. A file without the table is uncalibrated, and every estimate from
it says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: what each fraction scales, as a report names it
_TERMS = {
    "matmul_fraction": "matmuls",
    "memory_fraction": "memory",
    "link_fraction": "links",
    "hidden_fraction": "overlap",
}


@dataclass(frozen=True)
class Calibration:
    """Fractions of the datasheet rates that measured steps achieve, and what they were
    fitted to and checked on."""

    matmul_fraction: float = 1.0
    memory_fraction: float = 1.0
    link_fraction: float = 1.0
    hidden_fraction: float = 1.0
    fitted_to: tuple[str, ...] = ()
    checked_on: tuple[str, ...] = ()
    error_band: float | None = None
    #: fractions left at 1 because no measured row exercised them (one GPU: no links)
    not_fitted: tuple[str, ...] = ()
    source: str = ""

    @classmethod
    def of(cls, config: dict[str, Any], where: str) -> Calibration | None:
        """The `[calibration]` table of a hardware file (`where`, for errors); None where the
        file has none."""
        table = config.get("calibration")
        if table is None:
            return None
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(
                f"{where} [calibration]: unknown keys {unknown}; known {sorted(known)}"
            )
        found = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in table.items()})
        fractions = (found.matmul_fraction, found.memory_fraction, found.link_fraction)
        if not all(0 < f <= 1 for f in (*fractions, found.hidden_fraction)):
            raise ValueError(f"{where} [calibration]: every fraction must lie in (0, 1]")
        if not found.fitted_to:
            raise ValueError(f"{where} [calibration]: fitted_to must name the measured steps")
        if not set(found.not_fitted) <= set(_TERMS):
            raise ValueError(
                f"{where} [calibration]: not_fitted names {sorted(found.not_fitted)}; "
                f"fractions are {sorted(_TERMS)}"
            )
        if any(getattr(found, f) != 1.0 for f in found.not_fitted):
            raise ValueError(f"{where} [calibration]: a fraction not fitted must be 1")
        return found

    def describe(self) -> str:
        """One line for a report: what the estimate was fitted to, and its error band."""
        band = "" if self.error_band is None else f", within ±{self.error_band:.0%}"
        checked = (
            f", checked on {len(self.checked_on)} more"
            if self.checked_on
            else ", none kept out to check it"
        )
        unfitted = (
            f"; {' and '.join(_TERMS[f] for f in self.not_fitted)} not fitted (no measured "
            "step exercised them)"
            if self.not_fitted
            else ""
        )
        return (
            f"calibrated against {len(self.fitted_to)} measured step(s){checked}{band}"
            f"{unfitted} (tpu_configs/ [calibration])"
        )


def uncalibrated(hardware: str) -> str:
    """The label of an estimate whose hardware file has no `[calibration]`."""
    return (
        f"uncalibrated: {hardware}'s datasheet rates, never fitted to a measured step (a "
        "bound: measured steps run slower)"
    )
