"""Pipeline stages for a model whose layers are not a scan: a Python loop over blocks,
each with weights of its own, marks each layer's input with `xs.pipeline_boundary`, and
trains under `pipeline_stages` as `OneDeviceStrategy` trains it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pipeline_stages import TOKENS, Block, _assert_mirrored_and_equal, _flax_loss_of, _train

import xla_strategies as xs


# the flax docs' way for blocks that are not scanned: a loop creating one module each
class LoopedDecoder(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(50, 16)(tokens)
        for _ in range(self.layers):
            x = xs.pipeline_boundary(x)
            x, _ = Block()(x, None)
        x = xs.pipeline_boundary(x)
        return nn.Dense(50)(nn.LayerNorm()(x))


def _looped_params(layers=4):
    return LoopedDecoder(layers).init(jax.random.key(0), TOKENS[:1])["params"]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"microbatches": 4, "schedule": "gpipe"}, marks=pytest.mark.slow),
        pytest.param({"microbatches": 4}, marks=pytest.mark.slow),
    ],
    ids=["gpipe", "1f1b"],
)
def test_a_looped_flax_model_with_boundaries_trains_as_one_device_does(options):
    params, loss = _looped_params(), _flax_loss_of(LoopedDecoder())
    batches = [(TOKENS,)] * 3
    want = _train(xs.OneDeviceStrategy(), loss, params, batches)
    got = _train(xs.MirroredStrategy(pipeline_stages=2), loss, params, batches, **options)
    _assert_mirrored_and_equal(got, want)


def _plain_loss(params, x, y):
    """Plain JAX, a list of layers, one residual block each; a mask every layer reads."""
    h = jnp.tanh(x @ params["embed"])
    keep = (jnp.arange(h.shape[-1]) % 3 != 0).astype(h.dtype)
    for layer in params["layers"]:
        h = xs.pipeline_boundary(h)
        h = h + keep * jnp.tanh(h @ layer["w"] + layer["b"])
    h = xs.pipeline_boundary(h)
    return jnp.mean((h @ params["head"] - y) ** 2)


def _plain_params(layers=4, width=16):
    keys = jax.random.split(jax.random.key(2), layers + 2)
    return {
        "embed": jax.random.normal(keys[0], (8, width)) * 0.5,
        "layers": [
            {"w": jax.random.normal(k, (width, width)) * 0.3, "b": jnp.full((width,), 0.1)}
            for k in keys[2:]
        ],
        "head": jax.random.normal(keys[1], (width, 2)),
    }


def _plain_batches():
    x = np.random.default_rng(1).normal(size=(32, 8)).astype(np.float32)
    return [(x, np.cos(x[:, :2]))] * 3


@pytest.mark.slow
def test_a_plain_jax_loop_of_layers_with_boundaries_trains_on_four_stages():
    params = _plain_params()
    want = _train(xs.OneDeviceStrategy(), _plain_loss, params, _plain_batches())
    strategy = xs.MirroredStrategy(pipeline_stages=4)
    got = _train(strategy, _plain_loss, params, _plain_batches(), microbatches=4)
    _assert_mirrored_and_equal(got, want)


def test_boundaries_outside_a_pipelined_step_change_nothing():
    params, (x, y) = _plain_params(), _plain_batches()[0]
    jaxpr = jax.make_jaxpr(_plain_loss)(params, x, y)
    assert "pipeline_boundary" not in str(jaxpr)


def test_layers_that_differ_are_named():
    params = _plain_params()
    params["layers"][2]["w"] = params["layers"][2]["w"][:, :8]  # a narrower layer
    params["layers"][2]["b"] = params["layers"][2]["b"][:8]

    def loss(params, x, y):
        h = jnp.tanh(x @ params["embed"])
        for layer in params["layers"]:
            h = xs.pipeline_boundary(h)
            h = jnp.tanh(h @ layer["w"] + layer["b"])
            h = jnp.pad(h, ((0, 0), (0, 16 - h.shape[-1])))
        return jnp.mean((xs.pipeline_boundary(h) @ params["head"] - y) ** 2)

    with pytest.raises(ValueError, match="layer 2 does not run the operations layer 0 runs"):
        _train(xs.MirroredStrategy(pipeline_stages=2), loss, params, _plain_batches())


def test_a_layer_count_the_stages_do_not_divide_is_named():
    params = _plain_params(layers=3)
    with pytest.raises(ValueError, match="4 xs.pipeline_boundary marks enclose 3 layers"):
        _train(xs.MirroredStrategy(pipeline_stages=2), _plain_loss, params, _plain_batches())


@pytest.mark.slow
def test_boundaries_with_sharded_parameters_hold_each_layer_in_blocks():
    params = _plain_params()
    want = _train(xs.OneDeviceStrategy(), _plain_loss, params, _plain_batches())
    strategy = xs.MirroredStrategy(pipeline_stages=2)
    got = _train(strategy, _plain_loss, params, _plain_batches(), microbatches=4,
                 shard_parameters=True)  # fmt: skip
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    kernel = got["layers"][0]["w"]
    assert {s.data.size for s in kernel.addressable_shards} == {kernel.size // 4}
