"""The guarantee, on programs written the way their libraries' docs write them: compiled for
a TPU slice and a GPU node with the default options (`select_by_compiling` is on by default
where a topology's compiler judges), a step holds no more data per chip than plain
`jax.jit` data parallelism of the same step (its compiled code may differ by a few
percent: the instructions are named apart), and its estimated step is no longer. XLA's
compiler is the judge (`compiled_report`). A pipeline the user asked for is never swapped."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import xla_strategies as xs
from tests.frameworks.test_flax_quick_start import CNN  # flax's quick start, as written
from tests.helpers import counted_compiles
from xla_strategies.hardware.compiled_report import compiled_report
from xla_strategies.step.pipeline_choice import STEP_RESOLUTION

pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")

#: what two programs of the same instructions, named apart, may differ by in data memory
SAME_PROGRAM_BYTES = 4096


def _data_bytes(report) -> int:
    return report.memory.total_bytes - report.memory.generated_code_bytes


def _flax_cnn():
    model, tx = CNN(), optax.adam(1e-3)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((1, 28, 28, 1))))

    def step(params, opt_state, images, labels):
        def loss_fn(p):
            logits = model.apply(p, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch = ((28, 28, 1), jnp.float32), ((), jnp.int32)
    return step, (params, jax.eval_shape(tx.init, params)), batch


def _equinox_mlp():
    """equinox's MLP with `eqx.filter` splitting arrays from the rest, as its docs train it."""
    model = eqx.nn.MLP(64, 10, width_size=512, depth=3, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = jax.vmap(eqx.combine(p, static))(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return step, (shapes, jax.eval_shape(tx.init, shapes)), (((64,), jnp.float32), ((), jnp.int32))


def _plain_gpt2(cast_first):
    """A small GPT-2 written in plain JAX (`benchmarks.plain_jax_models`: tied embeddings,
    a scan over checkpointed blocks, bf16 compute on f32 weights, adamw)."""
    from benchmarks.plain_jax_models import gpt2_workload
    from benchmarks.tpu_models import TransformerConfig

    def make():
        cfg = TransformerConfig(4096, 256, 4, 2, 1024, 128)
        workload = gpt2_workload("small GPT-2", cfg, cast_first=cast_first)
        tx = optax.adamw(1e-3)
        train_step = workload.step(tx, None)
        params = jax.eval_shape(workload.init)

        def step(params, opt_state, tokens):
            return train_step(params, opt_state, {"tokens": tokens})

        batch = (((cfg.seq_len + 1,), jnp.int32),)
        return step, (params, jax.eval_shape(tx.init, params)), batch

    return make


def _reports(strategy, make):
    step, state, batch = make()
    rows = 16 * strategy.num_replicas_in_sync
    split = strategy.split_sharding()
    inputs = [jax.ShapeDtypeStruct((rows, *s), d, sharding=split) for s, d in batch]
    ours = strategy.compile(step, donate_argnums=(0, 1))  # the defaults
    ours_report = compiled_report(
        ours.lower(*strategy.replicate(state), *inputs).compile(), strategy
    )
    mesh = Mesh(np.array(strategy.devices).reshape(-1), ("batch",))
    whole, rows_split = (
        NamedSharding(mesh, PartitionSpec()),
        NamedSharding(mesh, PartitionSpec("batch")),
    )
    plain_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), state
    )
    plain_inputs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows_split) for a in inputs]
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*plain_state, *plain_inputs).compile()
    return ours_report, compiled_report(compiled, strategy)


@pytest.mark.parametrize(
    ("topology", "make"),
    [("v5e-16", _flax_cnn), ("v5e-16", _equinox_mlp), ("dgx-h100", _flax_cnn)],
    ids=["flax-cnn-v5e-16", "equinox-mlp-v5e-16", "flax-cnn-dgx-h100"],
)
def test_a_step_is_never_worse_than_plain_jit(topology, make):
    _assert_never_worse(topology, make)


@pytest.mark.slow  # 40 to 100 s each: four programs of ours and jax.jit's, for 16 chips
@pytest.mark.parametrize(
    "cast_first",
    [
        True,
        pytest.param(
            False,
            marks=pytest.mark.xfail(
                strict=True,
                reason="1.75 MiB more data than jax.jit's 36.99 (XLA's heap: the bf16 output "
                "layer's gradient, 2 MiB, live at our peak; libtpu 0.0.50), its step level",
            ),
        ),
    ],
    ids=["cast-first", "cast-per-use"],
)
def test_a_plain_jax_gpt2_is_never_worse_than_plain_jit(cast_first):
    _assert_never_worse("v5e-16", _plain_gpt2(cast_first))


