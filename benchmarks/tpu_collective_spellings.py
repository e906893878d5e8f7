"""How XLA's TPU compiler runs a layer loop's FSDP collectives, in the spellings a step can
give them: over every chip at once (what parameter sharding emits), one torus axis after
the other, or as bidirectional rings of collective-permutes written by hand.

Each loop trip is one Llama-2-7B layer (per chip: 2,048 tokens, the layer's 7 weights):
- `reduce-scatter`: its backward pass as the weight gradients come out, one weight after
  another, each gradient reduce-scattered over every chip as it is made;
- `all-gather`: its forward pass, each weight gathered from every chip's part just before
  its matmul.
The layer's other matmuls are the compute a collective could hide behind. Every compile is
read by the HLO text reader the one table uses (`hlo_report`): collective bytes, those XLA
left synchronous, the compute (a ring adds or places each part it receives), and the
estimated step with its exposed communication.

    JAX_PLATFORMS=cpu python -m benchmarks.tpu_collective_spellings --topology v5e-256 \\
        [--collective reduce-scatter] [--layers 4] [--spellings both-axes axis-by-axis ring] \\
        [--options none async-permute]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

import xla_strategies as xs
from benchmarks.results_rows import merge_rows
from xla_strategies.hardware.compiled_report import hlo_report

RESULTS = Path(__file__).parent / "results" / "tpu_collective_spellings.json"
TOKENS, MODEL, HIDDEN = 2048, 4096, 11008  # Llama-2-7B, one sequence per chip
#: the layer's weights, in the order the forward pass reads them
WEIGHTS = [(MODEL, MODEL)] * 4 + [(MODEL, HIDDEN), (MODEL, HIDDEN), (HIDDEN, MODEL)]
SPELLINGS = ("both-axes", "axis-by-axis", "ring")
#: MaxText's recipe flag for asynchronous collective-permutes (v5p's and v6e's recipes)
OPTIONS = {"none": {}, "async-permute": {"xla_enable_async_collective_permute": True}}


def _ring(axis: str, size: int, direction: int) -> tuple[Callable, Callable]:
    """The parts of a ring over `axis`: `at(step)` is where the chip's part is after
    `step` passes, and `passed(x)` is `x` one chip further along the ring."""
    index = lax.axis_index(axis)
    ring = [(i, (i + direction) % size) for i in range(size)]

    def passed(x: jax.Array) -> jax.Array:
        return lax.ppermute(x, axis, ring)

    def at(step: int) -> jax.Array:
        return (index - direction * step) % size

    return passed, at


def _ring_reduce_scatter(flat: jax.Array, axis: str, size: int, direction: int) -> jax.Array:
    """`size - 1` steps, each passing a partial sum on and adding the chip's own part;
    chip i ends with part i of the sum."""
    parts = flat.reshape(size, -1)
    passed, at = _ring(axis, size, direction)

    def part(step: int) -> jax.Array:
        return lax.dynamic_index_in_dim(parts, at(step + 1), 0, keepdims=False)

    total = part(0)
    for step in range(1, size):
        total = passed(total) + part(step)
    return total


def _ring_all_gather(part: jax.Array, axis: str, size: int, direction: int) -> jax.Array:
    """`size - 1` steps, each passing the last part received on and placing it; every chip
    ends with every chip's part, in the axis's order."""
    passed, at = _ring(axis, size, direction)
    whole = jnp.zeros((size, *part.shape), part.dtype)
    whole = lax.dynamic_update_index_in_dim(whole, part, at(0), 0)
    for step in range(1, size):
        part = passed(part)
        whole = lax.dynamic_update_index_in_dim(whole, part, at(step), 0)
    return whole


def _both_ways(ring: Callable, forward: jax.Array, backward: jax.Array, axis: str) -> jax.Array:
    """`forward` around the ring one way and `backward` the other at once, as a torus link
    carries both: each chip's part is its two halves side by side."""
    size = lax.axis_size(axis)
    halves = [ring(forward, axis, size, 1), ring(backward, axis, size, -1)]
    return jnp.concatenate(halves, axis=-1).reshape(-1)


def reduce_scatter(spelling: str, gradient: jax.Array, mesh: Any) -> jax.Array:
    """`gradient` summed over every chip of `mesh`, each chip keeping its part (flat)."""
    axes = tuple(mesh.axis_names)
    if spelling == "both-axes":
        return lax.psum_scatter(gradient, axes, scatter_dimension=0, tiled=True).reshape(-1)
    if spelling == "axis-by-axis":
        for axis in axes:
            gradient = lax.psum_scatter(gradient, axis, scatter_dimension=0, tiled=True)
        return gradient.reshape(-1)
    if spelling == "ring":
        flat = gradient.reshape(-1)
        for axis in axes:
            halves = jnp.split(flat.reshape(mesh.shape[axis], 2, -1), 2, axis=1)
            flat = _both_ways(_ring_reduce_scatter, *(h.reshape(-1) for h in halves), axis)
        return flat
    raise ValueError(f"spelling {spelling!r} is not one of {', '.join(SPELLINGS)}")


def all_gather(spelling: str, part: jax.Array, mesh: Any) -> jax.Array:
    """Every chip's `part` of `mesh`, in the mesh's order (flat): `reduce_scatter`'s dual."""
    axes = tuple(mesh.axis_names)
    if spelling == "both-axes":
        return lax.all_gather(part, axes, axis=0, tiled=True)
    if spelling == "axis-by-axis":
        for axis in reversed(axes):
            part = lax.all_gather(part, axis, axis=0, tiled=True)
        return part
    if spelling == "ring":
        for axis in reversed(axes):
            part = _both_ways(_ring_all_gather, *jnp.split(part, 2), axis)
        return part
    raise ValueError(f"spelling {spelling!r} is not one of {', '.join(SPELLINGS)}")


