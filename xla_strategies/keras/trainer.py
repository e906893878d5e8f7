"""The train, test and predict functions of a Keras model that belongs to a strategy.

Keras' JAX trainer keeps the model's state as four lists of arrays (trainable,
non-trainable, optimizer and metrics variables) and calls `train_function(state,
iterator)` once per step. Ours compiles Keras' own stateless `train_step(state, data)`
with `strategy.compile`, so its gradient reductions run through the pass pipeline (and
show in the dumps) like any other step. Around Keras' step:

- the batch is split across the replicas. A batch that does not divide (the last one of
  an epoch) runs on as many replicas as divide it, so every replica sees as many rows and
  MEAN stays the mean over the whole batch;
- metric variables are reduced across replicas by their declared aggregation (Keras
  declares totals and counts `sum`): each replica's increment is summed, so a mean metric
  is the global mean, and the step's logs are computed again from the reduced variables;
- non-trainable variables declared `mean`/`sum` are reduced likewise; undeclared ones
  (BatchNormalization's moving statistics) stay per replica, stacked, as the state rules
  say, and `jax_state_sync` stores their mean in the Keras variable (what tf.distribute
  reads from a SyncOnRead variable);
- predictions come back in order, one row per sample.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from xla_strategies.core.context import get_replica_context
from xla_strategies.core.layout import fold_stacked, is_stacked
from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.keras.loss_reduction import replica_losses
from xla_strategies.keras.synchronized_batch_norm import global_moments


def attach(model: Any, strategy: Any) -> None:
    """Make `model`'s train, test and predict functions run on `strategy`."""
    trainer = _Trainer(model, strategy)
    # Instance attributes, so only this model changes; Keras calls these by name.
    object.__setattr__(model, "distribute_strategy", strategy)
    object.__setattr__(model, "make_train_function", trainer.make_train_function)
    object.__setattr__(model, "make_test_function", trainer.make_test_function)
    object.__setattr__(model, "make_predict_function", trainer.make_predict_function)
    object.__setattr__(model, "jax_state_sync", trainer.jax_state_sync)


