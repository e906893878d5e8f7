"""Parameter sharding, what users read back: the split state's bytes per device, the
arrays read whole, checkpoints across replica counts, the option and its auto mode, the
pass in a spec, and XLA's TPU compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from tests.helpers import assert_close_to_scale, clipped_adamw, held_split, scanned_lm, train_on
from xla_strategies.demo import models


def test_parameter_and_optimizer_bytes_per_device_fall_to_one_over_n():
    strategy = xs.MirroredStrategy()
    params, make_step, batches = scanned_lm(vocab=64, width=64, layers=4)
    tx = optax.adam(1e-3)
    state, _ = train_on(strategy, make_step(tx), params, tx, batches[:1], shard_parameters=True)
    held, replicated = helpers.bytes_on(state, strategy.devices[5])
    assert held <= (1 / 8 + 0.05) * replicated, (held, replicated)


def test_split_parameters_read_whole():
    strategy = xs.MirroredStrategy()
    params, make_step, batches = scanned_lm()
    tx = optax.sgd(0.1)
    (p_on, _), _ = train_on(strategy, make_step(tx), params, tx, batches[:1], shard_parameters=True)
    kernel = p_on["ScanCheckpointBlock_0"]["Dense_1"]["kernel"]  # f32[3,32,16]
    assert kernel.shape == (3, 32, 16) and strategy.is_held_sharded(kernel)
    whole = np.asarray(kernel)
    np.testing.assert_array_equal(np.asarray(strategy.reduce("mean", kernel)), whole)
    parts = strategy.experimental_local_results(kernel)
    assert len(parts) == 8 and all(np.array_equal(np.asarray(p), whole) for p in parts)
    assert str(kernel) == str(whole)


def test_checkpoints_move_between_replica_counts_and_the_replicated_update(tmp_path):
    with jax.enable_x64(True):
        params, make_step, batches = scanned_lm(np.float64)
        batches = batches + batches[:1]
        tx = clipped_adamw()
        eight = xs.MirroredStrategy()
        state, _ = train_on(eight, make_step(tx), params, tx, batches[:2], shard_parameters=True)
        assert all(held_split(state[0], eight))
        with xs.CheckpointManager(tmp_path, eight) as manager:
            manager.save(2, state, force=True)
            manager.wait_until_finished()
        expected, _ = train_on(xs.OneDeviceStrategy(), make_step(tx), params, tx, batches)
        for shard in (True, False):
            four = xs.MirroredStrategy(jax.devices()[:4])
            target = four.replicate(params), four.replicate(tx.init(params))
            with xs.CheckpointManager(tmp_path, four) as manager:
                restored = manager.restore(target=target)
            assert_close_to_scale(restored, state, 0)  # the logical arrays, exactly
            step = four.compile(make_step(tx), donate_argnums=(0, 1), shard_parameters=shard)
            for batch in four.experimental_distribute_dataset(batches[2:]):
                *restored, _ = step(*restored, batch)
            assert_close_to_scale(tuple(restored), expected, 1e-12)
            assert all(held_split(restored[0], four)) == shard


def test_the_option_is_checked():
    strategy = xs.MirroredStrategy()
    with pytest.raises(TypeError, match="shard_parameters must be True, False or None"):
        strategy.compile(lambda p: p, shard_parameters="yes")
    with pytest.raises(ValueError, match="shard_parameters=True needs weight-update sharding"):
        strategy.compile(lambda p: p, shard_parameters=True, shard_weight_updates=False)
    with pytest.raises(ValueError, match="shard_parameters=True: CentralStorageStrategy"):
        xs.CentralStorageStrategy().compile(lambda p: p, shard_parameters=True)


def _decision(topology, layers):
    """shard-parameters' auto decision for a compile-only Adam step over a stack of
    `layers` f32[4096,4096] weights (64 MiB each)."""
    strategy = xs.TPUStrategy(topology, compile_only=True)
    tx = optax.adam(1e-3)
    stack = jax.ShapeDtypeStruct((layers, 4096, 4096), jnp.float32)
    x = jax.ShapeDtypeStruct(
        (8 * strategy.num_replicas_in_sync, 4096), jnp.float32, sharding=strategy.split_sharding()
    )

    state = strategy.replicate(stack), strategy.replicate(jax.eval_shape(tx.init, stack))
    # the default pipeline's own decision, never swapped for another (select_by_compiling)
    compiled = strategy.compile(
        helpers.scanned_tanh_step(tx), donate_argnums=(0, 1), select_by_compiling=False
    )
    executable = compiled.executable(*state, x)
    return executable.graph, executable.pass_stats["shard-parameters"]["decision"]


def test_auto_mode_holds_the_state_split_where_it_does_not_fit_the_chip():
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    graph, decision = _decision("v5e-4", layers=4)  # 1 GiB of weights, 4 GiB with Adam
    assert decision["on"] is False and decision["reason"] == "memory"
    assert not any(a.sharded for a in graph.io.inputs)
    graph, decision = _decision("v5e-4", layers=32)  # 8 GiB of weights: 32 GiB with Adam
    assert decision["on"] is True and decision["state_bytes"] >= 3 * 32 * 4096 * 4096 * 4
    assert sum(bool(a.sharded) for a in graph.io.inputs) == 3  # the stack and both moments


def test_the_tpu_compiler_gathers_one_layer_at_a_time_inside_the_loop():
    """XLA's TPU compiler (v5e 2x2) keeps the pass's per-layer all-gathers in the loops:
    each runs once per layer, and none gathers the whole stack."""
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    from xla_strategies.hardware.compiled_report import compiled_report

    strategy = xs.TPUStrategy("v5e-4", compile_only=True)
    layers = 3
    params, make_step, _ = scanned_lm(vocab=128, width=128, layers=layers)
    tx = optax.adamw(1e-3)
    tokens = jax.ShapeDtypeStruct((16, 33), jnp.int32, sharding=strategy.split_sharding())
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    step = strategy.compile(make_step(tx), donate_argnums=(0, 1), shard_parameters=True)
    report = compiled_report(step.lower(*state, tokens).compile(), strategy)
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    in_loop = [c for c in gathers if c.times == layers]
    assert len(in_loop) >= 2  # the forward and the backward (rematerialised) layer
    stack_bytes = sum(x.nbytes for x in jax.tree.leaves(params["ScanCheckpointBlock_0"]))
    assert all(c.nbytes * 2 < stack_bytes for c in gathers)  # never a whole stack
    scatters = [c for c in report.collectives if c.kind == "reduce-scatter"]
    assert any(c.times == layers for c in scatters)  # each layer's gradient, in the loop


def test_the_pass_works_from_a_pipeline_spec():
    """`shard-parameters` written in a spec (with weight-update sharding after it, which
    updates its blocks): the parameters come back split, with one device's numbers."""
    strategy = xs.MirroredStrategy()
    graphdef, params = helpers.mlp()
    tx = optax.sgd(0.1, momentum=0.9)
    step_fn = models.mlp_train_step(graphdef, tx)
    batches = helpers.mlp_batches(2)
    spec = "insert-reductions,shard-parameters,shard-weight-updates,combine-all-reduces"
    (p_spec, s_spec), _ = train_on(strategy, step_fn, params, tx, batches, pipeline=spec)
    (p_ref, s_ref), _ = train_on(xs.OneDeviceStrategy(), step_fn, params, tx, batches)
    assert_close_to_scale((p_spec, s_spec), (p_ref, s_ref), 1e-5)
    assert sum(held_split(p_spec, strategy)) == len(held_split(p_spec, strategy)) - 1  # not the [5]


