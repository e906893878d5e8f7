"""MaxText's own model code (the `maxtext` package's Llama-2 `Transformer`), trained by our
strategy: the same code MaxText's trainer compiles in `benchmarks/maxtext_aot.py`, so the
two sides of the cell differ only in who trains it.

The model is MaxText's, unchanged, built from its own `base.yml` and model name with the
settings `maxtext_aot.py` gives MaxText's trainer (plain attention, sequences of 2048).
Inside the step it is built on `xs.get_replica_context().mesh`, the mesh the replicas are
traced on: MaxText lays out its activations with `NamedSharding`s on the mesh it is
handed, and its layout rules name none of our axes, so each is the replica's whole value.
The step around the model is every benchmark language model's (`tpu_models.lm_workload`:
the next token's cross entropy in f32, optax's adamw). No dropout, as MaxText's trainer
compiles it here.

Needs MaxText's environment, with this package in it (`tools/make-maxtext-venv`):

    JAX_PLATFORMS=cpu .venv-maxtext/bin/python -m benchmarks.tpu_aot \\
        --models maxtext-llama2-7b --topologies v5e-256 --variants d
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.tpu_models import TransformerConfig, Workload, lm_workload

#: name -> (its name in the tables, MaxText's model_name, the same shapes for the flop count)
MAXTEXT = {
    "maxtext-llama2-7b": (
        "Llama-2-7B MaxText",
        "llama2-7b",
        TransformerConfig(32000, 4096, 32, 32, 11008, 2048, swiglu=True),
    ),
}


@cache
def _config(model_name: str, seq_len: int, *overrides: str) -> Any:
    """MaxText's config of `model_name` (`overrides`: more of its `key=value` settings)."""
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train_compile

    base = train_compile.__file__.rsplit("/trainers/", 1)[0] + "/configs/base.yml"
    argv = ["maxtext", base, f"model_name={model_name}", f"max_target_length={seq_len}",
            "per_device_batch_size=1", "attention=dot_product", "run_name=xla_strategies",
            "enable_checkpointing=false", "dropout_rate=0.0", *overrides]  # fmt: skip
    return pyconfig.initialize(argv)


def _model(config: Any, mesh: jax.sharding.Mesh) -> Any:
    """MaxText's `Transformer` (as a linen module) on `mesh`."""
    from maxtext.layers import quantizations
    from maxtext.models import models

    quant = quantizations.configure_quantization(config, quant_mode_str="train")
    return models.transformer_as_linen(config, mesh, quant=quant)


def workload(key: str) -> Workload:
    """MaxText's model `key` of `MAXTEXT` as a benchmark workload: the state is its linen
    parameters (MaxText's logically partitioned boxes), the batch token ids."""
    from maxtext.utils import maxtext_utils

    import xla_strategies as xs

    name, model_name, cfg = MAXTEXT[key]
    config = _config(model_name, cfg.seq_len)

    def init() -> Any:
        one_device = maxtext_utils.get_mesh_from_config(config, jax.devices()[:1])
        tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
        variables = _model(config, one_device).init(
            jax.random.key(0), tokens, _positions(tokens), enable_dropout=False
        )
        return variables["params"]

    def logits(params: Any, tokens: jax.Array) -> jax.Array:
        model = _model(config, xs.get_replica_context().mesh)
        return model.apply({"params": params}, tokens, _positions(tokens), enable_dropout=False)

    return lm_workload(name, cfg, init, logits)


def _positions(tokens: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
