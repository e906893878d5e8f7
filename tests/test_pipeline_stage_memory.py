"""What a pipeline's compiled program holds: the microbatches its schedule keeps alive,
each value once, where it waits."""

import re

import jax
import jax.numpy as jnp
import pytest

import xla_strategies as xs


def _compiled(schedule, microbatches, width=64, rows=128, layers=4, **options):
    """The gradient step of a stack of `layers` on 2 stages, compiled for 4 replicas of
    `rows` rows each."""
    strategy = xs.MirroredStrategy(pipeline_stages=2)

    def loss(params, x, y):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["w"])
        return jnp.mean((h @ params["head"] - y) ** 2)

    @strategy.compile(schedule=schedule, microbatches=microbatches, **options)
    def grads(params, x, y):
        return jax.grad(loss)(params, x, y)

    f32 = jnp.float32
    params = {
        "w": jax.ShapeDtypeStruct((layers, width, width), f32),
        "head": jax.ShapeDtypeStruct((width, 1), f32),
    }
    batch = [
        jax.ShapeDtypeStruct((4 * rows, n), f32, sharding=strategy.split_sharding())
        for n in (width, 1)
    ]
    return grads.lower(params, *batch).compile()


def test_stages_pass_activations_and_one_f_one_b_holds_fewer_than_gpipe():
    one_f_one_b, gpipe = _compiled("1f1b", 8), _compiled("gpipe", 8)
    assert "collective-permute" in one_f_one_b.as_text()
    # GPipe keeps all 8 microbatches' stage inputs, 1F1B at most 2 (one per stage)
    stage_input = (128 // 8) * 64 * 4
    saved = gpipe.memory_analysis().temp_size_in_bytes
    assert one_f_one_b.memory_analysis().temp_size_in_bytes + 6 * stage_input <= saved


def test_keeping_only_each_stage_input_holds_a_chunk_depth_less():
    """A chunk of 2 layers: the forward keeps 2 inputs a microbatch, or 1 with
    `stage_keeps="stage-inputs"`; GPipe holds all 8 microbatches' (the backward then runs
    the chunk's forward again, in its own temporaries)."""
    layer_input = (128 // 8) * 64 * 4
    layers = _compiled("gpipe", 8).memory_analysis().temp_size_in_bytes
    stage = _compiled("gpipe", 8, stage_keeps="stage-inputs").memory_analysis()
    assert stage.temp_size_in_bytes + 6 * layer_input <= layers
    with pytest.raises(ValueError, match="stage_keeps must be one of 'layer-inputs', 'stage"):
        xs.MirroredStrategy(pipeline_stages=2).compile(lambda p: p, stage_keeps="chunk")
    with pytest.raises(ValueError, match="stage_keeps= pipeline a step over stages"):
        xs.MirroredStrategy().compile(lambda p: p, stage_keeps="stage-inputs")


def test_each_layer_input_is_written_and_read_in_place_in_its_slot():
    """The forward writes each layer's input into its stash slot and the backward reads it
    from there: no value holds a chunk's layer inputs apart from the stash (stacked, then
    stored, and taken out whole, they were two copies beside it)."""
    hlo = _compiled("1f1b", 4, layers=16, width=256, rows=256).as_text()
    chunk_inputs = re.compile(r"= f32\[8,64,256\]\S* ")  # 8 layers a stage, 256/4 rows
    stash = re.compile(r"= f32\[2,8,64,256\]\S* ")  # 1F1B on 2 stages: 2 slots
    assert stash.search(hlo)
    assert not chunk_inputs.search(hlo), chunk_inputs.findall(hlo)[:3]
