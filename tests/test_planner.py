"""`strategy.plan`: a step compiled for a topology in each candidate configuration, the
ones that do not fit said so by XLA's compiler, and the fastest that fits recommended."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import xla_strategies as xs

pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")

REPO = Path(__file__).resolve().parents[1]


def _adam_step(tx):
    def step(w, opt_state, x):
        def loss(w):
            h, _ = jax.lax.scan(lambda h, layer: (jnp.tanh(h @ layer), None), x, w)
            return jnp.mean(h)

        updates, opt_state = tx.update(jax.grad(loss)(w), opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    return step


def _adam_layers_on_v5e_4(layers):
    """A compile-only v5e-4, the Adam step of `layers` 8192-wide f32 layers declared on it,
    its abstract state and a batch of 16 rows."""
    strategy = xs.TPUStrategy("v5e-4", compile_only=True)
    tx = optax.adam(1e-3)
    w = jax.ShapeDtypeStruct((layers, 8192, 8192), jnp.float32)
    state = (w, jax.eval_shape(tx.init, w))
    x = jax.ShapeDtypeStruct((16, 8192), jnp.float32, sharding=strategy.split_sharding())
    step = strategy.compile(_adam_step(tx), donate_argnums=(0, 1))  # the state, declared
    return strategy, step, state, x


def test_a_state_too_big_to_replicate_is_planned_split(tmp_path, monkeypatch):
    """18 layers of 8192 x 8192 float32 weights with Adam (14.5 GB of state, 19.3 with the
    gradients) on v5e-4 (16 GiB a chip): replicated, they do not fit; split, they do."""
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    strategy, step, state, x = _adam_layers_on_v5e_4(18)
    lines = []
    found = strategy.plan(
        step, *state, x, model_axes=(1,), batch_doublings=0, log=lines.append, workers=2
    )
    fits = {row.sharding: row.fits for row in found.rows}
    assert fits == {
        "replicated": False,
        "weight-update sharding": False,
        "parameter sharding": True,
    }
    assert found.best().sharding == "parameter sharding"
    assert "shard_parameters=True" in found.recommendation()
    assert "uncalibrated" in found.table() and "NO" in found.table()
    # what holds the memory where it does not fit: the weights and Adam's two moments
    # (6 GiB each), named by argument, and what XLA counts of the peak, within 5 %
    missed = found.rows[0]
    assert {what for _, _, what in missed.largest_held} >= {
        "args[0]",
        "args[1][0].mu",
        "args[1][0].nu",
    }
    assert sum(missed.held_by_group.values()) >= 0.95 * missed.memory_bytes
    assert "what holds the memory, does not fit: replicated" in found.memory()
    # the three configurations compiled two at a time, each said once
    assert sorted(line.split(":")[1] for line in lines) == [
        " compiling 1/3",
        " compiling 2/3",
        " compiling 3/3",
    ]
    again = strategy.plan(step, *state, x, model_axes=(1,), batch_doublings=0)
    assert again.rows == found.rows  # from the cache: nothing compiled again
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path / "one at a time"))
    alone = strategy.plan(step, *state, x, model_axes=(1,), batch_doublings=0, workers=1)
    assert alone.rows == found.rows  # compiled again one at a time: the same rows, in order


def test_plan_needs_a_compile_only_strategy():
    with pytest.raises(ValueError, match="build the strategy with compile_only=True"):
        xs.MirroredStrategy().plan(lambda w: w, jnp.ones(3))


def test_the_command_line_plans_a_scripts_first_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import jax.numpy as jnp, numpy as np
            import xla_strategies as xs
            strategy = xs.TPUStrategy("v5e-4")
            step = strategy.compile(lambda w, x: w - 0.1 * jnp.mean(x) * w, donate_argnums=0)
            batches = strategy.experimental_distribute_dataset([np.ones((8, 4), np.float32)])
            step(strategy.replicate(np.ones(4, np.float32)), next(iter(batches)))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "xla_strategies", "plan", "--topology", "v5e-4", "--out",
         str(tmp_path / "out"), "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**__import__("os").environ, "XLA_STRATEGIES_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan for TPUStrategy(v5e-4" in done.stdout
    assert (
        "step = strategy.compile(" in done.stdout or "<lambda> = strategy.compile(" in done.stdout
    )
    assert "plan: compiling 1/" in done.stderr
    # what the command line's heartbeat reads says what the plan did, not that nothing
    # compiled: the plan's last line
    progress = (tmp_path / "out" / ".progress").read_text()
    assert progress.startswith("<lambda>: plan: "), progress
    # the recommended configuration's step, drawn as XLA scheduled it
    (timeline,) = (tmp_path / "out").glob("*/plan_timeline.json")
    trace = json.loads(timeline.read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])  # instructions with times
    assert timeline.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_stages_across_slices_are_planned_where_replicated_state_does_not_fit(
    tmp_path, monkeypatch
):
    """24 layers of 6656 x 6656 float32 weights with Adam (12.8 GB of state) on two v5e-4
    slices: replicated it does not fit a chip (18.2 GB); split over two pipeline stages,
    each slice its 12 layers, it does (11.9 GiB), and in less with the stage's parameters
    held in blocks over its 4 chips."""
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    strategy = xs.TPUStrategy("2xv5e-4", compile_only=True)
    tx = optax.adam(1e-3)
    w = jax.ShapeDtypeStruct((24, 6656, 6656), jnp.float32)
    state = (w, jax.eval_shape(tx.init, w))
    x = jax.ShapeDtypeStruct((16, 6656), jnp.float32, sharding=strategy.split_sharding())
    step = strategy.compile(_adam_step(tx), donate_argnums=(0, 1))
    found = strategy.plan(
        step, *state, x, model_axes=(1,), batch_doublings=0, stages=(1, 2), schedules=()
    )
    fits = {(row.sharding, row.stages): row.fits for row in found.rows}
    assert fits[("replicated", 1)] is False
    assert fits[("replicated", 2)] is True
    assert fits[("parameter sharding", 2)] is True
    by = {(row.sharding, row.stages): row for row in found.rows}
    assert by["parameter sharding", 2].memory_bytes < by["replicated", 2].memory_bytes / 2
    staged = by["replicated", 2]
    assert staged.microbatches == 4  # 16 rows over 4 replicas: 4 a replica, at most 8
    assert staged.schedule == "1f1b-paired"  # the default
    assert "stages" in found.table().splitlines()[1]


def _plan_checkpointed_layers(topology, rows, stages):
    """The plan of an SGD step over 16 checkpointed 1024-wide layers (no remat policy of
    their own) on `topology`, a batch of `rows`, one batch size and model axis."""
    from tests.test_remat_policy import _step

    strategy = xs.TPUStrategy(topology, compile_only=True)
    tx = optax.sgd(0.1)
    stack = jax.ShapeDtypeStruct((16, 1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((rows, 1024), jnp.float32, sharding=strategy.split_sharding())
    return strategy.plan(
        _step(tx), stack, jax.eval_shape(tx.init, stack), x, model_axes=(1,), batch_doublings=0,
        stages=stages, log=lambda line: None,
    )  # fmt: skip


def test_remat_policies_are_tried_where_the_steps_blocks_have_none(tmp_path, monkeypatch):
    """A scan over `jax.checkpoint`ed layers with no policy: on the best configuration, the
    planner compiles the policies that keep more for the backward pass too; a policy that
    keeps more holds more memory, and the recommendation names the one it chose."""
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    found = _plan_checkpointed_layers("v5e-4", 4096, stages=(1,))
    tried = [row for row in found.rows if row.remat_policy]
    assert [row.remat_policy for row in tried] == [
        "dots_with_no_batch_dims_saveable", "dots_saveable", "everything_saveable"
    ]  # fmt: skip
    best_written = max(
        (r for r in found.rows if r.fits and not r.remat_policy),
        key=lambda r: r.items_per_s_per_chip,
    )
    assert {row.sharding for row in tried} == {best_written.sharding}  # on the best one
    assert tried[-1].memory_bytes > best_written.memory_bytes  # keeping all costs memory
    best = found.best()
    if best.remat_policy:
        assert f"remat_policy={best.remat_policy!r}" in found.recommendation()


def test_schedules_are_tried_on_the_best_configuration_with_stages(tmp_path, monkeypatch):
    """16 checkpointed layers on two v5e-4 slices: without stages the remat policies are
    tried, and on the best configuration with two stages the other schedules, the
    interleaved ones at each count of virtual stages that divides a stage's 8 layers;
    each compiles a program of its own, and the recommendation names what won."""
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    found = _plan_checkpointed_layers("2xv5e-4", 512, stages=(1, 2))
    assert {row.stages for row in found.rows if row.remat_policy} == {1}
    staged = [row for row in found.rows if row.stages == 2]
    first = max(
        (r for r in staged if r.schedule == "1f1b-paired"), key=lambda r: r.items_per_s_per_chip
    )
    tried = [(r.schedule, r.virtual_stages) for r in staged if r.schedule != "1f1b-paired"]
    assert tried == [
        ("1f1b", 0),
        ("zero-bubble-h1", 0),
        *(("interleaved-1f1b", v) for v in (2, 4, 8)),
        *(("interleaved-1f1b-paired", v) for v in (2, 4, 8)),
        *(("looped-bfs", v) for v in (2, 4, 8)),
    ]
    others = [r for r in staged if r.schedule != "1f1b-paired"]
    assert all(r.fits and r.sharding == first.sharding for r in others), found.table()
    # each a program of its own: the chunks' count changes the step
    assert len({r.step_s for r in others if r.schedule == "looped-bfs"}) == 3
    best = found.best()
    assert best.items_per_s_per_chip == max(r.items_per_s_per_chip or 0 for r in found.rows)
    if best.stages > 1:
        assert f"schedule={best.schedule!r}" in found.recommendation()


def test_virtual_stages_tried_divide_a_stages_layers_and_span_them():
    """At most four counts, from the fewest chunks to one layer a chunk (Llama-3.1-405B's
    126 layers over 2 stages: 63 a stage), none where a stage holds one layer."""
    from xla_strategies.distribute.planner import virtual_stage_counts

    assert virtual_stage_counts(63) == [3, 7, 21, 63]
    assert virtual_stage_counts(8) == [2, 4, 8]
    assert virtual_stage_counts(12) == [2, 3, 6, 12]
    assert virtual_stage_counts(7) == [7] and virtual_stage_counts(1) == []


def test_what_xla_counts_beyond_the_live_buffers_is_split_by_cause():
    """Of 10 GiB XLA counts, 5 are live buffers and 2 the heap's gaps at the peak: the
    other 3 are said to be beyond XLA's buffer assignment, not lumped with the gaps."""
    from xla_strategies.distribute.plan_rows import Row

    gib = 2**30
    row = Row("replicated", 1, 1, True, 10 * gib, None, None,
              held_by_group={"other temporaries": 5 * gib}, heap_gaps_bytes=2 * gib)  # fmt: skip
    held = row.held()
    assert "    2.00 GiB  gaps in XLA's heap" in held
    assert "    3.00 GiB  counted by XLA beyond its buffer assignment" in held


