"""Host cost of one call of a compiled step: ours against plain `jax.jit`, side by side.

Two steps whose device work is next to nothing, over a state of many small leaves as a
large model's parameters and optimizer state are, show what a call costs the host before
and after the device runs it (reading the arguments, finding the executable, placing them,
handing the outputs back): one reads every leaf and returns a number, one returns every
leaf as a train step returns its state. Both sides run on the same 8 CPU devices, ours a
`MirroredStrategy` over them and `jax.jit` with the same shardings (state replicated, batch
split), and alternate call by call; each row is the median of the repetitions.

    JAX_PLATFORMS=cpu python -m benchmarks.call_overhead
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.gpu_calibration import median_ms

RESULTS = Path(__file__).parent / "results" / "call_overhead.json"


def _state(leaves: int) -> dict[str, Any]:
    return {f"layer{i:04d}": {"w": jnp.full((4,), float(i))} for i in range(leaves)}


def _reads(state: Any, batch: Any) -> tuple[Any, Any]:
    # every leaf in, one read: the device does almost nothing, so the host's part shows
    first = jax.tree.leaves(state)[0]
    return first + batch.sum(), batch.sum()


def _writes(state: Any, batch: Any) -> tuple[Any, Any]:
    # every leaf in and out, as a train step's state: the outputs' handling too
    return jax.tree.map(lambda w: w * 1.0, state), batch.sum()


STEPS = {"reads": _reads, "writes": _writes}


def measure(kind: str, leaves: int, repetitions: int) -> dict[str, Any]:
    import xla_strategies as xs

    strategy = xs.MirroredStrategy()
    ours = strategy.compile(STEPS[kind])
    ours_state = strategy.replicate(_state(leaves))
    batch = jnp.ones((strategy.num_replicas_in_sync * 2, 4))
    ours_batch = next(iter(strategy.experimental_distribute_dataset([batch])))

    mesh = jax.sharding.Mesh(jax.devices(), ("batch",))
    jit_state = jax.device_put(_state(leaves), NamedSharding(mesh, P()))
    jit_batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
    plain = jax.jit(STEPS[kind])

    calls = {
        "ours": lambda: ours(ours_state, ours_batch),
        "jax.jit": lambda: plain(jit_state, jit_batch),
    }
    for call in calls.values():  # compile, and warm every cache
        jax.block_until_ready(call())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repetitions):  # alternating, so both see the same machine
        for name, call in calls.items():
            timed = median_ms(lambda c=call: jax.block_until_ready(c()), 5, warmup=0)
            times[name].append(timed["median_ms"])
    row = {name: statistics.median(t) for name, t in times.items()}
    return {"step": kind, "leaves": leaves, **row, "ours / jax.jit": row["ours"] / row["jax.jit"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[10, 300, 1200])
    parser.add_argument("--repetitions", type=int, default=20)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    rows = [measure(kind, n, args.repetitions) for kind in STEPS for n in args.leaves]
    print(f"{'step':6s} {'leaves':>7s} {'ours ms':>8s} {'jax.jit ms':>10s} {'ratio':>6s}")
    for row in rows:
        print(
            f"{row['step']:6s} {row['leaves']:7d} {row['ours']:8.2f} {row['jax.jit']:10.2f} "
            f"{row['ours / jax.jit']:6.2f}"
        )
    RESULTS.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
