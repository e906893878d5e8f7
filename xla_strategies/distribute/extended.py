"""`strategy.extended`: tf.distribute's `StrategyExtended`, for code that reaches for it.

Reductions and placement questions have a meaning here and are answered from the strategy.
Variables do not exist (state is plain arrays a step takes and returns), so the members
that act on a variable raise `NotImplementedError` saying what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import jax

from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.hardware.devices import resolve_device, resolve_devices

if TYPE_CHECKING:
    from xla_strategies.core.strategy_like import StrategyLike

_FUNCTIONAL_STATE = (
    "state is functional here: there are no tf.Variables to {what}; a step takes the "
    "state as arrays and returns its new value ({instead})"
)


class StrategyExtended:
    """What `tf.distribute.StrategyExtended` offers, for `strategy`."""

    def __init__(self, strategy: StrategyLike) -> None:
        self._strategy = strategy

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """This worker's (process's) devices that run replicas."""
        return tuple(d for d in self._strategy.devices if d.process_index == jax.process_index())

    @property
    def parameter_devices(self) -> tuple[Any, ...]:
        """The devices that hold the state: every replica's device, or
        CentralStorageStrategy's parameter device."""
        sharding = self._strategy.state_sharding()
        return tuple(sorted(sharding.device_set, key=self._strategy.devices.index))

    @property
    def experimental_require_static_shapes(self) -> bool:
        """True: XLA compiles for static shapes (a new shape compiles again)."""
        return True

    def reduce_to(
        self, reduce_op: ReduceOp | str, value: Any, destinations: Any, options: Any = None
    ) -> Any:
        """`strategy.reduce(reduce_op, value)` placed on `destinations`: a device (or its
        name or index), or the devices of a sequence, a sharding or an array (the result
        replicated on them). `options` (CommunicationOptions) changes nothing: the
        reduction runs outside any compiled step."""
        del options
        reduced = self._strategy.reduce(reduce_op, value)
        return jax.tree.map(lambda a: _place(a, destinations), reduced)

    def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: Any = None,
    ) -> list[Any]:
        """`reduce_to` for each `(value, destinations)` pair."""
        return [self.reduce_to(reduce_op, v, d, options) for v, d in value_destination_pairs]

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        group: bool = True,
    ) -> NoReturn:
        _no_variables("update", "compute the new value in the step and return it")

    def colocate_vars_with(self, colocate_with_variable: Any) -> NoReturn:
        _no_variables("colocate", "state lives where strategy.replicate puts it")

    def variable_created_in_scope(self, v: Any) -> NoReturn:
        _no_variables("track", "strategy.layout(x) says where an array lives")

    def value_container(self, value: Any) -> Any:
        """`value` itself: a `jax.Array` is its own container (its sharding says where it is)."""
        return value

    def __repr__(self) -> str:
        return f"StrategyExtended({self._strategy!r})"


def _no_variables(what: str, instead: str) -> NoReturn:
    raise NotImplementedError(_FUNCTIONAL_STATE.format(what=what, instead=instead))


def _place(array: Any, destinations: Any) -> Any:
    """`array` on `destinations`; inside a step (`merge_call`) every replica holds it."""
    if isinstance(array, jax.core.Tracer):
        return array
    return jax.device_put(array, _sharding(destinations))


def _sharding(destinations: Any) -> jax.sharding.Sharding:
    """Where `reduce_to` puts its result: replicated on the devices `destinations` names."""
    if isinstance(destinations, jax.sharding.Sharding):
        devices = list(destinations.device_set)
    elif isinstance(destinations, jax.Array):
        devices = list(destinations.devices())
    elif isinstance(destinations, list | tuple):
        devices = resolve_devices(destinations, "destinations")
    else:
        return jax.sharding.SingleDeviceSharding(resolve_device(destinations, "destinations"))
    mesh = jax.sharding.Mesh(sorted(devices, key=lambda d: d.id), ("destinations",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
