"""Every JAX primitive that common models' train steps capture is declared to the passes,
or is on the short list below of ops left opaque on purpose. A primitive a new JAX release
adds stays opaque until someone declares it: the cost model then charges it memory traffic
that XLA fuses away, and no pass rewrites through it, silently (JAX 0.12's
`one_minus_square`, tanh's derivative, was one). This test names the next one."""

from __future__ import annotations

import flax.linen as nn
import jax
import keras
import numpy as np
import optax
import pytest
import torch

import xla_strategies as xs
import xla_strategies.torch as xst
from benchmarks import tpu_models
from tests import helpers
from tests.keras_models import models as keras_models
from tests.torch_models import models as torch_models
from xla_strategies.passes.ir.text import parse
from xla_strategies.passes.ir.traits import traits_of
from xla_strategies.step.dump_reader import steps

#: foreign ops these models capture that the passes leave opaque, and why that is right
KNOWN_OPAQUE = {
    "jax.slice": "data movement: priced as the bytes it reads and writes",
    "jax.pad": "not linear: its padding value is an operand, summed by a cross-replica sum",
    "jax.rev": "a convolution's flipped kernel in the backward pass: small",
    "jax.iota": "makes a value from nothing: priced as the bytes it writes",
    "jax.stop_gradient": "the softmax's max: priced as its bytes, never on a gradient path",
    "jax.reduce_window_max": "max pooling: priced as its bytes",
    "jax.select_and_scatter_add": "max pooling's gradient: priced as its bytes",
    "jax.stack": "BatchNorm's two statistics stacked for one pmean (JAX 0.12): a few bytes",
    "jax.unstack": "the same statistics taken apart again: a few bytes",
    "jax.random_bits": "dropout's mask: priced as the bytes it writes",
    "jax.random_wrap": "a key's type change: no data",
    "jax.random_unwrap": "a key's type change: no data",
    "jax.random_seed": "a key: a few bytes",
    "jax.random_fold_in": "a key: a few bytes",
    "jax.bitcast_convert_type": "a key's bits: a few bytes",
    "jax.threefry2x32": "a key's hash: a few bytes",
    "jax.shift_right_logical": "dropout's uniform bits: priced as their bytes",
    "jax.argmax": "an accuracy metric's predicted class (Keras): priced as its bytes",
    "jax.shift_right_arithmetic": "Keras' argmax of the predictions' bits: a few bytes",
    "jax.reduce_prod": "a count of elements from a shape (Keras' metrics): a few bytes",
    "jax.concatenate": "data movement: priced as the bytes it reads and writes",
    "jax.empty": "torch.empty: makes a value from nothing, priced as the bytes it writes",
    "jax.random_split": "a key: a few bytes",
    "jax.reduce_window": "torch's max pooling (a generic window reduction): priced as its bytes",
    "jax.reduce_or": "a check of torch's attention mask: a few bytes",
}


