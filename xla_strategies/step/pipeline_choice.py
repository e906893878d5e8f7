"""Where the cost model cannot rank two pipelines, the compiler decides.

A compile for a TPU slice or GPU nodes costs seconds to minutes; a training run, days. So a
step compiled for a known topology can compile its pipeline's alternatives and keep the
best by what XLA's compiler says of each. The alternatives:

- `default`: the step's pipeline, every pass the cost model turned on included;
- `sharded-updates`: the default with weight-update sharding on where the cost model
  decides it (its estimate of the update's memory traffic is the least certain of its
  terms: on keras-hub's Llama 3.2 1B on v5e-256 it kept the update replicated, taking
  179.3 ms of XLA's compute a step against the sharded update's 112.8), and the
  parameters whole where the cost model decides that, as the default has its decision:
  ZeRO-1's program (on Gemma 3 1B on v5e-256, whose parameters the cost model sharded,
  this alternative compiled the default again before; ZeRO-1's is 14.13 GiB, 144.54 ms);
- `replicated`: only the passes that give the reductions their meaning (as `jax.jit`'s data
  parallelism runs: one reduction per gradient, XLA's own combiners and schedule).

The rule is the guarantee the library gives: of the programs that fit and are at most the
replicated one in memory per chip (within `SAME`, the rounding of a few instructions named
differently) and in estimated step (within `STEP_RESOLUTION`), the one with the shortest
estimated step is kept; where others' estimated steps are within `STEP_RESOLUTION` of it,
the smallest of them in memory, the earlier in that order on a tie. Memory is XLA's buffer
assignment, exact; the step is an estimate, which cannot rank programs 1 % apart (GPT-2
medium written in plain JAX on v5e-256: 283.45 ms with the update replicated, 284.35
sharded, 283.92 replicated, where the sharded update held 7.36 GiB against 7.75 and 8.25;
`jax.jit`'s program 7.72 GiB, 285.44 ms). Where the replicated program does not fit, the
same among those that do. A program that trades memory for a shorter step is not kept:
the verdict says what it would have given. An alternative whose passes leave the same
program as an earlier one is not compiled again.

Then each exact rewrite the cost model decides (`REFINEMENTS`) is tried on the program
kept, and kept with it where that is at most it in both and better in one: the loss's
label gradient taken as a select (`scatter-adds-as-selects`) took Gemma 3 1B's replicated
program on v5e-256 from 136.87 to 109.46 ms (XLA's compute 114.2 to 86.8 ms; `jax.jit`'s,
whose partitioner lowers that scatter-add its own way, 89.2). A rewrite that changes
nothing in a step is not compiled again either.

On by default for a strategy with a topology (TPU slices, GPU nodes); `compile(
select_by_compiling=...)` or `XLA_STRATEGIES_SELECT_BY_COMPILING=0|1` says otherwise. A
pipeline spec the user wrote runs as written. Where the user asked for a sharding
(`shard_parameters=True`, `shard_weight_updates=True`) the step's pipeline is the only
alternative, and only its refinements are tried: they judge what was left to the cost
model, not what was asked.
What the compiler said of each program is cached by the step's fingerprint (its captured
IR, the topology, the options, the pipeline and the compiler's releases; `verdict_cache`),
so compiling the same step again pays for one compile; the rule is applied again to what
was cached, and a program the cache does not hold (a refinement of another kept one) is
compiled. The dump and the step's remarks say what was compiled and why one
won.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from xla_strategies.core.errors import OutOfMemoryError
from xla_strategies.hardware.compiled_report import CompiledReport
from xla_strategies.passes.base import Pass
from xla_strategies.passes.pipeline import PassPipeline, with_pass, without_pass
from xla_strategies.passes.transforms.inline_nested_calls import InlineNestedCalls
from xla_strategies.passes.transforms.materialize_early_matmuls import MaterializeEarlyMatmuls
from xla_strategies.passes.transforms.scatter_adds_as_selects import ScatterAddsAsSelects
from xla_strategies.passes.transforms.shard_parameters import ShardParameters
from xla_strategies.passes.transforms.shard_weight_updates import ShardWeightUpdates
from xla_strategies.step import verdict_cache
from xla_strategies.step.compile_options import CompileOptions

#: the passes that give a step's reductions their meaning (and where the state goes, for
#: a strategy that keeps it on one device): never left out of an alternative
MEANING = frozenset({"insert-reductions", "fold-invariant-reductions", "reduce-to-one-device"})
#: exact rewrites the cost model decides, which it may leave off where they pay, and the
#: replicated alternative leaves out: each is tried on the program chosen among the
#: alternatives, and kept where that is better
REFINEMENTS: dict[str, Callable[[], Pass]] = {
    ScatterAddsAsSelects.name: lambda: ScatterAddsAsSelects(mode="on"),
    # its own rule (operands larger than the result) is the default's; the replicated
    # program, which leaves it out, is where a tied embedding's logits stay alive
    MaterializeEarlyMatmuls.name: lambda: MaterializeEarlyMatmuls(mode="auto"),
    # the user's nested calls inlined (for GPUs, what the default already does: the same
    # program, not compiled again)
    InlineNestedCalls.name: lambda: InlineNestedCalls(mode="on"),
}
#: the relative difference two programs' memory or estimated step may have and count as
#: the same (programs that differ in their instructions' names and fusion boundaries)
SAME = 1e-4
#: estimated steps this close (relative) rank as one: the smaller program in memory is kept.
#: The estimate's calibrated rates are within +-25 % of measured steps on v6e, +-16 % on
#: the H200 and uncalibrated on v5e; a difference under 1 % is below what it can tell.
STEP_RESOLUTION = 0.01


@dataclass(frozen=True)
class Compiled:
    """What XLA's compiler said of one alternative."""

    label: str
    spec: str
    fits: bool
    memory_bytes: int | None
    step_s: float | None

    def at_most(self, other: Compiled, step_resolution: float = SAME) -> bool:
        """Whether this program fits and is no worse than `other` in memory per chip (within
        `SAME`) and in estimated step (within `step_resolution`)."""
        if not self.fits:
            return False
        pairs = (
            (self.memory_bytes, other.memory_bytes, SAME),
            (self.step_s, other.step_s, step_resolution),
        )
        return all(
            mine is not None and theirs is not None and mine <= theirs * (1 + within)
            for mine, theirs, within in pairs
        )


