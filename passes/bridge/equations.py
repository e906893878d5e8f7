"""What the capture reads from a JAX equation: its values' IR types, its parameters in a
printable form, its collective axes and where in the user's code it came from."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from xla_strategies.passes.bridge.trace_hooks import varying_axes
from xla_strategies.passes.ir.graph import Value


def ir_value(aval: Any) -> Value:
    varying = varying_axes(aval)
    dtype = str(getattr(aval, "dtype", "token"))
    return Value(tuple(getattr(aval, "shape", ())), dtype, frozenset(varying))


def policy_name(policy: Callable[..., Any]) -> str:
    """A rematerialisation policy by its name in `jax.checkpoint_policies`, so the text
    form keeps it; `custom` for one made by a policy factory or by hand."""
    named = {
        name: value
        for name, value in vars(jax.checkpoint_policies).items()
        if not name.startswith("_") and value is policy
    }
    return next(iter(named), "custom")


def jsonable(value: Any) -> Any:
    """Params that print well in the IR (ints, strings, nested tuples); None otherwise."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (tuple, list)):
        items = [jsonable(v) for v in value]
        return (
            None
            if any(i is None and v is not None for i, v in zip(items, value, strict=True))
            else items
        )
    if isinstance(value, np.dtype):
        return str(value)
    if isinstance(value, enum.Enum):  # a gather's or scatter's `mode`: FILL_OR_DROP, CLIP
        return value.name
    return None


def axis_names(params: dict[str, Any]) -> list[str]:
    names = params.get("axes", params.get("axis_name"))
    return [names] if isinstance(names, str) else list(names)


# Primitives that only reshape or recast one value: a parameter a frontend reshapes before
# using it (torchax reshapes every bias) is still that parameter in the dumps.
RESHAPING = frozenset(
    {"reshape", "broadcast_in_dim", "convert_element_type", "squeeze", "expand_dims", "transpose"}
)


def user_frames(eqn: jex.JaxprEqn) -> tuple[tuple[str, int], ...]:
    """The equation's call stack outside JAX: the same for a parameter's use (its pvary)
    and for the reduction of its gradient (pvary's transpose)."""
    frames = getattr(eqn.source_info.traceback, "frames", None) or ()
    return tuple(
        (f.file_name, f.line_num) for f in frames if f"{os.sep}jax{os.sep}" not in f.file_name
    )


def user_source(eqn: jex.JaxprEqn) -> str | None:
    """`file.py:line` of the user code behind an equation."""
    from jax._src import source_info_util

    frame = source_info_util.user_frame(eqn.source_info.traceback)
    return f"{os.path.basename(frame.file_name)}:{frame.start_line}" if frame else None
