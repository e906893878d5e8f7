"""Compile-time overhead: capture + pass pipeline + lowering + XLA compile of a step, as a
ratio to plain `jax.jit` trace + compile of the same single-device step.

Both sides trace a fresh step function each repetition (no tracing cache), alternating, and
the medians are compared. Run: `python -m benchmarks.compile_overhead` (or `make bench`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

RESULTS = Path(__file__).parent / "results"


def _setup(layers: int, width: int) -> tuple[Any, ...]:
    import optax
    from flax import nnx

    from xla_strategies.demo import models
    from xla_strategies.demo.data import synthetic_tokens

    cfg = models.TransformerConfig(vocab=256, width=width, heads=4, layers=layers, seq_len=64)
    graphdef, params = nnx.split(models.TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    tokens = next(synthetic_tokens(1, 32, cfg.seq_len, cfg.vocab))
    return graphdef, params, tx, tokens


def _time(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(layers: int = 4, width: int = 128, repeats: int = 5) -> dict[str, Any]:
    import xla_strategies as xs
    from xla_strategies.demo import models

    graphdef, params, tx, tokens = _setup(layers, width)
    opt_state = tx.init(params)
    one, mirrored = xs.OneDeviceStrategy(), xs.MirroredStrategy()
    one_args = (
        one.replicate(params),
        one.replicate(opt_state),
        next(iter(one.experimental_distribute_dataset([tokens]))),
    )
    mirrored_args = (
        mirrored.replicate(params),
        mirrored.replicate(opt_state),
        next(iter(mirrored.experimental_distribute_dataset([tokens]))),
    )
    device = jax.devices()[0]
    plain_args = jax.device_put((params, opt_state, tokens), device)

    def plain() -> None:
        jax.jit(models.lm_train_step(graphdef, tx)).lower(*plain_args).compile()

    replicated = NamedSharding(mirrored.mesh, P())
    split = NamedSharding(mirrored.mesh, P("replica"))

    def plain_spmd() -> None:
        jax.jit(
            models.lm_train_step(graphdef, tx),
            in_shardings=(replicated, replicated, split),
            out_shardings=(replicated, replicated, split),
        ).lower(*mirrored_args).compile()

    def ours(strategy: Any, args: tuple) -> dict[str, float]:
        step = strategy.compile(models.lm_train_step(graphdef, tx), donate_argnums=(0, 1))
        total = _time(lambda: step.lower(*args).compile())
        return {"total": total, **step.executable(*args).seconds}

    samples: dict[str, list[float]] = {
        "plain_jit": [],
        "one_device": [],
        "plain_spmd8": [],
        "mirrored8": [],
    }
    parts: dict[str, list[float]] = {"capture": [], "pipeline": [], "verify": []}
    plain()  # warm up imports and backend initialisation on both sides
    ours(one, one_args)
    for _ in range(repeats):
        samples["plain_jit"].append(_time(plain))
        one_device = ours(one, one_args)
        samples["one_device"].append(one_device["total"])
        samples["plain_spmd8"].append(_time(plain_spmd))
        samples["mirrored8"].append(ours(mirrored, mirrored_args)["total"])
        parts["capture"].append(one_device["capture"])
        parts["pipeline"].append(one_device["pipeline"])
        parts["verify"].append(one_device["verify"])
    median = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "model": f"transformer LM, {layers} scanned layers, width {width}, adamw + clip",
        "repeats": repeats,
        "median_seconds": median,
        "one_device_capture_s": statistics.median(parts["capture"]),
        "one_device_pipeline_s": statistics.median(parts["pipeline"]),
        "one_device_verify_s": statistics.median(parts["verify"]),
        "ratio_one_device_vs_jit": median["one_device"] / median["plain_jit"],
        "ratio_mirrored8_vs_jit": median["mirrored8"] / median["plain_jit"],
        "ratio_mirrored8_vs_spmd8": median["mirrored8"] / median["plain_spmd8"],
        "target_ratio": 1.25,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    result = measure(args.layers, args.width, args.repeats)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compile_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["median_seconds"]
    rows = [
        ("plain jax.jit trace + compile (1 device)", m["plain_jit"], 1.0),
        ("xla_strategies, OneDeviceStrategy", m["one_device"], result["ratio_one_device_vs_jit"]),
        (
            "plain jax.jit SPMD, batch sharded (8)",
            m["plain_spmd8"],
            m["plain_spmd8"] / m["plain_jit"],
        ),
        ("xla_strategies, MirroredStrategy (8)", m["mirrored8"], result["ratio_mirrored8_vs_jit"]),
    ]
    print(result["model"])
    print(f"{'variant':<44} {'median s':>9} {'vs jit':>7}")
    for name, seconds, ratio in rows:
        print(f"{name:<44} {seconds:>9.3f} {ratio:>7.2f}")
    print(
        f"  of which capture {result['one_device_capture_s']:.3f} s, "
        f"pipeline {result['one_device_pipeline_s']:.4f} s "
        f"(the verifier, after capture and every pass: {result['one_device_verify_s']:.4f} s)"
    )


if __name__ == "__main__":
    main()
