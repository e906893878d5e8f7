"""Weight-update sharding end to end: the same numbers as the replicated update, the
optimizer state held split across the devices in its logical shape, and checkpoints that
move between replica counts and between the sharded and replicated update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from tests.helpers import assert_close_to_scale
from xla_strategies.core.layout import Layout
from xla_strategies.demo import models

STEPS = 3


def _clipped_adamw() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def _train(strategy, step_fn, params, tx, batches, **options):
    """(params, opt_state) after training, the last step's compiled step, and its state."""
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    step = strategy.compile(step_fn, donate_argnums=(0, 1), **options)
    for batch in strategy.experimental_distribute_dataset(batches):
        *state, _ = step(*state, batch)
    return tuple(state), step


def _both_ways(strategy, step_fn, params, tx, batches):
    """Train with the update sharded and replicated; both states agree to 1e-12. Returns
    (sharded state, replicated state, the sharded step)."""
    sharded, step = _train(strategy, step_fn, params, tx, batches, shard_weight_updates=True)
    replicated, _ = _train(strategy, step_fn, params, tx, batches, shard_weight_updates=False)
    assert_close_to_scale(sharded, replicated, 1e-12)
    return sharded, replicated, step


def _opt_state_sharded(opt_state, strategy) -> list[bool]:
    return [strategy.is_held_sharded(x) for x in jax.tree.leaves(opt_state) if x.ndim]


def _transformer():
    graphdef, params, cfg = helpers.transformer(np.float64, layers=2)
    return graphdef, params, models.lm_train_step, helpers.lm_batches(STEPS, cfg)


def _mlp():
    graphdef, params = helpers.mlp(np.float64)
    return graphdef, params, models.mlp_train_step, helpers.mlp_batches(STEPS, dtype=np.float64)


@pytest.mark.parametrize(
    ("make_strategy", "model"),
    [
        (xs.MirroredStrategy, _transformer),
        (lambda: xs.TPUStrategy("v5e-8", emulate=True), _mlp),  # a 2-D mesh
    ],
    ids=["mirrored-transformer", "tpu-v5e-8-mlp"],
)
def test_clipped_adamw_matches_the_replicated_update(make_strategy, model):
    with jax.enable_x64(True):
        strategy = make_strategy()
        graphdef, params, make_step, batches = model()
        step_fn, tx = make_step(graphdef, _clipped_adamw()), _clipped_adamw()
        (_, s_on), (_, s_off), step = _both_ways(strategy, step_fn, params, tx, batches)
        sharded = _opt_state_sharded(s_on, strategy)
        assert sum(sharded) >= 0.8 * len(sharded)  # leaves with no dividing dimension stay
        assert not any(_opt_state_sharded(s_off, strategy))
        assert step.cache_size == 1  # the sharded state is taken as it comes back


@pytest.mark.parametrize(
    "tx",
    [
        optax.sgd(0.1, momentum=0.9),
        optax.lion(1e-3, weight_decay=0.01),
        optax.adafactor(1e-2, min_dim_size_to_factor=16),
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
        ),
    ],
    ids=["sgd-momentum", "lion", "adafactor", "adam-schedule"],
)
def test_optax_optimizers_match_the_replicated_update(tx):
    with jax.enable_x64(True):
        strategy = xs.MirroredStrategy()
        graphdef, params = helpers.mlp(np.float64)
        step_fn = models.mlp_train_step(graphdef, tx)
        batches = helpers.mlp_batches(STEPS, dtype=np.float64)
        (p_on, s_on), _, step = _both_ways(strategy, step_fn, params, tx, batches)
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        assert step.executable(p_on, s_on, batch).graph.count_ops("reduce_scatter") >= 1
        assert step.cache_size == 1


def _adam_mlp_state(strategy, steps: int = 2):
    """(params, opt_state) of the float32 MLP after `steps` sharded Adam steps."""
    graphdef, params = helpers.mlp()
    tx = optax.adam(1e-2)
    step_fn = models.mlp_train_step(graphdef, tx)
    state, _ = _train(
        strategy, step_fn, params, tx, helpers.mlp_batches(steps), shard_weight_updates=True
    )
    return state


