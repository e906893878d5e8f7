"""`CompileOptions`: every option of `strategy.compile`, typed and checked in one place.

`strategy.compile(step, **keywords)`, `strategy.run`, Keras' and torch's steps and
`strategy.set_compile_defaults(**keywords)` all build one of these; the compiled step, its
pass pipeline and its lowering read its fields. A misspelt keyword is an error at the
call, naming the closest option. To add an option: a field here, with its docstring line,
then the code that reads it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xla_strategies.core.reduce_op import ReduceOp
from xla_strategies.passes.bridge.remat_policy import checked_policy
from xla_strategies.passes.stages.executor import KEEPS as STAGE_KEEPS

if TYPE_CHECKING:
    from xla_strategies.passes.pipeline import PassPipeline


@dataclass(frozen=True)
class CompileOptions:
    """The options of one compiled step (each default: not chosen).

    Attributes:
        gradient_reduction: `ReduceOp.MEAN` (the default) or `ReduceOp.SUM`: what the
            gradients of mirrored values, taken of per-replica losses, are.
        mirrored_outputs: a pytree prefix of bools over the outputs (True: the output is
            the same on every replica; `(True, ReduceOp.MEAN)`: aggregated so).
        static_argnums: positions of arguments that are part of the program, as `jax.jit`.
        static_argnames: names of such arguments.
        axis_name: the step's own name for the replica axis (pmap code's `lax.psum(x, "i")`).
        pipeline: a pass pipeline spec string or a `PassPipeline`, run as written.
        shard_weight_updates: True: each replica updates its block of the weights and
            keeps its block of the optimizer state; False: never; None: the cost model
            decides.
        shard_parameters: True: parameters and optimizer state are held split across the
            replicas between steps and gathered where used; None: on where the
            replicated state does not fit the chip.
        donate_argnums: positions of arguments whose buffers the step's new values take,
            as `jax.jit`; nothing else is donated.
        donate_argnames: names of such arguments.
        compiler_options: XLA option names to values, winning over the strategy's own.
        select_by_compiling: True: compile the pipeline's alternatives (the default one,
            it with the weight updates sharded, and one of only the passes that give
            reductions their meaning, as `jax.jit` runs) and keep the best by what XLA
            says (`step.pipeline_choice`); False:
            never; None: for a strategy with a topology (TPU, GPU) whose pipeline is the
            cost model's choice alone (not a spec, not `shard_parameters=True` or
            `shard_weight_updates=True`), unless XLA_STRATEGIES_SELECT_BY_COMPILING=0.
        microbatches: on a strategy with `pipeline_stages`, the microbatches each
            replica's batch is split into for the pipeline (default: the stages).
        schedule: the pipeline's schedule: "1f1b-paired" (the default), "1f1b",
            "gpipe", "interleaved-1f1b", "interleaved-1f1b-paired", "looped-bfs" or
            "zero-bubble-h1".
        virtual_stages: chunks of layers per stage for the interleaved schedules and
            "looped-bfs" (default 2).
        stage_keeps: what each stage's forward keeps of a microbatch for its backward:
            "layer-inputs" (the default: each layer's input, as JAX's gradient of a scan
            of checkpointed layers keeps) or "stage-inputs" (the chunk's input alone, a
            chunk's depth times less held per microbatch; the backward runs the chunk's
            forward again, about a third more compute).
        remat_policy: what every rematerialised block (`jax.checkpoint`, `nn.remat`)
            without a policy of its own keeps for the backward pass: a policy of
            `jax.checkpoint_policies` by name ("nothing_saveable", "dots_saveable",
            "dots_with_no_batch_dims_saveable", "everything_saveable"); None: as written.
        name: the step's name in dumps and errors (default: the function's).
    """

    gradient_reduction: ReduceOp | None = None
    mirrored_outputs: Any = None
    static_argnums: int | Sequence[int] = ()
    static_argnames: str | Sequence[str] = ()
    axis_name: str | None = None
    pipeline: str | PassPipeline | None = None
    shard_weight_updates: bool | None = None
    shard_parameters: bool | None = None
    donate_argnums: int | Sequence[int] = ()
    donate_argnames: str | Sequence[str] = ()
    compiler_options: Mapping[str, Any] | None = None
    select_by_compiling: bool | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    stage_keeps: str | None = None
    remat_policy: str | None = None
    name: str | None = None

    #: the options `set_compile_defaults` takes: the ones the library's own compiles
    #: (Keras' fit, strategy.run) must honour; the rest belong to one step
    DEFAULTABLE = ("gradient_reduction", "shard_parameters", "shard_weight_updates")

    def __post_init__(self) -> None:
        if self.gradient_reduction is not None:
            op = ReduceOp.of(self.gradient_reduction, "gradient_reduction")
            if op not in (ReduceOp.MEAN, ReduceOp.SUM):
                raise ValueError(
                    f"gradient_reduction must be ReduceOp.MEAN or ReduceOp.SUM, got {op.name}"
                )
            object.__setattr__(self, "gradient_reduction", op)
        if self.axis_name is not None and (
            not isinstance(self.axis_name, str) or not self.axis_name
        ):
            raise TypeError(f"axis_name must be a non-empty string, got {self.axis_name!r}")
        if self.remat_policy is not None:
            checked_policy(self.remat_policy)
        if self.stage_keeps not in (None, *STAGE_KEEPS):
            raise ValueError(
                f"stage_keeps must be one of {', '.join(map(repr, STAGE_KEEPS))}, got "
                f"{self.stage_keeps!r}"
            )
        for flag in ("shard_weight_updates", "shard_parameters", "select_by_compiling"):
            if getattr(self, flag) not in (None, True, False):
                raise TypeError(f"{flag} must be True, False or None, got {getattr(self, flag)!r}")

    @classmethod
    def of(cls, keywords: Mapping[str, Any], where: str = "strategy.compile") -> CompileOptions:
        """The options `keywords` give; an unknown keyword is a TypeError naming `where`
        and the closest option."""
        check_known(keywords, _FIELDS, where)
        return cls(**keywords)


_FIELDS = tuple(f.name for f in dataclasses.fields(CompileOptions))


def check_known(keywords: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """Raise TypeError for the first keyword not in `known`, naming the closest one."""
    for keyword in keywords:
        if keyword in known:
            continue
        closest = difflib.get_close_matches(keyword, known, n=1)
        hint = f"; did you mean {closest[0]!r}?" if closest else ""
        raise TypeError(
            f"{where} got an unknown option {keyword!r}{hint} (its options: {', '.join(known)})"
        )


def defaults_of(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """`set_compile_defaults`' keywords, checked: only `CompileOptions.DEFAULTABLE`, each
    a valid value."""
    allowed = CompileOptions.DEFAULTABLE
    unknown = sorted(set(keywords) - set(allowed))
    if unknown:
        check_known({unknown[0]: None}, _FIELDS, "set_compile_defaults")  # a misspelling
        raise TypeError(
            f"set_compile_defaults takes {sorted(allowed)}, not {unknown}: the others "
            "belong to one step (pass them to strategy.compile)"
        )
    CompileOptions(**keywords)  # each value checked as the step would check it
    return dict(keywords)
