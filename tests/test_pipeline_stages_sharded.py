"""Pipeline stages with parameter sharding inside each stage (FSDP within a stage):
`compile(shard_parameters=True)` on a strategy with `pipeline_stages` holds each stage's
layers in blocks over the replicas between steps, gathers one layer where a tick reads it
and reduce-scatters its gradient into the blocks, and trains as `OneDeviceStrategy` does."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_pipeline_stages import (
    TOKENS,
    TX,
    Decoder,
    _flax_loss_of,
    _plain_batches,
    _plain_loss,
    _plain_params,
    _train,
    assert_no_block_drifts,
)
from test_pipeline_stages_nnx import train_nnx_against_nnx_jit

import xla_strategies as xs
from tests.helpers import lm_step, train_on
from tests.test_model_axis import _Block
from xla_strategies.hardware.compiled_report import compiled_report


def _assert_held_in_blocks_and_equal(got, want, stacked, devices=8):
    """Each leaf equal to the one-device run's, the same on each device that holds a
    block of it; the stacked ones held split over the stages and the replicas, so each
    device holds 1/devices of them."""
    for name, g in got.items():
        np.testing.assert_allclose(np.asarray(g), np.asarray(want[name]), rtol=1e-4, atol=1e-5)
        assert_no_block_drifts(g)
        if name in stacked:
            assert tuple(g.sharding.spec)[:1] in {("stage",), ("sharded:stage",)}, name
            held = {shard.data.size for shard in g.addressable_shards}
            assert held == {g.size // devices}, (name, held)


@pytest.mark.parametrize(
    "stages, options",
    [
        (2, {"microbatches": 4, "schedule": "gpipe"}),
        (4, {"microbatches": 8, "schedule": "1f1b"}),
        pytest.param(
            2,
            {"microbatches": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2},
            marks=pytest.mark.slow,
        ),
        pytest.param(4, {"microbatches": 4, "schedule": "zero-bubble-h1"}, marks=pytest.mark.slow),
        pytest.param(2, {"microbatches": 4, "stage_keeps": "stage-inputs"}, marks=pytest.mark.slow),
        pytest.param(2, {"microbatches": 4}, marks=pytest.mark.slow),  # paired 1F1B, the default
    ],
    ids=["gpipe-S2", "1f1b-S4-M8", "interleaved", "zero-bubble", "stage-inputs", "paired"],
)
def test_each_schedule_with_sharded_parameters_trains_as_one_device_does(stages, options):
    params, batches = _plain_params(), _plain_batches()
    want = _train(xs.OneDeviceStrategy(), _plain_loss, params, batches)
    strategy = xs.MirroredStrategy(pipeline_stages=stages)
    got = _train(strategy, _plain_loss, params, batches, shard_parameters=True, **options)
    _assert_held_in_blocks_and_equal(got, want, stacked={"w", "b"})


@pytest.mark.slow
def test_a_flax_model_scanned_with_nn_scan_trains_with_sharded_stages():
    params = Decoder().init(jax.random.key(0), TOKENS[:1])["params"]
    batches, loss = [(TOKENS,)] * 3, _flax_loss_of(Decoder())
    want = _train(xs.OneDeviceStrategy(), loss, params, batches)
    got = _train(xs.MirroredStrategy(pipeline_stages=2), loss, params, batches,
                 shard_parameters=True, microbatches=4)  # fmt: skip
    stack = got["ScanBlock_0"]
    for kernel in (stack["Dense_0"]["kernel"], stack["Dense_1"]["kernel"]):
        assert {s.data.size for s in kernel.addressable_shards} == {kernel.size // 8}
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_a_stage_gathers_one_layer_at_a_time_and_scatters_its_gradient():
    """The compiled program's gathers of the stack are each one layer (a stage's layers
    are never whole on a device), and its gradients, and the head's, are reduce-scattered
    into blocks."""
    layers, width, stages = 8, 64, 2
    strategy = xs.MirroredStrategy(pipeline_stages=stages)
    replicas = strategy.num_replicas_in_sync

    def loss(params, x, y):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["w"])
        return jnp.mean((h @ params["head"] - y) ** 2)

    @strategy.compile(microbatches=4, shard_parameters=True)
    def grads(params, x, y):
        return jax.grad(loss)(params, x, y)

    f32 = jnp.float32
    params = {
        "w": jax.ShapeDtypeStruct((layers, width, width), f32),
        "head": jax.ShapeDtypeStruct((width, 1), f32),
    }
    batch = [jax.ShapeDtypeStruct((32, n), f32, sharding=strategy.split_sharding())
             for n in (width, 1)]  # fmt: skip
    hlo = grads.lower(params, *batch).compile().as_text()
    gathered = re.findall(r"= f32\[([0-9,]*)\][^ ]* all-gather(?:-start)?\(", hlo)
    sizes = [int(np.prod([int(n) for n in dims.split(",") if n])) for dims in gathered]
    assert sizes and max(sizes) <= width * width  # one layer, never a stage's 4
    scattered = re.findall(r"= f32\[([0-9,]*)\][^ ]* reduce-scatter\(", hlo)
    assert f"{width // replicas},{width}" in scattered  # a layer's gradient block
    assert f"{width // replicas},1" in scattered  # the head's, never summed whole


@pytest.mark.slow
def test_one_replica_per_stage_and_a_stack_no_replica_count_divides_stay_whole():
    """8 stages of one replica: nothing to split. 4 replicas and a 6-wide stack: held
    whole over the replicas, still split over the stages, never over its layers."""
    params, batches = _plain_params(), _plain_batches()
    want = _train(xs.OneDeviceStrategy(), _plain_loss, params, batches)
    got = _train(xs.MirroredStrategy(pipeline_stages=8), _plain_loss, params, batches,
                 microbatches=8, shard_parameters=True)  # fmt: skip
    _assert_held_in_blocks_and_equal(got, want, stacked={"w", "b"})

    def narrow_loss(params, x, y):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x[:, :6], params["w"])
        return jnp.mean((h @ params["head"] - y) ** 2)

    narrow = {"w": params["w"][:, :6, :6], "head": params["head"][:6]}
    want = _train(xs.OneDeviceStrategy(), narrow_loss, narrow, batches)
    got = _train(xs.MirroredStrategy(pipeline_stages=2), narrow_loss, narrow, batches,
                 microbatches=4, shard_parameters=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-4, atol=1e-5)
    assert tuple(got["w"].sharding.spec)[:1] in {("stage",), ("sharded:stage",)}
    assert {s.data.shape for s in got["w"].addressable_shards} == {(4, 6, 6)}


def test_sharded_stages_with_an_axis_name_train_as_one_device_does():
    """`axis_name` names the replicas as one axis, which the step's own collectives use
    (the loss averaged over it); each stage's layers are held in blocks over it."""

    @jax.jit
    def jit_loss(params, x, y):
        return _plain_loss(params, x, y)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_plain_loss)(params, x, y)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")

    params, batches = _plain_params(), _plain_batches()
    want = _train(xs.OneDeviceStrategy(), _plain_loss, params, batches)
    strategy = xs.MirroredStrategy(pipeline_stages=2)
    compiled = strategy.compile(step, microbatches=4, shard_parameters=True, axis_name="batch")
    with strategy.scope():
        state = strategy.replicate(params), strategy.replicate(TX.init(params))
    distributed = list(strategy.experimental_distribute_dataset(batches))
    for (x, y), batch in zip(batches, distributed, strict=True):
        loss = jit_loss(state[0], x, y)
        *state, got_loss = compiled(*state, *batch)
        np.testing.assert_allclose(got_loss, loss, rtol=1e-5)  # every replica's, the mean
    _assert_held_in_blocks_and_equal(state[0], want, stacked={"w", "b"})


