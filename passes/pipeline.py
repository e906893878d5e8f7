"""The pass pipeline: an ordered list of passes, itself a pass, with instruments around each.

Built from pass objects or from an MLIR-style spec string:

    insert-reductions,combine-all-reduces{threshold-bytes=4194304 first-bucket-bytes=1048576}

The verifier runs on the graph the pipeline is given and after every pass. Other
instruments (timer, dumper, IR printer) see each pass before and after it runs. A failing
pass re-raises its own exception with a note that names the passes that ran before it.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from xla_strategies.passes.base import Instrument, Pass, PassContext
from xla_strategies.passes.ir.graph import Graph
from xla_strategies.passes.ir.verifier import VerificationError, verify
from xla_strategies.passes.registry import PASS_ORDER, PASS_REGISTRY


class PipelineSpecError(ValueError):
    """A pipeline spec string names an unknown pass or option, or is malformed."""


@dataclass(frozen=True)
class PassPipeline(Pass):
    """Runs `passes` in order. A pass whose name is in `disabled` is skipped."""

    name: ClassVar[str] = "pipeline"
    passes: tuple[Pass, ...] = ()
    instruments: tuple[Instrument, ...] = ()
    disabled: frozenset[str] = frozenset()

    @classmethod
    def from_spec(cls, spec: str, **kwargs: Any) -> PassPipeline:
        return cls(passes=tuple(parse_spec(spec)), **kwargs)

    def spec(self) -> str:
        """The passes that run, as `from_spec` reads them: two pipelines with one spec run
        the same passes (a disabled pass is not in it)."""
        return ",".join(p.spec() for p in self.passes if p.name not in self.disabled)

    def enabled_names(self) -> list[str]:
        """The names of the passes that run, in order."""
        return [p.name for p in self.passes if p.name not in self.disabled]

    def with_instruments(self, *instruments: Instrument) -> PassPipeline:
        return dataclasses.replace(self, instruments=self.instruments + instruments)

    def run(self, graph: Graph, ctx: PassContext, stop_after: str | None = None) -> bool:
        """Run the passes; with `stop_after`, stop after the pass of that name (an error
        when it is not in the pipeline or is disabled: there is no graph after it)."""
        if stop_after is not None:
            self._check_stop_after(stop_after)
        try:  # a broken capture is reported as such, not blamed on the first pass
            _verify(graph, ctx)
        except VerificationError as exc:
            exc.add_note("in the graph given to the pipeline (after capture), before any pass")
            raise
        for instrument in self.instruments:
            instrument.before_pipeline(graph, ctx)
        history = ["capture"]
        changed_any = False
        for pass_ in self.passes:
            if pass_.name in self.disabled:
                continue
            start = time.perf_counter()
            try:
                changed = pass_.run(graph, ctx)
                _verify(graph, ctx)
            except Exception as exc:
                exc.add_note(
                    f"while running pass '{pass_.name}'; passes run before it: {', '.join(history)}"
                )
                raise
            seconds = time.perf_counter() - start
            for instrument in self.instruments:
                instrument.after_pass(pass_, graph, ctx, changed, seconds)
            history.append(pass_.name)
            changed_any |= changed
            if pass_.name == stop_after:
                break
        return changed_any

    def _check_stop_after(self, name: str) -> None:
        enabled = self.enabled_names()
        if name in enabled:
            return
        if name in self.disabled and any(p.name == name for p in self.passes):
            raise PipelineSpecError(
                f"pass {name!r} is disabled in this pipeline, so no graph comes after it; "
                f"the passes that run: {', '.join(enabled)}"
            )
        raise PipelineSpecError(f"no pass named {name!r} in this pipeline ({', '.join(enabled)})")


def _verify(graph: Graph, ctx: PassContext) -> None:
    """The verifier, its time added up under `ctx.stats["verify_seconds"]`."""
    start = time.perf_counter()
    try:
        verify(graph, ctx.mesh_axes)
    finally:
        ctx.stats["verify_seconds"] = ctx.stats.get("verify_seconds", 0.0) + (
            time.perf_counter() - start
        )


@dataclass
class PassTimer(Instrument):
    """Records each pass's wall time (seconds) under `ctx.stats["pass_seconds"]`."""

    seconds: dict[str, float] = field(default_factory=dict)

    def after_pass(
        self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool, seconds: float
    ) -> None:
        self.seconds[pass_.name] = self.seconds.get(pass_.name, 0.0) + seconds
        ctx.stats.setdefault("pass_seconds", {})[pass_.name] = self.seconds[pass_.name]


