"""`strategy.compile`: capture a per-replica step, run the pass pipeline, lower it to XLA.

Executables are cached per input signature (tree structure, shapes, dtypes, each array's
layout, and the static values), like `jax.jit`: a new structure, shape or static value
retraces.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from xla_strategies.core.errors import StoppedAfterCompile
from xla_strategies.core.layout import Layout
from xla_strategies.hardware.compiled_report import compiled_report
from xla_strategies.passes.base import PassContext
from xla_strategies.passes.bridge.called_functions import sites_called
from xla_strategies.passes.bridge.layouts import input_shardings
from xla_strategies.passes.bridge.lowering import lower
from xla_strategies.passes.cost.collective_stats import collective_summary
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.passes.ir.text import print_graph
from xla_strategies.passes.pipeline import PassPipeline
from xla_strategies.passes.rewrites.block_axes import within_slice
from xla_strategies.runtime import cluster_health
from xla_strategies.runtime.dispatch_pacing import CPU_PACER
from xla_strategies.step import in_place_state, numerics
from xla_strategies.step.argument_declarations import declared_arguments
from xla_strategies.step.arguments import (
    KnownSpecs,
    Signature,
    argument_paths,
    check_split_rows,
    flatten_arguments,
)
from xla_strategies.step.compile_options import CompileOptions
from xla_strategies.step.compile_program import LoweredStep, compile_lowered
from xla_strategies.step.compiler_options import option_values, step_compiler_options
from xla_strategies.step.dumping import (
    STOP_AFTER_COMPILE,
    DumpOptions,
    StepDumper,
    abstract,
)
from xla_strategies.step.executable import Executable
from xla_strategies.step.outputs import Outputs
from xla_strategies.step.pipeline_choice import (
    Verdict,
    choose,
    chosen_pipeline,
    selects_by_compiling,
    swappable,
)
from xla_strategies.step.plan_mode import plan_and_stop
from xla_strategies.step.recompiles import warn_if_recompiling
from xla_strategies.step.stage_plan import (
    stage_plan,
    staged_pipeline,
)
from xla_strategies.step.state import DeclaredState, donated_state
from xla_strategies.step.step_capture import capture_step
from xla_strategies.step.step_pipeline import PipelineOptions, check_sharding_options, step_pipeline
from xla_strategies.step.verdict_cache import fingerprint

if TYPE_CHECKING:
    from xla_strategies.step.step_strategy import StepStrategy


# Executables a compiled step keeps, the least recently used dropped first (jax.jit's own
# cache of a function is bounded alike)
CACHE_SIZE = 64


class CompiledStep:
    """A per-replica step compiled for a strategy. Call it like the original function."""

    def __init__(
        self,
        strategy: StepStrategy,
        fn: Callable[..., Any],
        options: CompileOptions | None = None,
        **keywords: Any,
    ) -> None:
        """`options`, or the same as keywords (`CompileOptions`' fields)."""
        if not callable(fn):
            raise TypeError(f"strategy.compile needs a function, got a {type(fn).__name__}")
        if options is None:
            options = CompileOptions.of(keywords)
        elif keywords:
            raise TypeError(f"give options= or keywords, not both (got {sorted(keywords)})")
        check_sharding_options(strategy, options.shard_weight_updates, options.shard_parameters)
        self.options = options
        self.strategy = strategy
        self.fn = fn
        self.name = options.name or getattr(fn, "__name__", "step")
        self.gradient_reduction = options.gradient_reduction
        self.mirrored_outputs = options.mirrored_outputs
        self.static_argnums, self.static_argnames = declared_arguments(
            fn, options.static_argnums, options.static_argnames, "static"
        )
        self.declared_state = DeclaredState(
            *declared_arguments(fn, options.donate_argnums, options.donate_argnames, "donate")
        )
        both = (self.declared_state.donate_argnums & self.static_argnums) | (
            self.declared_state.donate_argnames & self.static_argnames
        )
        if both:
            raise ValueError(f"arguments {sorted(map(str, both))} are both static and donated")
        self.axis_name = options.axis_name
        self.pipeline_options = PipelineOptions(
            options.pipeline,
            options.gradient_reduction,
            options.shard_weight_updates,
            options.shard_parameters,
        )
        self.stage_plan = stage_plan(strategy, options, lambda: within_slice(self._pass_context()))
        self.pipeline = staged_pipeline(
            step_pipeline(strategy, self.pipeline_options), self.stage_plan, options
        )
        self.compiler_options = option_values(options.compiler_options)
        self._cache: OrderedDict[Signature, Executable] = OrderedDict()
        self._known_specs = KnownSpecs()  # what its arguments' arrays read as, by their kind
        self._compiled = 0  # programs built, the evicted included
        self._calls = 0  # for errors that name the call (numerics)
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__

    # the public surface

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.strategy.completes_steps and (gone := cluster_health.unavailable()):
            raise gone  # a peer worker died: no step can run
        flat, signature = self._flatten(args, kwargs)
        if self.strategy.compile_only and (budget := DumpOptions.from_env().plan) is not None:
            plan_and_stop(self, args, kwargs, budget)
        abstract = self.strategy.compile_only or any(
            isinstance(leaf, jax.ShapeDtypeStruct) for leaf in flat
        )
        if abstract and not DumpOptions.from_env().stop_after_compile:
            what = (
                f"{self.strategy!r} only compiles"
                if self.strategy.compile_only
                else "its arguments are abstract (jax.ShapeDtypeStruct)"
            )
            raise TypeError(
                f"{self.name} cannot run: {what}. Use {self.name}.lower(*args).compile() for "
                "the executable, or xla-strategies aot for a summary of it"
            )
        executable = self._executable(signature)
        self._calls += 1
        if numerics.checks_inputs():
            numerics.check_arrays(
                flat,
                lambda i: f"{self.name} argument {argument_paths(signature)[i]}",
                lambda: f"before call {self._calls} of {self.name} ran",
            )
        pacer = CPU_PACER if self.strategy.devices_share_host_cores else None
        if pacer is not None:
            pacer.before_dispatch()
        outs = cluster_health.dispatched(
            lambda: executable.run(*executable.place(flat, self.strategy)),
            self.strategy.completes_steps,
        )
        if any(executable.rooted):  # only the root replica's copy is right
            pairs = zip(outs, executable.rooted, strict=True)
            outs = [self.strategy.root_copy(o) if r else o for o, r in pairs]
        if pacer is not None:
            pacer.after_dispatch(outs)
        outputs = executable.outputs
        if numerics.checks_outputs():
            numerics.check_arrays(
                outs,
                lambda i: f"{self.name} {outputs.names[i]}",
                lambda: f"made by call {self._calls} of {self.name}",
            )
        in_place_state.write_back(outputs.written, outputs.in_place(outs), args, kwargs)
        return outputs.join(outs)

    def lower(self, *args: Any, **kwargs: Any) -> LoweredStep:
        """The lowered program for these arguments, as `jax.jit(...).lower` gives it:
        arrays or abstract `jax.ShapeDtypeStruct`s whose sharding says their layout (none:
        mirrored; `strategy.split_sharding()`: a global batch). Its `compile()` returns the
        executable for the strategy's devices: a TPU executable on a compile-only strategy."""
        flat, signature = self._flatten(args, kwargs)
        executable = self._executable(signature)
        lowered = executable.run.lower(*executable.place(flat, self.strategy))
        return LoweredStep.of(lowered, self.strategy, self.name)

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

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[list[Any], Signature]:
        return flatten_arguments(
            args,
            kwargs,
            self.strategy.layout,
            self.static_argnums,
            self.static_argnames,
            lambda path: f"{self.name} argument {path}",
            self.strategy.model_dim,
            self._known_specs,
        )

    def _executable(self, signature: Signature) -> Executable:
        """The executable for `signature`: the cache keeps the `CACHE_SIZE` most recently
        used, so a value that changes every call (a static one) cannot grow it forever."""
        cached = self._cache.get(signature)
        if cached is None:
            check_split_rows(
                signature,
                self.strategy.num_replicas_in_sync,
                lambda: [f"{self.name} argument {p}" for p in argument_paths(signature)],
            )
            cached = self._cache[signature] = self._build(signature)
            self._compiled += 1
            if len(self._cache) > 1:  # the last one used before this one
                previous = list(self._cache)[-2]
                warn_if_recompiling(self.name, self._compiled, previous, signature)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(signature)
        return cached

    def _pass_context(self) -> PassContext:
        return PassContext(
            mesh_axes={a: self.strategy.mesh.shape[a] for a in self.strategy.replica_axes},
            topology=self.strategy.topology,
            synchronous_collectives=self.strategy.devices_share_host_cores,
            devices_per_replica=self.strategy.logical_devices_per_replica,
            platform=self.strategy.mesh.devices.flat[0].platform,
        )

    def _capture(self, signature: Signature) -> tuple[Graph, Outputs]:
        return capture_step(self, signature)

    def _build(self, signature: Signature) -> Executable:
        """Capture, run the passes (with the dump's instruments), lower; dump if asked."""
        options = DumpOptions.from_env()
        if options.plan is not None:  # a planner's candidate: neither dumped nor stopped
            options = DumpOptions()
        seconds: dict[str, float] = {}
        dump = StepDumper(options, self.name, self.strategy)
        start = time.perf_counter()
        graph, outputs = self._capture(signature)
        seconds["capture"] = time.perf_counter() - start
        dump.progress(f"captured in {seconds['capture']:.1f} s ({len(graph.nodes)} nodes)")
        captured_stats = collective_summary(graph)
        pipeline = self.pipeline
        if options.pipeline:  # XLA_STRATEGIES_PIPELINE: the user's spec, by the same rule
            spec = dataclasses.replace(self.pipeline_options, spec=options.pipeline)
            pipeline = step_pipeline(self.strategy, spec)
        remarks: list[str] = []
        if selects_by_compiling(self.options, self.strategy, options):
            verdict = self._select(signature, graph, pipeline, swappable(self.options))
            pipeline = chosen_pipeline(pipeline, verdict.chosen)
            remarks.append(verdict.remark())
            dump.progress(verdict.remark())
        start = time.perf_counter()
        ctx = self._pass_context()
        ctx.remarks.extend(remarks)
        dump.instrument(pipeline).run(graph, ctx)
        seconds["pipeline"] = time.perf_counter() - start
        dump.progress(f"{len(pipeline.passes)} passes ran in {seconds['pipeline']:.1f} s")
        seconds["verify"] = ctx.stats["verify_seconds"]  # part of the pipeline's time
        donated = donated_state(graph)
        strategy = self.strategy
        run, compiler_options = self._lowered(graph, ctx)
        dump.write(graph, run, signature.arrays, compiler_options)
        dump.write_schedule(self.stage_plan)
        if options.stop_after_compile:
            raise StoppedAfterCompile(f"{self.name} compiled; stopping ({STOP_AFTER_COMPILE})")
        shardings = input_shardings(graph, strategy.mesh, None, strategy.sharded_mesh)
        placements = tuple(
            sharding if spec.layout is Layout.MIRRORED else None
            for spec, sharding in zip(signature.arrays, shardings, strict=True)
        )
        stats = (captured_stats, seconds, ctx.stats, ctx.remarks)
        return Executable(graph, run, outputs, donated, placements, *stats)

    def _lowered(self, graph: Graph, ctx: PassContext) -> tuple[Any, dict[str, Any]]:
        """The jitted program of a graph the passes ran on, and its XLA options."""
        strategy = self.strategy
        compiler_options = step_compiler_options(
            strategy.compiler_options(ctx.parameters_split), self.compiler_options
        )
        run = lower(
            graph,
            strategy.mesh,
            donated_state(graph),
            strategy.stacked_mesh,
            compiler_options,
            strategy.sharded_mesh,
        )
        return run, compiler_options

    def _select(
        self, signature: Signature, graph: Graph, pipeline: PassPipeline, swap: bool
    ) -> Verdict:
        """Compile the alternatives of `pipeline` for this step (`pipeline_choice`); without
        `swap`, only its refinements."""
        strategy = self.strategy
        reports: dict[Any, Any] = {}  # by the program the passes left: each compiled once

        def compile_one(candidate: PassPipeline) -> Any:
            fresh, _ = self._capture(signature)
            ctx = self._pass_context()
            candidate.run(fresh, ctx)
            program = (print_graph(fresh), sites_called(fresh, ctx.platform))  # not in text
            if program not in reports:
                reports[program] = self._compiled_report(signature, fresh, ctx)
            return reports[program]

        # the pipeline's spec too: a verdict on the passes of another release is stale
        where = (self.options, pipeline.spec())
        key = fingerprint(print_graph(graph), strategy.topology, where)
        return choose(pipeline, compile_one, key, swap)

    def _compiled_report(self, signature: Signature, graph: Graph, ctx: PassContext) -> Any:
        """XLA's compile of `graph` (the passes ran on it) for the strategy's topology."""
        strategy = self.strategy
        run, compiler_options = self._lowered(graph, ctx)
        shardings = input_shardings(
            graph, strategy.mesh, strategy.stacked_mesh, strategy.sharded_mesh
        )
        args = abstract([(a.shape, a.dtype) for a in signature.arrays], shardings)
        compiled = compile_lowered(lambda: run.lower(*args).compile(), strategy, self.name)
        return compiled_report(compiled, strategy, compiler_options)
