"""With `jax_debug_nans`, a step that makes a NaN raises JAX's FloatingPointError naming
the primitive, in a process of its own (the flag is global)."""

from __future__ import annotations

import textwrap

import pytest

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


_ENTERING = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    if sys.argv[2] == "debug_nans":
        jax.config.update("jax_debug_nans", True)
    import json
    import jax.numpy as jnp, numpy as np, optax
    import xla_strategies as xs

    if sys.argv[2] == "check_numerics":
        xs.debugging.enable_check_numerics()
    where = sys.argv[1]
    strategy = xs.MirroredStrategy()
    tx = optax.adam(1e-2)

    def step(params, opt_state, batch):
        def loss_fn(p):
            pred = (batch["x"] @ p["w"])[:, 0]
            if where == "division":
                return jnp.mean(pred / (batch["y"] - batch["y"]))
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w": np.ones((4, 1), np.float32)}
    opt_state = tx.init(params)
    if where == "optimizer_state":
        opt_state = jax.tree.map(
            lambda a: np.full(a.shape, np.nan, a.dtype) if a.dtype == np.float32 else a,
            jax.tree.map(np.asarray, opt_state),
        )
    state = strategy.replicate((params, opt_state))
    x = np.ones((16, 4), np.float32)
    if where == "batch":
        x[5, 2] = np.nan
    (batch,) = strategy.experimental_distribute_dataset([{"x": x, "y": np.ones(16, np.float32)}])
    try:
        strategy.compile(step)(*state, batch)
        print(json.dumps("NO ERROR"))
    except FloatingPointError as exc:
        text = " ".join([str(exc), *getattr(exc, "__notes__", [])])
        print(json.dumps(f"RAISED {type(exc).__name__} {' '.join(text.split())}"))
    """
)


@pytest.mark.parametrize("check", ["debug_nans", "check_numerics"])
def test_a_nan_that_enters_with_the_arguments_is_named_by_its_argument(check):
    """A NaN in the batch, or in the optimizer state, is not the step's doing: the error
    names the argument and the element (JAX's own re-run of the program recursed without
    end on it)."""
    out = run_script(_ENTERING, "batch", check)
    assert "RAISED FloatingPointError invalid value (nan) in step argument args[2]['x']" in out
    assert "element (5, 2) of float32[16, 4]" in out, out[-3000:]
    out = run_script(_ENTERING, "optimizer_state", check)
    assert "invalid value (nan) in step argument args[1][0].mu['w']" in out, out[-3000:]


def test_a_nan_the_step_makes_is_jaxs_error_or_the_checks_naming_the_output():
    out = run_script(_ENTERING, "division", "debug_nans")
    assert "RAISED FloatingPointError Invalid value (nan)" in out, out[-3000:]
    assert "while lowering IR node jax.div" in out, out[-3000:]
    out = run_script(_ENTERING, "division", "check_numerics")
    assert "RAISED FloatingPointError invalid value (nan) in step output[0]['w']" in out, out
    assert "made by call 1 of step" in out, out[-3000:]
    assert "NO ERROR" in run_script(_ENTERING, "division", "off")  # silent unless asked
