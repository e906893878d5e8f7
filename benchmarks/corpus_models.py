"""Models others wrote, compiled unchanged, built from their configs (no weights
downloaded), each trained with optax's adamw as every other benchmark model:

- keras-hub's causal language models, trained by a JAX step written the way Keras' guide
  "Writing a training loop from scratch in JAX" writes it (`model.stateless_call` under
  `jax.value_and_grad`), in mixed precision as Keras users ask for it
  (`keras.config.set_dtype_policy("mixed_bfloat16")`: bf16 compute, f32 variables). Keras
  builds its variables when the model is made, so a workload holds its model's f32 weights
  in host memory while it compiles (GPT-2 medium 1.4 GB, the 1B Llama 5 GB);
- DeepMind's `gemma` library (flax linen), its parameters as the library makes them
  (bf16), `model.apply(...).logits` as its docs call it; initialised as shapes only.

Needs the corpus environment (`make .venv-corpus`).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.tpu_models import TransformerConfig, Workload, lm_workload


@cache
def _keras() -> Any:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    keras.config.set_dtype_policy("mixed_bfloat16")
    return keras


def _gpt2_medium(keras_hub: Any) -> Any:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50257, num_layers=24, num_heads=16, hidden_dim=1024,
        intermediate_dim=4096, max_sequence_length=1024, dropout=0.0,
    )  # fmt: skip
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _llama32_1b(keras_hub: Any) -> Any:
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=128256, num_layers=16, num_query_heads=32, hidden_dim=2048,
        intermediate_dim=8192, num_key_value_heads=8, rope_max_wavelength=500000,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    return keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)


#: The shapes of GPT-2 medium and Llama 3.2 1B as others write them (keras-hub's and Hugging
#: Face's), for MFU's flop count, and their per-chip batch: GPT-2 medium's 4 sequences, half
#: the flax model's, and the Llama's one, as their layers are not remat'd (at 4 sequences of
#: 2048 the Llama needs 42 GB a chip)
GPT2_MEDIUM = TransformerConfig(50257, 1024, 16, 24, 4096, 1024, batch_per_chip=4)
LLAMA32_1B = TransformerConfig(
    128256, 2048, 32, 16, 8192, 2048, swiglu=True, kv_heads=8, batch_per_chip=1
)

#: name -> (its name in the tables, keras-hub model maker, its shapes)
KERAS_HUB = {
    "keras-hub-gpt2-medium": ("GPT-2 medium keras-hub", _gpt2_medium, GPT2_MEDIUM),
    "keras-hub-llama3.2-1b": ("Llama 3.2 1B keras-hub", _llama32_1b, LLAMA32_1B),
}


#: name -> (the gemma library's model class name, the same shapes for the flop count)
GEMMA = {
    "gemma3-1b": (
        "Gemma3_1B",
        TransformerConfig(262144, 1152, 4, 26, 6912, 2048, swiglu=True, kv_heads=1, head_dim=256),
    ),
    "gemma3-12b": (
        "Gemma3_12B",
        TransformerConfig(262144, 3840, 16, 48, 15360, 2048, swiglu=True, kv_heads=8, head_dim=256),
    ),
}


def workload(key: str) -> Workload:
    """The corpus model `key` (of `KERAS_HUB` or `GEMMA`) as a benchmark workload."""
    return gemma_workload(key) if key in GEMMA else keras_hub_workload(key)


def gemma_workload(key: str) -> Workload:
    """The gemma library's model `key` of `GEMMA`: the next token's cross entropy of
    `model.apply({"params": params}, tokens=...).logits`, one sequence of 2048 per chip
    (its 262,144-entry vocabulary makes the logits the largest activation)."""
    from gemma import gm

    class_name, cfg = GEMMA[key]
    model = getattr(gm.nn, class_name)()

    def init() -> Any:
        return model.init(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]

    def logits(params: Any, tokens: jax.Array) -> jax.Array:
        return model.apply({"params": params}, tokens=tokens).logits

    name = f"{class_name.replace('_', ' ')} gemma"
    return lm_workload(name, cfg, init, logits)


def keras_hub_workload(key: str) -> Workload:
    """The keras-hub causal language model `key` of `KERAS_HUB`, as a workload: the state is
    the model's trainable variables (a list, Keras' order), the batch token ids, the loss
    the next token's cross entropy."""
    import keras_hub

    name, make, cfg = KERAS_HUB[key]
    _keras()
    model = make(keras_hub)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    if non_trainable:  # state the step would have to carry: none in these configs
        raise ValueError(f"{name}: {len(non_trainable)} non-trainable variables")

    def logits(trainable_variables: list[Any], tokens: jax.Array) -> jax.Array:
        inputs = {"token_ids": tokens, "padding_mask": jnp.ones_like(tokens, bool)}
        found, _ = model.stateless_call(trainable_variables, [], inputs)
        return found

    return lm_workload(name, cfg, lambda: trainable, logits)