def test_sharded_state_is_one_mirrored_value_to_read():
    strategy = xs.MirroredStrategy()
    _, opt_state = _adam_mlp_state(strategy)
    mu = opt_state[0].mu["layers"][1]["kernel"].value  # f32[32,32]
    assert mu.shape == (32, 32) and strategy.is_held_sharded(mu)
    assert {s.data.shape for s in mu.addressable_shards} == {(4, 32)}
    whole = np.asarray(mu)
    assert strategy.layout(mu) is Layout.MIRRORED
    np.testing.assert_array_equal(np.asarray(strategy.reduce("mean", mu)), whole)
    np.testing.assert_array_equal(np.asarray(strategy.reduce("sum", mu)), 8 * whole)
    parts = strategy.experimental_local_results(mu)
    assert len(parts) == 8 and all(p.shape == (32, 32) for p in parts)
    assert all(np.array_equal(np.asarray(p), whole) for p in parts)
    assert [next(iter(p.devices())) for p in parts] == list(strategy.devices)
    assert str(mu) == str(whole)  # printing reads the whole value


def test_optimizer_state_bytes_per_device_fall_to_one_over_n():
    strategy = xs.MirroredStrategy()
    _, s_on = _adam_mlp_state(strategy, steps=1)
    held, replicated = helpers.bytes_on(s_on, strategy.devices[3])
    assert held <= (1 / 8 + 0.05) * replicated, (held, replicated)


def test_checkpoints_move_between_replica_counts_and_the_replicated_update(tmp_path):
    with jax.enable_x64(True):
        graphdef, params = helpers.mlp(np.float64)
        tx = _clipped_adamw()
        step_fn = models.mlp_train_step(graphdef, tx)
        batches = helpers.mlp_batches(4, dtype=np.float64)
        eight = xs.MirroredStrategy()
        state, _ = _train(eight, step_fn, params, tx, batches[:2], shard_weight_updates=True)
        with xs.CheckpointManager(tmp_path, eight) as manager:
            manager.save(2, state, force=True)
            manager.wait_until_finished()
        expected, _ = _train(eight, step_fn, params, tx, batches, shard_weight_updates=False)
        for devices, shard in ((jax.devices()[:4], True), (jax.devices()[:4], False)):
            four = xs.MirroredStrategy(devices)
            target = four.replicate(params), four.replicate(tx.init(params))
            with xs.CheckpointManager(tmp_path, four) as manager:
                restored = manager.restore(target=target)
            assert_close_to_scale(restored, state, 0)  # the logical arrays, exactly
            step = four.compile(step_fn, donate_argnums=(0, 1), shard_weight_updates=shard)
            for batch in four.experimental_distribute_dataset(batches[2:]):
                *restored, _ = step(*restored, batch)
            assert_close_to_scale(tuple(restored), expected, 1e-12)
            assert any(_opt_state_sharded(restored[1], four)) == shard


def test_a_sharded_target_restores_into_its_blocks(tmp_path):
    strategy = xs.MirroredStrategy()
    state = _adam_mlp_state(strategy, steps=1)
    with xs.CheckpointManager(tmp_path, strategy) as manager:
        manager.save(1, state, force=True)
        manager.wait_until_finished()
        restored = manager.restore(target=state)
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert after.sharding == before.sharding
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_the_pass_works_from_a_pipeline_spec_and_its_options_are_checked():
    strategy = xs.MirroredStrategy()
    spec = "insert-reductions,shard-weight-updates,combine-all-reduces"
    graphdef, params = helpers.mlp()
    tx = optax.sgd(0.1, momentum=0.9)
    step_fn = models.mlp_train_step(graphdef, tx)
    batches = helpers.mlp_batches(2)
    (p_spec, s_spec), step = _train(strategy, step_fn, params, tx, batches, pipeline=spec)
    (p_ref, _), _ = _train(xs.OneDeviceStrategy(), step_fn, params, tx, batches)
    assert_close_to_scale(p_spec, p_ref, 1e-5)
    batch = next(iter(strategy.experimental_distribute_dataset(batches)))
    assert step.executable(p_spec, s_spec, batch).graph.count_ops("reduce_scatter") >= 1
    with pytest.raises(TypeError, match="shard_weight_updates must be True, False or None"):
        strategy.compile(step_fn, shard_weight_updates="yes")
    with pytest.raises(ValueError, match="CentralStorageStrategy keeps the variables on one"):
        xs.CentralStorageStrategy().compile(step_fn, shard_weight_updates=True)


