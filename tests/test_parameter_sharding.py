"""Parameter sharding end to end (ZeRO-3 / FSDP, `compile(shard_parameters=True)`): the
replicated update's numbers, parameters and optimizer state held split in their logical
shapes, each scanned layer gathered inside the loop, and checkpoints that move between
replica counts and the replicated update."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from tests.frameworks.reference import linen_regression_step, regression_batches
from tests.helpers import (
    assert_close_to_scale,
    clipped_adamw,
    held_split,
    scanned_lm,
    train_on,
    trains_as_jit,
)
from xla_strategies.demo import models

STEPS = 3


@pytest.mark.parametrize(
    ("make_strategy", "blocks"),
    [
        (xs.MirroredStrategy, 8),  # one replica axis
        (lambda: xs.TPUStrategy("v5e-8", emulate=True), 8),  # two: the slice's torus
        # two slices of 2x2: split over each slice's 4 chips, replicated across DCN
        (lambda: xs.TPUStrategy("2xv5e-4", emulate=True), 4),
    ],
    ids=["mirrored", "tpu-v5e-8", "tpu-2xv5e-4"],
)
def test_scanned_lm_with_clipped_adamw_matches_one_device(make_strategy, blocks):
    with jax.enable_x64(True):
        strategy = make_strategy()
        params, make_step, batches = scanned_lm(np.float64)
        tx = clipped_adamw()
        (p_on, s_on), step = train_on(
            strategy, make_step(tx), params, tx, batches, shard_parameters=True
        )
        (p_ref, s_ref), _ = train_on(xs.OneDeviceStrategy(), make_step(tx), params, tx, batches)
        assert_close_to_scale((p_on, s_on), (p_ref, s_ref), 1e-12)
        assert all(held_split(p_on, strategy))  # every parameter has a dimension that divides
        assert (
            sum(held_split(s_on, strategy)) >= len(held_split(s_on, strategy)) - 1
        )  # but the count
        assert step.cache_size == 1  # the split state is taken back as it comes
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        graph = step.executable(p_on, s_on, batch).graph
        loops = [n for n in graph.nodes if n.op == "jax.scan"]
        assert [r.count_ops("all_gather") >= 1 for n in loops for r in n.regions] == [True] * 2
        assert sum(r.count_ops("reduce_scatter") for n in loops for r in n.regions) >= 1
        if strategy.topology is not None:
            # the layers are a loop: the few gathers outside it (the tied embedding, the
            # last norm) share one bucket, on a v5e too, where the loops' gathers stay apart
            assert [n.op for n in graph.nodes].count("all_gather") == 1
        stack = p_on["ScanCheckpointBlock_0"]["Dense_0"]["kernel"]
        assert {s.data.shape for s in stack.addressable_shards} == {(3, 16 // blocks, 32)}


def _mirrored_scanned_lm_matches_one_device(pipeline=None, **lm_options):
    """The scanned LM (`lm_options`: `scanned_lm`'s) trained under `shard_parameters=True`
    on `MirroredStrategy` in float64, checked against one device; its step's executable."""
    with jax.enable_x64(True):
        strategy = xs.MirroredStrategy()
        params, make_step, batches = scanned_lm(np.float64, **lm_options)
        tx = clipped_adamw()
        (p_on, s_on), step = train_on(
            strategy, make_step(tx), params, tx, batches, shard_parameters=True, pipeline=pipeline
        )
        reference, _ = train_on(xs.OneDeviceStrategy(), make_step(tx), params, tx, batches)
        assert_close_to_scale((p_on, s_on), reference, 1e-12)
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        return step.executable(p_on, s_on, batch)


def test_without_remat_the_backward_loop_gathers_again_instead_of_stacking_weights():
    """Without nn.remat, autodiff stacks each layer's gathered weights as forward residuals
    (the whole model on every replica until the backward pass); the backward loop gathers
    them again from the blocks instead, and the numbers stay one device's."""
    executable = _mirrored_scanned_lm_matches_one_device(remat=False)
    assert executable.pass_stats["shard-parameters"]["regathered_residuals"] >= 2
    forward, backward = [n for n in executable.graph.nodes if n.op == "jax.scan"]
    # no stacked output of the forward loop has a whole layer's kernel in it
    kernels = {(3, 16, 32), (3, 32, 16)}
    assert not kernels & {tuple(v.shape) for v in forward.outputs}
    assert backward.regions[0].count_ops("all_gather") >= 1  # both kernels, one bucket


def test_a_stack_whose_layer_axis_is_not_its_first_is_gathered_a_layer_at_a_time():
    """flax's `nn.scan` with `variable_axes={"params": 1}` (MaxText's `param_scan_axis`)
    holds each kernel as [in, layers, out] and transposes it whole before the loop. The
    stack is split besides its layer axis, the transpose runs on the block, and each loop
    gathers one layer: no whole stack is gathered, and the numbers stay one device's."""
    executable = _mirrored_scanned_lm_matches_one_device(param_axis=1)
    graph = executable.graph
    gathered = [o.size for n in graph.nodes if n.op == "all_gather" for o in n.outputs]
    assert max(gathered) < 3 * 16 * 32  # a kernel's stack (buckets are flat)
    kernels = {i.shape for i in graph.inputs if len(i.shape) == 3}  # with their moments
    assert kernels == {(2, 3, 32), (4, 3, 16)}
    for loop in (n for n in graph.nodes if n.op == "jax.scan"):
        assert loop.regions[0].count_ops("all_gather") >= 1


def test_a_remat_policy_that_keeps_the_matmuls_reaches_the_program_and_keeps_the_numbers():
    """`nn.remat(..., policy=...)` as MaxText's `remat_policy=minimal` is written for flax
    (every weight's matmul output kept for the backward pass): the layers' checkpoint
    region in the backward loop carries the policy through the passes, and the numbers stay
    one device's."""
    policy = "dots_with_no_batch_dims_saveable"
    executable = _mirrored_scanned_lm_matches_one_device(remat_policy=policy)
    _, backward = [n for n in executable.graph.nodes if n.op == "jax.scan"]  # the recompute
    remats = [n for n in backward.regions[0].nodes if n.op == "jax.remat2"]
    assert [n.attrs.get("policy") for n in remats] == [policy]


def test_prefetching_the_next_layer_keeps_the_numbers():
    """prefetch-all-gathers (on by itself only with a topology) forced on emulated devices:
    each loop gathers layer i+1 into a carry while layer i computes; same numbers."""
    spec = xs.passes.DEFAULT_PIPELINE.replace(
        "prefetch-all-gathers{mode=auto}", "prefetch-all-gathers{mode=on}"
    )
    executable = _mirrored_scanned_lm_matches_one_device(pipeline=spec)
    assert executable.pass_stats["prefetch-all-gathers"]["loops"] == 2  # forward, backward
    loops = [n for n in executable.graph.nodes if n.op == "jax.scan"]
    # each loop carries the gathered layer: more carries than the scan had
    assert all(n.attrs["num_carry"] > 1 for n in loops)


def test_nnx_mlp_with_a_shape_that_does_not_divide_matches_the_replicated_update():
    """A [5] bias divides by no replica count: it stays replicated (a remark says so),
    and the rest is held split; the numbers are the replicated update's. The layers are
    not a scan."""
    with jax.enable_x64(True):
        strategy = xs.MirroredStrategy()
        graphdef, params = helpers.mlp(np.float64)
        tx = clipped_adamw()
        step_fn = models.mlp_train_step(graphdef, tx)
        batches = helpers.mlp_batches(STEPS, dtype=np.float64)
        (p_on, s_on), step = train_on(strategy, step_fn, params, tx, batches, shard_parameters=True)
        off, _ = train_on(strategy, step_fn, params, tx, batches, shard_parameters=False)
        assert_close_to_scale((p_on, s_on), off, 1e-12)
        held = {
            jax.tree_util.keystr(k): strategy.is_held_sharded(v)
            for k, v in jax.tree_util.tree_flatten_with_path(p_on)[0]
        }
        assert [k for k, h in held.items() if not h] == ["['layers'][2]['bias'].value"]
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        executable = step.executable(p_on, s_on, batch)
        replicated = executable.pass_stats["shard-parameters"]["replicated"]
        assert {"f64[5]"} <= {r["type"] for r in replicated}
    # the middle kernel's reads have only the smaller last layer gathered between them,
    # the last's backward read comes before any other gather, and the first one's input
    # gradient is not computed (the batch has none): nothing is gathered again
    assert executable.pass_stats["shard-weight-updates"]["regathered_reads"] == 0


class _DocsMLP(nn.Module):
    """The MLP of flax's "Flax fundamentals" guide: dense layers, relu between them."""

    features: tuple[int, ...] = (32, 32, 32, 8)

    @nn.compact
    def __call__(self, x):
        for i, features in enumerate(self.features):
            x = nn.Dense(features)(x)
            if i != len(self.features) - 1:
                x = nn.relu(x)
        return x


def test_a_small_gather_between_a_kernels_reads_does_not_gather_it_again():
    """In flax's docs MLP the last layer's small kernel and its biases are gathered
    between the third kernel's forward and backward reads: fewer bytes than that kernel,
    so it is held, not gathered again; the second kernel, with the third (as large)
    between its reads, is gathered again, in a block that waits its turn (without a chip
    memory size to weigh, not held across the step). The numbers are `jax.jit`'s."""
    model = _DocsMLP()
    batches = regression_batches(STEPS, rows=16, inputs=32, outputs=8)
    params = model.init(jax.random.key(0), batches[0][0])["params"]
    tx = optax.adam(1e-2)
    strategy = xs.MirroredStrategy()
    (p_on, s_on), compiled = trains_as_jit(
        strategy, linen_regression_step(model, tx), params, tx, batches, shard_parameters=True
    )
    batch = next(iter(strategy.experimental_distribute_dataset(batches)))
    executable = compiled.executable(p_on, s_on, batch)
    assert executable.pass_stats["shard-weight-updates"]["regathered_reads"] == 1
    graph = executable.graph
    copy = [n for n in graph.nodes if n.op == "all_gather" and n.attrs.get("parameter")]
    assert len(copy) == 1  # the forward's gathers share a bucket; the copy, after them, not
    assert graph.producers()[copy[0].inputs[0]].op == "after"  # waits its turn


def test_a_stacks_moments_are_split_where_the_stack_is_when_its_layers_divide():
    """8 layers on 8 replicas: the layer dimension divides too, but the stack is split
    after it (each layer is gathered in the loop), and its Adam moments must be split on
    the same dimension, or XLA gathers every moment whole to meet the stack's blocks (a
    7B model on 8 GPUs needed 65 GiB per GPU, not 18)."""
    with jax.enable_x64(True):
        strategy = xs.MirroredStrategy()
        params, make_step, batches = scanned_lm(np.float64, layers=8)
        tx = clipped_adamw()
        (p_on, s_on), _ = train_on(
            strategy, make_step(tx), params, tx, batches, shard_parameters=True
        )
        (p_ref, s_ref), _ = train_on(xs.OneDeviceStrategy(), make_step(tx), params, tx, batches)
        assert_close_to_scale((p_on, s_on), (p_ref, s_ref), 1e-12)
        kernel = ("ScanCheckpointBlock_0", "Dense_0", "kernel")
        stack = p_on[kernel[0]][kernel[1]][kernel[2]]
        assert {s.data.shape for s in stack.addressable_shards} == {(8, 2, 32)}
        moments = [
            leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(s_on)
            if [getattr(k, "key", None) for k in path[-3:]] == list(kernel)
        ]
        assert len(moments) == 2  # Adam's mu and nu
        for moment in moments:
            assert {s.data.shape for s in moment.addressable_shards} == {(8, 2, 32)}
