"""A model library that lays out its activations with `NamedSharding`s on a mesh it is
handed, as MaxText's model does (`with_sharding_constraint`, and `out_sharding=` on its
matmuls), trained unchanged when handed `xs.get_replica_context().mesh`; handed a mesh of
its own, the step fails with an error that says which mesh to hand it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import xla_strategies as xs
from tests.helpers import assert_close_to_scale, train_on


class MeshModel(nn.Module):
    """Two dense layers whose activations are laid out on `mesh`: replicated, or split on
    their features over a "model" axis where the mesh has one (a library's layout rule)."""

    mesh: Mesh

    @nn.compact
    def __call__(self, x):
        whole = NamedSharding(self.mesh, PartitionSpec(None, None))
        model = "model" if "model" in self.mesh.axis_names else None
        features = NamedSharding(self.mesh, PartitionSpec(None, model))
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 16))
        h = jnp.tanh(jnp.dot(x, kernel, out_sharding=whole))
        h = jax.lax.with_sharding_constraint(h, features)
        return nn.Dense(1)(h)


def _step(tx: optax.GradientTransformation, mesh_of=lambda: xs.get_replica_context().mesh):
    def train_step(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            model = MeshModel(mesh_of())
            return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def _problem():
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 32)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32))
        for _ in range(3)
    ]
    one_device = Mesh(np.array(jax.devices()[:1]), ("data",))
    params = MeshModel(one_device).init(jax.random.key(0), batches[0][0])["params"]
    return params, batches


@pytest.mark.parametrize(
    "options",
    [{}, {"axis_name": "batch"}, {"shard_parameters": True}],
    ids=["mirrored", "renamed-axis", "sharded-parameters"],
)
def test_a_library_handed_the_replica_mesh_trains_as_one_device(options):
    params, batches = _problem()
    tx = optax.adam(1e-2)
    ours, _ = train_on(xs.MirroredStrategy(), _step(tx), params, tx, batches, **options)
    reference, _ = train_on(xs.OneDeviceStrategy(), _step(tx), params, tx, batches)
    assert_close_to_scale(ours, reference, 1e-5)


def test_a_layout_over_the_model_axis_splits_within_the_replica():
    params, batches = _problem()
    tx = optax.adam(1e-2)
    strategy = xs.MirroredStrategy(logical_devices_per_replica=2)
    ours, step = train_on(strategy, _step(tx), params, tx, batches)
    reference, _ = train_on(xs.OneDeviceStrategy(), _step(tx), params, tx, batches)
    assert_close_to_scale(ours, reference, 1e-5)
    batch = next(iter(strategy.experimental_distribute_dataset(batches)))
    # each device of a replica computes half the features of its 4 rows
    assert "f32[4,8]" in step.lower(*ours, batch).compile().as_text()


def test_the_replica_mesh_is_the_strategys_with_its_replica_axes_manual():
    strategy = xs.MirroredStrategy()
    seen = []

    def step(x):
        seen.append(xs.get_replica_context().mesh)
        return x * 2

    strategy.compile(step)(strategy.experimental_distribute_values_from_function(lambda _: 1.0))
    (mesh,) = seen
    assert mesh.devices.tolist() == strategy.mesh.devices.tolist()
    assert mesh.axis_names == strategy.mesh.axis_names
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Manual}
    assert xs.get_replica_context().mesh is None  # outside a step


def test_a_library_handed_its_own_mesh_is_told_which_mesh_to_take():
    params, batches = _problem()
    tx = optax.adam(1e-2)
    own = Mesh(np.array(jax.devices()[:1]), ("data",))
    strategy = xs.MirroredStrategy()
    step = strategy.compile(_step(tx, lambda: own))
    batch = next(iter(strategy.experimental_distribute_dataset(batches)))
    with pytest.raises(xs.ForeignMeshError, match=r"get_replica_context\(\)\.mesh"):
        step(strategy.replicate(params), strategy.replicate(tx.init(params)), batch)
