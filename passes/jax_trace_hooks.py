"""What capture changes in JAX while a step is traced, and only then.

- pvary's transpose rule runs in the named scope `AUTODIFF_SCOPE`, so the importer tells
  autodiff's reductions from the ones the user wrote;
- `jax.vjp` (and so `jax.grad`) marks each gradient of a replica-invariant value, taken of
  a varying output, with a multiplication by 1 in the scope `GRADIENT_SCOPE(<axes>)`;
  insert-reductions turns the mark into the strategy's MEAN or SUM.

Each is installed for the trace, reference-counted across threads, and restored after it.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from xla_strategies.patching import patched

AUTODIFF_SCOPE = "xla_strategies.autodiff_reduction"
GRADIENT_SCOPE = "xla_strategies.gradient_scale"
GRADIENT_AXES = re.compile(re.escape(GRADIENT_SCOPE) + r"\(([^)]*)\)")


def varying_axes(aval: Any) -> frozenset[str]:
    varying = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(getattr(aval, "vma", ()) if varying is None else varying)


@contextlib.contextmanager
def tagging_autodiff_reductions() -> Any:
    """While a step is traced, pvary's transpose rule runs in a named scope, so the
    importer can tell autodiff's reductions from the user's. It only adds op metadata."""
    from jax._src import core
    from jax._src.interpreters import ad

    def tagging(rule: Callable[..., Any]) -> Callable[..., Any]:
        def tagged(*args, **kwargs):
            with jax.named_scope(AUTODIFF_SCOPE):
                return rule(*args, **kwargs)

        return tagged

    with patched(ad.primitive_transposes, core.pvary_p, tagging):
        yield


_capturing = threading.local()


@contextlib.contextmanager
def marking_gradient_scales() -> Any:
    """While a step is traced (in this thread only), `jax.vjp`, and so `jax.grad`, marks
    each gradient of a value that is the same on every replica, taken of a value that
    differs (a per-replica loss), with a multiplication by 1 under `GRADIENT_SCOPE`.

    JAX's gradient there is exactly that of the sum of the replicas' losses; the strategy's
    MEAN reduction is that divided by the replica count, once, whatever path the gradient
    took (BatchNorm statistics reduced in the forward pass cross two reductions). The
    importer turns the mark into a `scale` node, and insert-reductions sets its factor.
    Gradients of per-replica values (an input gradient) and of a loss that is already the
    same everywhere (a `pmean`ed loss, as pmap code writes it) are not marked."""
    from jax._src import api

    def marking(original: Callable[..., Any]) -> Callable[..., Any]:
        def vjp(fun: Callable[..., Any], *primals: Any, **kwargs: Any) -> Any:
            out, pullback, *aux = original(fun, *primals, **kwargs)
            if getattr(_capturing, "depth", 0):
                pullback = _marked_pullback(pullback, primals, out)
            return (out, pullback, *aux)

        return vjp

    _capturing.depth = getattr(_capturing, "depth", 0) + 1
    try:
        with patched(api, "vjp", marking), patched(jax, "vjp", marking):
            yield
    finally:
        _capturing.depth -= 1


def _marked_pullback(pullback: Callable[..., Any], primals: tuple, out: Any) -> Callable[..., Any]:
    def marked(cotangent: Any) -> Any:
        grads = pullback(cotangent)
        # the cotangent takes the output's type (a Python 1.0 seed becomes per-replica)
        seed = jax.tree.leaves(cotangent) + jax.tree.leaves(out)
        seed_axes = set().union(*(_vma(c) for c in seed))
        return jax.tree.map(lambda g, p: _mark(g, seed_axes - _vma(p)), grads, primals)

    return marked


def _vma(x: Any) -> set[str]:
    """The mesh axes over which `x` differs across replicas (none for a Python number)."""
    return set(varying_axes(jax.typeof(x)))


def _mark(grad: Any, axes: set[str]) -> Any:
    if not axes or not jax.numpy.issubdtype(grad.dtype, jax.numpy.inexact):
        return grad
    with jax.named_scope(f"{GRADIENT_SCOPE}({','.join(sorted(axes))})"):
        return grad * np.ones((), grad.dtype)