def test_sharded_stages_with_an_axis_name_over_part_of_the_replicas_are_refused():
    """Across 4 slices of 2 stages, each stage's blocks span a slice's chips, not the
    slices its replicas also span: `axis_name`, one axis over them all, cannot name them."""
    strategy = xs.TPUStrategy("4xv5e-4", compile_only=True, pipeline_stages=2)
    with pytest.raises(ValueError, match=r"axis_name='batch' holds each stage's layers in "
                       r"blocks over \['x', 'y'\].*drop axis_name"):  # fmt: skip
        strategy.compile(lambda p: p, shard_parameters=True, axis_name="batch")


class _StagedLM(nn.Module):
    """A scanned, rematerialised LM with Megatron's annotations (test_model_axis's), with
    4 layers for 2 stages and the embedding split on its vocabulary (the head reads it)."""

    @nn.compact
    def __call__(self, tokens):
        vocab_split = nn.with_partitioning(nn.initializers.normal(), ("model", None))
        embed = nn.Embed(12, 16, param_dtype=jnp.float64, embedding_init=vocab_split)
        stack = nn.scan(
            nn.remat(_Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=4,
            metadata_params={nn.PARTITION_NAME: None},
        )
        x, _ = stack(16)(embed(tokens), None)
        return embed.attend(nn.LayerNorm(param_dtype=jnp.float64)(x))


@pytest.mark.slow  # 9 s: three steps on 8 devices, and a compile for the report
def test_stages_with_a_model_axis_and_sharded_parameters_train_as_one_device_does():
    """2 replicas of 2 stages of 2 model devices, the layers held in blocks over the
    replicas on top of their model split: each device holds 1/8 of a kernel, the numbers
    are one device's (float64), and a layer, and the head's embedding, are gathered and
    their gradients scattered on each device's part of the model split, never whole over
    the model axis first (XLA's partitioner's way: an all-gather inside the replica of
    each weight before each collective across replicas)."""
    tx = optax.adamw(1e-2)
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 12, size=(16, 7)).astype(np.int32) for _ in range(3)]
    with jax.enable_x64(True):
        params = _StagedLM().init(jax.random.key(0), np.zeros((2, 6), np.int32))["params"]
        (want, _), _ = train_on(xs.OneDeviceStrategy(), lm_step(_StagedLM(), tx),
                                nn.meta.unbox(params), tx, batches)  # fmt: skip
        strategy = xs.MirroredStrategy(pipeline_stages=2, logical_devices_per_replica=2)
        (got, opt_state), step = train_on(strategy, lm_step(_StagedLM(), tx), params, tx,
                                          batches, microbatches=4, shard_parameters=True)  # fmt: skip
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-8)  # adam divides by sqrt(v)
            assert_no_block_drifts(g)  # a bias's blocks, each on both model devices
        stack = got["ScanCheckpoint_Block_0"]
        for kernel in (stack["Dense_0"]["kernel"].value, stack["Dense_1"]["kernel"].value):
            assert {s.data.size for s in kernel.addressable_shards} == {kernel.size // 8}
        tokens = next(iter(strategy.experimental_distribute_dataset(batches[:1])))
        report = compiled_report(step.lower(got, opt_state, tokens).compile(), strategy)
    # the partitioner's own: a bias's gradient, summed split over the model axis (f64[32])
    part = 6 * 16 * 8  # bytes of a device's part of the embedding, the smallest weight split
    inside = [c.nbytes for c in report.collectives if c.inside_replica and c.kind == "all-gather"]
    assert max(inside, default=0) < part, inside


def test_a_train_step_never_gathers_a_whole_stack():
    """New parameters and moments, which do not depend on the batch, leave the trace on
    microbatches as they are: broadcast over the microbatches and sliced, their blocks
    were gathered whole (8x a stage's stack, f32, on TPU)."""
    strategy = xs.MirroredStrategy(pipeline_stages=2)
    params = _plain_params()

    @strategy.compile(microbatches=4, shard_parameters=True)
    def step(params, opt_state, x, y):
        grads = jax.grad(_plain_loss)(params, x, y)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with strategy.scope():
        state = strategy.replicate(params), strategy.replicate(TX.init(params))
    batch = next(iter(strategy.experimental_distribute_dataset(_plain_batches())))
    graph = step.graph(*state, *batch, after="shard-weight-updates")
    gathered = [n.outputs[0].size for n in graph.nodes if n.op == "all_gather"]
    assert gathered  # the embedding and the head, read whole; no stack, nor a stage's
    assert max(gathered) <= max(params["embed"].size, params["head"].size)


def _cast_per_use_loss(params, x, y):
    """`_plain_loss` with its layers' matmuls in bfloat16 on float32 weights, the cast
    where each weight is read (as flax's `dtype=` and plain mixed-precision JAX write it)."""
    h = jnp.tanh(x * params["embed"])

    def layer(h, w):
        out = h.astype(jnp.bfloat16) @ w["w"].astype(jnp.bfloat16)
        return jnp.tanh(out.astype(jnp.float32) + w["b"]), None

    h, _ = jax.lax.scan(layer, h, {"w": params["w"], "b": params["b"]})
    return jnp.mean((h @ params["head"] - y) ** 2)


@pytest.mark.slow
def test_a_layer_read_as_bfloat16_is_gathered_and_scattered_as_bfloat16():
    """A layer that reads its float32 weight only as bfloat16 gathers the weight as
    bfloat16 and reduce-scatters its gradient as bfloat16 (half the bytes, what
    `jax.jit`'s partitioner moves); a weight it reads as float32 (the bias) stays float32.
    The gradients equal one device's to bfloat16's precision."""
    strategy = xs.MirroredStrategy(pipeline_stages=2)
    replicas = strategy.num_replicas_in_sync
    params, (x, y) = _plain_params(), _plain_batches()[0]

    @strategy.compile(microbatches=4, shard_parameters=True)
    def grads(params, x, y):
        return jax.grad(_cast_per_use_loss)(params, x, y)

    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    with strategy.scope():
        held = strategy.replicate(params)
    # the program as emitted (XLA:CPU widens bfloat16 collectives to float32 when it
    # compiles them; a TPU keeps them)
    emitted = grads.lower(held, *batch).as_text()
    width = params["w"].shape[-1]
    block, whole = f"tensor<{width // replicas}x{width}xbf16>", f"tensor<{width}x{width}xbf16>"
    gathered = re.findall(r'all_gather"[^\n]*: \((tensor<[^>]*>)\) -> (tensor<[^>]*>)', emitted)
    assert (block, whole) in gathered
    assert f"tensor<{width}x{width}xf32>" not in {t for _, t in gathered}
    scattered = re.findall(
        r"reduce_scatter.*?\}\) : \((tensor<[^>]*>)\) -> (tensor<[^>]*>)", emitted, re.S
    )
    assert (whole, block) in scattered
    assert (f"tensor<{width}xf32>", f"tensor<{width // replicas}xf32>") in scattered  # bias

    want = xs.OneDeviceStrategy().compile(lambda p, x, y: jax.grad(_cast_per_use_loss)(p, x, y))
    expected = want(params, x, y)
    for name, g in grads(held, *batch).items():
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(expected[name]), rtol=2e-2, atol=2e-3, err_msg=name
        )


