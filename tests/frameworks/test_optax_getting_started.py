"""optax's "Getting started: fitting a linear model", as its docs write it, with the loop's
body handed to the strategy: weight-update sharding on 2 replicas (the 2 weights divide),
a replicated update on 8 (they do not), each replica count in a process of its own. Its
50 unread steps once hung XLA's CPU runtime here, which admits 32 programs in flight per
device; the strategy now paces dispatch on CPU devices (`dispatch_pacing`)."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_script

_SCRIPT = textwrap.dedent(
    """
    import functools, json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, numpy as np, optax
    import xla_strategies as xs

    @functools.partial(jax.vmap, in_axes=(None, 0))
    def network(params, x):
        return jnp.dot(params, x)

    def compute_loss(params, x, y):
        y_pred = network(params, x)
        loss = jnp.mean(optax.l2_loss(y_pred, y))
        return loss

    key = jax.random.PRNGKey(42)
    target_params = 0.5
    xs_ = jax.random.normal(key, (16, 2))
    ys = jnp.sum(xs_ * target_params, axis=-1)
    optimizer = optax.adam(1e-1)

    params = jnp.array([0.0, 0.0])
    opt_state = optimizer.init(params)
    for _ in range(50):
        grads = jax.grad(compute_loss)(params, xs_, ys)
        updates, opt_state = optimizer.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
    reference = np.asarray(params)

    def step(params, opt_state, x, y):
        grads = jax.grad(compute_loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    n = int(sys.argv[1])
    strategy = xs.MirroredStrategy(jax.devices()[:n])
    train = strategy.compile(step, shard_weight_updates=True, donate_argnums=(0, 1))
    data = [(np.asarray(xs_), np.asarray(ys))]
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    params, opt_state = jnp.array([0.0, 0.0]), optimizer.init(jnp.array([0.0, 0.0]))
    for _ in range(50):
        params, opt_state = train(params, opt_state, *batch)
    error = float(np.max(np.abs(np.asarray(params) - reference)))
    held = [strategy.is_held_sharded(x) for x in jax.tree.leaves(opt_state) if x.ndim]
    print(json.dumps({"replicas": n, "error": error, "held": held}))
    """
)


@pytest.mark.parametrize("replicas", [2, 8])
def test_the_getting_started_loop_trains_like_the_docs(replicas):
    result = run_script(_SCRIPT, str(replicas))
    assert result["error"] < 1e-6, result
    # Adam's two moments: split on 2 replicas, whole on 8 (2 does not divide by 8)
    assert result["held"] == ([True, True] if replicas == 2 else [False, False]), result
