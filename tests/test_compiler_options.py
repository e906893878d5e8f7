"""A step's XLA options: checked where given, merged over the strategy's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_strategies as xs
from xla_strategies.step.compiler_options import option_values, step_compiler_options


def test_values_go_to_xla_as_given():
    given = {"a": True, "b": False, "c": 3, "d": 0.5, "e": "ENABLED"}
    assert option_values(given) == given
    assert option_values(None) == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["xla_flag"], r"compiler_options must be a mapping .* got a list"),
        ({1: "true"}, r"option names are non-empty strings, got 1"),
        ({"xla_flag": [1]}, r"compiler_options\['xla_flag'\] must be a string, bool or number"),
    ],
)
def test_bad_options_name_the_argument(options, message):
    with pytest.raises(TypeError, match=message):
        xs.MirroredStrategy().compile(lambda x: x, compiler_options=options)


def test_the_steps_options_win_and_disabled_passes_are_joined():
    strategy = {"xla_x": "true", "xla_disable_hlo_passes": "a,b"}
    step = {"xla_x": "false", "xla_disable_hlo_passes": "b,c"}
    assert step_compiler_options(strategy, step) == {
        "xla_x": "false",
        "xla_disable_hlo_passes": "a,b,c",
    }


def test_a_cpu_steps_option_reaches_xla():
    """An option only XLA can judge: an unknown name fails the compile, a known one runs."""
    strategy = xs.MirroredStrategy()
    x = np.arange(8.0 * strategy.num_replicas_in_sync).reshape(strategy.num_replicas_in_sync, 8)
    ok = strategy.compile(
        lambda v: jnp.sum(v), compiler_options={"xla_cpu_enable_fast_math": False}
    )
    data = next(iter(strategy.experimental_distribute_dataset([x])))
    assert np.asarray(ok(data)).shape == (strategy.num_replicas_in_sync,)
    bad = strategy.compile(lambda v: jnp.sum(v), compiler_options={"xla_no_such_option": 1})
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
        bad(data)
