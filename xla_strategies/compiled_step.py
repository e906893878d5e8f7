"""`strategy.compile`: capture a per-replica step, run the pass pipeline, lower it to XLA.

Executables are cached per input signature (tree structure, shapes, dtypes, and which leaves
are per-replica), like `jax.jit`: a new structure or shape retraces.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from xla_strategies.context import ReplicaContext, replica_scope
from xla_strategies.dumping import (
    STOP_AFTER_COMPILE,
    STOPPED_EXIT_CODE,
    DumpOptions,
    abstract,
    step_directory,
    write_artifacts,
)
from xla_strategies.passes.base import PassContext
from xla_strategies.passes.dump import IRDumper, IRPrinter
from xla_strategies.passes.ir import Graph
from xla_strategies.passes.jax_capture import capture
from xla_strategies.passes.jax_lowering import lower
from xla_strategies.passes.ledger import LedgerRecorder
from xla_strategies.passes.pipeline import PassPipeline, PassTimer
from xla_strategies.reduce_op import ReduceOp
from xla_strategies.trees import as_array, copy_to, path_str

if TYPE_CHECKING:
    from xla_strategies.strategy import Strategy


@dataclass
class Executable:
    """One compiled program of a step, for one input signature."""

    graph: Graph
    run: Callable[..., tuple[jax.Array, ...]]
    out_tree: Any
    donated: tuple[int, ...]
    captured_text_stats: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Signature:
    treedef: Any
    avals: tuple[tuple[tuple[int, ...], str, bool], ...]


class CompiledStep:
    """A per-replica step compiled for a strategy. Call it like the original function."""

    def __init__(
        self,
        strategy: Strategy,
        fn: Callable[..., Any],
        *,
        gradient_reduction: ReduceOp | str = ReduceOp.MEAN,
        mirrored_outputs: Any = None,
        pipeline: str | PassPipeline | None = None,
        donate: bool = True,
        name: str | None = None,
    ) -> None:
        op = ReduceOp.of(gradient_reduction, "gradient_reduction")
        if op not in (ReduceOp.MEAN, ReduceOp.SUM):
            raise ValueError(
                f"gradient_reduction must be ReduceOp.MEAN or ReduceOp.SUM, got {op.name}"
            )
        self.strategy = strategy
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "step")
        self.gradient_reduction = op
        self.mirrored_outputs = mirrored_outputs
        self.pipeline = strategy.pipeline(op, pipeline)
        self.donate = donate
        self._cache: dict[_Signature, Executable] = {}
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__

    # the public surface

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, signature = self._flatten(args, kwargs)
        executable = self._executable(signature)
        outs = executable.run(*self._place(flat, signature))
        if executable.graph.rooted_outputs:  # only the root replica's copy is right
            outs = [
                self.strategy.root_copy(o) if i in executable.graph.rooted_outputs else o
                for i, o in enumerate(outs)
            ]
        return jax.tree.unflatten(executable.out_tree, outs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The `jax.stages.Lowered` program for these arguments."""
        flat, signature = self._flatten(args, kwargs)
        return self._executable(signature).run.lower(*self._place(flat, signature))

    def graph(self, *args: Any, after: str = "capture", **kwargs: Any) -> Graph:
        """The IR for these arguments after capture or after the pass named `after`."""
        _, signature = self._flatten(args, kwargs)
        graph, _ = self._capture(signature)
        if after != "capture":
            self.pipeline.run(graph, self._pass_context(), stop_after=after)
        return graph

    def executable(self, *args: Any, **kwargs: Any) -> Executable:
        """The cached executable for these arguments (built if needed)."""
        return self._executable(self._flatten(args, kwargs)[1])

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    # building

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[list[Any], _Signature]:
        # Runs on every call: leaf paths are formatted only for an error message.
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        flat, avals = [], []
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise ValueError(
                    f"{self._where(args, kwargs, index)} was donated to an earlier call of a "
                    "compiled step and deleted; pass the array that call returned (or compile "
                    "with donate=False)"
                )
            array = as_array(leaf, lambda i=index: self._where(args, kwargs, i))
            flat.append(array)
            avals.append(
                (tuple(array.shape), str(array.dtype), self.strategy.is_per_replica(array))
            )
        return flat, _Signature(treedef, tuple(avals))

    def _where(self, args: tuple, kwargs: dict, index: int) -> str:
        path = jax.tree_util.tree_flatten_with_path((args, kwargs))[0][index][0]
        return f"{self.name} argument {_arg_path(path)}"

    def _place(self, flat: list[Any], signature: _Signature) -> list[Any]:
        mirrored = NamedSharding(self.strategy.mesh, PartitionSpec())
        return [
            leaf if per_replica else _put(leaf, mirrored)
            for leaf, (_, _, per_replica) in zip(flat, signature.avals, strict=True)
        ]

    def _executable(self, signature: _Signature) -> Executable:
        cached = self._cache.get(signature)
        if cached is None:
            cached = self._cache[signature] = self._build(signature)
        return cached

    def _pass_context(self) -> PassContext:
        return PassContext(
            mesh_axes=dict(self.strategy.mesh.shape), topology=self.strategy.topology
        )

    def _capture(self, signature: _Signature) -> tuple[Graph, Any]:
        strategy = self.strategy
        in_specs = [strategy.input_spec(per_replica) for _, _, per_replica in signature.avals]
        flat_args = [
            jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(strategy.mesh, spec))
            for (shape, dtype, _), spec in zip(signature.avals, in_specs, strict=True)
        ]
        context = ReplicaContext(tuple(strategy.mesh.axis_names), strategy.num_replicas_in_sync)

        def step(args: tuple, kwargs: dict) -> Any:
            with replica_scope(strategy, context):
                return self.fn(*args, **kwargs)

        names = [
            _arg_path(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(
                jax.tree.unflatten(signature.treedef, range(len(signature.avals)))
            )[0]
        ]
        captured = capture(
            step,
            flat_args,
            signature.treedef,
            strategy.mesh,
            [per_replica for _, _, per_replica in signature.avals],
            input_names=names,
            output_prefix="output",
            name=self.name,
        )
        graph = captured.graph
        if self.mirrored_outputs is not None:
            graph.declared_mirrored = _declared_mirrored(self.mirrored_outputs, captured.out_tree)
        return graph, captured.out_tree

    def _build(self, signature: _Signature) -> Executable:
        options = DumpOptions.from_env()
        seconds: dict[str, float] = {}
        start = time.perf_counter()
        graph, out_tree = self._capture(signature)
        seconds["capture"] = time.perf_counter() - start
        captured_stats = _reduction_stats(graph)
        pipeline = self.pipeline
        if options.pipeline:
            pipeline = self.strategy.pipeline(self.gradient_reduction, options.pipeline)
        pipeline = pipeline.with_instruments(PassTimer())
        if options.print_ir:
            pipeline = pipeline.with_instruments(
                IRPrinter(only_changed=options.print_ir == "change")
            )
        directory = step_directory(options.directory, self.name) if options.directory else None
        ledger = LedgerRecorder(self.strategy.topology)
        if directory is not None:
            label = self.strategy.pipeline_label
            pipeline = pipeline.with_instruments(IRDumper(directory, label), ledger)
        start = time.perf_counter()
        pipeline.run(graph, self._pass_context())
        seconds["pipeline"] = time.perf_counter() - start
        donated = self._donated(signature, out_tree, graph) if self.donate else ()
        in_specs = [self.strategy.input_spec(per_replica) for _, _, per_replica in signature.avals]
        run = lower(graph, self.strategy.mesh, in_specs, donated)
        if directory is not None:
            shardings = [NamedSharding(self.strategy.mesh, spec) for spec in in_specs]
            args = abstract([(s, d) for s, d, _ in signature.avals], shardings)
            write_artifacts(directory, graph, run, args, ledger, self.strategy.topology)
        if options.stop_after_compile:
            print(
                f"xla_strategies: {self.name} compiled; stopping ({STOP_AFTER_COMPILE})",
                file=sys.stderr,
            )
            raise SystemExit(STOPPED_EXIT_CODE)
        return Executable(graph, run, out_tree, donated, captured_stats, seconds)

    def _donated(self, signature: _Signature, out_tree: Any, graph: Graph) -> tuple[int, ...]:
        """Flat indices of the step's state: a mirrored positional argument that comes back
        at the same position of a tuple of outputs, with the same structure and types
        (`params, opt_state, ... = step(params, opt_state, ...)`), holding at least one
        non-scalar array. Anything else, e.g. an evaluation step's inputs, is never donated."""
        out_types = [None if v.varying_axes else (v.shape, v.dtype) for v in graph.outputs]
        outputs = jax.tree.unflatten(out_tree, range(out_tree.num_leaves))
        if not isinstance(outputs, tuple | list):
            return ()
        args = jax.tree.unflatten(signature.treedef, range(len(signature.avals)))[0]
        donated: list[int] = []
        for arg, part in zip(args, outputs, strict=False):
            flat = jax.tree.leaves(arg)
            if not flat or any(signature.avals[i][2] for i in flat):
                continue
            types = [signature.avals[i][:2] for i in flat]
            if (
                jax.tree.structure(part) == jax.tree.structure(arg)
                and types == [out_types[j] for j in jax.tree.leaves(part)]
                and any(shape for shape, _ in types)
            ):
                donated.extend(flat)
        return tuple(donated)


def _put(leaf: Any, sharding: NamedSharding) -> Any:
    if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
        return leaf
    return copy_to(leaf, sharding)  # never donate a caller's buffer


def _arg_path(path: tuple[Any, ...]) -> str:
    """Paths of the (args, kwargs) pair read as `args[0]['w']` or `kwargs['batch']`."""
    head, rest = path[0], path[1:]
    return path_str("args" if getattr(head, "idx", 0) == 0 else "kwargs", rest)


def _declared_mirrored(prefix: Any, out_tree: Any) -> frozenset[int]:
    """Flat output positions under a `True` leaf of the user's pytree prefix."""
    outputs = jax.tree.unflatten(out_tree, range(out_tree.num_leaves))
    try:
        marks = jax.tree.map(
            lambda flag, sub: [bool(flag)] * len(jax.tree.leaves(sub)), prefix, outputs
        )
    except ValueError as exc:
        raise ValueError(
            f"mirrored_outputs must be a pytree prefix of the step's outputs ({out_tree}): {exc}"
        ) from None
    flags = [
        f for group in jax.tree.leaves(marks, is_leaf=lambda x: isinstance(x, list)) for f in group
    ]
    return frozenset(i for i, flag in enumerate(flags) if flag)


def _reduction_stats(graph: Graph) -> dict[str, Any]:
    from xla_strategies.passes.collective_stats import collective_summary

    return collective_summary(graph)
