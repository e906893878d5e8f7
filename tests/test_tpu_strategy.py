"""TPUStrategy: emulated on CPU devices laid out as the topology, and its clear errors."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import xla_strategies as xs
from tests import helpers
from xla_strategies.demo import models


def test_emulated_slice_has_the_topology_mesh_and_trains_like_one_device():
    strategy = xs.TPUStrategy("v5e-8", emulate=True)
    assert dict(strategy.mesh.shape) == {"x": 2, "y": 4}
    assert strategy.num_replicas_in_sync == 8
    assert strategy.topology.name == "v5e-8"
    graphdef, params = helpers.mlp()
    tx = optax.sgd(0.1)
    batches = helpers.mlp_batches(5)
    step = models.mlp_train_step(graphdef, tx)
    one = helpers.train(xs.OneDeviceStrategy(), step, params, tx, batches)[-1]
    tpu = helpers.train(strategy, step, params, tx, batches)[-1]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), tpu, one)
    assert helpers.max_relative_error(one, jax.tree.map(np.asarray, params)) > 1e-3  # it trained
    assert "decompose-all-reduces" in strategy.pipeline().enabled_names()


def test_errors_say_what_to_do():
    with pytest.raises(RuntimeError, match="found no TPU devices .* emulate=True"):
        xs.TPUStrategy()
    with pytest.raises(ValueError, match="needs a topology"):
        xs.TPUStrategy(emulate=True)
    with pytest.raises(
        ValueError,
        match=r"needs 256 devices but JAX has 8; call jax.config.update\('jax_num_cpu_devices', 256\)",
    ):
        xs.TPUStrategy("v5e-256", emulate=True)


def test_replica_context_sees_every_chip():
    strategy = xs.TPUStrategy("v5e-8", emulate=True)
    ids = strategy.run(
        lambda x: xs.get_replica_context().replica_id_in_sync_group + 0 * x[0],
        args=(next(iter(strategy.experimental_distribute_dataset([np.ones((8, 1))]))),),
    )
    np.testing.assert_array_equal(np.asarray(ids).ravel(), np.arange(8))
