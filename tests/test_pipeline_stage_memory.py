"""What a pipeline's compiled program holds: the microbatches its schedule keeps alive,
each value once, where it waits."""

import re

import jax
import jax.numpy as jnp
import pytest
from test_pipeline_stages import tick_loops

import xla_strategies as xs
from xla_strategies.hardware.hlo import computations


def _compiled(schedule, microbatches, width=64, rows=128, layers=4, outputs=1, **options):
    """The gradient step of a stack of `layers` and an output layer of `outputs` on 2
    stages, compiled for 4 replicas of `rows` rows each."""
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
        "head": jax.ShapeDtypeStruct((width, outputs), f32),
    }
    batch = [
        jax.ShapeDtypeStruct((4 * rows, n), f32, sharding=strategy.split_sharding())
        for n in (width, outputs)
    ]
    return grads.lower(params, *batch).compile()


def test_stages_pass_activations_and_one_f_one_b_holds_fewer_than_gpipe():
    """GPipe keeps all 8 microbatches' layer inputs (2 layers a stage), 1F1B at most 2
    microbatches' (one per stage), paired 1F1B 3: the stash each loop of ticks carries. (XLA's total of
    temporaries also holds each microbatch's output for the head's gradients, which
    JAX 0.10.2's heap lays beside the stash: there 1F1B's total exceeds GPipe's.)"""
    one_f_one_b, gpipe = _compiled("1f1b", 8), _compiled("gpipe", 8)
    assert "collective-permute" in one_f_one_b.as_text()
    stash = lambda slots: f"f32[{slots},2,16,64]"  # noqa: E731  slots, layers, rows, width
    assert all(stash(2) in t for t in _tick_loops(one_f_one_b.as_text()))
    assert all(stash(8) in t for t in _tick_loops(gpipe.as_text()))
    # paired 1F1B: 2S-1, its first stage's forwards ahead of the gradient coming back
    paired = _tick_loops(_compiled("1f1b-paired", 8).as_text())
    assert paired and all(stash(3) in t for t in paired)


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


@pytest.mark.parametrize("schedule, head_weights", [("1f1b", [1, 1]), ("gpipe", [0, 0])])
def test_the_output_layers_gradient_is_no_value_of_the_loop_of_ticks(schedule, head_weights):
    """The head's weight gradients are taken after the ticks, from the head inputs the last
    stage kept: summed inside, they were a value each loop of ticks (and each tick's
    conditional) held a copy of, an output layer's f32 gradient each (Llama-3.1-405B on
    4xv5p-512: 5 of 8 GiB a chip). Where every forward runs before any backward (GPipe),
    the head runs once between them, so its weight is no value of the ticks either: in
    the forwards' ticks it made every stage wait for the last one's head, each tick."""
    tick_loops = _tick_loops(_compiled(schedule, 4, outputs=37).as_text())
    assert len(tick_loops) == 2  # the warm-up's forwards, and the rest
    # 1F1B's ticks read the head's weight; its gradient was a second value of its shape
    assert [types.count("f32[64,37]") for types in tick_loops] == head_weights, tick_loops


def _tick_loops(hlo):
    """The result types of the loops whose bodies pass activations between stages."""
    return [types for types, _ in tick_loops(computations(hlo)[0])]