def test_the_default_pipeline_says_what_the_cost_model_decided(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_STRATEGIES_DUMP_TO", str(tmp_path))
    graphdef, params = helpers.mlp()
    tx = optax.adam(1e-2)
    step_fn = models.mlp_train_step(graphdef, tx)
    decisions = []
    for strategy in (xs.MirroredStrategy(), xs.TPUStrategy("v5e-8", emulate=True)):
        state = strategy.replicate(params), strategy.replicate(tx.init(params))
        batch = next(iter(strategy.experimental_distribute_dataset(helpers.mlp_batches(1))))
        step = strategy.compile(step_fn, donate_argnums=(0, 1))
        decisions.append(step.executable(*state, batch).pass_stats["shard-weight-updates"])
    assert decisions[0]["decision"] == {"on": False, "reason": "synchronous collectives"}
    decision = decisions[1]["decision"]
    assert decision["reason"] == "cost model"
    assert decision["on"] == (decision["sharded_s"] < decision["replicated_s"])
    remarks = "\n".join(p.read_text() for p in tmp_path.rglob("*.txt"))
    assert "shard-weight-updates{mode=auto}: off: emulated devices" in remarks  # and dumped
    said = "on" if decision["on"] else "off"
    assert f"shard-weight-updates{{mode=auto}}: {said}: {decision['gradient_bytes']}" in remarks


def test_global_norm_clipping_sees_the_whole_gradient():
    """A clip that fires changes every leaf by the global factor, sharded or not."""
    strategy = xs.MirroredStrategy()
    w = {"a": jnp.arange(64.0).reshape(16, 4), "b": jnp.ones((8,))}
    tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))

    def step(w, opt_state, x):
        grads = jax.grad(lambda w: sum(jnp.sum(v * x.mean()) for v in jax.tree.leaves(w)))(w)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, grads

    x = strategy.experimental_distribute_dataset([np.arange(16.0)]).__iter__().__next__()
    sharded = strategy.compile(step, shard_weight_updates=True)(w, tx.init(w), x)
    replicated = strategy.compile(step, shard_weight_updates=False)(w, tx.init(w), x)
    assert_close_to_scale(sharded, replicated, 1e-6)


def test_optax_multisteps_holds_its_accumulators_split_and_matches_one_device():
    """MultiSteps picks accumulate-or-apply with a `cond` over the whole optimizer state:
    its branches run on the blocks, so nothing is gathered for it."""
    jax.config.update("jax_enable_x64", True)
    try:
        rng = np.random.default_rng(0)
        params = {"w": rng.normal(size=(16, 8)), "b": np.zeros(8)}
        tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
        batches = [rng.normal(size=(16, 16)) for _ in range(4)]

        def step(params, opt_state, x):
            grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def train(strategy, **options):
            state = strategy.replicate(params), strategy.replicate(tx.init(params))
            compiled = strategy.compile(step, donate_argnums=(0, 1), **options)
            for x in strategy.experimental_distribute_dataset(batches):
                state = compiled(*state, x)
            return state, compiled.executable(*state, x)

        mirrored = xs.MirroredStrategy()
        sharded, executable = train(mirrored, shard_weight_updates=True)
        one, _ = train(xs.OneDeviceStrategy())
        assert_close_to_scale(sharded, one, 1e-12)
        report = executable.pass_stats["shard-weight-updates"]
        assert report["gathered"] == []  # nothing read whole for the cond
        assert report["sharded_state"] == 6  # the accumulators and Adam's two moments
        assert mirrored.is_held_sharded(sharded[1].acc_grads["w"])
        assert mirrored.is_held_sharded(sharded[1].inner_opt_state[0].mu["w"])
    finally:
        jax.config.update("jax_enable_x64", False)


def test_a_cond_on_a_per_replica_predicate_is_read_whole():
    """Replicas that take different branches would not meet in a branch's collectives,
    so a cond on this replica's data keeps its operands whole."""

    def step(params, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p) ** 2))(params)
        new = params - 0.1 * grads
        return jax.lax.cond(x.sum() > 0, lambda p: p * 2.0, lambda p: p * 0.5, new)

    rng = np.random.default_rng(1)
    params = rng.normal(size=(8, 8)).astype(np.float32)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    strategy = xs.MirroredStrategy()
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    step_fn = strategy.compile(step, shard_weight_updates=True)
    got = step_fn(strategy.replicate(params), batch)
    gathered = step_fn.executable(strategy.replicate(params), batch).pass_stats
    assert gathered["shard-weight-updates"]["gathered"][0]["op"] == "jax.cond"
    want = strategy.compile(step, shard_weight_updates=False)(strategy.replicate(params), batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
