"""split-stacked-all-reduces: across TPU slices a small all-reduce of stacked rows
reduces its rows as operands of their own, in the IR and in what XLA's TPU compiler makes
of it; large values, buckets, values that stack nothing and single slices are left alone;
flax's BatchNorm statistics train to the numbers of one device."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from tests.filecheck import filecheck
from tests.passes.pass_testing import run_pass
from xla_strategies.hardware.compiled_report import hlo_report
from xla_strategies.hardware.topology import Topology
from xla_strategies.passes import SplitStackedAllReduces
from xla_strategies.passes.pipeline import without_pass

SLICES = Topology.from_name("2xv5p-512")
STATS = """\
func @step(%0: f32[{shape}]{{dcn,x,y,z}}) {{
  %1: f32[{shape}] = all_reduce(%0) {{"axes": [{axes}], "reduce_op": "mean"}}
  return %1
}}
"""


def _stats(shape: str, axes: str = '"dcn", "x", "y", "z"') -> str:
    return STATS.format(shape=shape, axes=axes)


def _run(pass_: SplitStackedAllReduces, text: str, topology: Topology | None = SLICES):
    mesh = (topology or SLICES).mesh_axes
    return run_pass(pass_, text, mesh, topology=topology)


def test_stacked_statistics_across_slices_are_reduced_row_by_row():
    changed, after, ctx = _run(SplitStackedAllReduces(), _stats("2,256"))
    stats = ctx.stats["split-stacked-all-reduces"]
    assert changed and stats["split"] == 1
    [decision] = stats["decisions"]
    assert decision["form"] == "rows" and decision["shape"] == [2, 256]
    assert decision["estimates_s"]["rows"] < decision["estimates_s"]["stacked"]
    filecheck(
        after,
        """
        CHECK: %[[A:[0-9]+]]: f32[1,256]{dcn,x,y,z} = slice(%0) {"limit": [1, 256], "start": [0, 0]}
        CHECK-NEXT: %[[RA:[0-9]+]]: f32[256]{dcn,x,y,z} = reshape(%[[A]])
        CHECK-NEXT: %[[B:[0-9]+]]: f32[1,256]{dcn,x,y,z} = slice(%0) {"limit": [2, 256], "start": [1, 0]}
        CHECK-NEXT: %[[RB:[0-9]+]]: f32[256]{dcn,x,y,z} = reshape(%[[B]])
        CHECK-NEXT: %[[MA:[0-9]+]]: f32[256], %[[MB:[0-9]+]]: f32[256] = all_reduce(%[[RA]], %[[RB]]) {"axes": ["dcn", "x", "y", "z"], "reduce_op": "mean"}
        CHECK-NEXT: %[[SA:[0-9]+]]: f32[1,256] = reshape(%[[MA]])
        CHECK-NEXT: %[[SB:[0-9]+]]: f32[1,256] = reshape(%[[MB]])
        CHECK-NEXT: %[[S:[0-9]+]]: f32[2,256] = concatenate(%[[SA]], %[[SB]]) {"dimension": 0}
        CHECK-NEXT: return %[[S]]
        """,
    )


@pytest.mark.parametrize(
    ("text", "topology"),
    [
        # 512 KiB: the rows' bytes among the slices cost more than XLA's second
        # all-reduce inside the slice saves (measured: 169.0 against 110.6 us)
        (_stats("2,65536"), SLICES),
        (_stats("512"), SLICES),  # nothing stacked
        (_stats("1,512"), SLICES),  # one row
        (_stats("64,256"), SLICES),  # more rows than stacked statistics
        (_stats("3,3,3,8"), SLICES),  # a convolution's kernel: its rows are no vectors
        (_stats("2,256", '"x", "y", "z"').replace("f32[2,256] =", "f32[2,256]{dcn} ="), SLICES),
        (_stats("2,256", '"x", "y", "z"').replace("dcn,", ""), Topology.from_name("v5p-512")),
    ],
    ids=["large", "rank-1", "one-row", "many-rows", "kernel", "inside-each-slice", "one-slice"],
)
def test_what_the_compiler_runs_well_already_is_left_alone(text, topology):
    changed, after, ctx = _run(SplitStackedAllReduces(), text, topology)
    assert not changed and "concatenate" not in after
    decisions = ctx.stats["split-stacked-all-reduces"].get("decisions", [])
    assert all(d["form"] == "stacked" for d in decisions)


def test_a_bucket_is_left_as_it_is():
    bucket = _stats("2,256").replace('"reduce_op": "mean"', '"bucket": 0, "reduce_op": "mean"')
    changed, _, _ = _run(SplitStackedAllReduces(mode="on"), bucket)
    assert not changed


def test_mode_on_splits_what_auto_prices_out_and_says_when_there_are_no_slices():
    changed, _, _ = _run(SplitStackedAllReduces(mode="on"), _stats("2,65536"))
    assert changed
    text = _stats("2,256", '"x", "y", "z"').replace("dcn,", "")
    changed, _, ctx = _run(SplitStackedAllReduces(mode="on"), text, Topology.from_name("v5p-512"))
    assert not changed
    assert any("mode=on}: nothing to split" in remark for remark in ctx.remarks)


class BatchNormCNN(nn.Module):
    """A convolution, flax's BatchNorm over the global batch (`axis_name`), as flax's
    docs write a data-parallel model with batch statistics."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)  # the norm's own bias follows
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(10)(x)


