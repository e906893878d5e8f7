"""Where a GPU machine is available: the GPU claims the deviceless compiles make, checked on
a real GPU. Run on one GPU; writes `results/gpu_device_check.json` (or `--out`).

1. Numbers: a flax MLP trained 20 steps with adam under `MirroredStrategy()` on the GPU
   equals `OneDeviceStrategy` on it.
2. The compiled program: the same train step compiled for the real GPU and deviceless for
   its target config (`tpu_configs/<node>.target_config.txtpb`, one GPU): XLA's
   instruction counts by opcode, collectives and memory, side by side.
3. Speed: GPT-2 medium's train step, ours (`strategy.compile`) against plain `jax.jit`,
   timed side by side on the same GPU (the median of 20 steps after 3 warm-up steps).

The estimate's calibration against measured steps is `benchmarks.gpu_calibration` (each
step in a process of its own, its HLO and a profile kept) and `gpu_calibration_fit`.
(`results/gpu_device_check.json` keeps the H100's calibration rows of 2026-11-27, which
`tpu_configs/dgx-h100.toml` is checked on.)

`--checks` runs some of them (all by default).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import xla_strategies as xs
from benchmarks.gpu_calibration import median_ms
from benchmarks.tpu_models import WORKLOADS
from xla_strategies.hardware.gpu_compile import target_config
from xla_strategies.hardware.hlo import computations

RESULTS = Path(__file__).parent / "results" / "gpu_device_check.json"


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(256)(x)))


def numbers() -> dict[str, Any]:
    """MirroredStrategy on the GPU against OneDeviceStrategy: 20 adam steps."""
    model, tx = MLP(), optax.adam(1e-2)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(64, 4)).astype(np.float32))
        for _ in range(20)
    ]

    def step(params, opt_state, batch):
        x, y = batch
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    results = []
    for strategy in (xs.OneDeviceStrategy(jax.devices()[0]), xs.MirroredStrategy()):
        params = strategy.replicate(model.init(jax.random.key(0), jnp.zeros((1, 32))))
        opt_state = strategy.replicate(tx.init(params))
        compiled = strategy.compile(step)
        for batch in strategy.experimental_distribute_dataset(batches):
            params, opt_state = compiled(params, opt_state, batch)
        results.append(jax.tree.map(np.asarray, params))
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), *results))
    return {"max_abs_difference": max(diffs), "equal_within_1e-6": max(diffs) <= 1e-6}


def _opcodes(hlo_text: str) -> Counter[str]:
    comps, _ = computations(hlo_text)
    return Counter(opcode for ops in comps.values() for _, _, opcode, _ in ops)


def compiled_program(node: str) -> dict[str, Any]:
    """GPT-2 medium's step compiled for this GPU and deviceless for `node`'s GPU."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    workload, tx = WORKLOADS["gpt2-medium"](), optax.adamw(1e-4)
    variables = jax.eval_shape(workload.init)
    opt_state = jax.eval_shape(tx.init, variables)
    batch = workload.batch(workload.batch_per_chip)
    step = jax.jit(workload.step(tx, None), donate_argnums=(0, 1))
    programs = {}
    description = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(node), topology="1x1x1"
    )
    for where, device in (("real", jax.devices()[0]), ("deviceless", description.devices[0])):
        mesh = jax.sharding.Mesh(np.array([device]), ("d",))
        whole = NamedSharding(mesh, PartitionSpec())
        args = jax.tree.map(
            lambda s, whole=whole: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole),
            (variables, opt_state, batch),
        )
        compiled = step.lower(*args).compile()
        memory = compiled.memory_analysis()
        programs[where] = {
            "opcodes": _opcodes(compiled.as_text()),
            "temp_bytes": memory.temp_size_in_bytes,
            "argument_bytes": memory.argument_size_in_bytes,
        }
    real, deviceless = programs["real"]["opcodes"], programs["deviceless"]["opcodes"]
    differing = {
        op: [real.get(op, 0), deviceless.get(op, 0)]
        for op in sorted(set(real) | set(deviceless))
        if real.get(op, 0) != deviceless.get(op, 0)
    }
    return {
        "instructions": [sum(real.values()), sum(deviceless.values())],
        "opcode_counts_differing_real_vs_deviceless": differing,
        "temp_bytes": [programs["real"]["temp_bytes"], programs["deviceless"]["temp_bytes"]],
        "argument_bytes": [
            programs["real"]["argument_bytes"],
            programs["deviceless"]["argument_bytes"],
        ],
    }


def speed(steps: int = 20) -> dict[str, Any]:
    """GPT-2 medium, ours against plain jax.jit on one GPU, timed side by side."""
    workload, tx = WORKLOADS["gpt2-medium"](), optax.adamw(1e-4)
    strategy = xs.MirroredStrategy()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=(workload.batch_per_chip, 1025)).astype(np.int32)
    timings = {}
    for name in ("jax.jit", "ours"):
        params = jax.jit(workload.init)()
        opt_state = jax.jit(tx.init)(params)
        if name == "ours":
            step = strategy.compile(workload.step(tx, "batch"), axis_name="batch",
                                    donate_argnums=(0, 1))  # fmt: skip
            params, opt_state = strategy.replicate(params), strategy.replicate(opt_state)
            batch = next(iter(strategy.experimental_distribute_dataset([{"tokens": tokens}])))
        else:
            step = jax.jit(workload.step(tx, None), donate_argnums=(0, 1))
            batch = {"tokens": jnp.asarray(tokens)}
        state = [params, opt_state, None]

        def run(state=state, step=step, batch=batch):
            state[:] = step(state[0], state[1], batch)
            state[2].block_until_ready()

        median = median_ms(run, steps)["median_ms"]
        timings[name] = {"median_ms": median, "loss": float(np.mean(state[2]))}
    ratio = timings["ours"]["median_ms"] / timings["jax.jit"]["median_ms"]
    return {**timings, "ours_over_jit": ratio}


def _recorded(check: Any, *args: Any) -> dict[str, Any]:
    """A check's findings, or the error that stopped it: one failing check leaves the
    others' numbers on record."""
    try:
        return check(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


CHECKS = ("numbers", "compiled_program", "speed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=list(CHECKS))
    args = parser.parse_args()
    device = jax.devices()[0]
    node = xs.MirroredStrategy().topology
    found: dict[str, Any] = {
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "node": getattr(node, "name", None),
    }
    if "numbers" in args.checks:
        found["numbers"] = _recorded(numbers)
    try:
        import torch

        props = torch.cuda.get_device_properties(0)
        found["cuda_properties"] = {
            "total_memory": props.total_memory,
            "multi_processor_count": props.multi_processor_count,
            "L2_cache_size": getattr(props, "L2_cache_size", None),
        }
    except Exception as exc:  # the GPU's own numbers, for a target config; optional
        found["cuda_properties"] = repr(exc)
    node_name = found["node"] or "dgx-h100"
    if "compiled_program" in args.checks:
        found["compiled_program"] = _recorded(compiled_program, node_name)
    if "speed" in args.checks:
        found["speed"] = _recorded(speed)
    text = json.dumps(found, indent=1, default=lambda o: dict(o))
    Path(args.out).write_text(text + "\n")
    print(re.sub(r"\n\s+", " ", text))


if __name__ == "__main__":
    main()
