"""The gradient reduce-scatter spellings `benchmarks.tpu_gradient_scatters` compiles for a
TPU slice sum the same values: each chip keeps the same part of the same sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from benchmarks.tpu_gradient_scatters import reduce_scatter


@pytest.mark.parametrize("spelling", ["axis-by-axis", "ring"])
def test_each_spelling_keeps_every_chips_part_of_the_sum(spelling):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    # small integers: every order of summation gives the same float
    gradients = jnp.asarray(np.random.default_rng(0).integers(-8, 8, (8, 16, 4)), jnp.float32)

    def per_chip(spelling):
        spec = PartitionSpec(("x", "y"))
        return jax.shard_map(
            lambda g: reduce_scatter(spelling, g[0], mesh)[None],
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )

    want = per_chip("both-axes")(gradients)
    got = per_chip(spelling)(gradients)
    np.testing.assert_array_equal(got, want)
    # and the parts are the sum's: chip i holds rows 2i and 2i + 1 of the summed gradient
    total = gradients.sum(axis=0).reshape(-1)
    np.testing.assert_array_equal(np.asarray(want).reshape(-1), total)
