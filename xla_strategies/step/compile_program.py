"""Compiling a lowered step for the strategy's devices, and the errors a user can act on:
a program too big for the chip is an `OutOfMemoryError` raised at compile time."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from xla_strategies.core.errors import OutOfMemoryError
from xla_strategies.hardware.compiled_report import Memory

if TYPE_CHECKING:
    from xla_strategies.step.step_strategy import StepStrategy

_NEEDED = re.compile(r"\(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)")


class LoweredStep(jax.stages.Lowered):
    """A lowered step: a `jax.stages.Lowered` whose `compile()` raises
    `xs.errors.OutOfMemoryError` when the program does not fit the chip."""

    __slots__ = ("strategy", "name")

    @classmethod
    def of(cls, lowered: jax.stages.Lowered, strategy: StepStrategy, name: str) -> LoweredStep:
        step = object.__new__(cls)
        for slot in jax.stages.Lowered.__slots__:
            setattr(step, slot, getattr(lowered, slot))
        step.strategy, step.name = strategy, name
        return step

    def compile(self, *args: Any, **kwargs: Any) -> jax.stages.Compiled:
        compile_ = super().compile
        return compile_lowered(lambda: compile_(*args, **kwargs), self.strategy, self.name)


def compile_lowered(compile_: Callable[[], Any], strategy: Any, name: str) -> Any:
    """`compile_()` (a lowered program's compile), timed (`compile_seconds` on the
    result), with XLA's out-of-memory refusal turned into an `OutOfMemoryError` that says
    what to change."""
    start = time.perf_counter()
    try:
        compiled = compile_()
    except jax.errors.JaxRuntimeError as exc:
        if "RESOURCE_EXHAUSTED" not in str(exc):
            raise
        raise OutOfMemoryError(_out_of_memory(str(exc), strategy, name)) from exc
    compiled.compile_seconds = time.perf_counter() - start
    if strategy.compile_only:
        _check_fits(compiled, strategy, name)
    return compiled


def _check_fits(compiled: Any, strategy: Any, name: str) -> None:
    """XLA's GPU compiler compiles a program whatever its size (the runtime fails when it
    allocates): for a compile-only strategy, the memory analysis is held against the
    device's memory here, as XLA's TPU compiler does itself."""
    hbm = getattr(strategy.topology, "hbm_bytes", None)
    stats = compiled.memory_analysis()
    if not hbm or stats is None:
        return
    needed = Memory.of(stats).total_bytes
    if needed > hbm:
        needs = f"needs {needed / 2**30:.2f} GiB per device, {hbm / 2**30:.2f} GiB available"
        said = "its memory analysis (arguments, outputs, temporaries) exceeds the device's memory"
        raise OutOfMemoryError(_out_of_memory(said, strategy, name, needs=needs))


def _out_of_memory(message: str, strategy: Any, name: str, needs: str | None = None) -> str:
    topology = strategy.topology
    where = str(topology) if topology is not None else f"{strategy.num_replicas_in_sync} devices"
    hbm = topology.hbm_bytes if topology is not None else None
    per = "memory per GPU" if strategy.devices[0].platform == "gpu" else "HBM per chip"
    chip = f"{hbm / 2**30:.2f} GiB of {per}" if hbm else "an unknown memory size"
    found = _NEEDED.search(message)
    if needs is None:
        needs = f"needs {found[1]}B per chip, {found[2]}B available" if found else "does not fit"
    first = message.strip().splitlines()[0].rstrip(".")
    return (
        f"step {name} {needs} on {where} ({chip}). XLA's compiler says: {first}. "
        "To shrink it: compile(shard_parameters=True) holds the parameters and optimizer "
        "state split across the replicas (the state the step returns; donate it with "
        "donate_argnums), a smaller per-chip "
        "batch shrinks the activations, and jax.checkpoint (remat) on the layers trades "
        "them for recompute"
    )
