"""Non-finite values in a step's arrays, found and named by the step that holds them.

A NaN or Inf that reaches training turns the weights non-finite a step later, silently:
XLA computes on it like any other number. Two checks say where one came from:

- `jax_debug_nans` / `jax_debug_infs` (JAX's own flags) check what a program computes.
  A NaN that comes in with a step's arguments (a batch read from a damaged file) is not
  computed by the step, and JAX's re-run of the program to find the operation that made
  it recursed without end (`RecursionError`). With either flag on, a compiled step checks
  its floating-point arguments first and raises `FloatingPointError` naming the argument;
  a NaN the step itself makes is JAX's error naming the operation, as before.
- `enable_check_numerics()` (tf.debugging's name) is the opt-in check with JAX's flags off:
  every compiled step checks its arguments before it runs and its outputs after, and the
  first non-finite value is a `FloatingPointError` naming the step, its call, the leaf and
  the element. It costs one reduction over every floating-point array per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["disable_check_numerics", "enable_check_numerics"]  # as `xs.debugging`

_check_numerics = False


def enable_check_numerics() -> None:
    """Every compiled step checks its arguments and outputs for NaN and Inf, and raises
    `FloatingPointError` naming the first one (tf.debugging.enable_check_numerics)."""
    global _check_numerics
    _check_numerics = True


def disable_check_numerics() -> None:
    """Undo `enable_check_numerics`."""
    global _check_numerics
    _check_numerics = False


def checks_inputs() -> bool:
    """Whether a step checks its arguments before it runs (either check is on)."""
    return _check_numerics or jax.config.jax_debug_nans or jax.config.jax_debug_infs


def checks_outputs() -> bool:
    return _check_numerics


def check_arrays(
    arrays: Sequence[Any], name_of: Callable[[int], str], what: Callable[[], str]
) -> None:
    """Raise `FloatingPointError` for the first array of `arrays` that holds a value the
    active check looks for, naming it (`name_of(index)`) and where it was (`what()`)."""
    nan = _check_numerics or jax.config.jax_debug_nans
    inf = _check_numerics or jax.config.jax_debug_infs
    floating = [
        i
        for i, a in enumerate(arrays)
        if isinstance(a, jax.Array | np.ndarray) and jnp.issubdtype(a.dtype, jnp.inexact)
    ]
    if not floating or not (nan or inf):
        return
    found = np.asarray(_nonfinite(nan, inf)(*(arrays[i] for i in floating)))
    if not found.any():
        return
    index = floating[int(np.argmax(found))]
    array = arrays[index]
    position, value = _first(array, nan, inf)
    kind = "nan" if np.isnan(value) else "inf"
    raise FloatingPointError(
        f"invalid value ({kind}) in {name_of(index)} {what()}: element {position} of "
        f"{array.dtype}{list(array.shape)} is {value}"
    )


@functools.cache
def _nonfinite(nan: bool, inf: bool) -> Callable[..., jax.Array]:
    """One program over all arrays: per array, whether it holds what is looked for."""

    def bad(x: jax.Array) -> jax.Array:
        found = jnp.isnan(x) if nan else jnp.zeros(x.shape, bool)
        return found | jnp.isinf(x) if inf else found

    return jax.jit(lambda *arrays: jnp.stack([jnp.any(bad(x)) for x in arrays]))


def _first(array: Any, nan: bool, inf: bool) -> tuple[tuple[int, ...], float]:
    """The first offending element's index and value (the array is read whole only on
    this error path)."""
    host = np.asarray(array)
    flat = (np.isnan(host) if nan else False) | (np.isinf(host) if inf else False)
    position = np.unravel_index(int(np.argmax(np.ravel(flat))), host.shape)
    return tuple(int(i) for i in position), host[position].item()
