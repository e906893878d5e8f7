"""MaxText's own decoder pipelined unchanged: the `maxtext` package's Llama-2 model code,
shrunk by its own config (4 scanned layers of width 64, float32), trained 3 adam steps
with `MirroredStrategy(pipeline_stages=2)` (4 replicas of 2 stages on 8 CPU devices) by
each schedule, against `OneDeviceStrategy`. MaxText pipelines its decoder with GPipe and
a circular schedule only; here the step is the benchmarks' language-model step, as
written, and the stages split MaxText's `nn.scan` of its layers.

Needs MaxText's environment (`tools/make-maxtext-venv`):

    JAX_PLATFORMS=cpu .venv-maxtext/bin/python -m benchmarks.maxtext_stages
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import maxtext_models

#: settings of MaxText's own config that shrink its Llama-2-7B to a CPU check
SMALL = ("override_model_config=true", "base_num_decoder_layers=4", "base_emb_dim=64",
         "base_mlp_dim=128", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=16",
         "vocab_size=256", "dtype=float32", "weight_dtype=float32", "scan_layers=true")  # fmt: skip
SEQ, ROWS, STEPS = 16, 16, 3
SCHEDULES = {
    "1f1b": {},
    "1f1b-paired": {"schedule": "1f1b-paired"},
    "gpipe, shard_parameters": {"schedule": "gpipe", "shard_parameters": True},
    "interleaved-1f1b V=2, shard_parameters": {
        "schedule": "interleaved-1f1b", "virtual_stages": 2, "shard_parameters": True},
    "zero-bubble-h1": {"schedule": "zero-bubble-h1"},
}  # fmt: skip
RESULTS = pathlib.Path(__file__).parent / "results" / "maxtext_stages.json"


def main() -> None:
    jax.config.update("jax_num_cpu_devices", 8)  # before anything starts JAX's backends
    from maxtext.utils import maxtext_utils

    import xla_strategies as xs

    config = maxtext_models._config("llama2-7b", SEQ, *SMALL)
    tokens = jnp.zeros((1, SEQ), jnp.int32)
    one_device = maxtext_utils.get_mesh_from_config(config, jax.devices()[:1])
    params = maxtext_models._model(config, one_device).init(
        jax.random.key(0), tokens, maxtext_models._positions(tokens), enable_dropout=False
    )["params"]
    tx = optax.adam(1e-3)

    def loss_fn(params, tokens):
        model = maxtext_models._model(config, xs.get_replica_context().mesh)
        x = tokens[:, :-1]
        logits = model.apply(
            {"params": params}, x, maxtext_models._positions(x), enable_dropout=False
        )
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]
        ).mean()

    def train(strategy, **options):
        @strategy.compile(**options)
        def step(params, opt_state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        with strategy.scope():
            state = strategy.replicate(params), strategy.replicate(tx.init(params))
        rng = np.random.default_rng(0)
        batches = [rng.integers(0, 256, size=(ROWS, SEQ + 1), dtype=np.int32) for _ in range(STEPS)]
        for batch in strategy.experimental_distribute_dataset(batches):
            *state, _ = step(*state, batch)
        return state[0]

    want = train(xs.OneDeviceStrategy())
    # the scale: how far one device's training moved the parameters
    moved = max(
        float(np.max(np.abs(np.asarray(w) - np.asarray(p))))
        for w, p in zip(jax.tree.leaves(want), jax.tree.leaves(params), strict=True)
    )
    print(f"max |parameter change| on one device after {STEPS} steps: {moved:.2e}")
    rows = []
    for name, options in SCHEDULES.items():
        got = train(xs.MirroredStrategy(pipeline_stages=2), microbatches=4, **options)
        worst = max(
            float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        )
        rows.append({"schedule": name, "max_abs_parameter_difference": worst})
        print(f"{name:40s} max |parameter - one device's| after {STEPS} steps: {worst:.2e}")
    summary = {"model": "MaxText llama2-7b, shrunk", "one_device_max_change": moved}
    RESULTS.write_text(json.dumps({**summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
