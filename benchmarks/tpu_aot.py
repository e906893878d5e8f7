"""What XLA's TPU compiler says of real training steps on TPU pods, compiled on this machine
without a TPU (`TPUStrategy(compile_only=True)`, libtpu).

For each model and topology, three programs of the same train step (adamw, f32 master
weights, bf16 compute):

- (a) ours: `strategy.compile` with the default pipeline (the cost model decides
  weight-update sharding);
- (b) ours with `shard_weight_updates=True`;
- (d) ours with `shard_parameters=True` (FSDP: parameters and optimizer state held split,
  each scanned layer gathered inside the loop, the next layer prefetched);
- (e) (d) without the prefetch (`prefetch-all-gathers` disabled);
- (c) the peer a JAX user writes: `jax.jit` with `NamedSharding`s, the batch split and the
  parameters replicated; where that does not fit the chip, MaxText-style FSDP shardings
  (every parameter and its optimizer state split over all chips on its largest dimension);
- (m) asked for by name: (d) with the two passes that hold less at the loss forced on
  (`scatter-adds-as-selects`, `reduce-scatters-before-loops`), where the topology's
  hardware file leaves them off (one v5p slice);
- (t) asked for by name, language models only: FSDP x tensor parallel, the model written
  with Megatron's `nn.with_partitioning` annotations, `TENSOR_PARALLEL` chips per replica
  (`logical_devices_per_replica`), and `shard_parameters=True`. The global batch is the
  same as the other variants' (one chip's batch times the chips).

Per cell, from the compiled executable: memory per chip and whether it fits, the
collectives XLA kept (count and bytes per step), the estimated step and its exposed
communication, and the compile time; for ours, also the cost model's compute estimate of
the optimised graph against the HLO's (its matmul flops at the chip's peak, the one
reader's compute term).

    python -m benchmarks.tpu_aot                              # every model and topology
    python -m benchmarks.tpu_aot --models gpt2-medium --topologies v5e-256
    python -m benchmarks.tpu_aot --models llama2-70b --topologies v5p-512 --variants d t
    python -m benchmarks.tpu_aot --models resnet50 --topologies v5e-256 --variants a --untuned
    python -m benchmarks.tpu_aot --reread     # every recorded cell's saved HLO, read again

Each compiled HLO text is kept (gzipped) in `results/hlo/`, so that a change to the reader
re-reads the table in seconds instead of compiling it again for hours.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

import xla_strategies as xs
from benchmarks.results_rows import merge_rows
from benchmarks.tpu_models import (
    CORPUS_ENVIRONMENT,
    MAXTEXT_ENVIRONMENT,
    WORKLOADS,
    trained_params,
)
from benchmarks.tpu_table import markdown, row_text
from xla_strategies.hardware.compiled_report import compiled_report, hlo_report
from xla_strategies.passes.cost.timeline import compute_estimate
from xla_strategies.passes.pipeline import with_pass, without_pass
from xla_strategies.passes.transforms.reduce_scatters_before_loops import ReduceScattersBeforeLoops
from xla_strategies.passes.transforms.scatter_adds_as_selects import ScatterAddsAsSelects
from xla_strategies.step.compile_program import compile_lowered

RESULTS = Path(__file__).parent / "results" / "tpu_aot.json"
#: Each cell's compiled HLO text, gzipped, for `--reread` (not committed: tens of MB)
HLO_DIR = RESULTS.parent / "hlo"
TOPOLOGIES = ("v5e-256", "v5p-512", "v6e-256", "2xv5p-512")
VARIANTS = ("a", "b", "c", "d", "e")
#: Chips per replica in variant (t), over the fastest torus axis, and the models annotated
#: for it (`benchmarks.tpu_models.TransformerConfig.tensor_parallel`).
TENSOR_PARALLEL = 4
TENSOR_PARALLEL_MODELS = {"llama2-7b", "llama2-70b", "llama2-70b-minimal", "llama3.1-405b"}
#: The pass a variant leaves out of its strategy's pipeline: (e) the prefetch; on GPU nodes
#: (`benchmarks.gpu_aot`), (f) and (g) are (a) and (d) without the decomposition across nodes.
LEFT_OUT = {
    "e": "prefetch-all-gathers",
    "f": "decompose-all-reduces",
    "g": "decompose-all-reduces",
}
#: The passes a variant forces on, in place of their `mode=auto` choice
FORCED_ON = {"m": (ScatterAddsAsSelects, ReduceScattersBeforeLoops)}


def abstract_state(workload: Any, tx: optax.GradientTransformation) -> tuple[Any, Any]:
    """The model's parameters (and other state) and the optimizer state, as shapes only."""
    variables = jax.eval_shape(workload.init)
    return variables, jax.eval_shape(tx.init, trained_params(variables))