def test_a_row_is_named_by_everything_that_configures_it():
    """Two rows that differ only in their remat policy (or stages) read differently
    wherever the plan names one: the memory's heading, the best so far, the recommendation."""
    from xla_strategies.distribute.plan_rows import Plan, Row, best_so_far

    row = Row("parameter sharding", 1, 2, True, 2**30, 1.0, 2.0, remat_policy="dots_saveable")
    assert row.describe() == "parameter sharding, remat dots_saveable, 1 per replica, 2 per chip"
    staged = Row("replicated", 2, 4, True, 2**30, 1.0, 4.0, stages=2, microbatches=4)
    assert staged.describe() == "replicated, 2 stages 1f1b-paired, 2 per replica, 4 per chip"
    looped = Row("replicated", 1, 4, True, 2**30, 1.0, 4.0, stages=2, microbatches=4,
                 schedule="looped-bfs", virtual_stages=4)  # fmt: skip
    assert looped.describe() == "replicated, 2 stages looped-bfs V=4, 1 per replica, 4 per chip"
    assert (
        "schedule='looped-bfs', virtual_stages=4" in Plan((looped,), "", "", True).recommendation()
    )
    # a large model's rate keeps its figures: 0.174 sequences a second, not 0.2
    slow = Row("parameter sharding", 1, 1, True, 2**30, 5.733, 1 / 5.733)
    assert " 0.174  " in slow.line() and "0.174 items/s/chip" in best_so_far([slow])
    plan = Plan((row,), "", "", True)
    assert "remat dots_saveable" in plan.memory().splitlines()[0]
    assert "remat dots_saveable" in plan.recommendation().splitlines()[0]