@dataclass(frozen=True)
class Verdict:
    chosen: str
    compiled: tuple[Compiled, ...]
    fingerprint: str
    cached: bool = False

    def remark(self) -> str:
        seen = "; ".join(
            f"{c.label} {_gib(c.memory_bytes)} GiB, {_ms(c.step_s)} ms"
            + ("" if c.fits else " (does not fit)")
            for c in self.compiled
        )
        source = " (the cached verdict)" if self.cached else ""
        if {c.label.split("+")[0] for c in self.compiled} == {"default"}:
            rule = "the pipeline asked for, with each rewrite that is better and no worse"
        else:
            within = f"{STEP_RESOLUTION:.0%}"
            rule = (
                "the fastest that fits and is at most the replicated program in memory and "
                f"in estimated step (within {within}), or the smallest of those within "
                f"{within} of it"
            )
        return f"select-by-compiling: compiled {seen}; kept {self.chosen}{source}: {rule}"


def alternatives(pipeline: PassPipeline) -> dict[str, PassPipeline]:
    """The pipelines to compile: the step's own; with weight-update sharding on and the
    parameters whole where it leaves those to the cost model; and the one of its passes
    that give the reductions their meaning (none when that is the same pipeline)."""
    meaning = tuple(p for p in pipeline.passes if p.name in MEANING)
    found = {"default": pipeline}
    if _left_to_cost_model(pipeline, ShardWeightUpdates.name):
        sharded = with_pass(pipeline, ShardWeightUpdates(mode="on", asked=False))
        if _left_to_cost_model(pipeline, ShardParameters.name):  # the default tries those
            sharded = without_pass(sharded, ShardParameters.name)
        found["sharded-updates"] = sharded
    if len(meaning) < len([p for p in pipeline.passes if p.name not in pipeline.disabled]):
        found["replicated"] = PassPipeline(passes=meaning)
    return found


def selects_by_compiling(options: CompileOptions, strategy: Any, dump_options: Any) -> bool:
    """Whether a step compiles its pipeline's alternatives (or, where `swappable` says
    no, its refinements): `select_by_compiling` where the step says, else
    `XLA_STRATEGIES_SELECT_BY_COMPILING` where set, else by default for a strategy whose
    topology's compiler compiles its steps (`judged`) and whose pipeline is not a spec
    the user wrote (which is run as written)."""
    chosen = options.select_by_compiling
    if chosen is not None:
        return chosen
    if options.pipeline is not None or dump_options.pipeline is not None:
        return False
    if dump_options.select_by_compiling is not None:
        return dump_options.select_by_compiling
    return judged(strategy)


def swappable(options: CompileOptions) -> bool:
    """Whether the step's pipeline may be swapped for another alternative: not where the
    user asked for one (`shard_parameters=True`, `shard_weight_updates=True`). Its
    refinements are still tried: they judge only what the user left to the cost model."""
    return options.shard_parameters is not True and options.shard_weight_updates is not True


