"""The reads of JAX internals that differ between the supported JAX releases (0.10.2 to
0.12.x), each a small function that hides the difference. Capture, trace hooks and
lowering go through these; nothing else in the package looks at a JAX version.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(num_consts, num_carry) of a `scan` equation.

    JAX 0.12 replaced scan's `num_consts`/`num_carry` params with `ft_in`/`ft_out`, flat
    trees whose first two groups are the constants and the carry."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def vjp_bwd_view(
    bwd: Callable[..., Any], args: tuple[Any, ...], result: Any
) -> tuple[Any, Any, Any, Any]:
    """What a gradient hook on `jax._src.api._vjp3_bwd` (JAX's own function, `bwd`) reads
    from one call of it: the primal output avals, the output cotangent, the input
    gradients, and a function that puts (marked) input gradients back into the result.

    JAX 0.12 added a `want_logs` argument after `out_primal_avals`; when it is set the
    result is `(gradients, logs)` rather than the gradients alone."""
    names = list(inspect.signature(bwd).parameters)
    out_avals, out_ct = args[names.index("out_primal_avals")], args[-1]
    if "want_logs" in names and args[names.index("want_logs")]:
        grads, logs = result
        return out_avals, out_ct, grads, lambda marked: (marked, logs)
    return out_avals, out_ct, result, lambda marked: marked

