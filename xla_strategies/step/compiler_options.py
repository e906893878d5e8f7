"""The XLA options a step compiles with: the strategy's own (its devices' workarounds, a TPU
generation's tuned flags from `tpu_configs/`), then the step's `compile(compiler_options=...)`,
which win name by name, as `jax.jit(compiler_options=...)` takes them.

Values go to XLA as given: strings, bools or numbers. XLA's own options read a bool as
`True` or `"True"` (not `"true"`); libtpu's read either. A name XLA does not know, or a
value it cannot read, is XLA's `INVALID_ARGUMENT` at compile time, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The one option whose values are lists: the strategy's passes to leave out are kept
#: beside the user's, since each works around a compiler abort.
DISABLED_PASSES = "xla_disable_hlo_passes"


def option_values(options: Any, argument: str = "compiler_options") -> dict[str, Any]:
    """`options` checked: a mapping of option names to strings, bools or numbers. None is
    no options."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(
            f"{argument} must be a mapping of XLA option names to values, "
            f"got a {type(options).__name__}"
        )
    values = {}
    for name, value in options.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{argument}: option names are non-empty strings, got {name!r}")
        if not isinstance(value, str | int | float):
            raise TypeError(
                f"{argument}[{name!r}] must be a string, bool or number, "
                f"got a {type(value).__name__}"
            )
        values[name] = value
    return values


def step_compiler_options(strategy: Mapping[str, Any], step: Mapping[str, Any]) -> dict[str, Any]:
    """The strategy's options with the step's over them; the passes both disable, joined."""
    merged = {**strategy, **step}
    if DISABLED_PASSES in strategy and DISABLED_PASSES in step:
        both = [*strategy[DISABLED_PASSES].split(","), *step[DISABLED_PASSES].split(",")]
        merged[DISABLED_PASSES] = ",".join(dict.fromkeys(p for p in both if p))
    return merged
