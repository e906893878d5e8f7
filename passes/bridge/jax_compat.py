"""The reads of JAX internals that differ between the supported JAX releases (0.10.2 and
0.12.x), each a small function that hides the difference. Capture, trace hooks and
lowering go through these; nothing else in the package looks at a JAX version.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def jaxpr_parts(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """A (sub-)jaxpr as its open jaxpr and the values of its constants.

    JAX 0.12 folded `ClosedJaxpr` into `Jaxpr`: `make_jaxpr` and the params of `jit`,
    `scan`, `while` and `cond` give a `Jaxpr` that carries its constants (its `.jaxpr` is
    itself, kept only for old callers). Before, those were `ClosedJaxpr`s wrapping an open
    `Jaxpr`, and `remat2`'s param was an open `Jaxpr` with no constants."""
    return getattr(jaxpr, "jaxpr", jaxpr), tuple(getattr(jaxpr, "consts", ()))


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters
    (jit, scan, remat and custom derivative bodies, cond's branches), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple) else (param,):
                if hasattr(inner := getattr(sub, "jaxpr", sub), "eqns"):
                    yield from equations(inner)


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
    out_avals, out_ct = vjp_bwd_out_avals(bwd, args), args[-1]
    if "want_logs" in names and args[names.index("want_logs")]:
        grads, logs = result
        return out_avals, out_ct, grads, lambda marked: (marked, logs)
    return out_avals, out_ct, result, lambda marked: marked


def vjp_bwd_out_avals(bwd: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """The primal output avals among the arguments of one call of `_vjp3_bwd` (`bwd`);
    its last argument is the output cotangent, on every tested JAX."""
    return args[list(inspect.signature(bwd).parameters).index("out_primal_avals")]


def bwd_with_logs(flatten_bwd_rest: tuple[Any, ...]) -> bool:
    """Whether a custom_vjp's backward rule returns `(cotangents, logs)`, from the
    arguments of `jax._src.custom_derivatives._flatten_bwd` after `in_avals`.

    JAX 0.12 passes `(out_trees, primal_fun, symbolic_zeros, with_logs)` there; JAX 0.10
    passed `out_trees` alone, and had no logs."""
    return bool(flatten_bwd_rest[3]) if len(flatten_bwd_rest) > 3 else False


def lowered_as_call(params: dict[str, Any]) -> bool:
    """Whether JAX lowers a `jit` equation with `params` as a call of a function, not
    inline: `inline=False` before JAX 0.12; an `Inline` other than JAX_EARLY and JAX_LATE
    (AUTO, the default, and XLA's own) from it."""
    inline = params.get("inline", False)
    if isinstance(inline, bool):
        return not inline
    return getattr(inline, "name", "") not in ("JAX_EARLY", "JAX_LATE")
