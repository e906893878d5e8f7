"""Steps that call hand-written kernels: Pallas kernels (JAX's splash attention, as MaxText
runs it) and `jax.custom_vjp` rules. Each once crashed the capture: Pallas refused output
shapes that do not say how they vary across replicas, and JAX refused a backward rule
that gave a mirrored input its replica's share of the gradient. Each is checked against
the same step under plain `jax.jit` on one device, the kernels in Pallas's interpreter
(this machine has no TPU), and splash attention compiled for a TPU topology too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import pallas as pl

import xla_strategies as xs

HEADS, LENGTH, HEAD_DIM, WIDTH = 2, 256, 128, 64


def _splash_kernel(interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel,
        splash_attention_mask,
    )

    causal = splash_attention_mask.CausalMask((LENGTH, LENGTH))
    mask = splash_attention_mask.MultiHeadMask([causal] * HEADS)
    return splash_attention_kernel.make_splash_mha(
        mask, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _attention_loss(kernel):
    def loss(params, x):
        q, k, v = (jnp.einsum("btd,hde->bhte", x, params[n]) for n in "qkv")
        out = jax.vmap(kernel)(q, k, v)  # the kernel takes one sequence's heads
        return jnp.mean(jnp.einsum("bhte,hed->btd", out, params["o"]) ** 2)

    return loss


def _attention_params(rng):
    params = {n: rng.normal(size=(HEADS, WIDTH, HEAD_DIM)) * 0.1 for n in "qkv"}
    params["o"] = rng.normal(size=(HEADS, HEAD_DIM, WIDTH)) * 0.1
    return jax.tree.map(lambda a: a.astype(np.float32), params)


def _pallas_multiply(x, w):
    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] * w_ref[...]

    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=out_shape, interpret=True)(x, w)


def _scale_with(multiply):
    """`x * w` with a hand-written gradient: the weight's is the replica's own share."""

    @jax.custom_vjp
    def scale(x, w):
        return multiply(x, w)

    def forward(x, w):
        return multiply(x, w), (x, w)

    def backward(saved, g):
        x, w = saved
        return multiply(g, w), multiply(g, x)

    scale.defvjp(forward, backward)
    return scale


def _scaled_loss(multiply):
    scale = _scale_with(multiply)

    def loss(params, x):
        h = scale(x, jnp.broadcast_to(params["w"], x.shape))  # the mirrored weight's use
        return jnp.mean(jnp.tanh(h @ params["v"]) ** 2)

    return loss


def _train_step(loss, tx):
    def step(params, opt_state, x):
        grads = jax.grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _against_one_device(step, params, tx, x):
    """New params from MirroredStrategy (8 replicas) and from `jax.jit` on one device."""
    expected, _ = jax.jit(step)(params, tx.init(params), x)
    strategy = xs.MirroredStrategy()
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    got, _ = strategy.compile(step)(*state, batch)
    return jax.tree.map(np.asarray, got), expected


@pytest.mark.parametrize(
    "multiply", [jnp.multiply, _pallas_multiply], ids=["jax-ops", "pallas-kernel"]
)
def test_a_custom_vjp_gives_a_mirrored_weight_its_gradient_summed_over_replicas(multiply):
    rng = np.random.default_rng(0)
    params = {
        "w": rng.normal(size=(16,)).astype(np.float32),
        "v": rng.normal(size=(16, 4)).astype(np.float32),
    }
    x = rng.normal(size=(32, 16)).astype(np.float32)
    tx = optax.sgd(0.5)
    got, expected = _against_one_device(_train_step(_scaled_loss(multiply), tx), params, tx, x)
    for name in params:  # the 8 replicas' shares, summed and averaged: the whole gradient
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)
    assert np.abs(expected["w"] - params["w"]).max() > 1e-3  # the step moved the weight


def test_splash_attention_trains_as_on_one_device():
    rng = np.random.default_rng(1)
    params = _attention_params(rng)
    x = rng.normal(size=(8, LENGTH, WIDTH)).astype(np.float32)
    tx = optax.sgd(0.1)
    step = _train_step(_attention_loss(_splash_kernel(interpret=True)), tx)
    got, expected = _against_one_device(step, params, tx, x)
    for name in params:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-7)
        assert np.abs(expected[name] - params[name]).max() > 1e-6


def test_an_interpreted_kernel_under_a_step_axis_name_is_a_clear_error():
    """Pallas's interpreter runs the kernel's own equations, which keep the mesh the step
    was traced on: under `axis_name=` that mesh is not the strategy's."""
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(size=(16,)).astype(np.float32), "v": np.ones((16, 4), np.float32)}
    tx = optax.sgd(0.5)
    strategy = xs.MirroredStrategy()
    state = strategy.replicate(params), strategy.replicate(tx.init(params))
    batch = next(iter(strategy.experimental_distribute_dataset([np.ones((32, 16), np.float32)])))
    step = strategy.compile(_train_step(_scaled_loss(_pallas_multiply), tx), axis_name="batch")
    with pytest.raises(NotImplementedError, match=r"interpret mode .* axis_name="):
        step(*state, batch)


