"""Parameter sharding end to end (ZeRO-3 / FSDP, `compile(shard_parameters=True)`): the
replicated update's numbers, parameters and optimizer state held split in their logical
shapes, each scanned layer gathered inside the loop, and checkpoints that move between
replica counts and the replicated update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from tests.helpers import assert_close_to_scale
from xla_strategies.demo import models

STEPS = 3


def _clipped_adamw() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def _lm(dtype=np.float32, vocab=11, width=16, layers=3, remat=True):
    """A flax linen LM with its layers under nn.scan(nn.remat(...)) and a tied embedding
    (vocab 11 divides by no replica count: the embedding splits on its width), the step
    flax's docs write for it, and its token batches."""
    model = helpers.ScannedLM(vocab=vocab, width=width, layers=layers, remat=remat)
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, vocab, size=(16, 7)).astype(np.int32) for _ in range(STEPS)]
    params = model.init(jax.random.key(0), batches[0][:, :-1])["params"]
    params = jax.tree.map(lambda x: x.astype(dtype), params)

    def make_step(tx):
        def step(params, opt_state, tokens):
            def loss_fn(p):
                logits = model.apply({"params": p}, tokens[:, :-1])
                labels = tokens[:, 1:]
                return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    return params, make_step, batches


def _train(strategy, step_fn, params, tx, batches, **options):
    """(params, opt_state) after training on `strategy`, and the compiled step."""
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    step = strategy.compile(step_fn, donate_argnums=(0, 1), **options)
    for batch in strategy.experimental_distribute_dataset(batches):
        *state, _ = step(*state, batch)
    return tuple(state), step


def _held(tree, strategy) -> list[bool]:
    return [strategy.is_held_sharded(x) for x in jax.tree.leaves(tree) if x.ndim]


