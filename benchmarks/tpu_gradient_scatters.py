"""How XLA's TPU compiler runs a layer loop's gradient reduce-scatters, in the spellings a
step can give them: over every chip at once (what FSDP's gradient reduction is), one torus
axis after the other, or as rings of collective-permutes written by hand.

Each loop trip is one Llama-2-7B layer's backward pass as its weight gradients come out,
one weight after another (per chip: 2,048 tokens, the layer's 7 weights gathered whole in
bf16), each gradient reduce-scattered over every chip as it is made. The layer's later
matmuls are the compute a reduction could hide behind. Every compile is read by the HLO
text reader the one table uses (`hlo_report`): collective bytes, those XLA left
synchronous, the compute (a ring adds each part it receives), and the estimated step with
its exposed communication.

    JAX_PLATFORMS=cpu python -m benchmarks.tpu_gradient_scatters --topology v5e-256 \\
        [--layers 4] [--spellings both-axes axis-by-axis ring] [--options none async-permute]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

import xla_strategies as xs
from xla_strategies.hardware.compiled_report import hlo_report

RESULTS = Path(__file__).parent / "results" / "tpu_gradient_scatters.json"
TOKENS, MODEL, HIDDEN = 2048, 4096, 11008  # Llama-2-7B, one sequence per chip
#: the layer's weights, in the order the backward pass makes their gradients
WEIGHTS = [(MODEL, MODEL)] * 4 + [(MODEL, HIDDEN), (MODEL, HIDDEN), (HIDDEN, MODEL)]
#: MaxText's recipe flag for asynchronous collective-permutes (v5p's and v6e's recipes)
OPTIONS = {"none": {}, "async-permute": {"xla_enable_async_collective_permute": True}}


def _ring(flat: jax.Array, axis: str, size: int, direction: int) -> jax.Array:
    """A ring reduce-scatter of `flat` over `axis`: `size - 1` steps, each passing a
    partial sum to the next chip and adding the chip's own part; chip i ends with part i."""
    parts = flat.reshape(size, -1)
    index = lax.axis_index(axis)
    ring = [(i, (i + direction) % size) for i in range(size)]

    def part(step: int) -> jax.Array:
        at = (index - direction * (step + 1)) % size
        return lax.dynamic_index_in_dim(parts, at, 0, keepdims=False)

    total = part(0)
    for step in range(1, size):
        total = lax.ppermute(total, axis, ring) + part(step)
    return total


def _bidirectional_ring(flat: jax.Array, axis: str, size: int) -> jax.Array:
    """Half of each part around the ring each way, as a torus link carries both."""
    forward, backward = jnp.split(flat.reshape(size, 2, -1), 2, axis=1)
    return jnp.concatenate(
        [_ring(forward.reshape(-1), axis, size, 1), _ring(backward.reshape(-1), axis, size, -1)]
    )


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
            flat = _bidirectional_ring(flat, axis, mesh.shape[axis])
        return flat
    raise ValueError(f"spelling {spelling!r} is not one of both-axes, axis-by-axis, ring")


def layer_loop(spelling: str, mesh: Any, layers: int) -> Any:
    """The jitted loop: per trip, each weight's gradient made and reduce-scattered."""

    def layer(dx: jax.Array, inputs: tuple) -> tuple:
        x, weights = inputs
        parts = []
        for w in weights:
            h = x if w.shape[0] == MODEL else jnp.tile(x, (1, 3))[:, : w.shape[0]]
            dy = jnp.tanh(h @ w)  # stands in for the cotangent from the layer above
            parts.append(reduce_scatter(spelling, (h.T @ dy).astype(jnp.bfloat16), mesh))
            dx = dx + (dy @ w.T)[:, :MODEL]
        return dx, parts

    def step(xs: jax.Array, weights: list) -> tuple:
        return lax.scan(layer, jnp.zeros((TOKENS, MODEL), jnp.bfloat16), (xs, weights))

    every_chip = PartitionSpec(tuple(mesh.axis_names))
    spmd = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(), every_chip),
        check_vma=False,
    )
    whole = NamedSharding(mesh, PartitionSpec())
    args = (
        jax.ShapeDtypeStruct((layers, TOKENS, MODEL), jnp.bfloat16, sharding=whole),
        [jax.ShapeDtypeStruct((layers, *s), jnp.bfloat16, sharding=whole) for s in WEIGHTS],
    )
    return jax.jit(spmd), args


def measure(topology: str, layers: int, spellings: list[str], options: list[str]) -> list[dict]:
    strategy = xs.TPUStrategy(topology, compile_only=True)
    rows = []
    jobs = [(s, o) for s in spellings for o in options]
    for spelling, option_set in tqdm(jobs, desc="compile", unit="program"):
        fn, args = layer_loop(spelling, strategy.mesh, layers)
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
        f"{row['spelling']:13} {row['options']:13} {row['collective_mib']:7.0f} MiB "
        f"({row['synchronous_mib']:5.0f} synchronous)  compute {row['compute_ms']:6.2f} ms, "
        f"step {row['step_ms']:6.2f} ms, "
        f"exposed {row['exposed_ms']:6.2f} ms  [{kinds}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topology", default="v5e-256")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--spellings", nargs="+", default=["both-axes", "axis-by-axis", "ring"],
        choices=["both-axes", "axis-by-axis", "ring"],
    )  # fmt: skip
    parser.add_argument("--options", nargs="+", default=["none"], choices=list(OPTIONS))
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers {args.layers} must be at least 1")
    rows = measure(args.topology, args.layers, args.spellings, args.options)
    RESULTS.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
