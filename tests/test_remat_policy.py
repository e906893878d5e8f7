"""`compile(remat_policy=...)`: every rematerialised block without a policy of its own keeps
what the named `jax.checkpoint_policies` policy says; the numbers do not change, the memory
XLA's compiler needs does, and an option that changes nothing says so."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xla_strategies as xs
from xla_strategies.hardware.compiled_report import compiled_report


def _step(tx, policy=None):
    """A scan over checkpointed tanh layers, as JAX's docs write remat (`jax.checkpoint`)."""

    def step(stack, opt_state, x):
        def loss(stack):
            layer = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None), policy=policy)
            h, _ = jax.lax.scan(layer, x, stack)
            return jnp.mean(h**2)

        value, grads = jax.value_and_grad(loss)(stack)
        updates, opt_state = tx.update(grads, opt_state, stack)
        return optax.apply_updates(stack, updates), opt_state, value

    return step


def test_a_policy_keeps_the_numbers_of_the_step_as_written():
    tx = optax.sgd(0.1)
    stack = jax.random.normal(jax.random.key(0), (4, 16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (32, 16))
    reference = xs.OneDeviceStrategy("cpu:0").compile(_step(tx))(stack, tx.init(stack), x)
    strategy = xs.MirroredStrategy()
    step = strategy.compile(_step(tx), remat_policy="dots_saveable")
    found = step(strategy.replicate(stack), strategy.replicate(tx.init(stack)), x)
    np.testing.assert_allclose(np.asarray(found[0]), np.asarray(reference[0]), rtol=1e-5, atol=1e-6)


def test_keeping_more_for_the_backward_pass_costs_memory_on_the_chip():
    strategy = xs.TPUStrategy("v5e-4", compile_only=True)
    tx = optax.sgd(0.1)
    stack = jax.ShapeDtypeStruct((16, 1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=strategy.split_sharding())
    state = strategy.replicate(stack), strategy.replicate(jax.eval_shape(tx.init, stack))

    def temporaries(**options):
        step = strategy.compile(_step(tx), select_by_compiling=False, **options)
        return compiled_report(step.lower(*state, x).compile(), strategy).memory.temp_bytes

    kept_nothing, kept_everything = temporaries(), temporaries(remat_policy="everything_saveable")
    # the layers keep their matmul outputs (4 MiB a layer on each chip's 1024 rows) for the
    # backward pass instead of computing them again: more than one layer's more
    assert kept_everything > kept_nothing + 1024 * 1024 * 4


def test_an_option_that_changes_nothing_says_so_and_a_misspelt_policy_names_the_closest():
    strategy = xs.MirroredStrategy()
    tx = optax.sgd(0.1)
    stack, x = jnp.zeros((2, 4, 4)), jnp.zeros((8, 4))
    own = strategy.compile(
        _step(tx, jax.checkpoint_policies.nothing_saveable), remat_policy="dots_saveable"
    )
    with pytest.warns(
        UserWarning, match=r"changed nothing: each of its remat blocks names its own"
    ):
        own(strategy.replicate(stack), strategy.replicate(tx.init(stack)), x)
    with pytest.raises(ValueError, match=r"did you mean 'dots_saveable'\?"):
        strategy.compile(_step(tx), remat_policy="dot_saveable")


def test_a_policy_given_in_one_thread_leaves_another_threads_blocks_alone():
    """A step compiled with `remat_policy` in one thread while another thread traces its
    own remat block: only the first thread's blocks take the policy (it was given by
    replacing remat's bind for every thread alike)."""
    import threading

    from xla_strategies.passes.bridge.remat_policy import given_remat_policy

    def policy_of(fn):
        eqns = jax.make_jaxpr(jax.checkpoint(fn))(jnp.ones(3)).eqns
        return next(e.params["policy"] for e in eqns if e.primitive.name == "remat2")

    inside, traced = threading.Event(), threading.Event()
    seen = {}

    def giving():
        with given_remat_policy("dots_saveable") as blocks:
            seen["given"] = policy_of(jnp.sin)
            inside.set()
            traced.wait(30)
            seen["counted"] = blocks()

    thread = threading.Thread(target=giving)
    thread.start()
    assert inside.wait(30)
    seen["other"] = policy_of(jnp.cos)  # while the first thread still gives its policy
    traced.set()
    thread.join(30)
    assert seen["given"] is jax.checkpoint_policies.dots_saveable
    assert seen["other"] is None
    assert seen["counted"] == (1, 0)


def test_the_backward_recomputation_is_lowered_behind_a_barrier_as_jax_lowers_it():
    """JAX lowers a differentiated remat region (the backward pass's recomputation) behind
    an optimization barrier, so XLA neither merges it with the forward pass nor schedules
    it early. The step's program keeps it: without it, a plain-JAX GPT-2 whose scanned
    blocks are `jax.checkpoint`ed held 35 MiB more temporaries on v5e-8 (110.5 MiB against
    75.0)."""
    strategy = xs.MirroredStrategy()
    tx = optax.sgd(0.1)
    stack = jax.ShapeDtypeStruct((4, 16, 16), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=strategy.split_sharding())
    state = strategy.replicate(stack), strategy.replicate(jax.eval_shape(tx.init, stack))
    ours = strategy.compile(_step(tx), pipeline="insert-reductions").lower(*state, x).as_text()
    plain = jax.jit(_step(tx)).lower(stack, jax.eval_shape(tx.init, stack), x).as_text()
    barriers = plain.count("stablehlo.optimization_barrier")
    assert barriers >= 1
    assert ours.count("stablehlo.optimization_barrier") == barriers
