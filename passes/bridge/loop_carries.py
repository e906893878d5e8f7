"""Loop carries that start the same on every replica and come out varying.

pmap code never had to say how a loop's carry varies across replicas; JAX's varying-axes
check rejects a carry whose type changes in the body ("carry input and carry output must
have equal types"; `pcast(..., to='varying')` is what its error asks for). While a step is
traced, such a loop is traced again with exactly the carry leaves that come out varying
made varying on the way in, until the types agree. Only those leaves: a carry of
`(loss_sum, grad_sum)` where only the loss varies (a micro-batch loop accumulating
`jax.value_and_grad`) keeps its gradients the same on every replica, so the parameters
updated with them come back mirrored and the next step still reduces its gradients.

    init (loss 0.0 invariant, grads zeros invariant)   body: loss + l{replica}, grads + g
    -> traced again with init (loss{replica}, grads)    the grads stay invariant
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax

from xla_strategies.core.patching import patched
from xla_strategies.passes.bridge.trace_hooks import varying_over, vma


@dataclass(frozen=True)
class _LoopSignature:
    """Where a `jax.lax` loop takes its initial carry and its body, and which part of the
    body's result is the carry."""

    carry: tuple[str, int]  # keyword, position
    body: tuple[str, int]
    carry_of_result: Callable[[Any], Any]


_LOOPS = {
    "scan": _LoopSignature(("init", 1), ("f", 0), lambda result: result[0]),
    "while_loop": _LoopSignature(("init_val", 2), ("body_fun", 1), lambda result: result),
    "fori_loop": _LoopSignature(("init_val", 3), ("body_fun", 2), lambda result: result),
}
_CARRY_MISMATCH = "carry input and carry output must have equal types"


@contextlib.contextmanager
def varying_loop_carries() -> Iterator[None]:
    """While active, `jax.lax.scan`, `while_loop` and `fori_loop` make varying the initial
    carry leaves their body makes varying, and no others."""
    with contextlib.ExitStack() as stack:
        for name, signature in _LOOPS.items():
            stack.enter_context(
                patched(jax.lax, name, functools.partial(_typing_carries, signature=signature))
            )
        yield


def _typing_carries(loop: Callable[..., Any], signature: _LoopSignature) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        seen: list[Any] = []  # the carry the body returned, as last traced
        args, kwargs = _replaced(
            args,
            kwargs,
            signature.body,
            lambda body: _recording(body, signature.carry_of_result, seen),
        )
        init = _argument(args, kwargs, signature.carry)
        # each retry makes at least one more (leaf, axis) varying, so this ends
        for _ in range(1 + len(jax.tree.leaves(init)) * _axis_count()):
            try:
                return loop(*args, **kwargs)
            except TypeError as exc:
                if _CARRY_MISMATCH not in str(exc) or not seen:
                    raise
                widened = _widened(init, seen[-1])
                if widened is None:
                    raise
                init = widened
                args, kwargs = _replaced(args, kwargs, signature.carry, lambda _, new=init: new)
        return loop(*args, **kwargs)

    return run


def _recording(body: Callable[..., Any], carry_of: Callable[[Any], Any], seen: list) -> Any:
    """`body`, noting the carry it returns each time JAX traces it."""

    @functools.wraps(body)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = body(*args, **kwargs)
        seen.append(carry_of(result))
        return result

    return recorded


def _widened(init: Any, carry_out: Any) -> Any | None:
    """`init` with each leaf made varying over the axes its body output varies over and it
    does not; None when nothing would change or the structures differ (JAX's own error
    then says what is wrong)."""
    init_leaves, treedef = jax.tree.flatten(init)
    out_leaves, out_treedef = jax.tree.flatten(carry_out)
    if treedef != out_treedef:
        return None
    pairs = zip(init_leaves, out_leaves, strict=True)
    widened = [varying_over(a, vma(b) - vma(a)) for a, b in pairs]
    if all(w is a for w, a in zip(widened, init_leaves, strict=True)):
        return None
    return jax.tree.unflatten(treedef, widened)


def _axis_count() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return max(1, len(getattr(mesh, "manual_axes", mesh.axis_names)))


def _argument(args: tuple, kwargs: dict, where: tuple[str, int]) -> Any:
    keyword, position = where
    return kwargs[keyword] if keyword in kwargs else args[position]


def _replaced(
    args: tuple, kwargs: dict, where: tuple[str, int], change: Callable[[Any], Any]
) -> tuple[tuple, dict]:
    keyword, position = where
    if keyword in kwargs:
        return args, {**kwargs, keyword: change(kwargs[keyword])}
    if position < len(args):
        return (*args[:position], change(args[position]), *args[position + 1 :]), kwargs
    return args, kwargs