def _our_step(strategy: Any, workload: Any, variant: str) -> tuple[Any, tuple]:
    """Our compiled step for `variant` and its abstract arguments."""
    tx = optax.adamw(1e-4)
    variables, opt_state = abstract_state(workload, tx)
    state = strategy.replicate(variables), strategy.replicate(opt_state)
    step = strategy.compile(
        workload.step(tx, "batch"),
        axis_name="batch",
        donate_argnums=(0, 1),
        shard_weight_updates={"b": True, "h": False}.get(variant),
        shard_parameters=True if variant in ("d", "e", "g", "m", "t") else None,
        pipeline=_pipeline(strategy, variant),
        name=f"{workload.name} ({variant})",
    )
    return step, (*state, _batch(strategy, workload))


def _pipeline(strategy: Any, variant: str) -> Any:
    """The pipeline `variant` runs in place of the strategy's own; None: the strategy's."""
    if variant in LEFT_OUT:
        return without_pass(strategy.pipeline(None), LEFT_OUT[variant])
    if variant in FORCED_ON:
        pipeline = strategy.pipeline(None)
        for pass_class in FORCED_ON[variant]:
            pipeline = with_pass(pipeline, pass_class(mode="on"))
        return pipeline
    return None


def ours(strategy: Any, workload: Any, variant: str) -> Any:
    step, args = _our_step(strategy, workload, variant)
    compiled = step.lower(*args).compile()
    compiled.our_compute_s = 1e-3 * our_compute_ms(strategy, step, args)
    return compiled


def our_compute_ms(strategy: Any, step: Any, args: tuple) -> float:
    """The cost model's compute estimate of our optimised graph (no XLA compile needed),
    for the check against XLA's."""
    graph = step.executable(*args).graph
    return 1e3 * compute_estimate(graph, strategy.topology)


def peer(strategy: Any, workload: Any, fsdp: bool) -> Any:
    """Plain `jax.jit` on the same chips: data parallel, or FSDP shardings."""
    tx = optax.adamw(1e-4)
    variables, opt_state = abstract_state(workload, tx)
    mesh = strategy.mesh
    place = _fsdp_sharding(mesh) if fsdp else (lambda leaf: NamedSharding(mesh, PartitionSpec()))
    state = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=place(leaf)),
        (variables, opt_state),
    )
    batch = _batch(strategy, workload)
    shardings = jax.tree.map(lambda s: s.sharding, (*state, batch))
    step = jax.jit(
        workload.step(tx, None),
        in_shardings=shardings,
        out_shardings=(shardings[0], shardings[1], NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0, 1),
    )
    name = f"{workload.name} (c{' fsdp' if fsdp else ''})"
    return compile_lowered(step.trace(*state, batch).lower().compile, strategy, name)


def _fsdp_sharding(mesh: Any) -> Any:
    """MaxText's FSDP: a leaf split over every chip on its largest dimension that divides."""
    chips, axes = mesh.devices.size, tuple(mesh.axis_names)

    def place(leaf: Any) -> NamedSharding:
        dims = sorted(range(len(leaf.shape)), key=lambda d: -leaf.shape[d])
        for dim in dims:
            if leaf.shape[dim] % chips == 0:
                spec = [None] * len(leaf.shape)
                spec[dim] = axes
                return NamedSharding(mesh, PartitionSpec(*spec))
        return NamedSharding(mesh, PartitionSpec())

    return place


def _batch(strategy: Any, workload: Any) -> dict[str, jax.ShapeDtypeStruct]:
    size = workload.batch_per_chip * len(strategy.devices)  # a replica may span several
    return {
        key: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=strategy.split_sharding())
        for key, spec in workload.batch(size).items()
    }


def cell(strategy: Any, workload: Any, variant: str) -> dict[str, Any]:
    """One compile, summarised; an out-of-memory refusal is a cell that does not fit."""
    try:
        if variant == "c":
            try:
                compiled, label = peer(strategy, workload, fsdp=False), "jit DP"
            except xs.errors.OutOfMemoryError:
                compiled, label = peer(strategy, workload, fsdp=True), "jit FSDP"
        else:
            compiled, label = ours(strategy, workload, variant), variant
    except xs.errors.OutOfMemoryError as exc:
        return {"variant": variant, "program": variant, "fits": False, "error": str(exc)[:300]}
    report = compiled_report(compiled, strategy)
    return {
        "variant": variant,
        "program": label,
        "fits": report.fits,
        "memory_gib": report.memory.total_bytes / 2**30,
        "temp_gib": report.memory.temp_bytes / 2**30,
        **_read(report),
        "our_compute_ms": 1e3 * getattr(compiled, "our_compute_s", math.nan),
        "compile_s": report.compile_seconds,
        "hlo_text": compiled.as_text(),
    }