WIDTH = 4096  # narrower layers' gathers fit the chip's on-chip memory


def _unscanned_layers_on_v5e(layers: int, width: int = WIDTH):
    """XLA's TPU compile (v5e 2x4) of an adamw step over unscanned bf16 matmul layers,
    with parameter sharding."""
    from xla_strategies.hardware.compiled_report import compiled_report

    def loss(params, x):
        for w in params:
            x = jnp.tanh(x @ w.astype(jnp.bfloat16))
        return jnp.mean(x.astype(jnp.float32) ** 2)

    tx = optax.adamw(1e-3)

    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    strategy = xs.TPUStrategy("v5e-8", compile_only=True)
    params = [jax.ShapeDtypeStruct((width, width), jnp.float32)] * layers
    state = strategy.replicate(params), strategy.replicate(jax.eval_shape(tx.init, params))
    x = jax.ShapeDtypeStruct((8 * 32, width), jnp.bfloat16, sharding=strategy.split_sharding())
    compiled = strategy.compile(step, donate_argnums=(0, 1), shard_parameters=True)
    return compiled_report(compiled.lower(*state, x).compile(), strategy)


@pytest.mark.slow  # two compiles of a 400 MiB model
def test_the_tpu_compiler_gathers_unscanned_layers_one_at_a_time_and_again_if_asked(
    monkeypatch,
):
    """Unscanned layers' gathers are left apart on TPU, as a layer loop's are (a bucket of
    them is copied out whole and held until its last member's reads). Where holding the
    forward's gathers for the backward pass would take too much of a chip (forced here),
    the backward pass gathers each layer again: XLA keeps the copies apart from the
    forward's gathers (it neither merges them nor hoists them to the step's start)."""
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    from xla_strategies.passes.transforms import shard_weight_updates

    layers = 6
    held = _unscanned_layers_on_v5e(layers)
    assert len([c for c in held.collectives if c.kind == "all-gather"]) == layers
    monkeypatch.setattr(shard_weight_updates, "REGATHER_SHARE_OF_HBM", 0.0)
    again = _unscanned_layers_on_v5e(layers)
    # every layer but the last (its backward comes first) and the first (no input gradient)
    assert len([c for c in again.collectives if c.kind == "all-gather"]) == 2 * layers - 2
