"""Pipeline stages train flax NNX models written as flax's guide writes them: layers made
by `nnx.vmap` and run by `nnx.scan`, a step of `nnx.value_and_grad` and
`optimizer.update`, against `nnx.jit` on one device; and NNX's random streams, whose
draws update the model's state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_pipeline_stages import _assert_mirrored_and_equal

import xla_strategies as xs


class _NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return nnx.tanh(self.linear(x))


class _NnxScanned(nnx.Module):
    """Layers as flax's NNX guide scans them: blocks made by `nnx.vmap`, run by `nnx.scan`."""

    def __init__(self, rngs: nnx.Rngs, block: type = _NnxBlock):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def create_block(rngs: nnx.Rngs):
            return block(rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(
            in_axes=(nnx.Carry, 0),
            out_axes=nnx.Carry,
            transform_metadata={nnx.PARTITION_NAME: None},
        )
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


def _nnx_train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def test_an_nnx_model_scanned_as_flaxs_guide_scans_trains_as_nnx_jit_does():
    """`nnx.value_and_grad` returns the model's state beside the loss: passed through the
    stages, each replica's copy of it came back typed as varying, and the step's in-place
    parameters were refused as differing across replicas."""

    strategy = xs.MirroredStrategy(pipeline_stages=2)
    model, want = train_nnx_against_nnx_jit(strategy, _NnxBlock, microbatches=4)
    _assert_mirrored_and_equal(nnx.state(model, nnx.Param), nnx.state(want, nnx.Param))
    assert tuple(model.blocks.linear.kernel[...].sharding.spec)[:1] == ("stage",)


def train_nnx_against_nnx_jit(strategy, block, **options):
    """`_NnxScanned` of `block`s trained 3 steps with adam on `strategy`, and by `nnx.jit`
    on one device (in a mesh of one, where flax makes annotated variables)."""

    def objects():
        model = _NnxScanned(nnx.Rngs(0), block)
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(32, 16)), rng.normal(size=(32, 3))) for _ in range(3)]
    batches = [(x.astype(np.float32), y.astype(np.float32)) for x, y in batches]
    one_device = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(one_device):
        want, want_optimizer = objects()
        for x, y in batches:
            nnx.jit(_nnx_train_step)(want, want_optimizer, x, y)
    with strategy.scope():
        model, optimizer = objects()
    step = strategy.compile(_nnx_train_step, **options)
    for x, y in strategy.experimental_distribute_dataset(batches):
        step(model, optimizer, x, y)
    return model, want