def _assert_never_worse(topology, make):
    if topology.startswith("dgx"):
        pytest.importorskip("jax_plugins.xla_cuda12", reason="the [gpu] extra: XLA's GPU compiler")
        strategy = xs.MirroredStrategy(topology=topology, compile_only=True)
    else:
        strategy = xs.TPUStrategy(topology, compile_only=True)
    ours, plain = _reports(strategy, make)
    # for flax's CNN and equinox's MLP the replicated alternative is jax.jit's program up to
    # its instructions' names and the per-replica loss it returns. Its data (arguments, outputs, temporaries) is jax.jit's
    # to within 768 B of temporaries (dgx-h100); its code differs by up to 3.4 % (34 KB of
    # 1 MB for equinox's MLP on v5e-16 with libtpu 0.0.42; 2 KB on 0.0.50)
    assert _data_bytes(ours) <= _data_bytes(plain) + SAME_PROGRAM_BYTES, (ours.memory, plain.memory)
    code = ours.memory.generated_code_bytes
    assert code <= plain.memory.generated_code_bytes * 1.05, (ours.memory, plain.memory)
    # the rule's own resolution: a program 1 % slower by the estimate ranks as the same
    # step, and the smaller in memory is kept (flax's CNN on dgx-h100: its sharded update,
    # 10.99 MB against 16.54, 53.79 us against 53.63 at the H200-fitted rates)
    assert ours.estimate["step_s"] <= plain.estimate["step_s"] * (1 + STEP_RESOLUTION)


def test_the_verdict_is_cached_by_the_programs_fingerprint_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    strategy = xs.TPUStrategy("v5e-16", compile_only=True)
    step, state, batch = _flax_cnn()
    rows = 16 * strategy.num_replicas_in_sync
    inputs = [
        jax.ShapeDtypeStruct((rows, *s), d, sharding=strategy.split_sharding()) for s, d in batch
    ]
    remarks = []
    for _ in range(2):  # a second compile of the same step, as a new process would make it
        compiled = strategy.compile(step, select_by_compiling=True)
        executable = compiled.executable(*strategy.replicate(state), *inputs)
        remarks.append(next(r for r in executable.remarks if r.startswith("select-by-compiling")))
    assert "compiled default" in remarks[0] and "replicated" in remarks[0]
    assert "(the cached verdict)" not in remarks[0] and "(the cached verdict)" in remarks[1]
    assert len(list((tmp_path / "pipeline_verdicts").glob("*.json"))) == 1