# spec strings

_PASS = re.compile(r"\s*([a-z][a-z0-9\-]*)\s*(\{[^{}]*\})?\s*(,|$)")


def parse_spec(spec: str) -> list[Pass]:
    """`"a,b{opt=1 other=x}"` -> `[A(), B(opt=1, other="x")]`, from the registry."""

    passes: list[Pass] = []
    pos = 0
    spec = spec.strip()
    while pos < len(spec):
        found = _PASS.match(spec, pos)
        if not found:
            raise PipelineSpecError(f"malformed pipeline spec at column {pos + 1}: {spec[pos:]!r}")
        name, options = found.group(1), found.group(2)
        if name not in PASS_REGISTRY:
            raise PipelineSpecError(
                f"unknown pass {name!r}; known passes: {', '.join(sorted(PASS_REGISTRY))}"
            )
        passes.append(_instantiate(PASS_REGISTRY[name], options[1:-1] if options else ""))
        pos = found.end()
    return passes


def _instantiate(cls: type[Pass], options: str) -> Pass:
    fields = {f.name: f for f in cls.option_fields()}
    kwargs: dict[str, Any] = {}
    for item in options.replace(",", " ").split():
        key, sep, raw = item.partition("=")
        attr = cls.option_names().get(key)
        if not sep or attr is None:
            known = ", ".join(cls.option_names()) or "none"
            raise PipelineSpecError(f"pass {cls.name!r} has no option {key!r} (options: {known})")
        kwargs[attr] = _convert(raw, fields[attr].type, f"{cls.name}{{{key}}}")
    return cls(**kwargs, written_options=frozenset(kwargs))


def fill_options(
    pipeline: PassPipeline, pass_class: type[Pass], setting: str, **options: Any
) -> PassPipeline:
    """Give every `pass_class` pass of `pipeline` the `options` its spec left unset. An
    option the spec set to another value is a `PipelineSpecError` naming `setting`, the
    place the other value came from (e.g. `compile(gradient_reduction=...)`)."""
    passes = []
    for pass_ in pipeline.passes:
        if isinstance(pass_, pass_class):
            chosen = pass_.set_options()
            for name, value in options.items():
                if name in chosen and getattr(pass_, name) != value:
                    option = name.replace("_", "-")
                    raise PipelineSpecError(
                        f"the pipeline sets {pass_.name}{{{option}={getattr(pass_, name)}}} "
                        f"but {setting} asks for {value}; drop one of them"
                    )
            unset = {k: v for k, v in options.items() if k not in chosen}
            pass_ = dataclasses.replace(pass_, **unset)
        passes.append(pass_)
    return dataclasses.replace(pipeline, passes=tuple(passes))


def with_pass(pipeline: PassPipeline, pass_: Pass) -> PassPipeline:
    """`pipeline` running `pass_`: in place of each pass of its name, else inserted where
    `PASS_ORDER` puts it (before the first pass that runs after it there, or at the end);
    enabled either way."""
    passes = list(pipeline.passes)
    found = [i for i, p in enumerate(passes) if p.name == pass_.name]
    for i in found:
        passes[i] = pass_
    if not found:
        order = PASS_ORDER if pass_.name in PASS_ORDER else (pass_.name,)
        later = order[order.index(pass_.name) + 1 :]
        at = next((i for i, p in enumerate(passes) if p.name in later), len(passes))
        passes.insert(at, pass_)
    return dataclasses.replace(
        pipeline, passes=tuple(passes), disabled=pipeline.disabled - {pass_.name}
    )


def without_pass(pipeline: PassPipeline, name: str) -> PassPipeline:
    """`pipeline` with the pass of that name disabled (it stays in the list, so the dump
    and `stop_after` can name it)."""
    return dataclasses.replace(pipeline, disabled=pipeline.disabled | {name})


def dropping_pass(pipeline: PassPipeline, name: str) -> PassPipeline:
    """`pipeline` without the pass of that name: not part of it at all."""
    return dataclasses.replace(
        pipeline,
        passes=tuple(p for p in pipeline.passes if p.name != name),
        disabled=pipeline.disabled - {name},
    )


def _convert(raw: str, annotation: Any, where: str) -> Any:
    kind = str(annotation)
    try:
        if "bool" in kind:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if "int" in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
    except ValueError:
        raise PipelineSpecError(f"option {where}: cannot read {raw!r} as {kind}") from None
    return raw
