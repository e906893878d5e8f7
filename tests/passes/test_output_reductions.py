"""The reduction of its rows each output of a function was made by, read from its jaxpr:
what a pipelined loss's per-microbatch statistics combine by."""

import jax
import jax.numpy as jnp

from xla_strategies.passes.bridge.output_reductions import reductions


def test_each_statistic_is_read_as_the_reduction_that_made_it():
    def statistics(x):
        return (
            jnp.mean(x),
            jnp.sum(x),
            jnp.max(x),
            jnp.min(x, axis=0),
            jnp.mean(x, axis=0),
            jnp.mean(x > 0),  # a mean of a cast
            jnp.sum(x).astype(jnp.bfloat16),  # a cast of a sum
            jnp.std(x),  # no reduction of the microbatches' gives the batch's
            jnp.sum(x) / 2,  # a scaled sum, not a mean: none either
            x,
        )

    found = reductions(jax.make_jaxpr(statistics)(jnp.ones((4, 3))).jaxpr)
    assert found == ("mean", "sum", "max", "min", "mean", "mean", "sum", None, None, None)