@pytest.mark.parametrize(
    ("make_strategy", "blocks"),
    [
        (xs.MirroredStrategy, 8),  # one replica axis
        (lambda: xs.TPUStrategy("v5e-8", emulate=True), 8),  # two: the slice's torus
        # two slices of 2x2: split over each slice's 4 chips, replicated across DCN
        (lambda: xs.TPUStrategy("2xv5e-4", emulate=True), 4),
    ],
    ids=["mirrored", "tpu-v5e-8", "tpu-2xv5e-4"],
)
def test_scanned_lm_with_clipped_adamw_matches_one_device(make_strategy, blocks):
    with jax.enable_x64(True):
        strategy = make_strategy()
        params, make_step, batches = _lm(np.float64)
        tx = _clipped_adamw()
        (p_on, s_on), step = _train(
            strategy, make_step(tx), params, tx, batches, shard_parameters=True
        )
        (p_ref, s_ref), _ = _train(xs.OneDeviceStrategy(), make_step(tx), params, tx, batches)
        assert_close_to_scale((p_on, s_on), (p_ref, s_ref), 1e-12)
        assert all(_held(p_on, strategy))  # every parameter has a dimension that divides
        assert sum(_held(s_on, strategy)) >= len(_held(s_on, strategy)) - 1  # but the count
        assert step.cache_size == 1  # the split state is taken back as it comes
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        graph = step.executable(p_on, s_on, batch).graph
        loops = [n for n in graph.nodes if n.op == "jax.scan"]
        assert [r.count_ops("all_gather") >= 1 for n in loops for r in n.regions] == [True] * 2
        assert sum(r.count_ops("reduce_scatter") for n in loops for r in n.regions) >= 1
        stack = p_on["ScanCheckpointBlock_0"]["Dense_0"]["kernel"]
        assert {s.data.shape for s in stack.addressable_shards} == {(3, 16 // blocks, 32)}


def test_without_remat_the_backward_loop_gathers_again_instead_of_stacking_weights():
    """Without nn.remat, autodiff stacks each layer's gathered weights as forward residuals
    (the whole model on every replica until the backward pass); the backward loop gathers
    them again from the blocks instead, and the numbers stay one device's."""
    with jax.enable_x64(True):
        strategy = xs.MirroredStrategy()
        params, make_step, batches = _lm(np.float64, remat=False)
        tx = _clipped_adamw()
        (p_on, s_on), step = _train(
            strategy, make_step(tx), params, tx, batches, shard_parameters=True
        )
        reference, _ = _train(xs.OneDeviceStrategy(), make_step(tx), params, tx, batches)
        assert_close_to_scale((p_on, s_on), reference, 1e-12)
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        executable = step.executable(p_on, s_on, batch)
        assert executable.pass_stats["shard-parameters"]["regathered_residuals"] >= 2
        forward, backward = [n for n in executable.graph.nodes if n.op == "jax.scan"]
        # no stacked output of the forward loop has a whole layer's kernel in it
        kernels = {(3, 16, 32), (3, 32, 16)}
        assert not kernels & {tuple(v.shape) for v in forward.outputs}
        assert backward.regions[0].count_ops("all_gather") >= 1  # both kernels, one bucket


def test_prefetching_the_next_layer_keeps_the_numbers():
    """prefetch-all-gathers (on by itself only with a topology) forced on emulated devices:
    each loop gathers layer i+1 into a carry while layer i computes; same numbers."""
    with jax.enable_x64(True):
        strategy = xs.MirroredStrategy()
        params, make_step, batches = _lm(np.float64)
        tx = _clipped_adamw()
        spec = xs.passes.DEFAULT_PIPELINE.replace(
            "prefetch-all-gathers{mode=auto}", "prefetch-all-gathers{mode=on}"
        )
        (p_on, s_on), step = _train(
            strategy, make_step(tx), params, tx, batches, shard_parameters=True, pipeline=spec
        )
        reference, _ = _train(xs.OneDeviceStrategy(), make_step(tx), params, tx, batches)
        assert_close_to_scale((p_on, s_on), reference, 1e-12)
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        executable = step.executable(p_on, s_on, batch)
        assert executable.pass_stats["prefetch-all-gathers"]["loops"] == 2  # forward, backward
        loops = [n for n in executable.graph.nodes if n.op == "jax.scan"]
        # each loop carries the gathered layer: more carries than the scan had
        assert all(n.attrs["num_carry"] > 1 for n in loops)


def test_nnx_mlp_with_a_shape_that_does_not_divide_matches_the_replicated_update():
    """A [5] bias divides by no replica count: it stays replicated (a remark says so),
    and the rest is held split; the numbers are the replicated update's."""
    with jax.enable_x64(True):
        strategy = xs.MirroredStrategy()
        graphdef, params = helpers.mlp(np.float64)
        tx = _clipped_adamw()
        step_fn = models.mlp_train_step(graphdef, tx)
        batches = helpers.mlp_batches(STEPS, dtype=np.float64)
        (p_on, s_on), step = _train(strategy, step_fn, params, tx, batches, shard_parameters=True)
        off, _ = _train(strategy, step_fn, params, tx, batches, shard_parameters=False)
        assert_close_to_scale((p_on, s_on), off, 1e-12)
        held = {
            jax.tree_util.keystr(k): strategy.is_held_sharded(v)
            for k, v in jax.tree_util.tree_flatten_with_path(p_on)[0]
        }
        assert [k for k, h in held.items() if not h] == ["['layers'][2]['bias'].value"]
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        executable = step.executable(p_on, s_on, batch)
        assert executable.pass_stats["shard-parameters"]["replicated_state"] >= 1
        assert any("f64[5]" in r and "divides by 8" in r for r in executable.remarks)


def test_parameter_and_optimizer_bytes_per_device_fall_to_one_over_n():
    strategy = xs.MirroredStrategy()
    params, make_step, batches = _lm(vocab=64, width=64, layers=4)
    tx = optax.adam(1e-3)
    state, _ = _train(strategy, make_step(tx), params, tx, batches[:1], shard_parameters=True)
    held, replicated = helpers.bytes_on(state, strategy.devices[5])
    assert held <= (1 / 8 + 0.05) * replicated, (held, replicated)


def test_split_parameters_read_whole():
    strategy = xs.MirroredStrategy()
    params, make_step, batches = _lm()
    tx = optax.sgd(0.1)
    (p_on, _), _ = _train(strategy, make_step(tx), params, tx, batches[:1], shard_parameters=True)
    kernel = p_on["ScanCheckpointBlock_0"]["Dense_1"]["kernel"]  # f32[3,32,16]
    assert kernel.shape == (3, 32, 16) and strategy.is_held_sharded(kernel)
    whole = np.asarray(kernel)
    np.testing.assert_array_equal(np.asarray(strategy.reduce("mean", kernel)), whole)
    parts = strategy.experimental_local_results(kernel)
    assert len(parts) == 8 and all(np.array_equal(np.asarray(p), whole) for p in parts)
    assert str(kernel) == str(whole)


def test_checkpoints_move_between_replica_counts_and_the_replicated_update(tmp_path):
    with jax.enable_x64(True):
        params, make_step, batches = _lm(np.float64)
        batches = batches + batches[:1]
        tx = _clipped_adamw()
        eight = xs.MirroredStrategy()
        state, _ = _train(eight, make_step(tx), params, tx, batches[:2], shard_parameters=True)
        assert all(_held(state[0], eight))
        with xs.CheckpointManager(tmp_path, eight) as manager:
            manager.save(2, state, force=True)
            manager.wait_until_finished()
        expected, _ = _train(xs.OneDeviceStrategy(), make_step(tx), params, tx, batches)
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
            assert all(_held(restored[0], four)) == shard


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

    def step(stack, opt_state, x):
        def loss(stack):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, stack)
            return jnp.mean(h**2)

        updates, opt_state = tx.update(jax.grad(loss)(stack), opt_state, stack)
        return optax.apply_updates(stack, updates), opt_state

    state = strategy.replicate(stack), strategy.replicate(jax.eval_shape(tx.init, stack))
    executable = strategy.compile(step, donate_argnums=(0, 1)).executable(*state, x)
    return executable.graph, executable.pass_stats["shard-parameters"]["decision"]


def test_auto_mode_holds_the_state_split_where_it_does_not_fit_the_chip():
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    graph, decision = _decision("v5e-4", layers=4)  # 1 GiB of weights, 4 GiB with Adam
    assert decision["on"] is False and decision["reason"] == "memory"
    assert not graph.sharded_inputs
    graph, decision = _decision("v5e-4", layers=32)  # 8 GiB of weights: 32 GiB with Adam
    assert decision["on"] is True and decision["state_bytes"] >= 3 * 32 * 4096 * 4096 * 4
    assert len(graph.sharded_inputs) == 3  # the stack and both moments


def test_the_tpu_compiler_gathers_one_layer_at_a_time_inside_the_loop():
    """XLA's TPU compiler (v5e 2x2) keeps the pass's per-layer all-gathers in the loops:
    each runs once per layer, and none gathers the whole stack."""
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    from xla_strategies.compiled_report import compiled_report

    strategy = xs.TPUStrategy("v5e-4", compile_only=True)
    layers = 3
    params, make_step, _ = _lm(vocab=128, width=128, layers=layers)
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
    (p_spec, s_spec), _ = _train(strategy, step_fn, params, tx, batches, pipeline=spec)
    (p_ref, s_ref), _ = _train(xs.OneDeviceStrategy(), step_fn, params, tx, batches)
    assert_close_to_scale((p_spec, s_spec), (p_ref, s_ref), 1e-5)
    assert sum(_held(p_spec, strategy)) == len(_held(p_spec, strategy)) - 1  # not the [5]
