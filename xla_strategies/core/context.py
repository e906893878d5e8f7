"""Which strategy is in scope, and the replica context inside a step.

As in tf.distribute: inside `strategy.scope()`, `xs.get_strategy()` (`default_strategy.py`,
which adds the one-device default) returns that strategy and
`get_replica_context()` returns None (cross-replica context); inside a compiled step it
returns the step's `ReplicaContext`; outside both there is a default one-replica context.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import jax
from jax import lax

from xla_strategies.core.reduce_op import ReduceOp

if TYPE_CHECKING:
    from xla_strategies.core.strategy_like import StrategyLike

_local = threading.local()


def _stack(name: str) -> list[Any]:
    if not hasattr(_local, name):
        setattr(_local, name, [])
    return getattr(_local, name)


class ReplicaContext:
    """What a step sees of its replica group. Collectives act on every replica of the step.

    Attributes:
        num_replicas_in_sync: the number of replicas running the step together.
    """

    def __init__(
        self, axes: tuple[str, ...], num_replicas: int, mesh: jax.sharding.Mesh | None = None
    ) -> None:
        self._axes = axes
        self.num_replicas_in_sync = num_replicas
        self._mesh = mesh

    @property
    def mesh(self) -> jax.sharding.Mesh | None:
        """The mesh the step is traced on, its replica axes manual; None outside a compiled
        step. Hand it to a library that builds `NamedSharding`s on a mesh it is given
        (MaxText's model): a sharding on it that names no replica axis is the replica's
        whole value, and one over a model axis splits the value within the replica."""
        return self._mesh

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh axes the step's replicas run over (what `lax.psum` needs)."""
        return self._axes

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's index, 0 .. num_replicas_in_sync - 1 (a traced int32)."""
        return lax.axis_index(self._axes) if self._axes else 0

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduce every leaf of `value` across replicas; every replica gets the result."""
        op = ReduceOp.of(reduce_op)
        if not self._axes:
            return value
        reducer = {
            ReduceOp.SUM: lax.psum,
            ReduceOp.MEAN: lax.pmean,
            ReduceOp.MAX: lax.pmax,
            ReduceOp.MIN: lax.pmin,
        }[op]
        return jax.tree.map(lambda leaf: reducer(leaf, self._axes), value)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenate every leaf of `value` across replicas along `axis`, in replica
        order; every replica gets the result (`lax.all_gather(..., tiled=True)`).
        `options` (CommunicationOptions) is accepted for tf.distribute's signature."""
        del options
        if not self._axes:
            return value

        def gather(leaf: Any) -> Any:
            ndim = jax.numpy.ndim(leaf)
            if not -ndim <= axis < ndim:
                raise ValueError(
                    f"all_gather: axis={axis} is out of range for a value of rank {ndim}"
                )
            return lax.all_gather(leaf, self._axes, axis=axis % ndim, tiled=True)

        return jax.tree.map(gather, value)

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """Run `merge_fn(strategy, *args, **kwargs)` once, in a cross-replica view of the
        replicas' values, and give its result to every replica (see `merge_call.py`)."""
        strategy = strategy_in_scope() or _default_strategy()
        return strategy.merge_in_step(self, merge_fn, args, kwargs or {})


_DEFAULT_REPLICA_CONTEXT = ReplicaContext((), 1)


ScopeHook = Callable[["StrategyLike"], AbstractContextManager[Any]]
# What a frontend does while a strategy's scope is active (Keras: models compiled there
# belong to the strategy), registered by the frontend when it is imported, so the strategy
# itself knows no frontend.
_SCOPE_HOOKS: list[ScopeHook] = []


def register_scope_hook(hook: ScopeHook) -> None:
    """Enter `hook(strategy)` around every `strategy.scope()` (once per hook)."""
    if hook not in _SCOPE_HOOKS:
        _SCOPE_HOOKS.append(hook)


@contextlib.contextmanager
def user_scope(strategy: StrategyLike) -> Iterator[StrategyLike]:
    """`strategy.scope()`: the strategy in scope, with every frontend's hook."""
    with strategy_scope(strategy), contextlib.ExitStack() as hooks:
        for hook in _SCOPE_HOOKS:
            hooks.enter_context(hook(strategy))
        yield strategy


def _default_strategy() -> StrategyLike:
    """The default context's one-device strategy, once `default_strategy.py` (imported by
    the package) has registered it: this module depends on no strategy class."""
    raise RuntimeError("no default strategy is registered; import xla_strategies")


def register_default_strategy(make: Callable[[], StrategyLike]) -> None:
    global _default_strategy
    _default_strategy = make


@contextlib.contextmanager
def strategy_scope(strategy: StrategyLike) -> Iterator[StrategyLike]:
    stack = _stack("strategies")
    stack.append(strategy)
    try:
        yield strategy
    finally:
        stack.pop()


@contextlib.contextmanager
def replica_scope(strategy: StrategyLike, context: ReplicaContext) -> Iterator[ReplicaContext]:
    with strategy_scope(strategy):
        stack = _stack("replicas")
        stack.append(context)
        try:
            yield context
        finally:
            stack.pop()


@contextlib.contextmanager
def cross_replica_scope() -> Iterator[None]:
    """Inside a step, a stretch in cross-replica context (`merge_call`'s merge_fn):
    `get_replica_context()` is None there, as in tf.distribute."""
    stack = _stack("replicas")  # the same list: replica_scope pops from it
    saved = stack[:]
    stack.clear()
    try:
        yield
    finally:
        stack[:] = saved


def strategy_in_scope() -> StrategyLike | None:
    """The innermost strategy whose scope is active, or None (see `xs.get_strategy`)."""
    stack = _stack("strategies")
    return stack[-1] if stack else None


def scope_depth() -> int:
    """How many strategy scopes are open in this thread."""
    return len(_stack("strategies"))


def has_strategy() -> bool:
    return bool(_stack("strategies"))


def get_replica_context() -> ReplicaContext | None:
    """The step's replica context, None in a strategy's cross-replica scope, else a default."""
    replicas = _stack("replicas")
    if replicas:
        return replicas[-1]
    return None if _stack("strategies") else _DEFAULT_REPLICA_CONTEXT


def in_compiled_step() -> bool:
    """Whether this thread is tracing a compiled step (inside its replica context)."""
    return bool(_stack("replicas"))


def in_cross_replica_context() -> bool:
    return bool(_stack("strategies")) and not _stack("replicas")