def test_a_pipeline_or_sharding_the_user_asked_for_or_an_emulated_chip_is_never_swapped(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    step, state, batch = _flax_cnn()

    def selected(strategy, **options):
        rows = 16 * strategy.num_replicas_in_sync
        split = strategy.split_sharding()
        inputs = [jax.ShapeDtypeStruct((rows, *s), d, sharding=split) for s, d in batch]
        compiled = strategy.compile(step, **options)
        executable = compiled.executable(*strategy.replicate(state), *inputs)
        return [r for r in executable.remarks if r.startswith("select-by-compiling")]

    tpu = xs.TPUStrategy("v5e-16", compile_only=True)
    assert "replicated" in selected(tpu)[0]  # the default: the compiler judges
    # a sharding asked for is kept: only the rewrites left to the cost model are tried
    (asked,) = selected(tpu, shard_weight_updates=True)
    assert "compiled default" in asked and "replicated" not in asked
    assert "default+scatter-adds-as-selects" in asked
    assert not selected(tpu, pipeline=tpu.pipeline().spec())  # a spec runs as written
    assert not selected(tpu, select_by_compiling=False)
    assert not selected(xs.TPUStrategy("v5e-8", emulate=True))  # CPU devices judge nothing


def test_the_fastest_program_at_most_the_replicated_one_is_kept_or_a_smaller_one_as_fast():
    from xla_strategies.step.pipeline_choice import Compiled, _kept

    replicated = Compiled("replicated", "insert-reductions", True, 1000, 1.0)
    faster_but_larger = Compiled("default", "...", True, 1100, 0.5)
    no_worse = Compiled("default", "...", True, 1000, 0.9)
    too_big = Compiled("default", "...", False, None, None)
    assert _kept([no_worse, replicated]).label == "default"
    assert _kept([faster_but_larger, replicated]).label == "replicated"
    assert _kept([too_big, replicated]).label == "replicated"
    only_default = Compiled("replicated", "insert-reductions", False, None, None)
    assert _kept([no_worse, only_default]).label == "default"
    sharded = Compiled("sharded-updates", "...", True, 900, 0.8)
    assert _kept([no_worse, sharded, replicated]).label == "sharded-updates"
    assert _kept([faster_but_larger, sharded, replicated]).label == "sharded-updates"
    same_step = Compiled("sharded-updates", "...", True, 900, 0.9)  # a tie: the smaller
    assert _kept([no_worse, same_step, replicated]).label == "sharded-updates"
    same_both = Compiled("sharded-updates", "...", True, 1000, 0.9)  # in both: the earlier
    assert _kept([no_worse, same_both, replicated]).label == "default"
    # steps under 1 % apart rank as one (the estimate cannot tell): the smaller is kept
    barely_slower = Compiled("sharded-updates", "...", True, 900, 0.905)
    assert _kept([no_worse, barely_slower, replicated]).label == "sharded-updates"
    slower = Compiled("sharded-updates", "...", True, 900, 0.95)
    assert _kept([no_worse, slower, replicated]).label == "default"
    # so are steps under 1 % slower than the replicated program's: it is no faster
    smaller = Compiled("sharded-updates", "...", True, 900, 1.005)
    assert _kept([replicated, smaller]).label == "sharded-updates"
    assert _kept([replicated, Compiled("default", "...", True, 900, 1.02)]).label == "replicated"
    larger = Compiled("sharded-updates", "...", True, 1001, 0.5)
    assert _kept([no_worse, larger, replicated]).label == "default"
    assert _kept([too_big, only_default]).label == "default"  # none fits: the first


def test_an_alternative_that_leaves_the_same_program_is_not_compiled_again(tmp_path, monkeypatch):
    compiles = counted_compiles(monkeypatch)
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    strategy = xs.TPUStrategy("v5e-16", compile_only=True)

    def evaluate(weights, x):  # no gradient: every alternative leaves the same program
        return jnp.mean(jnp.tanh(x @ weights))

    weights = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((16 * 16, 64), jnp.float32, sharding=strategy.split_sharding())
    compiled = strategy.compile(evaluate, select_by_compiling=True)
    remark = next(
        r
        for r in compiled.executable(strategy.replicate(weights), x).remarks
        if r.startswith("select-by-compiling")
    )
    assert "default" in remark and "sharded-updates" in remark and "replicated" in remark
    assert "+scatter-adds-as-selects" in remark  # tried on the program kept: no scatter here
    assert len(compiles) == 1, remark


def test_the_sharded_update_alternative_is_zero_1_where_the_default_decides_both():
    """The default runs what the cost model decides of parameter and weight-update
    sharding; the sharded-update alternative is the point it may have missed: the update
    sharded, every parameter whole (ZeRO-1), not the default's decision again."""
    from xla_strategies.step.pipeline_choice import alternatives

    pipeline = xs.TPUStrategy("v5e-16", compile_only=True).pipeline(None)
    assert {"shard-parameters", "shard-weight-updates"} <= set(pipeline.enabled_names())
    found = alternatives(pipeline)
    sharded = found["sharded-updates"]
    assert "shard-parameters" not in sharded.enabled_names()
    assert any(p.name == "shard-weight-updates" and p.mode == "on" for p in sharded.passes)
    assert len({p.spec() for p in found.values()}) == len(found)  # each a different program


def test_a_refinement_is_kept_only_where_it_is_better_and_no_worse(tmp_path, monkeypatch):
    from xla_strategies.step import pipeline_choice
    from xla_strategies.step.pipeline_choice import choose

    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    pipeline = xs.TPUStrategy("v5e-16", compile_only=True).pipeline(None)

    class Report:  # what the compiler says of each pipeline, by whether it takes selects
        def __init__(self, memory, step):
            self.memory = type("Memory", (), {"total_bytes": memory})()
            self.estimate, self.fits = {"step_s": step}, True

    def with_selects(memory, step):
        def compile_one(candidate):
            on = any(
                p.name == "scatter-adds-as-selects" and p.mode == "on" for p in candidate.passes
            )
            return Report(memory, step) if on else Report(1000, 1.0)

        return compile_one

    kept = choose(pipeline, with_selects(900, 0.8), "faster").chosen
    assert kept.endswith("+scatter-adds-as-selects")
    assert pipeline_choice.chosen_pipeline(pipeline, kept).spec() != pipeline.spec()
    assert "+" not in choose(pipeline, with_selects(1100, 0.8), "larger").chosen
    assert "+" not in choose(pipeline, with_selects(1000, 1.0), "the same").chosen
    # a verdict cached before a refinement existed is not this one's: compiled again
    from xla_strategies.step.pipeline_choice import Compiled, Verdict

    pipeline_choice._write(Verdict("default", (Compiled("default", "", True, 1, 1.0),), "older"))
    assert choose(pipeline, with_selects(900, 0.8), "older").chosen.endswith(
        "+scatter-adds-as-selects"
    )
