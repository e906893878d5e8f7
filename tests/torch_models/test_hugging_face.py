"""Hugging Face's own PyTorch models (`transformers`' GPT-2 and Llama, built from their
configs, no weights) trained by `xla_strategies.torch` unchanged, with eager torch's
numbers: the loss is the one the model computes from `labels`, as Hugging Face's trainer
takes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xla_strategies as xs
from tests.frameworks.reference import TOL
from tests.torch_models.models import eager_data_parallel, token_batches
from tests.torch_models.test_train import _train

transformers = pytest.importorskip("transformers", reason="the [frameworks] extra provides it")

#: small configs of each model, written as their docs write them
MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, max_position_embeddings=16)
    ),
}  # fmt: skip


def hf_loss(model, tokens):
    """The causal LM loss the model computes itself from its labels (shifted inside)."""
    return model(input_ids=tokens.long(), labels=tokens.long()).loss


def _sgd(model):
    # SGD, not AdamW: Adam's m/sqrt(v) turns float-order noise in a near-zero gradient
    # into a whole step, which no two summation orders agree on
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


@pytest.mark.parametrize(
    "name",
    ["gpt2", pytest.param("llama", marks=pytest.mark.slow)],  # 8-14 s each
)
def test_a_hugging_face_model_trains_as_eager_torch_does(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    batches = [(tokens,) for tokens, _ in token_batches(3)]
    reference, _, ref_losses = eager_data_parallel(model, _sgd, hf_loss, batches)
    state, losses, _ = _train(xs.MirroredStrategy(), model, _sgd(model), hf_loss, batches)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    for key, param in reference.named_parameters():
        np.testing.assert_allclose(
            np.asarray(state.params[key]), param.detach().numpy(), **TOL, err_msg=key
        )
    moved = [
        k for k, p in model.named_parameters() if not torch.equal(p, reference.get_parameter(k))
    ]
    assert len(moved) == len(list(model.parameters()))  # every parameter trained