def _abstract(shape: tuple, mesh: Any, spec: PartitionSpec) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))


def _backward_loop(spelling: str, mesh: Any, layers: int) -> tuple:
    """Each trip makes the layer's weight gradients one by one from its saved input (the
    weights whole) and reduce-scatters each; the parts come out split over every chip."""

    def layer(dx: jax.Array, inputs: tuple) -> tuple:
        x, weights = inputs
        parts = []
        for w in weights:
            h = x if w.shape[0] == MODEL else jnp.tile(x, (1, 3))[:, : w.shape[0]]
            dy = jnp.tanh(h @ w)  # stands in for the cotangent from the layer above
            parts.append(reduce_scatter(spelling, (h.T @ dy).astype(jnp.bfloat16), mesh))
            dx = dx + (dy @ w.T)[:, :MODEL]
        return dx, parts

    whole = PartitionSpec()
    inputs = (
        _abstract((layers, TOKENS, MODEL), mesh, whole),
        [_abstract((layers, *shape), mesh, whole) for shape in WEIGHTS],
    )
    return layer, (whole, (whole, whole)), (whole, PartitionSpec(tuple(mesh.axis_names))), inputs


def _forward_loop(spelling: str, mesh: Any, layers: int) -> tuple:
    """Each trip gathers the layer's weights one by one from every chip's part, each just
    before its matmul."""

    def layer(x: jax.Array, weights: list) -> tuple:
        h = x
        for part, shape in zip(weights, WEIGHTS, strict=True):
            w = all_gather(spelling, part, mesh).reshape(shape)
            h = jnp.tanh(h[:, : shape[0]] @ w).astype(jnp.bfloat16)
        return h[:, :MODEL], None

    split = PartitionSpec(None, tuple(mesh.axis_names))
    inputs = [_abstract((layers, rows * columns), mesh, split) for rows, columns in WEIGHTS]
    whole = PartitionSpec()
    return layer, (whole, split), (whole, whole), inputs


def layer_loop(collective: str, spelling: str, mesh: Any, layers: int) -> tuple[Any, tuple]:
    """The jitted loop of `layers` trips over `mesh`, and its abstract arguments."""
    build = _backward_loop if collective == "reduce-scatter" else _forward_loop
    layer, in_specs, out_specs, inputs = build(spelling, mesh, layers)
    spmd = jax.shard_map(
        lambda carry, xs: lax.scan(layer, carry, xs),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
    )
    return jax.jit(spmd), (_abstract((TOKENS, MODEL), mesh, PartitionSpec()), inputs)


def measure(
    topology: str, collective: str, layers: int, spellings: list[str], options: list[str]
) -> list[dict]:
    strategy = xs.TPUStrategy(topology, compile_only=True)  # its mesh follows the torus
    rows = []
    jobs = [(s, o) for s in spellings for o in options]
    for spelling, option_set in tqdm(jobs, desc="compile", unit="program"):
        fn, args = layer_loop(collective, spelling, strategy.mesh, layers)
        started = time.time()
        compiled = fn.lower(*args).compile(compiler_options=OPTIONS[option_set] or None)
        report = hlo_report(compiled.as_text(), strategy.topology)
        estimate = report.estimate
        kinds: dict[str, int] = {}
        for c in report.collectives:
            kinds[c.kind] = kinds.get(c.kind, 0) + c.times
        rows.append(
            {
                "topology": topology,
                "collective": collective,
                "layers": layers,
                "spelling": spelling,
                "options": option_set,
                "collectives": kinds,
                "collective_mib": report.bytes_per_step() / 2**20,
                "synchronous_mib": report.bytes_per_step(synchronous_only=True) / 2**20,
                "compute_ms": 1e3 * estimate["compute_s"],
                "step_ms": 1e3 * estimate["step_s"],
                "exposed_ms": 1e3 * estimate["exposed_s"],
                "compile_s": time.time() - started,
            }
        )
        tqdm.write(_line(rows[-1]))
    return rows


def _line(row: dict) -> str:
    kinds = ", ".join(f"{k} x{n}" for k, n in sorted(row["collectives"].items()))
    return (
        f"{row['topology']} {row['collective']:14} {row['spelling']:13} {row['options']:13} "
        f"{row['collective_mib']:7.0f} MiB ({row['synchronous_mib']:5.0f} synchronous)  "
        f"compute {row['compute_ms']:6.2f} ms, step {row['step_ms']:6.2f} ms, "
        f"exposed {row['exposed_ms']:6.2f} ms  [{kinds}]"
    )


def _cell_key(row: dict) -> tuple:
    return row["topology"], row["collective"], row["layers"], row["spelling"], row["options"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topology", default="v5e-256")
    parser.add_argument(
        "--collective", default="reduce-scatter", choices=["reduce-scatter", "all-gather"]
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--spellings", nargs="+", default=list(SPELLINGS), choices=SPELLINGS)
    parser.add_argument("--options", nargs="+", default=["none"], choices=list(OPTIONS))
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers {args.layers} must be at least 1")
    rows = measure(args.topology, args.collective, args.layers, args.spellings, args.options)
    merge_rows(RESULTS, rows, _cell_key)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
