"""Hugging Face `transformers`' PyTorch models, built from their configs (no weights
downloaded), run unchanged through `xla_strategies.torch`: the logits are the model's own
`model(input_ids=...).logits`, computed by `xst.apply` on the step's parameters (torchax
runs the torch forward on JAX values). The step around them is every benchmark language
model's (`tpu_models.lm_workload`: the next token's cross entropy in f32, optax's adamw),
so `jax.jit` and our strategy compile the same torch code. Float32 weights and compute, as
the model is made; no dropout (its config's rates set to 0, as for the other corpus
models). The model's f32 weights sit in host memory while it compiles (GPT-2 medium 1.4
GB, the 1B Llama 5 GB).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from benchmarks.corpus_models import GPT2_MEDIUM, LLAMA32_1B
from benchmarks.tpu_models import TransformerConfig, Workload, lm_workload


def _gpt2_medium(transformers: Any) -> Any:
    config = transformers.GPT2Config(
        vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24, n_head=16,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama32_1b(transformers: Any) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


#: name -> (its name in the tables, its maker, its shapes: keras-hub's same models')
HUGGING_FACE: dict[str, tuple[str, Callable[[Any], Any], TransformerConfig]] = {
    "hf-gpt2-medium": ("GPT-2 medium Hugging Face", _gpt2_medium, GPT2_MEDIUM),
    "hf-llama3.2-1b": ("Llama 3.2 1B Hugging Face", _llama32_1b, LLAMA32_1B),
}


def workload(key: str) -> Workload:
    """The Hugging Face model `key` of `HUGGING_FACE` as a benchmark workload: the state is
    its parameters by name (tied weights once), the batch token ids."""
    import torch
    import transformers

    import xla_strategies.torch as xst

    name, make, cfg = HUGGING_FACE[key]
    torch.manual_seed(0)
    state = xst.TrainState.create(make(transformers))

    def logits(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        return xst.apply(
            state.replace(params=params), tokens, method=lambda m, t: m(input_ids=t.long()).logits
        )

    return lm_workload(name, cfg, lambda: state.params, logits)