def _read(report: Any) -> dict[str, Any]:
    """What the one reader reads from a program's HLO text alone."""
    estimate = report.estimate
    return {
        "collectives": sum(c.times for c in report.collectives),
        "collective_bytes": report.bytes_per_step(),
        "synchronous_bytes": report.bytes_per_step(synchronous_only=True),
        "kinds": sorted({c.kind for c in report.collectives}),
        "asynchronous": sum(1 for c in report.collectives if c.asynchronous),
        "step_ms": 1e3 * (estimate["step_s"] or math.nan),
        "compute_ms": 1e3 * (estimate["compute_s"] or math.nan),
        "matmul_ms": 1e3 * (estimate["matmul_s"] or math.nan),
        "exposed_share": (estimate["exposed_s"] or 0.0) / (estimate["step_s"] or math.inf),
        "opaque_kernels": report.opaque_kernels,
        # the estimate's rates (calibrated or the datasheet's) and the compiler that compiled
        "calibration": report.calibration,
        "compiled_by": compiled_by(report),
    }


def compiled_by(report: Any) -> str:
    """The compiler's release: libtpu's for a TPU program, jaxlib's (and its CUDA plugin's)
    for a GPU one."""
    found = report.compiler or {}
    if report.platform == "tpu":
        return f"libtpu {found.get('libtpu', '-')}"
    from importlib import metadata

    try:
        plugin = f", jax-cuda12-plugin {metadata.version('jax-cuda12-plugin')}"
    except metadata.PackageNotFoundError:
        plugin = ""
    return f"jaxlib {found.get('jaxlib', '-')}{plugin}"


def compile_only_strategy(topology: str, devices_per_replica: int = 1, tuned: bool = True) -> Any:
    """The strategy a user trains on `topology` with, compile-only: a TPU slice's
    TPUStrategy (`tuned`: with its generation's XLA options), one GPU node's
    MirroredStrategy, several nodes' MultiWorkerMirroredStrategy."""
    found = xs.Topology.from_name(topology)
    k = {"logical_devices_per_replica": devices_per_replica}
    if found.hardware.startswith("v"):
        return xs.TPUStrategy(topology, compile_only=True, generation_compiler_options=tuned, **k)
    if found.mesh_axes.get("host", 1) > 1:
        return xs.MultiWorkerMirroredStrategy(topology=topology, compile_only=True, **k)
    return xs.MirroredStrategy(topology=topology, compile_only=True, **k)


def measure(
    models: list[str], topologies: list[str], variants: list[str], tuned: bool = True
) -> list[dict]:
    jobs = [(m, t, v) for m in models for t in topologies for v in variants]
    return measure_cells(jobs, tuned)


def measure_cells(jobs: list[tuple[str, str, str]], tuned: bool = True) -> list[dict]:
    """Each (model, topology, variant) compiled and summarised, with progress; `tuned`:
    TPU steps with their generation's XLA options (`tpu_configs/`), as by default."""
    rows = []
    strategies: dict[tuple[str, int], Any] = {}
    for model, topology, variant in tqdm(jobs, desc="compile", unit="program"):
        strategy, workload = _strategy_and_workload(strategies, model, topology, variant, tuned)
        row = cell(strategy, workload, variant)
        if not tuned:
            row["program"] += ", untuned"
        row = {"model": workload.name, "topology": topology, **row, "tuned": tuned}
        row["model_ms"] = model_ms(workload, topology)
        if "hlo_text" in row:
            row["hlo"] = _save_hlo(row.pop("hlo_text"), row)
        rows.append(row)
        tqdm.write(row_text(rows[-1]))
    return rows


def _strategy_and_workload(
    strategies: dict[tuple[str, int], Any], model: str, topology: str, variant: str, tuned: bool
) -> tuple[Any, Any]:
    """The compile-only strategy (made once per topology and replica size, in `strategies`)
    and the workload a cell compiles: for (t), 4 chips per replica and the model annotated
    for tensor parallelism."""
    tensor_parallel = variant == "t"
    if tensor_parallel and model not in TENSOR_PARALLEL_MODELS:
        raise ValueError(
            f"variant t (tensor parallel) needs a model annotated for it: one of "
            f"{sorted(TENSOR_PARALLEL_MODELS)}, not {model!r}"
        )
    key = (topology, TENSOR_PARALLEL if tensor_parallel else 1)
    if key not in strategies:
        strategies[key] = compile_only_strategy(*key, tuned=tuned)
    workload = WORKLOADS[model](tp=True) if tensor_parallel else WORKLOADS[model]()
    return strategies[key], workload


def model_ms(workload: Any, topology: str) -> float:
    """One chip's share of the model's flops per step (`train_flops_per_item`) at the chip's
    bf16 peak (the datasheet's, not the calibrated rate), in ms: MFU is this over the
    estimated step."""
    peak = xs.Topology.from_name(topology).at_datasheet_rates().peak_flops
    return 1e3 * workload.train_flops_per_item * workload.batch_per_chip / peak


