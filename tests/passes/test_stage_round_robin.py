"""Interleaved chunks' weights moved between the stack's order and the round robin each
stage runs them in: every chunk where the schedule reads it, and back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xla_strategies.passes.stages.round_robin import round_robin, stack_order


def _on_stages(fn, stages, x):
    mesh = Mesh(np.array(jax.devices()[:stages]), ("stage",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("stage"), out_specs=P("stage")))(x)


@pytest.mark.parametrize("stages, virtual", [(2, 2), (2, 3), (4, 3), (4, 5), (8, 2)])
def test_each_stage_gets_the_chunks_it_runs_and_its_gradient_goes_back(stages, virtual):
    # chunk k of the stack holds k in every entry; stage d holds chunks dV .. dV+V-1
    stack = jnp.repeat(jnp.arange(stages * virtual, dtype=jnp.float32)[:, None], 3, axis=1)
    run = np.asarray(_on_stages(lambda x: round_robin(x, stages, "stage"), stages, stack))
    # stage d's chunk v is global chunk v*S + d
    want = [v * stages + d for d in range(stages) for v in range(virtual)]
    np.testing.assert_array_equal(run[:, 0], want)
    back = _on_stages(lambda x: stack_order(x, stages, "stage"), stages, jnp.asarray(run))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(stack))


def test_the_move_sends_each_stage_only_what_it_runs():
    """One permute per shift of the ring, each of ceil(V/S) chunks: not the whole stack."""
    stages, virtual = 4, 3
    mesh = Mesh(np.array(jax.devices()[:stages]), ("stage",))
    fn = jax.shard_map(
        lambda x: round_robin(x, stages, "stage"),
        mesh=mesh,
        in_specs=P("stage"),
        out_specs=P("stage"),
    )
    text = jax.jit(fn).lower(jnp.zeros((stages * virtual, 16))).as_text()
    permutes = [line for line in text.splitlines() if "collective_permute" in line]
    assert len(permutes) == stages - 1
    assert all("tensor<1x16xf32>" in line for line in permutes), permutes
    assert "all_gather" not in text
