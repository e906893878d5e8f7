"""A step that compiles again on every call says which value keeps changing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import xla_strategies as xs
from xla_strategies.step.recompiles import RECOMPILES_WARNED_AFTER


def test_a_static_value_that_changes_every_call_is_named():
    strategy = xs.OneDeviceStrategy()
    step = strategy.compile(lambda x, scale: x * scale, static_argnums=1)
    x = np.ones(3, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning before the limit
        for k in range(RECOMPILES_WARNED_AFTER - 1):
            step(x, float(k))
    with pytest.warns(UserWarning, match=r"compiled 8 programs: the static value args\[1\]"):
        step(x, 99.0)
    np.testing.assert_allclose(np.asarray(step(x, 2.0)), 2.0)  # cached: no new program


def test_a_traced_number_never_compiles_again():
    strategy = xs.OneDeviceStrategy()
    step = strategy.compile(lambda x, lr: x * lr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(2 * RECOMPILES_WARNED_AFTER):
            step(np.ones(3, np.float32), 0.1 * k)  # a Python float is traced
    assert step.cache_size == 1


def test_a_flax_train_state_made_on_the_host_compiles_once():
    """flax's `TrainState.create` (step=0, a Python int; numpy int64 leaves) passed straight
    to the step, as flax's docs pass it, without `strategy.replicate`."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training import train_state

    model = nn.Dense(4)
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.1))
    strategy = xs.MirroredStrategy()

    @strategy.compile
    def train_step(state, x):
        grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    for batch in strategy.experimental_distribute_dataset([np.ones((8, 3), np.float32)] * 3):
        state = train_step(state, batch)
    assert int(state.step) == 3 and train_step.cache_size == 1