def _save_hlo(text: str, row: dict[str, Any]) -> str:
    """Keep a cell's compiled HLO text (`HLO_DIR`, not committed) so that a change to the
    reader can re-read every cell (`--reread`) without compiling it again; its file name."""
    name = "_".join(
        [row["model"], row["topology"], row["variant"]] + ([] if row["tuned"] else ["untuned"])
    )
    name = re.sub(r"[^\w.-]+", "-", name) + ".hlo.txt.gz"
    HLO_DIR.mkdir(parents=True, exist_ok=True)
    (HLO_DIR / name).write_bytes(gzip.compress(text.encode()))
    return name


def reread(results: Path) -> None:
    """Read every recorded cell's saved HLO text again with the reader as it is now: the
    collectives, bytes, estimated step and compute columns (memory and compile time are
    the executable's, kept). Cells without a saved text are named and left as they were."""
    data = json.loads(results.read_text())
    names = _workload_keys()
    missing = []
    for row in tqdm(data["rows"], desc="re-read", unit="program"):
        path = HLO_DIR / row.get("hlo", "-")
        if "error" in row:
            continue
        row["model_ms"] = model_ms(WORKLOADS[names[row["model"]]](), row["topology"])
        if not path.exists():
            missing.append(f"{row['model']} {row['topology']} ({row['variant']})")
            continue
        text = gzip.decompress(path.read_bytes()).decode()
        per_replica = TENSOR_PARALLEL if row["variant"] == "t" else 1
        topology = xs.Topology.from_name(row["topology"]).split_model_axis(per_replica)
        row.update(_read(hlo_report(text, topology, per_replica)))
    results.write_text(json.dumps(data, indent=1) + "\n")
    print(markdown(data["rows"]))
    if missing:
        print(f"not re-read, no saved HLO text (compile them again): {', '.join(missing)}")


def _workload_keys(models: list[str] | None = None) -> dict[str, str]:
    """`WORKLOADS`' keys (of `models`) by the model names recorded rows carry."""
    return {WORKLOADS[m]().name: m for m in models or WORKLOADS}


def compute_check(results: Path, models: list[str] | None = None) -> None:
    """Refill the cost model's compute estimate (`our compute ms`) of every recorded cell of
    ours in `results` (of `models`), without compiling with XLA again."""
    data = json.loads(results.read_text())
    names = _workload_keys(models)
    strategies: dict[tuple[str, int], Any] = {}
    for row in data["rows"]:
        if row["model"] not in names or row["variant"] == "c" or "error" in row:
            continue
        topology, variant = row["topology"], row["variant"]
        # XLA's options do not change our graph: any row's strategy will do
        strategy, workload = _strategy_and_workload(
            strategies, names[row["model"]], topology, variant, tuned=True
        )
        row["our_compute_ms"] = our_compute_ms(strategy, *_our_step(strategy, workload, variant))
        print(f"{row['model']} {topology} ({variant}): {row['our_compute_ms']:.2f} ms")
    results.write_text(json.dumps(data, indent=1) + "\n")
    print(markdown(data["rows"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models",
        nargs="+",
        default=[m for m in WORKLOADS if m not in CORPUS_ENVIRONMENT + MAXTEXT_ENVIRONMENT],
        choices=list(WORKLOADS),
        help="default: every model but those of the corpus (make .venv-corpus) and MaxText's "
        "environments",
    )
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=(*VARIANTS, "m", "t")
    )
    parser.add_argument(
        "--untuned",
        action="store_true",
        help="compile without the TPU generation's XLA options (tpu_configs/), to measure them",
    )
    parser.add_argument(
        "--compute-check",
        action="store_true",
        help="only refill the cost model's compute estimate of the recorded cells of ours",
    )
    parser.add_argument(
        "--reread",
        action="store_true",
        help="only read every recorded cell's saved HLO text again, with the reader as it is",
    )
    args = parser.parse_args()
    if args.reread:
        reread(RESULTS)
        return
    if args.compute_check:
        compute_check(RESULTS, args.models)
        return
    record(measure(args.models, args.topologies, args.variants, not args.untuned), RESULTS)


def record(rows: list[dict[str, Any]], results: Path) -> None:
    """Write `rows` into `results` in place of the same cells measured before, and print
    them and the whole table."""
    merged = merge_rows(results, rows, _cell_key)
    print("\n".join(row_text(r) for r in rows))
    print(markdown(merged))


def _cell_key(row: dict[str, Any]) -> tuple:
    return row["model"], row["topology"], row["variant"], row.get("tuned", True)


if __name__ == "__main__":
    main()
