"""What capture changes in JAX while a step is traced, and only then.

- pvary's transpose rule runs in the named scope `AUTODIFF_SCOPE`, so the importer tells
  autodiff's reductions from the ones the user wrote;
- (`loop_carries`) a loop carry that comes out of the body varying goes in varying;
- primitives whose JAX wrapper binds operands of different varying axes without casting
  them have their operands cast to varying first;
- a Pallas kernel (splash attention, any `pallas_call`) runs on each replica's values:
  its operands are cast to vary over the replica axes, and an output shape that does not
  say how it varies (JAX's own kernels do not) varies over them too;
- a custom_vjp's backward rule that gives a replica-invariant input a cotangent varying
  across replicas has it summed across them, as pvary's transpose sums any other's;
- every reverse-mode gradient (`jax.vjp`, `jax.grad`, however imported) marks each
  gradient of a replica-invariant value, taken of a varying output, with a multiplication
  by 1 in the scope `GRADIENT_SCOPE(<axes>)`; insert-reductions turns the mark into the
  strategy's MEAN or SUM.

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

from xla_strategies.core.patching import patched, set_in_this_thread
from xla_strategies.passes.bridge import jax_compat

AUTODIFF_SCOPE = "xla_strategies.autodiff_reduction"
GRADIENT_SCOPE = "xla_strategies.gradient_scale"
# a pipelined layer stack's gradient, held split over the stage axis (dim 0)
STAGE_SPLIT_SCOPE = "xla_strategies.stage_split"
GRADIENT_AXES = re.compile(re.escape(GRADIENT_SCOPE) + r"\(([^)]*)\)")
# a pipelined stack held in blocks over the replica axes named in parentheses: the slice
# of a replica's block and the gather of the gradient's blocks
REPLICA_BLOCK_SCOPE = "xla_strategies.replica_block"
REPLICA_BLOCK_AXES = re.compile(re.escape(REPLICA_BLOCK_SCOPE) + r"\(([^)]*)\)")


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
    """While a step is traced (in this thread only), every reverse-mode gradient marks each
    gradient of a value that is the same on every replica, taken of a value that differs
    (a per-replica loss), with a multiplication by 1 under `GRADIENT_SCOPE`.

    JAX's gradient there is exactly that of the sum of the replicas' losses; the strategy's
    MEAN reduction is that divided by the replica count, once, whatever path the gradient
    took (BatchNorm statistics reduced in the forward pass cross two reductions). The
    importer turns the mark into a `scale` node, and insert-reductions sets its factor.
    Gradients of per-replica values (an input gradient) and of a loss that is already the
    same everywhere (a `pmean`ed loss, as pmap code writes it) are not marked.

    The hook is the backward pass that `jax.vjp`, `jax.grad` and `jax.value_and_grad` all
    run, looked up in JAX's module when a pullback is called, so a `vjp` bound before the
    trace (`from jax import vjp`, a library's own alias) is marked like `jax.vjp`."""
    from jax._src import api

    def marking(original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(*args: Any) -> Any:
            if not getattr(_capturing, "depth", 0):
                return original(*args)
            args = (*args[:-1], _typed_like_outputs(args[-1], original, args))
            result = original(*args)
            out_avals, out_ct, grads, rebuild = jax_compat.vjp_bwd_view(original, args, result)
            # the cotangent takes the output's type (a Python 1.0 seed becomes per-replica)
            seed_axes = set().union(
                *(set(varying_axes(a)) for a in out_avals),
                *(vma(c) for c in jax.tree.leaves(out_ct)),
            )
            return rebuild(jax.tree.map(lambda g: _mark(g, seed_axes), grads))

        return backward

    _capturing.depth = getattr(_capturing, "depth", 0) + 1
    try:
        with patched(api, "_vjp3_bwd", marking):
            yield
    finally:
        _capturing.depth -= 1


def _typed_like_outputs(out_ct: Any, bwd: Callable[..., Any], args: tuple) -> Any:
    """The seed a pullback is called with, each array varying over the replica axes its
    output does: a seed the same on every replica (a loss scale, `jnp.asarray(64.0)`) of a
    per-replica loss, which JAX refuses by type, seeds each replica's loss, as JAX casts
    a Python 1.0 itself."""
    leaves, tree = jax.tree.flatten(out_ct)
    avals = jax.tree.leaves(jax_compat.vjp_bwd_out_avals(bwd, args))
    if len(leaves) != len(avals):  # symbolic zeros among them: JAX checks their types
        return out_ct
    typed = [
        varying_over(_as_array(c, a.dtype), varying_axes(a)) if _is_value(c, a) else c
        for c, a in zip(leaves, avals, strict=True)
    ]
    return jax.tree.unflatten(tree, typed)


def _is_value(x: Any, aval: Any) -> bool:
    """A seed that can vary: a number or an array of one, of an inexact output (an
    integer's seed is float0)."""
    numbers = int | float | jax.Array | jax.core.Tracer | np.ndarray | np.generic
    inexact = lambda dtype: jax.numpy.issubdtype(dtype, jax.numpy.inexact)  # noqa: E731
    if not isinstance(x, numbers) or not inexact(aval.dtype):
        return False
    return isinstance(x, int | float) or inexact(x.dtype)


def _as_array(x: Any, dtype: Any) -> Any:
    """A Python number as an array of its output's dtype, as JAX takes it (weakly typed)."""
    return jax.numpy.asarray(x, dtype) if isinstance(x, int | float) else x


def vma(x: Any) -> set[str]:
    """The mesh axes over which `x` differs across replicas (none for a Python number)."""
    return set(varying_axes(jax.typeof(x)))


def _mark(grad: Any, seed_axes: set[str]) -> Any:
    """`grad` marked with the axes its seed varies over and it does not (a gradient's type
    is its primal's); a placeholder for an unwanted gradient is passed through."""
    if not isinstance(grad, jax.Array | jax.core.Tracer):
        return grad
    axes = seed_axes - vma(grad)
    if not axes or not jax.numpy.issubdtype(grad.dtype, jax.numpy.inexact):
        return grad
    with jax.named_scope(f"{GRADIENT_SCOPE}({','.join(sorted(axes))})"):
        return grad * np.ones((), grad.dtype)


# Primitives whose `jax.lax` wrapper binds constants beside a varying operand without
# casting them, which JAX's varying-axes check rejects: JAX 0.12's `polynomial`, behind
# `erf` and so exact GELU (torch's `nn.GELU()`, Keras' "gelu").
_UNCAST_PRIMITIVES = ("polynomial_p",)


@contextlib.contextmanager
def matching_operand_types() -> Any:
    """While a step is traced, the operands of `_UNCAST_PRIMITIVES` are cast to vary over
    the union of their varying axes, as `jax.lax.add` casts its own."""
    from jax._src.lax import lax as lax_internal

    with contextlib.ExitStack() as stack:
        for name in _UNCAST_PRIMITIVES:
            primitive = getattr(lax_internal, name, None)  # absent before JAX 0.12
            if primitive is not None:
                stack.enter_context(patched(primitive, "bind", _casting_operands))
        yield


def _casting_operands(bind: Callable[..., Any]) -> Callable[..., Any]:
    def cast_then_bind(*operands: Any, **params: Any) -> Any:
        axes = frozenset().union(*(vma(x) for x in operands))
        cast = [varying_over(x, axes) for x in operands]
        return bind(*cast, **params)

    return cast_then_bind


def varying_over(x: Any, axes: frozenset[str] | set[str]) -> Any:
    """`x` made varying over `axes` too (a `pcast`); `x` itself when it already is."""
    missing = tuple(sorted(axes - vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


@contextlib.contextmanager
def pallas_kernels_per_replica(axes: tuple[str, ...]) -> Any:
    """While a step is traced (in this thread: each trace types with its own replica
    axes), every Pallas kernel is typed as a function of one replica's values. Pallas
    refuses an output shape without varying axes under `check_vma=True`
    (`manual_axis_type` must not be None), and JAX's own kernels give none: splash
    attention, as MaxText runs it, crashed the capture. Casting the operands too keeps the
    types whole: a replica-invariant operand's gradient is reduced across the replicas
    (the cast's transpose), as for any op."""
    try:
        from jax._src.pallas import core as pallas_core
        from jax._src.pallas import pallas_call
    except ImportError:  # this jaxlib has no Pallas
        yield
        return
    with (
        set_in_this_thread(_kernel_replicas, "axes", frozenset(axes)),
        patched(pallas_core, "_convert_out_shape_to_aval", _typing_kernel_outputs),
        patched(pallas_call.pallas_call_p, "bind", _casting_kernel_operands),
    ):
        yield


_kernel_replicas = threading.local()  # the replica axes this thread's trace types over


def _typing_kernel_outputs(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    from jax._src import core as jax_core

    def convert_varying(out_shape: Any) -> Any:
        replicas = getattr(_kernel_replicas, "axes", None)
        untyped = isinstance(out_shape, jax.ShapeDtypeStruct) and out_shape.manual_axis_type is None
        if replicas is not None and untyped:
            out_shape = jax.ShapeDtypeStruct(
                out_shape.shape,
                out_shape.dtype,
                sharding=out_shape.sharding,
                manual_axis_type=jax_core.ManualAxisType(varying=replicas),
            )
        return convert(out_shape)

    return convert_varying


def _casting_kernel_operands(bind: Callable[..., Any]) -> Callable[..., Any]:
    def cast_then_bind(*operands: Any, **params: Any) -> Any:
        replicas = getattr(_kernel_replicas, "axes", None)
        if replicas is not None:
            operands = tuple(varying_over(x, replicas) for x in operands)
        return bind(*operands, **params)

    return cast_then_bind


@contextlib.contextmanager
def summing_custom_vjp_cotangents() -> Any:
    """While a step is traced, a custom_vjp's backward rule may give a replica-invariant
    input (a mirrored weight) a cotangent that varies across replicas: its replica's share,
    computed from the replica's data by a Pallas kernel or any other code. The share is
    summed across the replicas in autodiff's scope, as pvary's transpose sums the gradient
    of every other op a mirrored value meets; JAX refuses the rule otherwise ("the manual
    axis types do not match")."""
    from jax._src import custom_derivatives
    from jax._src import linear_util as lu

    def summing(flatten_bwd: Callable[..., Any]) -> Callable[..., Any]:
        def flatten_summed(bwd: Any, in_tree: Any, in_avals: Any, *rest: Any) -> Any:
            with_logs = jax_compat.bwd_with_logs(rest)

            def summed_bwd(*args: Any) -> Any:
                out = bwd.call_wrapped(*args)
                cotangents, logs = out if with_logs else (out, None)
                cotangents = _summed_like(cotangents, in_tree, in_avals)
                return (cotangents, logs) if with_logs else cotangents

            wrapped = lu.wrap_init(summed_bwd, debug_info=bwd.debug_info)
            return flatten_bwd(wrapped, in_tree, in_avals, *rest)

        return flatten_summed

    with patched(custom_derivatives, "_flatten_bwd", summing):
        yield


def _summed_like(cotangents: Any, in_tree: Any, in_avals: Any) -> Any:
    """`cotangents` (one per primal argument, None for none) with every array that varies
    over more axes than its primal summed over those."""
    primals = jax.tree_util.tree_unflatten(in_tree, list(in_avals))
    if not isinstance(cotangents, tuple | list) or len(cotangents) != len(primals):
        return cotangents  # JAX's own check names what is wrong
    try:
        return type(cotangents)(
            ct if ct is None else jax.tree.map(_summed_to, primal, ct)
            for primal, ct in zip(primals, cotangents, strict=True)
        )
    except ValueError:  # a structure unlike the primal's: JAX's check reports it
        return cotangents


def _summed_to(primal: Any, cotangent: Any) -> Any:
    if not isinstance(cotangent, jax.Array | jax.core.Tracer):
        return cotangent  # None, a symbolic zero
    extra = vma(cotangent) - set(varying_axes(primal))
    if not extra:
        return cotangent
    with jax.named_scope(AUTODIFF_SCOPE):
        return jax.lax.psum(cotangent, tuple(sorted(extra)))
