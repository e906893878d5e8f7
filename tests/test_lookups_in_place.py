"""An embedding table held split on its features is looked up, and its gradient summed,
where it lies (`passes/rewrites/lookup_blocks.py`): token ids gathered, a local
gather and an all-to-all forward; an all-to-all and a local scatter-add backward. The
numbers are one device's."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

import xla_strategies as xs
from tests.helpers import assert_close_to_scale, clipped_adamw, lm_step, train_on


class UntiedLM(nn.Module):
    """A language model with its own output layer, as Llama writes it: the embedding
    table is read only by the lookup."""

    vocab: int = 64
    width: int = 16

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = nn.gelu(nn.Dense(2 * self.width)(x))
        return nn.Dense(self.vocab, use_bias=False)(nn.LayerNorm()(x))


def _train(strategy, vocab: int = 64, sequences: int = 16, **options):
    """(params, opt_state), the compiled step's executable, and one device's
    (params, opt_state) after the same 3 steps of the untied LM, in float64."""
    model = UntiedLM(vocab=vocab)
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, vocab, size=(sequences, 8)).astype(np.int32) for _ in range(3)]
    params = model.init(jax.random.key(0), batches[0][:, :-1])["params"]
    params = jax.tree.map(lambda x: x.astype(np.float64), params)
    tx, step_fn = clipped_adamw(), lm_step(model, clipped_adamw())
    state, step = train_on(strategy, step_fn, params, tx, batches, **options)
    reference, _ = train_on(xs.OneDeviceStrategy(), step_fn, params, tx, batches)
    batch = next(iter(strategy.experimental_distribute_dataset(batches)))
    return state, step.executable(*state, batch), reference


def _exchanges(executable) -> list[tuple[int, int]]:
    """(split, concat) axes of the step's top-level all-to-alls."""
    nodes = executable.graph.nodes
    return sorted(
        (n.attrs["split_axis"], n.attrs["concat_axis"]) for n in nodes if n.op == "all_to_all"
    )


@pytest.mark.parametrize(
    ("make_strategy", "blocks"),
    [
        (xs.MirroredStrategy, 8),
        (lambda: xs.TPUStrategy("v5e-8", emulate=True), 8),  # blocks over the torus's two axes
        # two slices of 2x2: each slice's 4 chips hold the blocks, summed across DCN
        (lambda: xs.TPUStrategy("2xv5e-4", emulate=True), 4),
    ],
    ids=["mirrored", "tpu-v5e-8", "tpu-2xv5e-4"],
)
def test_a_table_split_on_its_features_is_looked_up_where_it_lies(make_strategy, blocks):
    with jax.enable_x64(True):
        state, executable, reference = _train(make_strategy(), shard_parameters=True)
        assert_close_to_scale(state, reference, 1e-12)
        table = state[0]["Embed_0"]["embedding"]
        assert {s.data.shape for s in table.addressable_shards} == {(64, 16 // blocks)}
        assert _exchanges(executable) == [
            (0, 2),  # the lookup: every replica's tokens in, this replica's columns out
            (2, 0),  # its gradient: the transpose
        ]
        gathers = [n for n in executable.graph.nodes if n.op == "all_gather"]
        assert all(n.outputs[0].shape != (64, 16) for n in gathers)  # never gathered whole


def test_the_weight_update_alone_sums_a_lookup_gradient_where_its_block_lies():
    with jax.enable_x64(True):
        state, executable, reference = _train(xs.MirroredStrategy(), shard_weight_updates=True)
        assert_close_to_scale(state, reference, 1e-12)
        assert _exchanges(executable) == [(2, 0)]  # the table is whole for its lookup
        assert executable.pass_stats["shard-weight-updates"]["lookup_gradients"] == 1


def test_a_table_smaller_than_its_lookups_is_gathered_and_reduce_scattered_as_before():
    """8 rows against 8 x 7 tokens a replica: the all-to-alls would move more than the
    table and its gradient, so neither rule is taken."""
    with jax.enable_x64(True):
        strategy = xs.MirroredStrategy()
        state, executable, reference = _train(
            strategy, vocab=8, sequences=64, shard_parameters=True
        )
        assert_close_to_scale(state, reference, 1e-12)
        assert _exchanges(executable) == []
        assert executable.pass_stats["shard-weight-updates"]["lookup_gradients"] == 0