def test_the_type_a_layer_reads_is_found_through_its_checkpoint_and_never_guessed():
    """A weight cast to bfloat16 wherever it is read, inside `jax.checkpoint` too, is read
    as bfloat16; one also read as float32 anywhere, or not read at all, is not."""
    from xla_strategies.passes.bridge.cast_reads import read_as

    def cast_only(w, x):
        return jax.checkpoint(lambda w, x: x @ w.astype(jnp.bfloat16))(w, x)

    def also_wide(w, x):
        return x @ w.astype(jnp.bfloat16) + w.sum().astype(jnp.bfloat16)

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4), jnp.bfloat16)
    for fn, expected in [(cast_only, jnp.bfloat16), (also_wide, None), (lambda w, x: x, None)]:
        jaxpr = jax.make_jaxpr(fn)(w, x).jaxpr
        assert read_as(jaxpr, jaxpr.invars[0]) == expected, fn


class _NnxTensorParallelBlock(nnx.Module):
    """A residual MLP block annotated as the flax NNX guides annotate tensor parallelism."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        columns, rows = (None, "model"), ("model", None)
        self.up = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, columns), rngs=rngs)
        self.down = nnx.Linear(32, 16, kernel_init=nnx.with_partitioning(init, rows), rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.tanh(self.up(x)))


@pytest.mark.slow
def test_an_nnx_model_with_a_model_axis_trains_in_sharded_stages_as_nnx_jit_does():
    strategy = xs.MirroredStrategy(pipeline_stages=2, logical_devices_per_replica=2)
    model, want = train_nnx_against_nnx_jit(
        strategy, _NnxTensorParallelBlock, microbatches=4, shard_parameters=True
    )
    got = nnx.state(model, nnx.Param)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(nnx.state(want, nnx.Param)), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
        assert_no_block_drifts(g)
    for kernel in (model.blocks.up.kernel[...], model.blocks.down.kernel[...]):
        assert {s.data.size for s in kernel.addressable_shards} == {kernel.size // 8}