class _Trainer:
    def __init__(self, model: Any, strategy: Any) -> None:
        self.model = model
        self.strategy = strategy
        self._sub_strategies: dict[int, Any] = {}
        self._previous = strategy  # the strategy the last step ran on

    # the functions Keras' fit / evaluate / predict loops call

    def make_train_function(self, force: bool = False) -> None:
        if self.model.train_function is not None and not force:
            return
        self.model.train_function = self._function(self._train_step, "keras_train_step")

    def make_test_function(self, force: bool = False) -> None:
        if self.model.test_function is not None and not force:
            return
        self.model.test_function = self._function(self._test_step, "keras_test_step")

    def make_predict_function(self, force: bool = False) -> Callable[..., Any]:
        if self.model.predict_function is not None and not force:
            return self.model.predict_function
        run = self._function(self._predict_step, "keras_predict_step", concatenate=True)
        self.model.predict_function = run
        return run

    def jax_state_sync(self) -> None:
        """Keras' own sync, after folding per-replica values into one value each."""
        model = self.model
        state = getattr(model, "_jax_state", None)
        if state and not model._jax_state_synced:
            for key, values in state.items():
                if values:
                    state[key] = [self._mirrored(x) for x in values]
        type(model).jax_state_sync(model)

    # one call of a step function

    def _function(
        self, step_fn: Callable[..., Any], name: str, concatenate: bool = False
    ) -> Callable[..., Any]:
        compiled: dict[int, Any] = {}

        def groups_first(*args: Any) -> Any:
            # State groups as positional arguments, donated (as Keras' own jit does) to
            # the groups the step returns at the same positions.
            *state, data = args
            outputs, new_state = step_fn(tuple(state), data)
            return (*new_state, outputs)

        def run(state: Any, iterator: Any) -> Any:
            outputs = []
            for _ in range(self.model.steps_per_execution):
                try:
                    data = next(iterator)
                except StopIteration:
                    if not outputs:
                        raise
                    break
                strategy = self._strategy_for(data)
                if strategy is not self._previous:  # other replicas: one value per state
                    state = self._on_other_replicas(state)
                self._previous = strategy
                replicas = strategy.num_replicas_in_sync
                if replicas not in compiled:
                    compiled[replicas] = strategy.compile(
                        groups_first, name=name, donate_argnums=tuple(range(len(state)))
                    )
                *state, out = compiled[replicas](*state, _split(strategy, data))
                state = tuple(state)
                if strategy is not self.strategy:
                    jax.block_until_ready((state, out))
                outputs.append(out)
            if concatenate:
                return _concatenate(outputs), state
            return outputs[-1], state

        return run

    def _on_other_replicas(self, state: Any) -> Any:
        """The state for a program on another set of replicas (a batch that does not
        divide, or the full set after one): every stacked per-replica value as its mean,
        once all earlier programs are done. XLA's CPU runtime does not order programs over
        different device sets, so a program on 2 devices must not overtake an 8-device one
        waiting in a collective."""
        jax.block_until_ready(state)
        return jax.tree.map(self._mirrored, state)

    def _mirrored(self, value: Any) -> Any:
        """A stacked per-replica value folded to one (`fold_stacked`); others as they are."""
        if is_stacked(value):  # by this model's strategy or one of its sub-strategies
            return fold_stacked(value, f"a Keras variable of shape {value.shape[1:]}")
        return value

    def _strategy_for(self, data: Any) -> Any:
        """The strategy whose replicas split this batch evenly: this one, or its
        sub-strategy on its first gcd(rows, replicas) replicas for a batch that does not
        divide."""
        rows = _rows(data)
        replicas = math.gcd(rows, self.strategy.num_replicas_in_sync) if rows else 1
        if replicas == self.strategy.num_replicas_in_sync:
            return self.strategy
        if replicas not in self._sub_strategies:
            self._sub_strategies[replicas] = self.strategy.sub_strategy(replicas)
        return self._sub_strategies[replicas]

    # Keras' steps, per replica, with the cross-replica parts

    def _train_step(self, state: Any, data: Any) -> Any:
        model = self.model
        seeds = _seed_states(model.non_trainable_variables)
        with replica_losses(model), global_moments(sys.modules["keras"]):
            _, new_state = type(model).train_step(model, _offset_state(state, seeds, +1), data)
        trainable, non_trainable, optimizer, metrics = _offset_state(new_state, seeds, -1)
        non_trainable = _reduce(model.non_trainable_variables, state[1], non_trainable)
        metrics = _reduce(model.metrics_variables, state[3], metrics)
        return _logs(model, metrics), (trainable, non_trainable, optimizer, metrics)

    def _test_step(self, state: Any, data: Any) -> Any:
        model = self.model
        seeds = _seed_states(model.non_trainable_variables)  # Monte-Carlo dropout draws
        with replica_losses(model):
            _, new_state = type(model).test_step(model, _offset_state(state, seeds, +1), data)
        trainable, non_trainable, metrics = _offset_state(new_state, seeds, -1)
        metrics = _reduce(model.metrics_variables, state[2], metrics)
        return _logs(model, metrics), (trainable, non_trainable, metrics)

    def _predict_step(self, state: Any, data: Any) -> Any:
        model = self.model
        seeds = _seed_states(model.non_trainable_variables)  # Monte-Carlo dropout draws
        offset = _offset_state(state, seeds, +1)
        outputs, non_trainable = type(model).predict_step(model, offset, data)
        return outputs, (state[0], _offset_seeds(non_trainable, seeds, -1))


# Added to a seed state's first word times the replica id: an odd constant (the 32-bit
# golden ratio), so every replica's key differs.
_REPLICA_SEED_STRIDE = 0x9E3779B9


def _seed_states(variables: Sequence[Any]) -> list[int]:
    """The positions of Keras `SeedGenerator` states (what Dropout draws its masks from)."""
    return [i for i, v in enumerate(variables) if v.path.endswith("seed_generator_state")]


