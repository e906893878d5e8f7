"""Arguments a step declares by position and by name (`static_argnums`/`static_argnames`,
`donate_argnums`/`donate_argnames`), checked and mapped both ways as `jax.jit` maps them."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any


def declared_arguments(
    fn: Callable[..., Any],
    argnums: int | Sequence[int],
    argnames: str | Sequence[str],
    kind: str,
) -> tuple[frozenset[int], frozenset[str]]:
    """The positions and names `{kind}_argnums` and `{kind}_argnames` declare, each
    argument under both, so it is what it was declared however the caller passes it."""
    return _both_ways(
        fn,
        _int_set(argnums, f"{kind}_argnums"),
        _name_set(argnames, fn, f"{kind}_argnames"),
    )


def _both_ways(
    fn: Callable[..., Any], numbers: frozenset[int], names: frozenset[str]
) -> tuple[frozenset[int], frozenset[str]]:
    """Each argument named by position or by name (static, donated), by both, as `jax.jit`
    maps them, so it is what it was declared however the caller passes it."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return numbers, names
    positional = [
        p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    numbers |= {i for i, name in enumerate(positional) if name in names}
    names |= {positional[i] for i in numbers if i < len(positional)}
    return frozenset(numbers), frozenset(names)


def _int_set(value: int | Sequence[int], what: str) -> frozenset[int]:
    items = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(i, int) and i >= 0 for i in items):
        raise TypeError(f"{what} must be non-negative ints, got {value!r}")
    return frozenset(items)


def _name_set(value: str | Sequence[str], fn: Callable[..., Any], what: str) -> frozenset[str]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be strings, got {value!r}")
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: nothing to check against
        return frozenset(names)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    unknown = [n for n in names if n not in parameters and not takes_any]
    if unknown:
        raise ValueError(
            f"{what} names {unknown}, which {getattr(fn, '__name__', 'the step')} "
            f"does not take (its parameters: {list(parameters)})"
        )
    return frozenset(names)
