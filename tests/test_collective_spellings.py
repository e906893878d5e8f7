"""The FSDP collective spellings `benchmarks.tpu_collective_spellings` compiles for a TPU
slice compute the same values: each chip keeps the same part of the same sum, and gathers
every chip's part in the same order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from benchmarks.tpu_collective_spellings import all_gather, reduce_scatter


def _per_chip(collective, spelling, mesh):
    spec = PartitionSpec(("x", "y"))
    return jax.shard_map(
        lambda g: collective(spelling, g[0], mesh)[None],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        check_vma=False,
    )


@pytest.mark.parametrize("spelling", ["axis-by-axis", "ring"])
def test_each_spelling_keeps_every_chips_part_of_the_sum(spelling):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    # small integers: every order of summation gives the same float
    gradients = jnp.asarray(np.random.default_rng(0).integers(-8, 8, (8, 16, 4)), jnp.float32)
    want = _per_chip(reduce_scatter, "both-axes", mesh)(gradients)
    np.testing.assert_array_equal(_per_chip(reduce_scatter, spelling, mesh)(gradients), want)
    # the parts are the sum's: chip i holds rows 2i and 2i + 1 of the summed gradient
    np.testing.assert_array_equal(np.asarray(want).reshape(-1), gradients.sum(0).reshape(-1))


@pytest.mark.parametrize("spelling", ["axis-by-axis", "ring"])
def test_each_spelling_gathers_every_chips_part_in_order(spelling):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    parts = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    got = np.asarray(_per_chip(all_gather, spelling, mesh)(parts))
    for chip in range(8):  # every chip holds the whole weight, chips' parts in mesh order
        np.testing.assert_array_equal(got[chip], np.arange(48))