class _DropoutHead(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.linear = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear(self.dropout(x))


def _step_with_each_examples_error(model, optimizer, x, y):
    def loss(model):
        errors = jnp.mean((model(x) - y) ** 2, axis=1)
        return jnp.mean(errors), errors

    (loss, errors), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, errors


def _trained_on_repeated_rows(strategy, objects):
    """The model of `objects()` trained 3 steps with 4 microbatches on `strategy`, and by
    `nnx.jit`, on the same 2 rows as every microbatch; and the last step's errors."""
    rng = np.random.default_rng(0)
    rows, targets = rng.normal(size=(2, 16)), rng.normal(size=(2, 3))
    batch = (
        np.tile(rows, (16, 1)).astype(np.float32),
        np.tile(targets, (16, 1)).astype(np.float32),
    )
    want, want_optimizer = objects()
    with strategy.scope():
        model, optimizer = objects()
    step = strategy.compile(_step_with_each_examples_error, microbatches=4)
    for x, y in strategy.experimental_distribute_dataset([batch] * 3):
        _, errors = step(model, optimizer, x, y)
        nnx.jit(_step_with_each_examples_error)(want, want_optimizer, *batch)
    return model, want, errors


def _assert_each_microbatch_drew_its_own(strategy, errors):
    """The same 2 rows as each of the replicas' 4 microbatches came back with different
    errors: each microbatch and replica drew its own masks."""
    per_microbatch = np.asarray(errors).reshape(-1, 2)
    assert len(per_microbatch) == 4 * strategy.num_replicas_in_sync
    distinct = {tuple(np.round(e, 6)) for e in per_microbatch}
    assert len(distinct) == len(per_microbatch), per_microbatch


def test_a_head_that_draws_dropout_trains_in_stages_each_microbatch_drawing_its_own_mask():
    """The head's Dropout advances its stream's count (state the loss returns beside its
    gradient): that failed to trace in the stage program. Its count advances as under
    `nnx.jit`, once a step, its key is as it was, and each microbatch and replica draws
    its own mask."""

    def objects():
        model = _NnxScanned(nnx.Rngs(0, dropout=1))
        model.head = _DropoutHead(nnx.Rngs(2, dropout=3))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    strategy = xs.MirroredStrategy(pipeline_stages=2)
    model, want, errors = _trained_on_repeated_rows(strategy, objects)
    stream, want_stream = model.head.dropout.rngs, want.head.dropout.rngs
    assert int(stream.count[...]) == int(want_stream.count[...]) == 3
    np.testing.assert_array_equal(
        jax.random.key_data(stream.key[...]), jax.random.key_data(want_stream.key[...])
    )
    _assert_each_microbatch_drew_its_own(strategy, errors)


def _block_then(layer):
    """`_NnxBlock` with its output run through one more layer, `layer(rngs)`: `.then`."""

    class Block(_NnxBlock):
        def __init__(self, rngs: nnx.Rngs):
            super().__init__(rngs)
            self.then = layer(rngs)

        def __call__(self, x):
            return self.then(super().__call__(x))

    return Block


_DropoutBlock = _block_then(lambda rngs: nnx.Dropout(0.5, rngs=rngs))


def test_layers_that_draw_dropout_train_in_stages_their_streams_advanced_as_nnx_jit_does():
    """Each scanned layer's Dropout advances its own stream's count: the layer scan returns
    the counts beside the activations, and was refused as "per-layer outputs the loss
    reads". The counts come back advanced as under `nnx.jit`, and each microbatch draws
    its own masks."""

    def objects():
        model = _NnxScanned(nnx.Rngs(0, dropout=1), _DropoutBlock)
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    strategy = xs.MirroredStrategy(pipeline_stages=2)
    model, want, errors = _trained_on_repeated_rows(strategy, objects)
    stream, want_stream = model.blocks.then.rngs, want.blocks.then.rngs
    np.testing.assert_array_equal(stream.count[...], want_stream.count[...])
    np.testing.assert_array_equal(stream.count[...], [3, 3, 3, 3])
    _assert_each_microbatch_drew_its_own(strategy, errors)


def test_the_layers_draws_are_the_same_whatever_the_schedule():
    """A layer draws from its own stream with its microbatch's index, wherever the
    schedule runs it: interleaved 1F1B (each stage's layer keys sent round the stages)
    with sharded parameters trains to 1F1B's numbers."""

    def trained(**options):
        strategy = xs.MirroredStrategy(pipeline_stages=2)
        with strategy.scope():
            model = _NnxScanned(nnx.Rngs(0, dropout=1), _DropoutBlock)
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = strategy.compile(_step_with_each_examples_error, microbatches=4, **options)
        rng = np.random.default_rng(0)
        batch = (rng.normal(size=(32, 16)), rng.normal(size=(32, 3)))
        batch = tuple(a.astype(np.float32) for a in batch)
        for x, y in strategy.experimental_distribute_dataset([batch] * 3):
            step(model, optimizer, x, y)
        return model

    want = trained()
    got = trained(schedule="interleaved-1f1b", virtual_stages=2, shard_parameters=True)
    np.testing.assert_array_equal(got.blocks.then.rngs.count[...], [3, 3, 3, 3])
    for g, w in zip(
        jax.tree.leaves(nnx.state(got, nnx.Param)),
        jax.tree.leaves(nnx.state(want, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


_BatchNormBlock = _block_then(lambda rngs: nnx.BatchNorm(16, rngs=rngs))


def test_batchnorm_inside_the_pipelined_layers_is_refused_by_name():
    """Each layer's running statistics come out of the layer scan: the error names them."""
    strategy = xs.MirroredStrategy(pipeline_stages=2)
    with pytest.raises(ValueError, match="BatchNorm's running statistics"):
        train_nnx_against_nnx_jit(strategy, _BatchNormBlock, microbatches=4)
