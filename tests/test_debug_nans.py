"""With `jax_debug_nans`, a step that makes a NaN raises JAX's FloatingPointError naming
the primitive, in a process of its own (the flag is global)."""

from __future__ import annotations

import textwrap

from tests.helpers import run_script

_SCRIPT = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_debug_nans", True)
    import json
    import jax.numpy as jnp, numpy as np, optax
    import xla_strategies as xs

    strategy = xs.MirroredStrategy()
    tx = optax.adam(1e-2)

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.log(x @ p["w"])))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w": -np.ones((2, 3), np.float32)}
    state = strategy.replicate((params, tx.init(params)))
    (batch,) = strategy.experimental_distribute_dataset([np.ones((8, 2), np.float32)])
    try:
        strategy.compile(step)(*state, batch)
    except FloatingPointError as exc:
        text = " ".join([str(exc), *getattr(exc, "__notes__", [])])
        print(json.dumps(f"RAISED {type(exc).__name__} {' '.join(text.split())}"))
    """
)


def test_a_nan_under_debug_nans_is_jaxs_error_naming_the_primitive():
    out = run_script(_SCRIPT)
    assert "RAISED FloatingPointError Invalid value (nan)" in out, out[-3000:]
    assert "while lowering IR node jax.log" in out, out[-3000:]