@pytest.mark.parametrize("axis_name", [None, "batch"])  # "batch": traced on a mesh so named
def test_splash_attention_compiles_for_a_tpu_slice_and_the_report_names_its_kernels(axis_name):
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    from xla_strategies.hardware.compiled_report import compiled_report
    from xla_strategies.hardware.report_text import summary_text

    strategy = xs.TPUStrategy("v5e-4", compile_only=True)
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
        _attention_params(np.random.default_rng(2)),
    )
    tx = optax.adamw(1e-3)
    state = strategy.replicate(params), strategy.replicate(jax.eval_shape(tx.init, params))
    batch = jax.ShapeDtypeStruct(
        (2 * strategy.num_replicas_in_sync, LENGTH, WIDTH),
        jnp.bfloat16,
        sharding=strategy.split_sharding(),
    )
    step = _train_step(_attention_loss(_splash_kernel(interpret=False)), tx)
    compiled = (
        strategy.compile(step, donate_argnums=(0, 1), axis_name=axis_name)
        .lower(*state, batch)
        .compile()
    )
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 3
    report = compiled_report(compiled, strategy)
    # forward, and the two backward kernels (queries; keys and values)
    assert report.opaque_kernels == 3
    assert "3 call(s) per step of compiled kernels (Pallas)" in summary_text(report, "splash")
    # the four projections, their weights' gradients and the output's input gradient (2
    # sequences per chip); the kernels' own flops are not in the text
    projection = 2 * 2 * LENGTH * WIDTH * HEAD_DIM * HEADS
    assert report.flops == 9 * projection
    assert report.fits


DECLARED_BYTES = 1_000_000


def _declared_matmul(declare: bool):
    """A Pallas matmul kernel of two bf16 [512, 512] blocks, declaring its cost or not."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, y_ref, o_ref):
        product = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
        o_ref[...] = product.astype(o_ref.dtype)

    # the bytes it declares differ from its operands' and result's, to tell them apart
    cost = pl.CostEstimate(flops=2 * 512**3, transcendentals=0, bytes_accessed=DECLARED_BYTES)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((512, 512), jnp.bfloat16),
        cost_estimate=cost if declare else None,
    )


@pytest.mark.parametrize("declare", [True, False])
def test_a_kernel_that_declares_its_cost_is_priced_by_it(declare):
    """Pallas keeps a kernel's `cost_estimate` in the compiled HLO: the reader counts its
    flops and bytes; a kernel that declares nothing (JAX's and MaxText 0.2.5's splash
    kernels) stays counted apart, as opaque."""
    pytest.importorskip("libtpu", reason="the [tpu] extra provides XLA's TPU compiler")
    from tests.helpers import one_tpu_chip
    from xla_strategies.hardware.compiled_report import hlo_report
    from xla_strategies.hardware.hlo import computations
    from xla_strategies.hardware.hlo_roofline import hbm_bytes
    from xla_strategies.hardware.topology import Topology

    block = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=one_tpu_chip())
    text = jax.jit(_declared_matmul(declare)).lower(block, block).compile().as_text()
    topology = Topology.from_name("v5e-4")
    report = hlo_report(text, topology)
    assert report.flops == (2 * 512**3 if declare else 0)
    assert report.opaque_kernels == (0 if declare else 1)
    comps, entry = computations(text)
    types = {op[0]: op[1] for op in comps[entry]}
    (kernel,) = [op for op in comps[entry] if "tpu_custom_call" in op[3]]
    moved = hbm_bytes(kernel, comps, types)
    if declare:  # its flops at the bf16 peak, and the bytes it declares
        assert report.estimate["matmul_s"] == pytest.approx(2 * 512**3 / topology.peak_flops)
        assert moved == DECLARED_BYTES
    else:  # what it reads and writes
        assert moved == 3 * 512 * 512 * 2