def _bn_batches(steps: int = 2, size: int = 16) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(size, 6, 6, 3)).astype(np.float32), rng.integers(0, 10, size=size))
        for _ in range(steps)
    ]


def test_batch_norm_across_emulated_slices_trains_to_the_numbers_of_one_device():
    """Two slices of four chips (2xv5e-4 on eight CPU devices): the global batch's
    statistics, reduced row by row, give the numbers of BatchNorm over the whole batch on
    one device (flax's own `apply`, no axis name)."""
    strategy = xs.TPUStrategy("2xv5e-4", emulate=True)
    tx, batches = optax.sgd(0.1), _bn_batches()
    variables = BatchNormCNN().init(jax.random.key(0), batches[0][0], train=False)
    reference = variables, tx.init(variables["params"])
    for batch in batches:
        *reference, _ = jax.jit(helpers.batch_norm_step(BatchNormCNN(), tx))(*reference, batch)
    step = strategy.compile(helpers.batch_norm_step(BatchNormCNN("batch"), tx), axis_name="batch")
    state = strategy.replicate(variables), strategy.replicate(tx.init(variables["params"]))
    for batch in strategy.experimental_distribute_dataset(batches):
        *state, _ = step(*state, batch)
    assert step.executable(*state, batch).pass_stats["split-stacked-all-reduces"]["split"] >= 1
    helpers.assert_close_to_scale(tuple(state), tuple(reference), 1e-5)


@pytest.mark.parametrize("split", [False, True], ids=["stacked", "rows"])
def test_xla_reduces_the_rows_in_fewer_collectives_inside_the_slice(split):
    """XLA's TPU compiler for two slices of v5e-4: the stacked statistics are an
    all-reduce inside the slice, the shares among the slices, and a gather inside the
    slice again; the rows, an all-reduce inside the slice and one among the slices."""
    strategy = xs.TPUStrategy("2xv5e-4", compile_only=True)
    tx, (images, _) = optax.sgd(0.1), _bn_batches(1)[0]
    variables = jax.eval_shape(lambda: BatchNormCNN().init(jax.random.key(0), images, train=False))
    pipeline = strategy.pipeline(None)
    if not split:
        pipeline = without_pass(pipeline, "split-stacked-all-reduces")
    step = strategy.compile(
        helpers.batch_norm_step(BatchNormCNN("batch"), tx), axis_name="batch", pipeline=pipeline
    )
    args = strategy.replicate(variables), strategy.replicate(tx.init(variables["params"]))
    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: (jnp.zeros((2, 6, 6, 3)), jnp.zeros((2,), jnp.int32))
    )
    report = hlo_report(step.lower(*args, batch).compile().as_text(), strategy.topology)
    inside = [c.kind for c in report.collectives if not c.across_slices]
    among = [c for c in report.collectives if c.across_slices]
    # the statistics and two gradients cross the slices either way (the convolution's
    # kernel, [3, 3, 3, 8], is a triple either way); the stacked statistics take one more
    # collective inside the slice: a gather of the shares
    assert len(among) == 3
    assert (len(inside), inside.count("all-gather")) == ((4, 1) if split else (5, 2))
