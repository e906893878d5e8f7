"""The model flops behind the TPU table's MFU (`benchmarks.tpu_models`): the forward's
third of them is what the HLO reader counts in the compiled forward (XLA's CPU compile of
the same flax modules, nothing recomputed there), and Llama-2's are MaxText's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks.tpu_models import (
    COMPUTE,
    WORKLOADS,
    ResNet50,
    Transformer,
    TransformerConfig,
    resnet50_train_flops_per_image,
)
from xla_strategies.hardware.hlo_flops import hlo_flops


def _forward_flops(model, *inputs, **kwargs) -> int:  # noqa: ANN001
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *inputs, **kwargs))
    apply = jax.jit(lambda v, *xs: model.apply(v, *xs, **kwargs))
    return sum(hlo_flops(apply.lower(variables, *inputs).compile().as_text()).values())


@pytest.mark.parametrize(
    "cfg",
    [
        TransformerConfig(96, 64, 4, 2, 160, 16, causal=False),  # BERT's and GPT-2's layers
        TransformerConfig(96, 64, 4, 2, 160, 16, causal=False, swiglu=True, kv_heads=2),
    ],
    ids=["layer-norm-gelu-tied", "llama-gqa"],
)
def test_transformer_flops_are_the_compiled_forwards_three_times(cfg):
    # plain attention computes every score, so only a model without a mask compares
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    assert 3 * _forward_flops(Transformer(cfg), tokens) == cfg.train_flops_per_sequence


def test_a_causal_mask_halves_the_attention_flops():
    cfg = TransformerConfig(96, 64, 4, 2, 160, 16, causal=False)
    causal = TransformerConfig(96, 64, 4, 2, 160, 16, causal=True)
    scores_and_mix = 3 * 2 * 2 * cfg.seq_len**2 * cfg.width * cfg.layers  # fwd + bwd
    assert cfg.train_flops_per_sequence - causal.train_flops_per_sequence == scores_and_mix / 2


def test_resnet50_flops_are_the_compiled_forwards_three_times():
    image = jnp.zeros((1, 64, 64, 3), COMPUTE)  # small, so padding's missing taps matter
    forward = _forward_flops(ResNet50(), image, train=False)
    assert 3 * forward == resnet50_train_flops_per_image(64)


@pytest.mark.parametrize(
    ("model", "maxtext_tflops"),
    # MaxText 0.2.5's `calculate_tflops_training_per_device` for model_name=llama2-7b and
    # llama2-70b, per_device_batch_size=1, max_target_length=2048
    [("llama2-7b", 84.486301679616), ("llama2-70b", 860.84029513728)],
)
def test_llama_flops_are_maxtexts(model, maxtext_tflops):
    assert WORKLOADS[model]().train_flops_per_item / 1e12 == pytest.approx(maxtext_tflops)