def _offset_state(state: Sequence[Any], positions: list[int], sign: int) -> tuple[Any, ...]:
    """A step's state groups with the seed states of its non-trainable variables (the
    second group in every Keras step's state) offset as `_offset_seeds` does. Every step
    draws per replica, not only training: a layer that calls `Dropout(...)(x, training=True)`
    (Monte-Carlo dropout) draws in `evaluate` and `predict` too."""
    return (state[0], _offset_seeds(state[1], positions, sign), *state[2:])


def _offset_seeds(values: Sequence[Any], positions: list[int], sign: int) -> list[Any]:
    """Each replica draws from its own key: the seed state's first word moved by the
    replica id (`sign=+1`) for the step, and moved back after it (`sign=-1`), so the state
    advances as single-device Keras advances it (`SeedGenerator.next` adds [0, 1] per
    draw) and every replica holds the same state."""
    context = get_replica_context()
    if not positions or context is None or context.num_replicas_in_sync == 1:
        return list(values)
    values = list(values)
    for i in positions:
        word = jnp.asarray(context.replica_id_in_sync_group, jnp.uint32) * jnp.uint32(
            _REPLICA_SEED_STRIDE
        )
        offset = jnp.stack([word, jnp.uint32(0)]).astype(values[i].dtype)
        values[i] = values[i] + offset if sign > 0 else values[i] - offset
    return values


def _reduce(variables: Sequence[Any], old: Sequence[Any], new: Sequence[Any]) -> list[Any]:
    """Each variable's new value across replicas, by its declared aggregation: `sum`
    sums the replicas' increments, `mean` averages, `only_first_replica` takes replica
    0's; `none` leaves each replica its own."""
    context = get_replica_context()
    reduced = []
    for variable, before, after in zip(variables, old, new, strict=True):
        aggregation = getattr(variable, "aggregation", "none")
        if aggregation == "sum":
            after = before + context.all_reduce(ReduceOp.SUM, after - before)
        elif aggregation == "mean":
            after = context.all_reduce(ReduceOp.MEAN, after)
        elif aggregation == "only_first_replica":
            first = context.replica_id_in_sync_group == 0
            after = context.all_reduce(ReduceOp.SUM, jnp.where(first, after, 0))
        reduced.append(after)
    return reduced


def _logs(model: Any, metrics: Sequence[Any]) -> dict[str, Any]:
    """The model's metric results computed from these (reduced) metric variables."""
    import keras

    mapping = list(zip(model.metrics_variables, metrics, strict=True))
    with keras.StatelessScope(state_mapping=mapping):
        return model.get_metrics_result()


def _rows(data: Any) -> int:
    leaves = [x for x in jax.tree.leaves(data) if hasattr(x, "shape") and x.ndim]
    return int(leaves[0].shape[0]) if leaves else 0


def _split(strategy: Any, data: Any) -> Any:
    """Put a global batch on the devices, split on dim 0 across the replicas."""
    sharding = NamedSharding(strategy.mesh, strategy.input_spec(True))
    return jax.tree.map(
        lambda x: (
            jax.device_put(np.asarray(x) if not isinstance(x, jax.Array) else x, sharding)
            if getattr(x, "ndim", 0)
            else x
        ),
        data,
    )


def _concatenate(outputs: list[Any]) -> Any:
    """Stacked per-replica predictions of each call, as rows in sample order. Calls that
    ran on different devices (a last batch that does not divide) are joined on the host."""
    rows = [jax.tree.map(lambda x: jnp.reshape(x, (-1, *x.shape[2:])), out) for out in outputs]
    placements = {frozenset(leaf.devices()) for leaf in jax.tree.leaves(rows)}
    join = jnp.concatenate
    if len(placements) > 1:
        rows, join = jax.device_get(rows), np.concatenate
    return functools.reduce(lambda a, b: jax.tree.map(lambda x, y: join([x, y]), a, b), rows)