def judged(strategy: Any) -> bool:
    """Whether XLA's compiler for the strategy's topology compiles its steps: a TPU slice
    or GPU nodes, compile-only or real (not one emulated on CPU devices, whose compile
    says nothing of the chips)."""
    platform = strategy.devices[0].platform if strategy.devices else "cpu"
    return strategy.topology is not None and (strategy.compile_only or platform != "cpu")


def choose(
    pipeline: PassPipeline,
    compile_one: Callable[[PassPipeline], CompiledReport],
    key: str,
    swap: bool = True,
) -> Verdict:
    """The best of `pipeline`'s alternatives, then of it with each refinement, compiled one
    by one with `compile_one` where the cache holds no report of that pipeline for `key`.
    Without `swap`, `pipeline` is the only alternative."""
    cached = _read(key)
    known = {c.label: c for c in cached.compiled} if cached is not None else {}
    fresh: list[str] = []

    def compiled_as(label: str, candidate: PassPipeline) -> Compiled:
        held = known.get(label)
        if held is not None and held.spec == candidate.spec():
            return held  # what the compiler said of this very pipeline
        fresh.append(label)
        return _compiled(label, candidate, compile_one)

    candidates = alternatives(pipeline) if swap else {"default": pipeline}
    compiled = [compiled_as(label, p) for label, p in candidates.items()]
    kept = _kept(compiled)
    for name in _refinements(pipeline):
        label = f"{kept.label}+{name}"
        refined = compiled_as(label, chosen_pipeline(pipeline, label))
        compiled.append(refined)
        if refined.at_most(kept) and not kept.at_most(refined):  # better, and no worse
            kept = refined
    verdict = Verdict(kept.label, tuple(compiled), key, cached=not fresh)
    if fresh:
        _write(verdict)
    return verdict


def chosen_pipeline(pipeline: PassPipeline, label: str) -> PassPipeline:
    """The pipeline a verdict's `label` names: an alternative of `pipeline`, and the
    refinements after its `+`s."""
    base, *refinements = label.split("+")
    chosen = alternatives(pipeline)[base]
    for name in refinements:
        chosen = with_pass(chosen, REFINEMENTS[name]())
    return chosen


def _refinements(pipeline: PassPipeline) -> list[str]:
    return [name for name in REFINEMENTS if _left_to_cost_model(pipeline, name)]


def _left_to_cost_model(pipeline: PassPipeline, name: str) -> bool:
    """Whether `pipeline` runs the pass `name` in `mode=auto`: its cost model decides."""
    return name not in pipeline.disabled and any(
        p.name == name and getattr(p, "mode", None) == "auto" for p in pipeline.passes
    )


def _compiled(
    label: str, pipeline: PassPipeline, compile_one: Callable[[PassPipeline], CompiledReport]
) -> Compiled:
    try:
        report = compile_one(pipeline)
    except OutOfMemoryError:  # XLA refused it: it does not fit
        return Compiled(label, pipeline.spec(), False, None, None)
    memory = report.memory.total_bytes if report.memory is not None else None
    fits = report.fits is not False
    return Compiled(label, pipeline.spec(), fits, memory, report.estimate.get("step_s"))


def _kept(compiled: list[Compiled]) -> Compiled:
    """The rule of the module's docstring: of those that fit and are at most the replicated
    program (all that fit, where it does not), the smallest in memory of those within
    `STEP_RESOLUTION` of the fastest, the earlier on a tie; the first where none fits."""
    fitting = [c for c in compiled if c.fits]
    baseline = next((c for c in fitting if c.label == "replicated"), None)
    eligible = [c for c in fitting if baseline is None or c.at_most(baseline, STEP_RESOLUTION)]
    timed = [c for c in eligible if c.step_s is not None]
    if not timed:
        return eligible[0] if eligible else compiled[0]
    fastest = min(c.step_s for c in timed)
    near = [c for c in timed if c.step_s <= fastest * (1 + STEP_RESOLUTION)]
    kept = near[0]
    for other in near[1:]:
        if (other.memory_bytes or 0) < (kept.memory_bytes or 0) * (1 - SAME):
            kept = other
    return kept


def _read(key: str) -> Verdict | None:
    data = verdict_cache.read("pipeline_verdicts", key)
    try:
        compiled = tuple(Compiled(**c) for c in data["compiled"])
        return Verdict(data["chosen"], compiled, key, cached=True)
    except (KeyError, TypeError):  # none, or of another layout: compile
        return None


def _write(verdict: Verdict) -> None:
    verdict_cache.write("pipeline_verdicts", verdict.fingerprint, asdict(verdict))


def _gib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**30:.3f}"


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.2f}"