def test_a_configuration_whose_state_alone_outgrows_the_chip_is_not_compiled(tmp_path, monkeypatch):
    """40 layers of 8192 x 8192 float32 weights with Adam (32 GB of state) on v5e-4 (16 GiB
    a chip): replicated, the state alone is twice a chip, so that row says so and nothing is
    compiled for it; split over the 4 chips it may fit, so those are compiled."""
    monkeypatch.setenv("XLA_STRATEGIES_CACHE", str(tmp_path))
    strategy, step, state, x = _adam_layers_on_v5e_4(40)
    lines = []
    found = strategy.plan(step, *state, x, model_axes=(1,), batch_doublings=0, log=lines.append)
    replicated = found.rows[0]
    assert not replicated.fits and replicated.note.startswith("not compiled: the state alone")
    # the weights, Adam's two moments and its step count
    assert replicated.memory_bytes == 3 * 40 * 8192 * 8192 * 4 + 4
    said = sorted(line.split(":")[1].split("/")[0] for line in lines)
    assert said == [" compiling 2", " compiling 3", " not compiling 1"]  # the sharded two
    assert found.best().sharding == "parameter sharding"


def test_stages_with_a_model_axis_are_planned_with_parameter_sharding_too():
    """Each stage's parameters held in blocks over its replicas composes with a model axis
    inside the stage, so the planner tries it there too."""
    from xla_strategies.distribute.planner import _candidates

    strategy = xs.TPUStrategy("2xv5e-4", compile_only=True)
    tried = {
        (sharding, model, variant.pipeline_stages)
        for variant, sharding, model in _candidates(strategy, (1, 2), (2,))
    }
    assert tried == {
        ("replicated", 1, 2),
        ("parameter sharding", 1, 2),
        ("replicated", 2, 2),
        ("parameter sharding", 2, 2),
    }
