"""The `Strategy` base: a strategy answers layout questions and holds no algorithm.

It knows its devices and mesh, how inputs are placed, and which pass pipeline its steps
run. Values are plain `jax.Array`s and their sharding says what they are (`Layout`):

- mirrored: replicated on every replica;
- split: a global batch, split on dim 0 across the replicas;
- stacked: one value per replica (a varying step output, per-replica state such as
  BatchNorm statistics), stacked on a leading axis of length `num_replicas_in_sync` and
  sharded over `strategy.stacked_mesh`, whose axis names are the replica axes with the
  reserved prefix `STACKED_PREFIX`. A stacked value of shape `[R, ...]` and a batch of R rows
  therefore never look alike, whatever their shapes.

Mirrored state that a step holds split across the replicas between steps (the optimizer
state under weight-update sharding; the parameters too under parameter sharding) lives on
`strategy.sharded_mesh`, under the prefix `SHARDED_PREFIX`. It is
still one mirrored value of its logical shape: a step takes it as it is, and anything else
reads it whole.

A replica may span several devices (`logical_devices_per_replica=k`): the mesh then ends in
a model axis (`MODEL_AXIS`) of k neighbouring devices, cut from its fastest axis. Replicas
are the other axes. Inside a step a value is whole over the model axis, and XLA's
partitioner lays it out from the shardings the step and its arguments declare
(`with_sharding_constraint`, a parameter created split over "model" under `scope()`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from xla_strategies.core.context import in_compiled_step, user_scope
from xla_strategies.core.layout import (
    Layout,
)
from xla_strategies.core.reduce_op import ReduceOp, check_axis, reduce_replicas
from xla_strategies.core.trees import abstract_like, copy_to, map_arrays
from xla_strategies.distribute import planner
from xla_strategies.distribute.extended import StrategyExtended
from xla_strategies.distribute.merge_call import merge_call
from xla_strategies.distribute.mesh_layout import MeshLayout
from xla_strategies.distribute.model_axis import scope_with_mesh, state_shardings
from xla_strategies.distribute.values import distribute_values_from_function
from xla_strategies.passes.pipeline import PassPipeline
from xla_strategies.runtime.distributed_dataset import (
    DistributedDataset,
    DistributedDatasetFromFunction,
)
from xla_strategies.runtime.input_options import InputContext, InputOptions
from xla_strategies.step.compile_options import CompileOptions, defaults_of
from xla_strategies.step.compiled_step import CompiledStep
from xla_strategies.step.step_pipeline import PipelineOptions, step_pipeline
from xla_strategies.step.step_strategy import PipelineChanges, Setting


class Strategy(MeshLayout):
    """Shared API of all strategies (`OneDeviceStrategy`, `MirroredStrategy`, ...): the
    layout questions (`MeshLayout`), the pass pipeline, and tf.distribute's API."""

    #: The label of this strategy's pipeline in dump file names.
    pipeline_label: ClassVar[str] = "strategy"
    #: Whether every replica updates the weights, so the update can be sharded.
    shards_weight_updates: ClassVar[bool] = True
    #: The cluster's resolver, as tf.distribute has it: None for strategies of one host.
    cluster_resolver: Any = None
    #: Whether a step call waits for its outputs, so that a failure (a dead peer worker)
    #: is raised by the step, where the strategy can say what happened, and not at the
    #: caller's next read of an output.
    completes_steps: ClassVar[bool] = False

    def __init__(
        self,
        devices: Any,
        axis_names: tuple[str, ...] = ("replica",),
        compile_only: bool = False,
        logical_devices_per_replica: int = 1,
        layout_map: Any = None,
        pipeline_stages: int = 1,
    ) -> None:
        """The mesh and its layout as `MeshLayout` has them; `layout_map`: a Keras
        `keras.distribution.LayoutMap` that lays out over the model axis the variables
        of a Keras model built under `scope()` (`xla_strategies.keras`)."""
        super().__init__(
            devices, axis_names, compile_only, logical_devices_per_replica, pipeline_stages
        )
        if layout_map is not None and self.logical_devices_per_replica == 1:
            raise ValueError(
                "layout_map lays variables out over the model axis, which this strategy "
                "does not have: give logical_devices_per_replica > 1"
            )
        self.layout_map = layout_map
        self._compiled_runs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._compile_defaults: dict[str, Any] = {}

    def pipeline_changes(self) -> PipelineChanges:
        """What this strategy changes in the default pipeline (`step_pipeline`)."""
        return PipelineChanges()

    def pipeline_settings(self) -> tuple[Setting, ...]:
        """Pass options this strategy's user-facing settings give any pipeline."""
        return ()

    def pipeline(
        self, gradient_reduction: ReduceOp | None = None, spec: str | PassPipeline | None = None
    ) -> PassPipeline:
        """The pass pipeline a step compiled with these options runs (`step_pipeline`):
        `spec` (default: the strategy's), with the gradient reduction filled in where the
        spec did not set one."""
        return step_pipeline(self, PipelineOptions(spec, gradient_reduction))

    # tf.distribute's API

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Inside it, `xs.get_strategy()` returns this strategy, and a Keras model
        compiled there trains, evaluates and predicts on it (`xla_strategies.keras`).
        With a model axis, the strategy's mesh is also JAX's mesh context
        (`jax.set_mesh`): a flax variable annotated with a sharding is created split."""
        if self.logical_devices_per_replica == 1:
            return user_scope(self)
        return scope_with_mesh(user_scope(self), self._mesh)

    def sub_strategy(self, replicas: int) -> Strategy:
        """A strategy of this kind on this one's first `replicas` replicas, for a batch
        too small to split over all of them (Keras' last batch)."""
        raise ValueError(
            f"{type(self).__name__} cannot run a step on {replicas} of its "
            f"{self.num_replicas_in_sync} replicas; give every step a batch that splits over "
            "all of them (drop or pad the last batch)"
        )

    def replicate(self, tree: Any) -> Any:
        """Copy every array of `tree` to where this strategy keeps state (mirrored on all
        replicas, except for CentralStorageStrategy's parameter device). Functions held as
        leaves (an equinox module's activations) stay as they are. With a model axis, an
        array split over it (or annotated so by flax linen's `nn.with_partitioning`) is
        held split over it on every replica."""
        if self.logical_devices_per_replica == 1:
            shardings = itertools.repeat(self.state_sharding())
        else:
            shardings = state_shardings(tree, self._mesh, self.model_dim)
        return map_arrays(
            lambda a, _: self.place(a, next(shardings)),
            tree,
            "replicate(tree)",
            keep_functions=True,
        )

    def place(self, array: Any, sharding: jax.sharding.Sharding) -> Any:
        """A copy of `array` with `sharding`; abstract (a `jax.ShapeDtypeStruct`) when the
        strategy only compiles or `array` is abstract already."""
        if self.compile_only or isinstance(array, jax.ShapeDtypeStruct):
            return abstract_like(array, sharding)
        return copy_to(array, sharding)

    def with_logical_devices_per_replica(self, k: int) -> Strategy | None:
        """This strategy with `k` devices per replica (a model axis of `k`), for the
        planner; None where this kind of strategy cannot build one, or `k` does not divide
        its fastest axis."""
        return self if k == self.logical_devices_per_replica else None

    def with_pipeline_stages(self, stages: int) -> Strategy | None:
        """This strategy with its layers split over `stages` pipeline stages, for the
        planner; None where this kind of strategy cannot build them for its topology."""
        return self if stages == self.pipeline_stages else None

    def plan(
        self, step: Callable[..., Any], *args: Any, budget: float | None = None, **search: Any
    ) -> planner.Plan:
        """Compile `step` on abstract `args` in every candidate configuration for this
        strategy's topology, before launch: what fits, and what is fastest
        (`xla_strategies.distribute.planner`). `budget`: seconds, then the best so far;
        `search`: `model_axes` (devices per replica to try), `stages` (pipeline stages to
        try), `batch_doublings` and `remat_policies` (tried on the best configuration)."""
        if not self.compile_only or self.topology is None:
            raise ValueError(
                f"plan compiles for a topology without its chips: build the strategy with "
                f"compile_only=True and a topology, not {self!r}"
            )
        return planner.plan(self, step, args, budget, **search)

    def root_copy(self, array: jax.Array) -> jax.Array:
        """The correct copy of a step output that only one replica holds (`rooted`)."""
        raise NotImplementedError(f"{type(self).__name__} produces no rooted outputs")

    def compile(
        self,
        fn: Callable[..., Any] | None = None,
        options: CompileOptions | None = None,
        **keywords: Any,
    ) -> Any:
        """Compile a per-replica step; use as `@strategy.compile` or `@strategy.compile(...)`.

        The options are `CompileOptions`' fields, given as keywords (`donate_argnums=(0,
        1)`) or as one `options=CompileOptions(...)`; each is documented there. Options
        given to `set_compile_defaults` apply where a call does not give them.
        """
        if options is None:
            options = CompileOptions.of({**self._compile_defaults, **keywords})
        elif keywords:
            raise TypeError(f"give options= or keywords, not both (got {sorted(keywords)})")
        if fn is None:
            return lambda f: CompiledStep(self, f, options)
        return CompiledStep(self, fn, options)

    def set_compile_defaults(self, **keywords: Any) -> None:
        """Options every step this strategy compiles takes unless it gives its own: the
        way to ask for them where the library compiles the step (Keras' `fit`, `evaluate`
        and `predict` under `strategy.scope()`, `strategy.run`), e.g.
        `strategy.set_compile_defaults(shard_parameters=True)`. Only
        `CompileOptions.DEFAULTABLE` can be set."""
        self._compile_defaults = {**self._compile_defaults, **defaults_of(keywords)}

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run `fn` once on every replica; per-replica outputs come back stacked. `fn` is
        compiled as `strategy.compile(fn)` would compile it, with the compile defaults
        (`set_compile_defaults`) in force at the call: tf.distribute's custom loop, which
        sums gradients, asks for `gradient_reduction=ReduceOp.SUM` there."""
        if in_compiled_step():
            raise RuntimeError(
                "strategy.run was called inside a compiled step, which already runs on every "
                "replica: call the function directly there (tf.distribute's run, too, is "
                "called in the cross-replica context)"
            )
        defaults, step = self._compiled_runs.get(fn, (None, None))
        if step is None or defaults != self._compile_defaults:
            step = self.compile(fn)
            self._compiled_runs[fn] = (dict(self._compile_defaults), step)
        return step(*args, **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine per-replica values across replicas, and along `axis` of each if given."""
        op = ReduceOp.of(reduce_op)
        return map_arrays(
            lambda a, where: self._reduce_leaf(op, a, axis, where), value, "reduce(value)"
        )

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate per-replica values along `axis` (of each replica's value)."""

        def leaf(a: Any, where: str) -> Any:
            stacked = self._stacked(a)
            if stacked is None:  # mirrored: every replica's part is the value itself
                value = jnp.asarray(a)
                stacked = jnp.broadcast_to(value, (self.num_replicas_in_sync, *value.shape))
            check_axis(axis, stacked.ndim - 1, where)
            at = axis % (stacked.ndim - 1)
            # the parts side by side along `axis` is a layout change of the stack, so XLA
            # moves the bits; indexing the stack replica by replica compiles to a masked
            # sum over the devices (-0.0 comes back +0.0)
            moved = jnp.moveaxis(stacked, 0, at)
            return moved.reshape(*moved.shape[:at], -1, *moved.shape[at + 2 :])

        return map_arrays(leaf, value, "gather(value)")

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """A tuple with each local replica's part of `value`, each on that replica's device."""
        local = [d for d in self.devices if d.process_index == jax.process_index()]
        per_leaf = map_arrays(lambda a, _: self._local_parts(a, local), value, "value")
        return tuple(
            jax.tree.map(
                lambda parts, i=i: parts[i], per_leaf, is_leaf=lambda x: isinstance(x, list)
            )
            for i in range(len(local))
        )

    def experimental_distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        """`value_fn(xs.experimental.ValueContext)` for each replica, stacked per leaf on
        the replica axis: a step reads its own replica's value (`distribute/values.py`)."""
        return distribute_values_from_function(self, value_fn)

    def merge_in_step(
        self, context: Any, merge_fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        """`ReplicaContext.merge_call` inside this strategy's step (`merge_call.py`)."""
        return merge_call(self, context, merge_fn, args, kwargs)

    @functools.cached_property
    def extended(self) -> StrategyExtended:
        """tf.distribute's `StrategyExtended` (`xla_strategies.distribute.extended`)."""
        return StrategyExtended(self)

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Split each global batch of `dataset` on axis 0 across the replicas, prefetched
        to the devices by a background thread (see `xs.InputOptions`)."""
        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> DistributedDatasetFromFunction:
        """Call `dataset_fn(input_context)` once on each host; it returns that host's part
        of every global batch (`input_context.get_per_host_batch_size(global_batch)`)."""
        return DistributedDatasetFromFunction(self, dataset_fn, options)

    # helpers

    def _stacked(self, array: Any) -> Any | None:
        """Per-replica data as [replicas, per-replica value...]: a step's stacked output as
        it is; a distributed batch (k examples per replica) reshaped to [replicas, k, ...].
        None for a mirrored value."""
        layout = self.layout(array)
        if layout is Layout.STACKED:
            return jnp.asarray(array)
        if layout is Layout.MIRRORED:
            return None
        n = self.num_replicas_in_sync
        return jnp.reshape(jnp.asarray(array), (n, array.shape[0] // n, *array.shape[1:]))

    def _per_replica_parts(self, array: Any) -> list[Any]:
        stacked = self._stacked(array)
        if stacked is not None:
            return [stacked[i] for i in range(self.num_replicas_in_sync)]
        return [jnp.asarray(array)] * self.num_replicas_in_sync

    def _reduce_leaf(self, op: ReduceOp, array: Any, axis: int | None, where: str) -> Any:
        stacked = self._stacked(array)
        x = jnp.asarray(array) if stacked is None else stacked
        return reduce_replicas(op, x, stacked is not None, axis, self.num_replicas_in_sync, where)

    def _local_parts(self, array: Any, devices: list[jax.Device]) -> list[Any]:
        if not isinstance(array, jax.Array):
            return [jax.device_put(array, d) for d in devices]
        layout = self.layout(array)
        stacked = layout is Layout.STACKED
        shards = {s.device: s.data for s in array.addressable_shards}
        # a mirrored value held sharded (weight-update sharding) has no whole copy to hand out
        own_part = layout is not Layout.MIRRORED or array.sharding.is_fully_replicated
        if own_part and all(d in shards for d in devices):
            return [shards[d][0] if stacked else shards[d] for d in devices]
        parts = self._per_replica_parts(array)
        return [jax.device_put(part, d) for part, d in zip(parts, devices, strict=False)]

    def __repr__(self) -> str:
        shown = f"num_replicas_in_sync={self.num_replicas_in_sync}{self._logical_devices_shown()}"
        if self.compile_only:
            shown = f"{self.topology}, {shown}, compile_only=True"
        return f"{type(self).__name__}({shown})"

    def _logical_devices_shown(self) -> str:
        k, stages = self.logical_devices_per_replica, self.pipeline_stages
        shown = f", logical_devices_per_replica={k}" if k > 1 else ""
        return shown + (f", pipeline_stages={stages}" if stages > 1 else "")
