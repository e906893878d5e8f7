"""What holds the memory: the buffers live at a compiled program's peak, read from XLA's own
buffer assignment, each named by the argument it holds or the source line that made it."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest

from xla_strategies.hardware.compiled_report import Memory
from xla_strategies.hardware.memory_at_peak import (
    ARGUMENTS,
    dump_options,
    library_directories,
    memory_at_peak,
)


def _loss(x, w):
    hidden = jnp.tanh(x @ w)  # kept for the backward pass: 4 MiB
    return jnp.sum(hidden @ w.T)


_HIDDEN_LINE = inspect.getsourcelines(_loss)[1] + 1


def test_the_buffers_at_the_peak_are_what_the_compiler_counts_and_name_their_lines(tmp_path):
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    w = jax.ShapeDtypeStruct((1024, 4096), jnp.float32)
    step = jax.jit(jax.grad(_loss, argnums=1))
    compiled = step.lower(x, w).compile(compiler_options=dump_options(tmp_path))
    held = memory_at_peak(tmp_path, library_directories())
    memory = Memory.of(compiled.memory_analysis())
    counted = memory.total_bytes - memory.generated_code_bytes  # the data, not the program
    # XLA's heap can hold a little more than is ever live at once; never less
    assert 0.95 * counted <= held.peak_bytes <= counted
    assert held.by_group()[ARGUMENTS] == (256 * 1024 + 1024 * 4096) * 4
    arguments = sorted(b.argument for b in held.buffers if b.argument is not None)
    assert arguments == [0, 1]
    named = {held.describe(b, ["x", "w"]) for b in held.buffers if b.argument is not None}
    assert named == {"x", "w"}
    made_here = [b for b in held.buffers if f"test_memory_at_peak.py:{_HIDDEN_LINE}" in b.source]
    assert made_here, held.text(argument_names=["x", "w"])
    assert "MiB" in held.text(argument_names=["x", "w"])


def test_a_directory_without_a_dump_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="compile with dump_options"):
        memory_at_peak(tmp_path)


_ASSIGNMENT = """\
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <1 p @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 600, preallocated-temp:
 value: <2 a @0> (size=200,offset=0): f32[50]{0}
 value: <3 b @0> (size=100,offset=200): f32[25]{0}
 value: <4 c @0> (size=300,offset=300): f32[75]{0}
"""
_LIVE_RANGES = """\
BufferLiveRange:
  p{}:0-5
  a{}:0-1
  b{}:0-5
  c{}:2-5
"""


def test_the_heaps_gaps_at_the_peak_are_counted_apart(tmp_path):
    """`a` dies before `c` is made, but XLA laid `c` above `b`: at the peak (b and c live)
    the heap's 600 bytes hold 400 live ones and a 200-byte gap where `a` was."""
    stem = tmp_path / "module_0000.jit_step.after_optimizations"
    (tmp_path / f"{stem.name}-buffer-assignment.txt").write_text(_ASSIGNMENT)
    (tmp_path / f"{stem.name}-live-range.txt").write_text(_LIVE_RANGES)
    (tmp_path / f"{stem.name}.txt").write_text("")
    held = memory_at_peak(tmp_path)
    assert held.peak_bytes == 64 + 100 + 300
    assert held.heap_gaps_bytes == 200
    assert "gaps in XLA's heap" in held.text()
