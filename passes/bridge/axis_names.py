"""The capture's mesh axis names: renaming the names a step was traced with to the
strategy's, and naming an axis the step uses that the mesh does not have."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.extend.core as jex

from xla_strategies.passes.ir.graph import Value


class UnknownAxisError(ValueError):
    """The step uses a collective over an axis the strategy's mesh does not have."""


class AxisRenamer:
    """Maps the capture mesh's axis names to the strategy's, in IR values, collective
    attributes and the parameters of foreign equations (`axis_index`, grouped `psum`)."""

    _PARAM_KEYS = ("axes", "axis_name")

    def __init__(self, rename: Mapping[str, Sequence[str]]) -> None:
        self._rename = {k: tuple(v) for k, v in rename.items()}

    def names(self, names: Sequence[str]) -> list[str]:
        out: list[str] = []
        for n in names:
            out.extend(a for a in self._rename.get(n, (n,)) if a not in out)
        return out

    def value(self, value: Value) -> Value:
        if self._rename and value.varying_axes:
            value.varying_axes = frozenset(self.names(sorted(value.varying_axes)))
        return value

    def equation(self, eqn: jex.JaxprEqn) -> jex.JaxprEqn:
        if not self._rename:
            return eqn
        if eqn.primitive.name == "pallas_call" and eqn.params.get("interpret"):
            # the interpreter runs the kernel's own equations, which keep the trace's mesh
            raise NotImplementedError(
                "a Pallas kernel in interpret mode (interpret=True) cannot run in a step "
                f"compiled with axis_name= (here {sorted(self._rename)}): compile it "
                "without axis_name (xs.get_replica_context() names the replicas), or run "
                "the kernel compiled, on its accelerator or for a TPU topology"
            )
        changes = {}
        for key in self._PARAM_KEYS:
            names = eqn.params.get(key)
            if isinstance(names, str) and names in self._rename:
                renamed = self._rename[names]
                changes[key] = renamed[0] if len(renamed) == 1 else renamed
            elif isinstance(names, tuple) and any(n in self._rename for n in names):
                changes[key] = tuple(self.names(names))
        return eqn.replace(params={**eqn.params, **changes}) if changes else eqn


def diagnose_unknown_axis(
    retrace: Callable[[], Any], axes: tuple[str, ...], original: Exception
) -> None:
    """JAX reports an unbound collective axis as a bare assertion. Trace again with JAX's
    traceback filtering off, find the collective's axis names in its frames, and name the
    unknown one. Returns quietly when the failure is something else."""
    from jax._src import config

    try:
        with config.traceback_filtering("off"):
            retrace()
    except (AssertionError, NameError) as exc:
        _raise_if_unknown_axis(exc, axes, original)


def _raise_if_unknown_axis(exc: BaseException, axes: tuple[str, ...], original: Exception) -> None:
    tb = exc.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        for key in ("axis_name", "axes", "names"):
            names = local.get(key)
            names = (names,) if isinstance(names, str) else names
            if isinstance(names, tuple) and all(isinstance(n, str) for n in names):
                unknown = [n for n in names if n not in axes]
                if unknown:
                    raise UnknownAxisError(
                        f"the step uses a collective over axis {unknown[0]!r}, but the strategy's "
                        f"mesh has only the axes {list(axes)}; name the replica axis with "
                        f"compile(axis_name={unknown[0]!r}), or use "
                        "xs.get_replica_context().all_reduce(...)"
                    ) from original
        tb = tb.tb_next