class _CNN(nn.Module):
    """flax's ImageNet example's pieces, small: convolutions, BatchNorm, max pooling,
    dropout."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), strides=2, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        x = nn.Conv(8, (1, 1), feature_group_count=2)(x)
        x = nn.Dropout(0.1, deterministic=not train)(x.mean(axis=(1, 2)))
        return nn.Dense(3)(x)


def _captured_ops(strategy, step, state, batch) -> set[str]:
    replicated = [strategy.replicate(s) for s in state]
    compiled = strategy.compile(step, axis_name="batch")
    (batch,) = strategy.experimental_distribute_dataset([batch])
    graph = compiled.executable(*replicated, batch).graph
    return _foreign_ops(graph)


def _foreign_ops(graph) -> set[str]:
    return {node.op for region in graph.graphs() for node in region.nodes if node.is_foreign}


def _undeclared(ops: set[str]) -> set[str]:
    return {op for op in ops if not traits_of(op)} - set(KNOWN_OPAQUE)


# the table's transformers, small: GPT-2 (causal, GELU), BERT (bidirectional), Llama
# (SwiGLU, RMSNorm, grouped-query attention)
TRANSFORMERS = {
    "gpt2": tpu_models.TransformerConfig(64, 32, 4, 2, 64, 8),
    "bert": tpu_models.TransformerConfig(64, 32, 4, 2, 64, 8, causal=False),
    "llama": tpu_models.TransformerConfig(64, 32, 4, 2, 64, 8, swiglu=True, kv_heads=2),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_every_op_of_a_transformers_train_step_is_declared(name):
    workload = tpu_models.language_model(name, TRANSFORMERS[name])
    tx = optax.adamw(1e-3)
    params = workload.init()
    tokens = np.random.default_rng(0).integers(0, 64, size=(16, 9)).astype(np.int32)
    strategy = xs.MirroredStrategy()
    step = workload.step(tx, "batch")
    ops = _captured_ops(
        strategy, lambda p, o, t: step(p, o, {"tokens": t}), (params, tx.init(params)), tokens
    )
    assert "jax.dot_general" in ops  # the capture saw the model
    assert _undeclared(ops) == set()


def test_every_op_of_a_cnns_train_step_is_declared():
    model, tx = _CNN(), optax.sgd(0.1, momentum=0.9)
    images = np.random.default_rng(0).normal(size=(16, 16, 16, 3)).astype(np.float32)
    labels = np.arange(16, dtype=np.int32) % 3
    variables = model.init(jax.random.key(0), images[:2], train=False)
    strategy = xs.MirroredStrategy()

    def dropout_key() -> dict:  # each replica its own dropout mask
        replica = xs.get_replica_context().replica_id_in_sync_group
        return {"dropout": jax.random.fold_in(jax.random.key(0), replica)}

    step = helpers.batch_norm_step(model, tx, dropout_key)
    ops = _captured_ops(strategy, step, (variables, tx.init(variables["params"])), (images, labels))
    assert "jax.conv_general_dilated" in ops
    assert _undeclared(ops) == set()


def test_the_known_opaque_ops_are_still_opaque():
    """An op declared since it was listed here leaves the list (its entry would hide the
    next release's change to it)."""
    assert {op for op in KNOWN_OPAQUE if traits_of(op)} == set()


@pytest.mark.parametrize("make", ["mnist_convnet", "text_transformer"])
def test_every_op_of_a_keras_fit_is_declared(make, tmp_path, monkeypatch):
    """keras.io's convnet and transformer, trained by `fit` in the strategy's scope: the
    step Keras' trainer compiles, as the dump holds it after capture."""
    monkeypatch.setenv("XLA_STRATEGIES_DUMP_TO", str(tmp_path))
    rng = np.random.default_rng(0)
    if make == "mnist_convnet":
        x = rng.normal(size=(16, 28, 28, 1)).astype(np.float32)
        y = keras.utils.to_categorical(np.arange(16) % 10, 10)
        loss = "categorical_crossentropy"
    else:
        x, y = rng.integers(0, 50, size=(16, 16)), np.arange(16) % 2
        loss = "sparse_categorical_crossentropy"
    strategy = xs.MirroredStrategy()
    with strategy.scope():
        model = getattr(keras_models, make)()
        model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    (step,) = steps(tmp_path)
    graph = parse(step.ir_after("capture"))
    ops = _foreign_ops(graph)
    assert "jax.dot_general" in ops
    assert _undeclared(ops) == set()


@pytest.mark.parametrize("name", ["Net", "TinyLM"])
def test_every_op_of_a_torch_train_step_is_declared(name):
    """PyTorch's CIFAR-10 tutorial network and a word-language-model transformer, through
    torchax, with torch's AdamW."""
    module = getattr(torch_models, name)()
    if name == "Net":
        loss, batch = torch_models.classification_loss, torch_models.image_batches(1)[0]
    else:
        tokens = np.random.default_rng(0).integers(0, 32, size=(16, 9)).astype(np.int32)
        loss, batch = torch_models.lm_loss, (tokens[:, :-1], tokens[:, 1:])
    state = xst.TrainState.create(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    strategy = xs.MirroredStrategy()
    step = strategy.compile(lambda s, *b: xst.train_step(s, loss, *b))
    (batch,) = strategy.experimental_distribute_dataset([batch])
    graph = step.graph(state, *batch)
    ops = _foreign_ops(graph)
    assert "jax.dot_general" in ops
    assert _undeclared(ops) == set()
